"""Real Flax model code under mpx (issue 25, item 4): a small GPT (NNX: causal masks, dropout RNG,
``nnx.scan`` over ``nnx.remat``-ed layers) and a ResNet (linen, as Flax's ImageNet example: BatchNorm
batch statistics), trained under ``mixed_bfloat16`` and ``mixed_float16`` with ``with_loss_scaling``.

For each: the op table inside scan/remat (dtypes read from the jaxpr), a skipped step that leaves
parameters, optimizer state and batch statistics bit-identical, one compilation for finite and skipped
steps, and an orbax round trip that resumes bit for bit.
"""

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpx
import mpx_jax
import mpx_jax.flax

nnx = pytest.importorskip("flax.nnx")
nn = pytest.importorskip("flax.linen")
ocp = pytest.importorskip("orbax.checkpoint")
from mpx_jax.flax import apply_policy, policy_apply  # noqa: E402
from mpx_jax.linen import TrainState  # noqa: E402
from mpx_jax.nnx import Optimizer  # noqa: E402
from mpx_jax.orbax import StandardCheckpointer  # noqa: E402

POLICIES = {"mixed_bfloat16": jnp.bfloat16, "mixed_float16": jnp.float16}
CONFIG = mpx.ScalerConfig(
    init_scale=2.0**10, growth_interval=2
)  # dynamic under both policies: skips exercised


def walk(jaxpr, inside=()):
    """Every equation of ``jaxpr`` and its sub-jaxprs, with the primitives it is nested in."""
    for eqn in jaxpr.eqns:
        yield eqn, inside
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                body = getattr(sub, "jaxpr", sub)
                if hasattr(body, "eqns"):
                    yield from walk(body, (*inside, eqn.primitive.name))


def in_dtypes(eqns):
    return {str(v.aval.dtype) for e in eqns for v in e.invars if hasattr(v.aval, "dtype")}


def bits(tree):
    def raw(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x).tobytes()

    return [raw(x) for x in jax.tree_util.tree_leaves(tree)]


# -- a small GPT, as Flax's NNX miniGPT tutorial and "scan over layers" guide write it ----------------------
VOCAB, SEQ, EMBED, HEADS, FF, LAYERS, BATCH = 32, 8, 16, 2, 32, 2, 4


class TransformerBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, rate: float = 0.1):
        self.mha = nnx.MultiHeadAttention(
            num_heads=HEADS,
            in_features=EMBED,
            dropout_rate=rate,
            deterministic=False,
            decode=False,
            rngs=rngs,
        )
        self.dropout1 = nnx.Dropout(rate=rate, rngs=rngs)
        self.layer_norm1 = nnx.LayerNorm(epsilon=1e-6, num_features=EMBED, rngs=rngs)
        self.linear1 = nnx.Linear(EMBED, FF, rngs=rngs)
        self.linear2 = nnx.Linear(FF, EMBED, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=rate, rngs=rngs)
        self.layer_norm2 = nnx.LayerNorm(epsilon=1e-6, num_features=EMBED, rngs=rngs)

    def __call__(self, inputs, mask):
        attention_output = self.mha(inputs_q=inputs, mask=mask, decode=False)
        attention_output = self.dropout1(attention_output)
        out1 = self.layer_norm1(inputs + attention_output)
        ffn_output = self.linear2(nnx.relu(self.linear1(out1)))
        ffn_output = self.dropout2(ffn_output)
        return self.layer_norm2(out1 + ffn_output)


