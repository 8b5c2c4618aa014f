"""Block-scaled recipes in JAX (#31): autocast and the Flax layers quantize with the core's bytes and
scales, each GEMM's roles and blocks as torch's BlockLinear; seeded recipes (nvfp4_te: stochastic
rounding, the Hadamard transform) key their bits by (seed, step, index) as the core and torch do, the
step traced (one compile); a tiny transformer trains under mxfp8, nvfp4 and nvfp4_te; a skipped step
commits nothing; the stateless state dict is the one torch writes."""

from __future__ import annotations

import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mpx
import mpx_jax
from mpx.blocks import PRESETS, BlockRecipe
from mpx.kernels import blocks as kb
from mpx.kernels.array_ops import NUMPY_OPS
from mpx_jax import blocks, get_loss_scale, with_loss_scaling
from mpx_jax.blocks_flax import BlockDense, BlockLinear, BlockStep, block_layers, number_block_layers
from mpx_jax.float8_flax import Float8Linear, float8_state_dict, load_float8_state_dict
from mpx_jax.float8_linen import Float8Dense

#: the round-to-nearest presets (the seeded ones, nvfp4_te, are drawn by the seeded tests below)
DETERMINISTIC = {n: r for n, r in PRESETS.items() if r.rounding == "nearest" and not r.hadamard}
#: seeded recipes: TE's NVFP4 and an MXFP8 with both randomizations (1x32 E8M0 blocks after the RHT)
SEEDED = {"nvfp4_te": PRESETS["nvfp4_te"], "mxfp8_sr_rht": BlockRecipe(rounding="stochastic", hadamard=True)}


STATE_DICTS = json.loads((pathlib.Path(__file__).parents[1] / "block_state_dicts.json").read_text())
SPECS = {"mxfp8": "mixed_bfloat16,fp8=mxfp8", "nvfp4": "mixed_bfloat16,fp4=nvfp4",
         "nvfp4_te": "mixed_bfloat16,fp4=nvfp4_te"}  # fmt: skip
_Q = jax.jit(blocks.quantize, static_argnums=(1, 2, 3))  # eager JAX compiles op by op: jit is ~20x faster


@jax.jit
def _gemms(x, kernel, dy, recipe):
    y, vjp = jax.vjp(lambda a, b: blocks.block_matmul(a, b, recipe), x, kernel)
    return (y, *vjp(dy))


_gemms = jax.jit(_gemms.__wrapped__, static_argnums=(3,))


def _dq(a: np.ndarray, recipe, role: str, axis: int) -> np.ndarray:
    """The numpy reference's dequantized operand."""
    return kb.dequantize(NUMPY_OPS, kb.quantize(NUMPY_OPS, a, recipe, role, axis), recipe, role, axis)


def _same(got: kb.BlockQuantized, want: kb.BlockQuantized) -> None:
    assert np.array_equal(np.asarray(got.codes), want.codes)
    assert np.array_equal(np.asarray(got.scales).view(np.int32), np.asarray(want.scales).view(np.int32))
    if want.tensor_scale is not None:
        assert np.asarray(got.tensor_scale).view(np.int32) == np.asarray(want.tensor_scale).view(np.int32)


