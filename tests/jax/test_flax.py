import jax
import jax.numpy as jnp
import pytest

import mpx

nnx = pytest.importorskip("flax.nnx")
nn = pytest.importorskip("flax.linen")
from mpx_jax.flax import apply_policy, policy_apply  # noqa: E402

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
        "emb": BF16,
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
