import os
import re
import subprocess
import sys
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import mpx

nnx = pytest.importorskip("flax.nnx")
nn = pytest.importorskip("flax.linen")
from mpx_jax.flax import apply_policy, float32_softmax_attention, policy_apply  # noqa: E402

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16


class Net(nnx.Module):
    def __init__(self, rngs):
        self.emb = nnx.Embed(10, 8, rngs=rngs)
        self.lin = nnx.Linear(8, 8, rngs=rngs)
        self.conv = nnx.Conv(8, 8, (3,), rngs=rngs)
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.rms = nnx.RMSNorm(8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(2, 8, decode=False, rngs=rngs)
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, tokens):
        x = self.emb(tokens)
        a = self.lin(x)
        c = self.conv(a)
        n = self.norm(c)
        r = self.rms(n)
        b = self.bn(r, use_running_average=True)
        d = self.attn(b)
        return {"emb": x, "lin": a, "conv": c, "norm": n, "rms": r, "bn": b, "attn": d, "head": self.head(d)}


TOKENS = jnp.array([[1, 2, 3, 4]])


def test_nnx_mixed_preset_dtypes_per_submodule():
    model = apply_policy(
        Net(nnx.Rngs(0)), mpx.get_policy("mixed_bfloat16").with_overrides({"head": "float32"})
    )
    out = model(TOKENS)
    dtypes = {k: v.dtype for k, v in out.items()}
    assert dtypes == {
        "emb": F32,  # PASSTHROUGH: the float32 table's dtype, as torch.nn.Embedding under autocast
        "lin": BF16,
        "conv": BF16,
        "norm": F32,
        "rms": F32,
        "bn": F32,
        "attn": BF16,
        "head": F32,
    }
    assert model.attn.query.dtype == BF16 and model.lin.dtype == BF16 and model.norm.dtype == F32
    params = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))
    assert params and all(p.dtype == F32 for p in params)


def test_nnx_pure_half_casts_params_but_not_batch_stats_and_grads():
    model = apply_policy(Net(nnx.Rngs(0)), "float16")
    assert (
        model.lin.kernel.dtype == F16 and model.norm.scale.dtype == F16 and model.emb.embedding.dtype == F16
    )
    assert model.bn.mean.dtype == F32 and model.bn.var.dtype == F32
    assert model.lin.param_dtype == F16
    out = model(TOKENS)
    assert out["lin"].dtype == F16 and out["norm"].dtype == F32
    # gradients wrt the stored (half) params are half; loss in float32
    grads = nnx.grad(lambda m: jnp.mean(m(TOKENS)["head"].astype(F32)))(model)
    assert all(g.dtype == F16 for g in jax.tree_util.tree_leaves(nnx.state(grads, nnx.Param)))


def test_nnx_float32_policy_and_errors():
    model = apply_policy(Net(nnx.Rngs(0)), "float32")
    assert all(v.dtype == F32 for v in model(TOKENS).values())
    with pytest.raises(TypeError, match="nnx.Module"):
        apply_policy(object(), "float32")
    with pytest.raises(mpx.PolicyError):
        apply_policy(Net(nnx.Rngs(0)), "mixed_float17")


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        a = nn.Dense(8)(x)
        b = nn.LayerNorm()(a)
        c = nn.BatchNorm(use_running_average=not train)(b)
        d = nn.MultiHeadDotProductAttention(num_heads=2)(c[:, None, :])[:, 0]
        e = nn.Dense(3, name="head")(d)
        for name, value in dict(a=a, b=b, c=c, d=d, e=e).items():
            self.sow("intermediates", name, value)
        return e


X = jax.random.normal(jax.random.PRNGKey(1), (2, 4))


def linen_vars():
    return LinenNet().init(jax.random.PRNGKey(0), X)


@pytest.mark.parametrize(("policy", "compute"), [("mixed_bfloat16", BF16), ("mixed_float16", F16)])
def test_linen_dtypes_per_submodule_and_output(policy, compute):
    apply = policy_apply(LinenNet(), policy)
    out, state = apply(linen_vars(), X, mutable=["intermediates"])
    got = {k: v[0].dtype for k, v in state["intermediates"].items()}
    assert got == {"a": compute, "b": F32, "c": F32, "d": compute, "e": compute}
    assert out.dtype == F32  # output_dtype