class MiniGPT(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.token_emb = nnx.Embed(num_embeddings=VOCAB, features=EMBED, rngs=rngs)
        self.pos_emb = nnx.Embed(num_embeddings=SEQ, features=EMBED, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create_block(rngs):
            return TransformerBlock(rngs)

        self.blocks = create_block(rngs)
        self.output_layer = nnx.Linear(EMBED, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        positions = jnp.arange(tokens.shape[1])[None, :]
        x = self.token_emb(tokens) + self.pos_emb(positions)
        causal = nnx.make_causal_mask(tokens)
        padding = nnx.make_attention_mask(tokens > 0, tokens > 0)  # token 0 is padding
        mask = nnx.combine_masks(causal, padding)

        @nnx.scan(in_axes=(nnx.Carry, 0, None), out_axes=nnx.Carry)  # each layer's own dropout stream
        @nnx.remat
        def forward(x, block, mask):
            return block(x, mask)

        return self.output_layer(forward(x, self.blocks, mask))


TOKENS = jax.random.randint(jax.random.PRNGKey(5), (BATCH, SEQ + 1), 1, VOCAB).at[0, -3:].set(0)


def gpt_loss(model, tokens, poison):
    logits = model(tokens[:, :-1]).astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return loss * poison


def make_gpt(policy):
    model = apply_policy(MiniGPT(nnx.Rngs(params=0, dropout=1)), policy)
    opt = Optimizer(model, mpx_jax.with_loss_scaling(optax.adamw(1e-3), CONFIG), wrt=nnx.Param)
    return model, opt


def gpt_step(traces):
    @nnx.jit
    def train_step(model, opt, tokens, poison):
        traces.append(1)
        loss_scale = opt.loss_scale

        def scaled(model):
            loss = gpt_loss(model, tokens, poison)
            return loss_scale.scale(loss), loss

        grads, loss = nnx.grad(scaled, has_aux=True)(model)
        opt.update(model, grads)
        return loss

    return train_step


@pytest.mark.parametrize("policy", POLICIES)
def test_gpt_op_table_inside_scan_and_remat(policy):
    compute = str(jnp.dtype(POLICIES[policy]))
    model, _ = make_gpt(policy)
    graphdef, state = nnx.split(model)

    def grads(state):
        return nnx.state(nnx.grad(gpt_loss)(nnx.merge(graphdef, state), TOKENS, 1.0))

    eqns = list(walk(jax.make_jaxpr(grads)(state).jaxpr))
    in_layers = [e for e, ctx in eqns if "scan" in ctx and "remat2" in ctx]
    dots = [e for e in in_layers if e.primitive.name == "dot_general"]
    # attention (q, k, v, out, logits, weights x values) and both MLP layers, forward and backward
    assert len(dots) >= 20 and in_dtypes(dots) == {compute}
    forward = jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(TOKENS[:, :-1]))(state)
    layer_sums = [e for e, ctx in walk(forward.jaxpr) if "scan" in ctx and e.primitive.name == "reduce_sum"]
    assert layer_sums and in_dtypes(layer_sums) == {"float32"}  # both LayerNorms' statistics
    exps = [e for e, ctx in walk(forward.jaxpr) if "scan" in ctx and e.primitive.name == "exp"]
    assert exps and {str(e.outvars[0].aval.dtype) for e in exps} == {"float32"}  # the attention softmax
    assert model.blocks.mha.attention_fn is mpx_jax.flax.float32_softmax_attention
    # the parameters stay float32 masters, the stacked layers keep their layer axis
    assert model.blocks.linear1.kernel.shape == (LAYERS, EMBED, FF)
    assert {p.dtype for p in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))} == {jnp.dtype("float32")}


@pytest.mark.parametrize("policy", POLICIES)
def test_gpt_trains_skips_bit_identically_compiles_once_and_resumes(policy, tmp_path):
    traces = []
    train_step = gpt_step(traces)
    model, opt = make_gpt(policy)
    losses = [float(train_step(model, opt, TOKENS, jnp.float32(1.0))) for _ in range(3)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    params, opt_state = bits(nnx.state(model, nnx.Param)), bits(opt.opt_state.inner_state)
    step, scale = int(opt.step[...]), opt.loss_scale.get_scale()
    train_step(model, opt, TOKENS, jnp.float32(jnp.inf))  # overflows: skipped
    assert bits(nnx.state(model, nnx.Param)) == params and bits(opt.opt_state.inner_state) == opt_state
    assert int(opt.step[...]) == step and opt.loss_scale.get_scale() == scale / 2
    assert len(traces) == 1

    with StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "gpt", {"model": model, "opt": opt})
        ckptr.wait_until_finished()
        fresh_model, fresh_opt = make_gpt(policy)
        back = ckptr.restore(tmp_path / "gpt", {"model": fresh_model, "opt": fresh_opt})
    resumed_model, resumed_opt = back["model"], back["opt"]
    assert resumed_opt.loss_scale.state == opt.loss_scale.state and resumed_opt.loss_scale.config == CONFIG
    for _ in range(2):
        a = train_step(model, opt, TOKENS, jnp.float32(1.0))
        b = train_step(resumed_model, resumed_opt, TOKENS, jnp.float32(1.0))
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert bits(nnx.state(resumed_model)) == bits(nnx.state(model))  # params and the dropout RNG state
    assert bits(resumed_opt) == bits(opt)


# -- a ResNet, as Flax's ImageNet example writes it (linen, BatchNorm batch statistics) ----------------------
ModuleDef = Any


class ResNetBlock(nn.Module):
    filters: int
    conv: ModuleDef
    norm: ModuleDef
    act: Any
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x):
        residual = x
        y = self.conv(self.filters, (3, 3), self.strides)(x)
        y = self.norm()(y)
        y = self.act(y)
        y = self.conv(self.filters, (3, 3))(y)
        y = self.norm(scale_init=nn.initializers.zeros_init())(y)
        if residual.shape != y.shape:
            residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(residual)
            residual = self.norm(name="norm_proj")(residual)
        return self.act(residual + y)