@st.composite
def operands(draw) -> np.ndarray:
    """A 2-D float32 array whose shape does not divide 16 or 32, with zero, subnormal, NaN, inf and
    mixed-magnitude blocks."""
    rows, cols = draw(st.sampled_from([(3, 40), (5, 17), (33, 7), (2, 70)]))
    kind = draw(st.sampled_from(["random", "zero", "subnormal", "nan", "inf", "mixed"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    if kind == "zero":
        x[:, : cols // 2] = 0.0
        x[0, 0] = -0.0
    elif kind == "subnormal":
        x[: rows // 2 + 1] *= np.float32(2.0**-130)
    elif kind == "nan":
        x[rng.integers(rows), rng.integers(cols)] = np.nan
    elif kind == "inf":
        x[rng.integers(rows), rng.integers(cols)] = -np.inf
    elif kind == "mixed":
        x *= np.float32(2.0) ** rng.integers(-40, 40, size=(rows, cols)).astype(np.float32)
    return x


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    x=operands(),
    name=st.sampled_from(sorted(DETERMINISTIC)),
    role=st.sampled_from(["input", "weight", "grad"]),
    axis=st.sampled_from([0, 1]),
)
def test_jit_quantize_is_the_cores_bit_for_bit(x, name, role, axis) -> None:
    recipe = PRESETS[name]
    with np.errstate(all="ignore"):
        want = kb.quantize(NUMPY_OPS, x, recipe, role, axis)
    _same(_Q(x, recipe, role, axis), want)


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4", "fp8_blockwise", "fp8_rowwise"])
def test_block_matmul_gemms_are_torchs_roles_and_blocks(name: str) -> None:
    recipe = PRESETS[name]
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((6, 40)) * 3).astype(np.float32)
    kernel = rng.standard_normal((40, 24)).astype(np.float32)
    dy = rng.standard_normal((6, 24)).astype(np.float32)
    y, dx, dk = _gemms(x, kernel, dy, recipe)
    w = kernel.T  # torch's weight (N, K): the bytes of every copy are its bytes
    for t, role, axis in ((x, "input", 1), (x, "input", 0)):
        _same(_Q(t, recipe, role, axis), kb.quantize(NUMPY_OPS, t, recipe, role, axis))
    for axis in (0, 1):  # the kernel blocked along the other axis is torch's weight's copy
        got = _Q(kernel, recipe, "weight", 1 - axis)
        _same(
            kb.BlockQuantized(np.asarray(got.codes).T, got.scales, got.tensor_scale),
            kb.quantize(NUMPY_OPS, w, recipe, "weight", axis),
        )
    tol = {"rtol": 1e-5, "atol": 1e-5}
    np.testing.assert_allclose(y, _dq(x, recipe, "input", 1) @ _dq(w, recipe, "weight", 1).T, **tol)
    np.testing.assert_allclose(dx, _dq(dy, recipe, "grad", 1) @ _dq(w, recipe, "weight", 0), **tol)
    np.testing.assert_allclose(dk, (_dq(dy, recipe, "grad", 0).T @ _dq(x, recipe, "input", 0)).T, **tol)


def test_a_non_finite_operand_makes_the_gemm_nan() -> None:
    recipe = PRESETS["mxfp8"]
    x = np.ones((2, 32), np.float32)
    x[0, 0] = np.inf
    y, _, _ = _gemms(x, np.ones((32, 3), np.float32), np.ones((2, 3), np.float32), recipe)
    assert np.isnan(np.asarray(y)).all()
    _, dx, dk = _gemms(
        np.ones((2, 32), np.float32),
        np.ones((32, 3), np.float32),
        np.full((2, 3), np.nan, np.float32),
        recipe,
    )
    assert np.isnan(np.asarray(dx)).all() and np.isnan(np.asarray(dk)).all()
    with pytest.raises(mpx.Float8Error, match="batch dimensions"):
        blocks.block_dot_general(
            jnp.ones((2, 3, 4)), jnp.ones((2, 4, 5)), (((2,), (1,)), ((0,), (0,))), recipe
        )
    with pytest.raises(mpx.Float8Error, match="BlockRecipe"):
        blocks.block_matmul(x, jnp.ones((32, 3)), mpx.Float8Recipe())


def test_autocast_runs_unbatched_dots_block_scaled_and_leaves_bmm_to_the_compute_dtype() -> None:
    recipe = PRESETS["nvfp4"]
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 40)).astype(np.float32)
    w = rng.standard_normal((40, 8)).astype(np.float32)

    def f(x, w):
        h = jnp.einsum("btd,df->btf", x, w)
        return h, jnp.einsum("btf,bsf->bts", h, h)

    fn = jax.jit(mpx_jax.autocast(f, "mixed_bfloat16,fp4=nvfp4"))
    h, s = fn(x, w)
    assert h.dtype == jnp.bfloat16 and s.dtype == jnp.bfloat16
    want = jax.jit(blocks.block_matmul, static_argnums=(2, 3))(x.reshape(6, 40), w, recipe, jnp.bfloat16)
    want = want.reshape(2, 3, 8)
    assert np.array_equal(np.asarray(h).view(np.uint16), np.asarray(want).view(np.uint16))
    text = str(jax.make_jaxpr(fn)(x, w))
    assert text.count("name=_block_mm") == 1
    grads = jax.jit(jax.grad(lambda x, w: fn(x, w)[0].astype(jnp.float32).sum(), argnums=(0, 1)))(x, w)
    assert grads[0].dtype == jnp.float32 and np.isfinite(np.asarray(grads[1])).all()
    # a nested float32 autocast keeps its dots out of the block recipe
    inner = mpx_jax.autocast(lambda x, w: x @ w, "float32")
    out = jax.jit(mpx_jax.autocast(lambda x, w: inner(x, w), "mixed_bfloat16,fp8=mxfp8"))(x[0], w)
    assert "_block_mm" not in str(
        jax.make_jaxpr(mpx_jax.autocast(lambda x, w: inner(x, w), SPECS["mxfp8"]))(x[0], w)
    )
    np.testing.assert_allclose(out, x[0] @ w, rtol=1e-5)


def test_flax_layers_add_the_bias_in_float32_and_refuse_the_wrong_recipe() -> None:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 3, 40)).astype(np.float32)
    layer = BlockLinear(
        40, 24, recipe=SPECS["mxfp8"], bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(0)
    )
    recipe = PRESETS["mxfp8"]
    kernel, bias = np.asarray(layer.kernel[...]), np.asarray(layer.bias[...])
    y = nnx.jit(lambda m, x: m(x))(layer, jnp.asarray(x, jnp.bfloat16))
    want = (
        _dq(x.reshape(6, 40).astype(jnp.bfloat16).astype(np.float32), recipe, "input", 1)
        @ _dq(kernel.T, recipe, "weight", 1).T
        + bias
    )
    assert y.dtype == jnp.bfloat16 and y.shape == (2, 3, 24)
    np.testing.assert_allclose(np.asarray(y, np.float32).reshape(6, 24), want, rtol=1e-2, atol=1e-2)
    dense = BlockDense(24, recipe)
    params = dense.init(jax.random.key(0), x)
    np.testing.assert_allclose(
        jax.jit(dense.apply)(params, x).reshape(6, 24),
        _dq(x.reshape(6, 40), recipe, "input", 1) @ _dq(np.asarray(params["params"]["kernel"]).T, recipe, "weight", 1).T,
        rtol=1e-5, atol=1e-5,
    )  # fmt: skip
    with pytest.raises(mpx.Float8Error, match="expected an mpx.blocks.BlockRecipe"):
        BlockLinear(2, 2, recipe="mixed_bfloat16,fp8=hybrid", rngs=nnx.Rngs(0))
    with pytest.raises(mpx.Float8Error, match="BlockLinear"):
        Float8Linear(2, 2, recipe=mpx.get_policy("mixed_bfloat16,fp8=fp8_blockwise"), rngs=nnx.Rngs(0))
    with pytest.raises(mpx.Float8Error, match="BlockDense"):
        Float8Dense(4, PRESETS["mxfp8"]).init({"params": jax.random.key(0)}, jnp.ones((1, 2)))