def test_linen_overrides_kwargs_and_float32_gradients():
    policy = mpx.get_policy("mixed_bfloat16").with_overrides({"head": "float32"})
    apply = policy_apply(LinenNet(), policy)
    variables = linen_vars()
    _out, state = apply(variables, X, train=True, mutable=["batch_stats", "intermediates"])
    assert state["intermediates"]["e"][0].dtype == F32
    assert all(x.dtype == F32 for x in jax.tree_util.tree_leaves(state["batch_stats"]))

    def loss(params):
        return jnp.mean(apply({**variables, "params": params}, X) ** 2)

    grads = jax.jit(jax.grad(loss))(variables["params"])
    assert all(g.dtype == F32 for g in jax.tree_util.tree_leaves(grads))
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(variables["params"])
    # the module object itself is untouched afterwards
    assert LinenNet().apply(variables, X).dtype == F32


def test_linen_pure_bfloat16_casts_params_and_errors():
    apply = policy_apply(LinenNet(), "bfloat16")
    out, state = apply(linen_vars(), X, mutable=["intermediates"])
    assert out.dtype == BF16 and state["intermediates"]["a"][0].dtype == BF16
    assert state["intermediates"]["b"][0].dtype == F32
    with pytest.raises(TypeError, match="linen"):
        policy_apply(object(), "float32")


# -- the model's own inputs (issue 25, item 0): the root module's arguments are not cast ------------------
MEAN = jnp.array([0.485, 0.456, 0.406])
STD = jnp.array([0.229, 0.224, 0.225])


class NormalizingNet(nn.Module):
    """Normalizes its inputs in its own body, as flaxmodels' ResNet18 does, then convolves."""

    dtype: object = F32
    norm: bool = False

    @nn.compact
    def __call__(self, x):
        x = (x - MEAN) / STD
        self.sow("intermediates", "normalized", x)
        x = nn.Conv(16, (3, 3), dtype=self.dtype)(x)
        if self.norm:
            x = nn.BatchNorm(use_running_average=True, dtype=self.dtype)(x)
        x = nn.relu(x)
        x = nn.Conv(8, (3, 3), dtype=self.dtype)(x)
        return jnp.mean(x, axis=(1, 2))


IMAGES = jax.random.uniform(jax.random.PRNGKey(3), (4, 16, 16, 3))


def test_linen_root_inputs_keep_their_dtype_and_match_flax_native_bfloat16():
    variables = NormalizingNet().init(jax.random.PRNGKey(0), IMAGES)
    reference = NormalizingNet().apply(variables, IMAGES)
    out, state = policy_apply(NormalizingNet(), "mixed_bfloat16")(
        variables, IMAGES, mutable=["intermediates"]
    )
    assert state["intermediates"]["normalized"][0].dtype == F32  # the model's normalization ran in float32
    native = NormalizingNet(dtype=BF16).apply(variables, IMAGES)
    assert native.dtype == BF16 and out.dtype == F32
    # without norms mpx computes what Flax's own dtype="bfloat16" computes, bit for bit
    assert jnp.array_equal(out, native.astype(F32))
    assert float(jnp.max(jnp.abs(out - reference))) > 0  # and it is a bfloat16 computation


def test_linen_root_inputs_error_no_worse_than_flax_native_with_norms():
    variables = NormalizingNet(norm=True).init(jax.random.PRNGKey(0), IMAGES)
    reference = NormalizingNet(norm=True).apply(variables, IMAGES)
    mpx_out = policy_apply(NormalizingNet(norm=True), "mixed_bfloat16")(variables, IMAGES)
    native = NormalizingNet(norm=True, dtype=BF16).apply(variables, IMAGES).astype(F32)
    mpx_err = float(jnp.mean(jnp.abs(mpx_out - reference)))
    native_err = float(jnp.mean(jnp.abs(native - reference)))
    assert 0 < mpx_err <= native_err


# -- categories from the core's table (issue 22) --------------------------------------------------------
class LinenSoftmax(nn.Module):
    mpx_category = "softmax"

    @nn.compact
    def __call__(self, x):
        self.sow("intermediates", "input", x)
        return jax.nn.softmax(x)


class LinenWithSoftmax(nn.Module):
    @nn.compact
    def __call__(self, x):
        return LinenSoftmax()(nn.Dense(4)(x))


def test_linen_mpx_category_softmax_runs_in_float32():
    variables = LinenWithSoftmax().init(jax.random.PRNGKey(0), X)
    _out, state = policy_apply(LinenWithSoftmax(), "mixed_float16")(variables, X, mutable=["intermediates"])
    assert state["intermediates"]["LinenSoftmax_0"]["input"][0].dtype == F32
    _, state = policy_apply(LinenWithSoftmax(), "mixed_float16,keep_fp32=none")(
        variables, X, mutable=["intermediates"]
    )
    assert state["intermediates"]["LinenSoftmax_0"]["input"][0].dtype == F16