class ResNet(nn.Module):
    stage_sizes: tuple[int, ...] = (1, 1)
    num_filters: int = 8
    num_classes: int = 4
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv = partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = partial(
            nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5, dtype=self.dtype
        )
        x = conv(self.num_filters, (3, 3), name="conv_init")(x)
        x = norm(name="bn_init")(x)
        x = nn.relu(x)
        for i, block_size in enumerate(self.stage_sizes):
            for j in range(block_size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = ResNetBlock(self.num_filters * 2**i, conv=conv, norm=norm, act=nn.relu, strides=strides)(
                    x
                )
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
        return jnp.asarray(x, self.dtype)


class ResNetState(TrainState):
    batch_stats: Any


IMAGES = jax.random.normal(jax.random.PRNGKey(7), (4, 8, 8, 3))
LABELS = jnp.array([0, 1, 2, 3])


def make_resnet(policy):
    variables = ResNet().init(jax.random.PRNGKey(0), IMAGES, train=False)
    return ResNetState.create(
        apply_fn=policy_apply(ResNet(), policy),
        params=variables["params"],
        tx=mpx_jax.with_loss_scaling(optax.sgd(0.1, momentum=0.9), CONFIG),
        batch_stats=variables["batch_stats"],
    )


def resnet_loss(state, params, images, poison):
    logits, updates = state.apply_fn(
        {"params": params, "batch_stats": state.batch_stats}, images, mutable=["batch_stats"]
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, LABELS).mean() * poison
    return state.loss_scale.scale(loss), (loss, updates)


def resnet_step(traces):
    @jax.jit
    def train_step(state, images, poison):
        traces.append(1)
        grads, (loss, updates) = jax.grad(partial(resnet_loss, state), has_aux=True)(
            state.params, images, poison
        )
        return state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"]), loss

    return train_step


@pytest.mark.parametrize("policy", POLICIES)
def test_resnet_op_table(policy):
    compute = str(jnp.dtype(POLICIES[policy]))
    state = make_resnet(policy)
    jaxpr = jax.make_jaxpr(lambda s: jax.grad(partial(resnet_loss, s), has_aux=True)(s.params, IMAGES, 1.0))(
        state
    )
    eqns = [e for e, _ in walk(jaxpr.jaxpr)]
    convs = [e for e in eqns if e.primitive.name in ("conv_general_dilated", "dot_general")]
    assert len(convs) >= 15 and in_dtypes(convs) == {compute}  # forward and backward, Dense included
    forward = jax.make_jaxpr(lambda s: s.apply_fn({"params": s.params, "batch_stats": s.batch_stats}, IMAGES,
                                                  mutable=["batch_stats"]))(state)  # fmt: skip
    sums = [e for e, _ in walk(forward.jaxpr) if e.primitive.name == "reduce_sum"]
    # every BatchNorm's batch statistics in float32 (the global average pool is the model's own mean)
    assert len(sums) >= 8 and {str(e.outvars[0].aval.dtype) for e in sums} == {"float32"}


@pytest.mark.parametrize("policy", POLICIES)
def test_resnet_trains_skips_bit_identically_compiles_once_and_resumes(policy, tmp_path):
    traces = []
    train_step = resnet_step(traces)
    state = make_resnet(policy)
    losses = []
    for _ in range(3):
        state, loss = train_step(state, IMAGES, jnp.float32(1.0))
        losses.append(float(loss))
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    skipped, _ = train_step(state, IMAGES * 2.0, jnp.float32(jnp.inf))
    for name in ("step", "params", "batch_stats"):
        assert bits(getattr(skipped, name)) == bits(getattr(state, name)), name
    assert bits(skipped.opt_state.inner_state) == bits(state.opt_state.inner_state)
    assert skipped.loss_scale.state.skipped_steps == 1
    assert len(traces) == 1

    with StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "resnet", skipped)
        ckptr.wait_until_finished()
        blank = jax.tree_util.tree_map(jnp.zeros_like, skipped)  # same apply_fn and tx: no new compilation
        resumed = ckptr.restore(tmp_path / "resnet", blank)
    assert resumed.loss_scale.state == skipped.loss_scale.state and bits(resumed) == bits(skipped)
    a, b = skipped, resumed
    for _ in range(2):
        a, _ = train_step(a, IMAGES, jnp.float32(1.0))
        b, _ = train_step(b, IMAGES, jnp.float32(1.0))
    assert bits(a) == bits(b)
    assert len(traces) == 1