class Block(nnx.Module):
    def __init__(self, d: int, spec: str, rngs: nnx.Rngs) -> None:
        self.norm1, self.norm2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        self.qkv = BlockLinear(d, 3 * d, recipe=spec, rngs=rngs)
        self.out = BlockLinear(d, d, recipe=spec, rngs=rngs)
        self.up = BlockLinear(d, 2 * d, recipe=spec, rngs=rngs)
        self.down = BlockLinear(2 * d, d, recipe=spec, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, -1)
        a = jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1]), -1)
        x = x + self.out(a @ v)
        return x + self.down(jax.nn.relu(self.up(self.norm2(x))))


class TinyTransformer(nnx.Module):
    def __init__(self, spec: str, vocab: int = 16, d: int = 32, seed: int = 0) -> None:
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Embed(vocab, d, rngs=rngs)

        @nnx.split_rngs(splits=2)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs: nnx.Rngs) -> Block:
            return Block(d, spec, rngs)

        self.blocks = blocks(rngs)  # two blocks, stacked: one scan body, compiled once
        self.head = BlockLinear(d, vocab, recipe=spec, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def run(block: Block, x: jax.Array) -> jax.Array:
            return block(x)

        return self.head(run(self.blocks, self.embed(tokens)))


def _batch(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    tokens = rng.integers(0, 16, (8, 9))
    return tokens[:, :-1], (tokens[:, :-1] + 1) % 16  # learn "the next token id" of each token


def _loss(model: TinyTransformer, x: jax.Array, y: jax.Array, scale, poison) -> jax.Array:
    logits = model(x).astype(jnp.float32)
    return scale.scale(optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() * poison)


_TRACES: list[str] = []


def _train_step(model, opt, x, y, poison):
    _TRACES.append("step")  # runs once per trace
    loss, grads = nnx.value_and_grad(_loss)(model, x, y, get_loss_scale(opt), poison)
    opt.update(model, grads)
    return get_loss_scale(opt).unscale(loss)


_step = nnx.jit(_train_step)


def _make(spec: str):
    model = number_block_layers(TinyTransformer(spec), seed=5)  # the stacked blocks share their indices
    opt = nnx.Optimizer(
        model, with_loss_scaling(optax.adam(1e-2), mpx.ScalerConfig(init_scale=2.0**8)), wrt=nnx.Param
    )
    return model, opt


@pytest.fixture(scope="module", params=["mxfp8", "nvfp4", "nvfp4_te"])
def trained(request):
    """A tiny transformer trained 12 steps under the preset (compiled once: the skip test reuses it)."""
    model, opt = _make(SPECS[request.param])
    rng = np.random.default_rng(1)
    _TRACES.clear()
    losses = [float(_step(model, opt, *_batch(rng), 1.0)) for _ in range(12)]
    assert _TRACES == ["step"]  # one compile for every step (a seeded recipe's step is traced)
    return request.param, model, opt, losses


def test_a_two_block_transformer_trains_with_falling_loss(trained) -> None:
    name, model, _, losses = trained
    layers = list(block_layers(model))
    assert len(layers) == 5 and all(m.recipe == PRESETS[name] for _, m in layers)  # 4 of them stacked
    assert [m.block_index for _, m in layers] == [0, 1, 2, 3, 4] and {m.block_seed for _, m in layers} == {5}
    if name == "nvfp4_te":  # each training call advanced every layer's counter (the stack's per block)
        assert [np.asarray(m.block_step[...]).tolist() for _, m in layers] == [[12, 12]] * 4 + [12]
    else:
        assert all(m.block_step is None for _, m in layers)
    assert model.blocks.qkv.kernel[...].shape == (2, 32, 96)
    assert all(math.isfinite(v) for v in losses)
    assert np.mean(losses[-3:]) < 0.7 * np.mean(losses[:3]), losses


def _bits(tree) -> list[bytes]:
    return [np.asarray(x).reshape(-1).view(np.uint8).tobytes() for x in jax.tree_util.tree_leaves(tree)]


def test_a_skipped_step_commits_nothing(trained) -> None:
    name, model, opt, _ = trained
    x, y = _batch(np.random.default_rng(2))
    params, inner = _bits(nnx.state(model, nnx.Param)), _bits(opt.opt_state.inner_state)
    steps = _bits(nnx.state(model, BlockStep))
    skipped = int(get_loss_scale(opt).skipped_steps)
    _step(model, opt, x, y, math.inf)
    assert int(get_loss_scale(opt).skipped_steps) == skipped + 1
    assert _bits(nnx.state(model, nnx.Param)) == params  # every parameter (block recipes keep no state)
    # the seeded recipe's counter advances on a skipped step too (torch's block_step does): not state
    assert (_bits(nnx.state(model, BlockStep)) == steps) == (name != "nvfp4_te")
    assert _bits(opt.opt_state.inner_state) == inner  # Adam's moments and count


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_the_stateless_state_dict_is_torchs_and_loads_back(name: str) -> None:
    model = TinyTransformer(SPECS[name])
    d = float8_state_dict(model)
    assert json.loads(json.dumps(d)) == STATE_DICTS[name]  # the dict mpx_torch writes (tests/torch)
    load_float8_state_dict(model, STATE_DICTS[name])
    other = "nvfp4" if name == "mxfp8" else "mxfp8"
    with pytest.raises(mpx.StateDictError, match="block recipe"):
        load_float8_state_dict(model, STATE_DICTS[other])


_QS = jax.jit(blocks.quantize, static_argnums=(1, 2, 3), static_argnames=("seed", "index"))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    x=operands(),
    name=st.sampled_from(sorted(SEEDED)),
    role_axis=st.sampled_from([("grad", 0), ("grad", 1), ("input", 0)]),
    seed=st.sampled_from([0, 1, 2**20 + 3]),
    step=st.integers(0, 2**31 - 1),
    index=st.integers(0, 9),
)
def test_seeded_quantize_is_the_cores_bit_for_bit(x, name, role_axis, seed, step, index) -> None:
    """Stochastic rounding (grad) and the Hadamard transform (input and grad along M) with a traced step:
    the numpy core's codes, scales and tensor scale for the same (seed, step, index)."""
    recipe, (role, axis) = SEEDED[name], role_axis
    with np.errstate(all="ignore"):
        want = kb.quantize(NUMPY_OPS, x, recipe, role, axis, seed=seed, step=step, index=index)
    _same(_QS(x, recipe, role, axis, seed=seed, step=jnp.int32(step), index=index), want)


def _seeded_gemms(recipe, seed: int, index: int):
    traces: list[int] = []

    @jax.jit
    def gemms(x, kernel, dy, step):
        traces.append(1)
        y, vjp = jax.vjp(
            lambda a, b: blocks.block_matmul(a, b, recipe, seed=seed, step=step, index=index), x, kernel
        )
        return (y, *vjp(dy))

    return gemms, traces


def _rng(seed: int, step: int, index: int) -> dict:
    return {"seed": seed, "step": step, "index": index}


def test_seeded_block_matmul_is_the_cores_gemms_with_one_compile() -> None:
    """Each step's three GEMMs are the core's operands (torch BlockLinear's keys: 2 * index for the input
    gradient's dy, 2 * index + 1 for the kernel gradient's, the RHT signs of (seed, step)); a new step is
    new bits, not a new compile (mxfp8_sr_rht's operands: the hypothesis test above)."""
    recipe = SEEDED["nvfp4_te"]
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((20, 40)) * 3).astype(np.float32)  # M = 20: padded to 32 under the RHT
    kernel = rng.standard_normal((40, 24)).astype(np.float32)
    dy = rng.standard_normal((20, 24)).astype(np.float32)
    w = kernel.T
    gemms, traces = _seeded_gemms(recipe, seed=7, index=3)
    dks = []
    for step in (0, 1, 2**20):
        y, dx, dk = gemms(x, kernel, dy, jnp.int32(step))
        want_dx = kb.dequantize(
            NUMPY_OPS, kb.quantize(NUMPY_OPS, dy, recipe, "grad", 1, **_rng(7, step, 6)), recipe, "grad", 1
        ) @ _dq(w, recipe, "weight", 0)
        gq = kb.quantize(NUMPY_OPS, dy, recipe, "grad", 0, **_rng(7, step, 7))
        xq = kb.quantize(NUMPY_OPS, x, recipe, "input", 0, **_rng(7, step, 0))
        want_dw = kb.dequantize(NUMPY_OPS, gq, recipe, "grad", 0).T @ kb.dequantize(
            NUMPY_OPS, xq, recipe, "input", 0
        )
        tol = {"rtol": 1e-5, "atol": 1e-5}
        np.testing.assert_allclose(y, _dq(x, recipe, "input", 1) @ _dq(w, recipe, "weight", 1).T, **tol)
        np.testing.assert_allclose(dx, want_dx, **tol)
        np.testing.assert_allclose(dk, want_dw.T, **tol)
        dks.append(np.asarray(dk))
    assert traces == [1]
    assert not np.array_equal(dks[0], dks[1])  # the step changes the bits
    again = gemms(x, kernel, dy, jnp.int32(1))[2]
    assert np.array_equal(np.asarray(again), dks[1])  # the same step, the same bytes