class NnxLoss(nnx.Module):
    mpx_category = "loss"

    def __init__(self):
        self.dtype = None

    def __call__(self, logits, labels):
        logits = logits.astype(self.dtype or logits.dtype)
        return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, labels[:, None], -1)[:, 0])


class NnxLossNoDtype(nnx.Module):
    mpx_category = "loss"

    def __call__(self, logits):
        return jnp.mean(logits)


class NnxClassifier(nnx.Module):
    def __init__(self, rngs, loss):
        self.lin = nnx.Linear(4, 3, rngs=rngs)
        self.loss = loss


def test_nnx_mpx_category_loss_gets_float32_and_needs_a_dtype_attribute():
    model = apply_policy(NnxClassifier(nnx.Rngs(0), NnxLoss()), "mixed_bfloat16")
    assert model.lin.dtype == BF16 and model.loss.dtype == F32
    logits = model.lin(X)
    assert logits.dtype == BF16 and model.loss(logits, jnp.array([0, 2])).dtype == F32
    with pytest.raises(mpx.PolicyError, match="loss: mpx_category 'loss'.*no dtype attribute"):
        apply_policy(NnxClassifier(nnx.Rngs(0), NnxLossNoDtype()), "mixed_bfloat16")
    # nothing to change (float32 everywhere): no error
    apply_policy(NnxClassifier(nnx.Rngs(0), NnxLossNoDtype()), "float32")
    bad = NnxLoss()
    bad.mpx_category = "attention"
    with pytest.raises(mpx.PolicyError, match="mpx_category 'attention' is not a category"):
        apply_policy(NnxClassifier(nnx.Rngs(0), bad), "mixed_bfloat16")


def test_wrong_module_types_raise_unsupported_type_error():
    with pytest.raises(mpx.UnsupportedTypeError, match="flax.nnx.Module.*policy_apply"):
        apply_policy(nn.Dense(2), "mixed_bfloat16")
    with pytest.raises(mpx.UnsupportedTypeError, match="flax.linen.Module.*apply_policy"):
        policy_apply(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), "mixed_bfloat16")


# -- nnx.scan over stacked layers and nnx.remat (issue 25, item 1) ----------------------------------------
def walk(jaxpr, inside=()):
    """Every equation of ``jaxpr`` and its sub-jaxprs, with the primitives it is nested in."""
    for eqn in jaxpr.eqns:
        yield eqn, inside
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                body = getattr(sub, "jaxpr", sub)
                if hasattr(body, "eqns"):
                    yield from walk(body, (*inside, eqn.primitive.name))


class Block(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(8, 8, rngs=rngs)
        self.norm = nnx.LayerNorm(8, rngs=rngs)

    def __call__(self, x):
        return x + self.norm(nnx.relu(self.lin(x))).astype(x.dtype)


class Stacked(nnx.Module):
    def __init__(self, rngs, layers=3):
        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return Block(rngs)

        self.blocks = create(rngs)
        self.head = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def forward(x, block):
            return block(x)

        return self.head(forward(x, self.blocks))


def test_nnx_scan_over_layers_with_remat_keeps_the_op_table():
    model = apply_policy(Stacked(nnx.Rngs(0)), "mixed_bfloat16")
    assert model.blocks.lin.kernel.shape == (3, 8, 8) and model.blocks.lin.kernel.dtype == F32
    assert model.blocks.lin.dtype == BF16 and model.blocks.norm.dtype == F32
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 8))

    def loss(model, x):
        return jnp.mean(model(x).astype(F32) ** 2)

    graphdef, state = nnx.split(model)
    jaxpr = jax.make_jaxpr(lambda s, x: jax.grad(lambda s: loss(nnx.merge(graphdef, s), x))(s))(state, x)
    found = list(walk(jaxpr.jaxpr))
    in_scan = [(e, ctx) for e, ctx in found if "scan" in ctx]
    dots = [e for e, ctx in in_scan if e.primitive.name == "dot_general"]
    assert len(dots) >= 3 and any("remat2" in ctx for _, ctx in in_scan)
    # forward and backward matmuls of every stacked layer in bfloat16 (inside scan and remat)
    assert {str(v.aval.dtype) for e in dots for v in e.invars} == {"bfloat16"}
    # the forward LayerNorm statistics in float32 (the backward's bias reduction is the Linear's, bfloat16)
    forward = jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
    sums = [e for e, ctx in walk(forward.jaxpr) if "scan" in ctx and e.primitive.name == "reduce_sum"]
    assert sums and {str(v.aval.dtype) for e in sums for v in e.invars} == {"float32"}
    grads = jax.grad(lambda s: loss(nnx.merge(graphdef, s), x))(state)
    assert all(g.dtype == F32 for g in jax.tree_util.tree_leaves(grads))


# -- docs/flax.md runs as written (each block in a fresh interpreter) ----------------------------------------
DOC = Path(__file__).resolve().parents[2] / "docs" / "flax.md"
DOC_BLOCKS = {
    block.splitlines()[0].split(":", 1)[1].strip(): block
    for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    if block.startswith("# readme-example:")
}
DOC_OUTPUT = {
    "flax-doc-nnx": "of 51 steps",
    "flax-doc-linen": "of 21 steps, unchanged True",
    "flax-doc-orbax": "growth_interval 2 vs 2000",
    "flax-doc-dynamic-scale": "4096.0 700",
}


def test_every_doc_block_is_checked():
    assert set(DOC_BLOCKS) == set(DOC_OUTPUT)


@pytest.mark.parametrize("name", sorted(DOC_OUTPUT))
def test_doc_example_runs(name):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, "-c", DOC_BLOCKS[name]], capture_output=True, text=True, timeout=600, env=env,
        cwd=DOC.parents[1],
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert DOC_OUTPUT[name] in proc.stdout


# -- NNX attention: the softmax in float32 -------------------------------------------------------------------
def test_nnx_attention_gets_a_float32_softmax_under_mixed_policies():
    model = apply_policy(Net(nnx.Rngs(0)), "mixed_bfloat16")
    assert model.attn.attention_fn is float32_softmax_attention
    jaxpr = jax.make_jaxpr(lambda x: model.attn(x))(jnp.ones((1, 4, 8), F32))
    eqns = [e for e, _ in walk(jaxpr.jaxpr)]
    assert {str(e.outvars[0].aval.dtype) for e in eqns if e.primitive.name == "exp"} == {"float32"}
    assert in_dtypes([e for e in eqns if e.primitive.name == "dot_general"]) == {"bfloat16"}
    assert model.attn(jnp.ones((1, 4, 8), F32)).dtype == BF16
    assert apply_policy(model, "mixed_bfloat16,keep_fp32=none").attn.attention_fn is nnx.dot_product_attention
    custom = Net(nnx.Rngs(0))
    custom.attn.attention_fn = mine = partial(nnx.dot_product_attention)
    assert apply_policy(custom, "mixed_bfloat16").attn.attention_fn is mine


def in_dtypes(eqns):
    return {str(v.aval.dtype) for e in eqns for v in e.invars if hasattr(v.aval, "dtype")}


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_float32_softmax_attention_computes_flax_attention(kv_heads, dropout):
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (2, 5, 4, 8))
    k = jax.random.normal(keys[1], (2, 7, kv_heads, 8))
    v = jax.random.normal(keys[2], (2, 7, kv_heads, 8))
    mask = jax.random.bernoulli(keys[3], 0.7, (2, 1, 5, 7))
    bias = jnp.linspace(-1.0, 1.0, 35).reshape(1, 1, 5, 7)
    kwargs = dict(bias=bias, mask=mask, dropout_rng=jax.random.PRNGKey(9), dropout_rate=dropout)
    # without dropout Flax runs jax.nn.dot_product_attention, with dropout its own weights and the same mask bits
    want = nnx.dot_product_attention(q, k, v, **kwargs)
    got = float32_softmax_attention(q, k, v, **kwargs)
    assert got.dtype == F32
    assert jnp.allclose(got, want, atol=1e-5, rtol=1e-5)
    causal = float32_softmax_attention(q[:, :, :, :], k[:, :5], v[:, :5], is_causal=True)
    assert jnp.allclose(causal, nnx.dot_product_attention(q, k[:, :5], v[:, :5], is_causal=True), atol=1e-5)
    half = float32_softmax_attention(q.astype(BF16), k.astype(BF16), v.astype(BF16), **kwargs)
    assert half.dtype == BF16


@pytest.mark.parametrize(("backend", "root"), [("flax.nnx", nnx), ("flax.linen", nn)])
def test_flax_categories_are_the_core_table(backend, root):
    """Parity with mpx.CATEGORY_CLASSES: every class named there exists in this Flax (a missing one would be a
    stale table) and mpx_jax.flax categorises it as the table says."""
    from mpx.categories import CATEGORY_CLASSES, resolve_categories

    classes = resolve_categories(backend, root)
    for category, paths in CATEGORY_CLASSES[backend].items():
        assert [getattr(root, p) for p in paths] == list(classes[category])
    import mpx_jax.flax as mpx_flax

    resolved = mpx_flax._NNX_CATEGORIES if backend == "flax.nnx" else mpx_flax._LINEN_CATEGORIES
    assert resolved == classes