def test_autocast_numbers_seeded_dots_in_trace_order_and_needs_rng() -> None:
    recipe = PRESETS["nvfp4_te"]
    rng = np.random.default_rng(5)
    x = rng.standard_normal((16, 32)).astype(np.float32)
    w1 = rng.standard_normal((32, 16)).astype(np.float32)
    w2 = rng.standard_normal((16, 8)).astype(np.float32)

    def f(x, w1, w2):
        return ((x @ w1) @ w2).astype(jnp.float32).sum()

    traces: list[int] = []

    @jax.jit
    def grads(x, w1, w2, step):
        traces.append(1)
        fn = mpx_jax.autocast(f, SPECS["nvfp4_te"], rng=blocks.BlockRng(seed=3, step=step, index=4))
        return jax.grad(fn, argnums=(1, 2))(x, w1, w2)

    def by_hand(x, w1, w2, step):  # the same program with the keys written out: dots 4 and 5
        h = blocks.block_matmul(x, w1, recipe, jnp.bfloat16, seed=3, step=step, index=4)
        return (
            blocks.block_matmul(h, w2, recipe, jnp.bfloat16, seed=3, step=step, index=5)
            .astype(jnp.float32)
            .sum()
        )

    want = jax.jit(jax.grad(by_hand, argnums=(1, 2)))
    for step in (0, 9):
        got = grads(x, w1, w2, jnp.int32(step))
        for a, b in zip(got, want(x, w1, w2, jnp.int32(step)), strict=True):
            assert np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
    assert traces == [1]
    with pytest.raises(mpx.Float8Error, match=r"^rng: .*needs rng=mpx_jax.blocks.BlockRng"):
        mpx_jax.autocast(f, SPECS["nvfp4_te"])
    with pytest.raises(mpx.MPXError, match=r"^rng: expected an mpx_jax.blocks.BlockRng"):
        mpx_jax.autocast(f, SPECS["nvfp4_te"], rng=(3, 0))
    with pytest.raises(mpx.Float8Error, match=r"^seed: the recipe nvfp4_te .* needs seed="):
        blocks.block_matmul(x, w1, recipe)
    with pytest.raises(mpx.Float8Error, match=r"^index: 40000 is not allowed"):
        blocks.block_matmul(x, w1, recipe, seed=0, index=40000)
    with pytest.raises(mpx.Float8Error, match=r"^step: expected an integer scalar"):
        blocks.block_matmul(x, w1, recipe, seed=0, step=jnp.zeros(2, jnp.int32))


def test_seeded_flax_layers_carry_and_advance_their_step() -> None:
    """NNX: block_step advances in training calls, not under eval(); linen: in the mpx_blocks collection
    when apply makes it mutable; both give block_matmul's gradients for their (seed, step, index)."""
    recipe = PRESETS["nvfp4_te"]
    x = np.random.default_rng(9).standard_normal((16, 32)).astype(np.float32)
    layer = BlockLinear(32, 16, recipe=recipe, seed=4, index=2, rngs=nnx.Rngs(0))
    kernel = layer.kernel[...]

    @nnx.jit
    def grad_of(m, x):
        return nnx.grad(lambda m: m(x).sum())(m).kernel[...]

    @jax.jit
    def want(kernel, step):  # the keys written out
        def fn(k):
            return blocks.block_matmul(x, k, recipe, jnp.float32, seed=4, step=step, index=2).sum()

        return jax.grad(fn)(kernel)

    for step in (0, 1):
        assert np.array_equal(np.asarray(grad_of(layer, x)), np.asarray(want(kernel, jnp.int32(step))))
        assert int(layer.block_step[...]) == step + 1
    layer.eval()
    grad_of(layer, x)
    assert int(layer.block_step[...]) == 2
    layer.train()
    dense = BlockDense(16, recipe, seed=4, index=2)
    variables = jax.jit(dense.init)(jax.random.key(0), x)
    assert int(variables["mpx_blocks"]["block_step"]) == 0
    params = {"kernel": kernel, "bias": variables["params"]["bias"]}

    @jax.jit
    def linen_grad(params, steps, x):
        def loss(p):
            y, new = dense.apply({"params": p, "mpx_blocks": steps}, x, mutable=["mpx_blocks"])
            return y.sum(), new["mpx_blocks"]

        return jax.grad(loss, has_aux=True)(params)

    steps = variables["mpx_blocks"]
    for step in (0, 1):
        g, steps = linen_grad(params, steps, x)
        assert int(steps["block_step"]) == step + 1
        assert np.array_equal(np.asarray(g["kernel"]), np.asarray(want(kernel, jnp.int32(step))))
    assert BlockLinear(2, 2, recipe=SPECS["mxfp8"], rngs=nnx.Rngs(0)).block_step is None
    with pytest.raises(mpx.Float8Error, match=r"^seed: -1 is not allowed"):
        BlockLinear(2, 2, recipe=recipe, seed=-1, rngs=nnx.Rngs(0))
