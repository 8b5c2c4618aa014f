"""mpx_jax.autocast under an FP8 policy: LOWER dots (no batch dimensions) run as mpx_jax.float8's FP8 GEMM.

The product equals the core's ``fp8_dot`` on the same inputs (current scaling: each operand's own amax),
within float32 rounding of the sums; the output gradient is quantized in e5m2 under ``hybrid``; jit,
grad and training work; everything else follows the compute dtype.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mpx
from mpx import float8 as core
from mpx.float8 import Float8Recipe
from mpx_jax import autocast

CURRENT = "mixed_bfloat16_fp8_current"
F32_FP8 = "float32,fp8=hybrid,fp8_scaling=current"
F32_E4M3 = "float32,fp8=e4m3,fp8_scaling=current"
EPS32 = 2.0**-23


CURRENT_RECIPE = Float8Recipe(scaling="current")


def _scale(x, fmt):
    return core.compute_scale(CURRENT_RECIPE, float(np.max(np.abs(np.asarray(x, np.float32)))), fmt)


def _bound(a, b, sa, sb, fa="e4m3", fb="e4m3"):
    """docs/fp8.md's bound against fp8_dot: (4k + 4) * eps32 * (|qa| @ |qb|) / (sa * sb) for k-term sums."""
    qa = np.abs(core.quantize(a, sa, fa).astype(np.float32))
    qb = np.abs(core.quantize(b, sb, fb).astype(np.float32))
    k = qa.shape[-1]
    return (4 * k + 4) * EPS32 * (qa @ qb) * core.scale_inv(sa) * core.scale_inv(sb)


def _dtypes_in(jaxpr_text):
    return {t for t in ("f8_e4m3fn", "f8_e5m2") if t in jaxpr_text}


# a few sizes, so examples share shapes: eager autocast compiles each op once per shape (about 3 s a shape)
matrices = st.tuples(
    st.sampled_from([1, 3, 6]),
    st.sampled_from([1, 5, 24]),
    st.sampled_from([1, 6]),
    st.integers(0, 2**32 - 1),
)


@settings(max_examples=15, deadline=None)
@given(matrices, st.floats(min_value=2.0**-20, max_value=2.0**20), st.sampled_from([F32_FP8, F32_E4M3]))
def test_the_product_equals_the_core_fp8_dot(shape, spread, spec):
    m, k, n, seed = shape
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, k)) * spread).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32) / spread
    x[0, 0] = 0.0  # a zero operand element, and subnormal products below
    y = np.asarray(autocast(lambda x, w: x @ w, spec)(x, w))
    sx, sw = _scale(x, "e4m3"), _scale(w, "e4m3")
    ref = core.fp8_dot(x, w, sx, sw)
    assert y.dtype == np.float32
    assert np.all(np.abs(y - ref) <= _bound(x, w, sx, sw))
    # the bfloat16 policy computes the same float32 product and rounds it once to bfloat16
    half = np.asarray(autocast(lambda x, w: x @ w, CURRENT)(x, w))
    assert half.dtype == jnp.bfloat16
    np.testing.assert_array_equal(half, y.astype(jnp.bfloat16))


def test_the_dot_runs_on_float8_operands_quantized_from_the_values_as_they_arrive():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 16)).astype(np.float32)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    text = str(jax.make_jaxpr(autocast(lambda x, w: x @ w, CURRENT))(x, w))
    assert "f8_e4m3fn" in text and "bf16[4,16]" not in text  # float32 master values, never a bf16 copy
    hlo = jax.jit(autocast(lambda x, w: x @ w, CURRENT)).lower(x, w).as_text()
    assert "f8E4M3FN" in hlo
    # einsum contracting a feature axis and a 3-D activation: linear layers, both FP8
    x3 = rng.standard_normal((2, 3, 16)).astype(np.float32)
    for fn in (lambda x, w: jnp.einsum("btd,df->btf", x, w), lambda x, w: x @ w):
        y = np.asarray(autocast(fn, F32_FP8)(x3, w))
        sx, sw = _scale(x3, "e4m3"), _scale(w, "e4m3")
        ref = core.fp8_dot(x3.reshape(6, 16), w, sx, sw).reshape(2, 3, 8)
        assert np.all(np.abs(y - ref) <= _bound(x3.reshape(6, 16), w, sx, sw).reshape(2, 3, 8))


@pytest.mark.parametrize("spec, grad_fmt", [(F32_FP8, "e5m2"), (F32_E4M3, "e4m3"), (CURRENT, "e5m2")])
def test_gradients_flow_with_the_output_gradient_in_the_recipes_format(spec, grad_fmt):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 12)).astype(np.float32)
    w = rng.standard_normal((12, 7)).astype(np.float32)
    # a cotangent whose e4m3 and e5m2 quantizations differ, exact in bfloat16
    c = np.asarray(rng.standard_normal((5, 7)).astype(jnp.bfloat16), np.float32) * np.float32(3e-3)
    c = np.asarray(c.astype(jnp.bfloat16), np.float32)

    def loss(x, w):
        return jnp.sum(autocast(lambda x, w: x @ w, spec)(x, w).astype(jnp.float32) * c)

    dx, dw = jax.grad(loss, argnums=(0, 1))(x, w)
    assert dx.dtype == np.float32 and dw.dtype == np.float32  # gradients keep the parameters' dtype
    sx, sw, sg = _scale(x, "e4m3"), _scale(w, "e4m3"), _scale(c, grad_fmt)
    ref_dx = core.fp8_dot(c, w.T, sg, sw, grad_fmt, "e4m3")
    ref_dw = core.fp8_dot(x.T, c, sx, sg, "e4m3", grad_fmt)
    half = spec == CURRENT

    def close(got, ref, bound):
        got = np.asarray(got, np.float32)
        if half:  # the dot's results are bfloat16 (x and w arrive in float32: their gradient is cast back)
            bound = bound + np.abs(ref) * 2.0**-8
        return np.all(np.abs(got - ref) <= bound)

    assert close(dx, ref_dx, _bound(c, w.T, sg, sw, grad_fmt, "e4m3"))
    assert close(dw, ref_dw, _bound(x.T, c, sx, sg, "e4m3", grad_fmt))
    other = "e4m3" if grad_fmt == "e5m2" else "e5m2"
    sg_other = _scale(c, other)
    assert not np.allclose(ref_dx, core.fp8_dot(c, w.T, sg_other, sw, other, "e4m3"), rtol=0, atol=0)
    bwd = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w))
    assert {"f8_e5m2": grad_fmt == "e5m2", "f8_e4m3fn": True} == {
        t: t in bwd for t in ("f8_e5m2", "f8_e4m3fn")
    }


def test_jit_gives_the_eager_result_and_compiles_once():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((8, 32)).astype(np.float32)
    w = rng.standard_normal((32, 16)).astype(np.float32)
    fn = autocast(lambda x, w: jax.nn.gelu(x @ w), CURRENT)
    jitted = jax.jit(fn)
    eager = np.asarray(fn(x, w), np.float32)
    np.testing.assert_array_equal(np.asarray(jitted(x, w), np.float32), eager)
    jitted(x * 2, w)  # new amaxes, new scales: values, not a new trace
    assert jitted._cache_size() == 1
    # the backward under jit: bfloat16 elementwise work fuses in float32 under jit (XLA:CPU) and its
    # rounding then moves e5m2 quantization steps, so compare a float32 program
    lin = autocast(lambda x, w: jax.nn.relu(x @ w), F32_FP8)

    def loss(x, w):
        return jnp.sum(lin(x, w) * x[:, :16])

    np.testing.assert_array_equal(
        np.asarray(jax.jit(jax.grad(loss, argnums=1))(x, w)), np.asarray(jax.grad(loss, argnums=1)(x, w))
    )


def test_everything_but_the_linear_dots_follows_the_compute_dtype():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 4, 8)).astype(np.float32)
    w = rng.standard_normal((8, 8)).astype(np.float32)
    kern = rng.standard_normal((3, 3, 2, 4)).astype(np.float32)
    img = rng.standard_normal((1, 6, 6, 2)).astype(np.float32)

    def f(x, w, img, kern):
        h = x @ w  # linear: FP8
        scores = jnp.einsum("bqd,bkd->bqk", h, h)  # batched (attention): bf16, no FP8
        p = jax.nn.softmax(scores)  # FLOAT32
        conv = jax.lax.conv_general_dilated(
            img, kern, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        return h, scores, p, jax.nn.relu(h), h + 1.0, jnp.sum(h), conv

    fn = autocast(f, CURRENT)
    outs = fn(x, w, img, kern)
    dtypes = [o.dtype for o in outs]
    assert dtypes == [
        jnp.bfloat16,
        jnp.bfloat16,
        jnp.float32,
        jnp.bfloat16,
        jnp.bfloat16,
        jnp.float32,
        jnp.bfloat16,
    ]
    # exactly one FP8 dot: the batched einsum and the convolution run on bfloat16 operands
    text = str(jax.make_jaxpr(fn)(x, w, img, kern))
    assert _dtypes_in(text) == {"f8_e4m3fn"}
    bf16_dots = [
        line for line in text.splitlines() if "dot_general" in line or "conv_general_dilated" in line
    ]
    assert len(bf16_dots) == 3, text  # the FP8 dot (inside its custom_vjp), the batched einsum, the conv
    # the batched einsum equals the plain bfloat16 autocast's on the FP8 linear's output
    h = outs[0]
    plain = autocast(lambda h: jnp.einsum("bqd,bkd->bqk", h, h), "mixed_bfloat16")(h)
    np.testing.assert_array_equal(np.asarray(outs[1], np.float32), np.asarray(plain, np.float32))


def test_a_nested_float32_region_and_float32_islands_have_no_fp8():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    w = rng.standard_normal((8, 8)).astype(np.float32)
    exact = autocast(lambda x, w: x @ w, "float32")

    def f(x, w):
        pos = jnp.arange(8, dtype=jnp.float32)
        island = jnp.outer(pos, pos) @ jnp.ones((8, 8), jnp.float32)  # the function's own float32
        return exact(x, w), island

    out, island = autocast(f, CURRENT)(x, w)
    assert out.dtype == np.float32 and island.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jnp.asarray(x) @ jnp.asarray(w)))
    assert not _dtypes_in(str(jax.make_jaxpr(autocast(f, CURRENT))(x, w)))


def test_no_fp8_where_the_op_table_does_not_lower_matmul():
    x = np.ones((2, 4), np.float32)
    table = mpx.OP_TABLE.replace(matmul="float32")
    fn = autocast(lambda x: x @ x.T, CURRENT, op_table=table)
    assert not _dtypes_in(str(jax.make_jaxpr(fn)(x)))
    assert fn(x).dtype == np.float32


def test_a_delayed_scaling_recipe_is_refused_naming_the_fixes():
    for spec in ("mixed_bfloat16_fp8", "mixed_bfloat16,fp8=hybrid", "float32,fp8=e4m3"):
        with pytest.raises(mpx.Float8Error, match="current scaling only.*fp8_scaling=current.*Float8Linear"):
            autocast(lambda x: x, spec)
    # policies without FP8 are unchanged; a current recipe with any other key is accepted
    autocast(lambda x: x, "mixed_bfloat16,fp8=hybrid,fp8_scaling=current,fp8_margin=1")


def test_a_non_finite_operand_or_gradient_reaches_the_loss_scaler_as_nan():
    x = np.ones((2, 4), np.float32)
    w = np.ones((4, 3), np.float32)
    fn = autocast(lambda x, w: x @ w, F32_FP8)
    x_inf = x.copy()
    x_inf[0, 0] = np.inf
    assert np.all(np.isnan(np.asarray(fn(x_inf, w))))  # the clip would have hidden the inf
    c = np.ones((2, 3), np.float32)
    c[1, 2] = np.inf
    dw = jax.grad(lambda w: jnp.sum(fn(x, w) * c))(w)
    assert np.all(np.isnan(np.asarray(dw)))


def test_a_small_mlp_trains_with_loss_scaling_and_the_loss_falls():
    import mpx_jax

    rng = np.random.default_rng(5)
    xs = rng.standard_normal((64, 16)).astype(np.float32)
    true_w = rng.standard_normal((16, 1)).astype(np.float32)
    ys = np.tanh(xs @ true_w)
    params = {
        "w1": jnp.asarray(rng.standard_normal((16, 32)) * 0.25, jnp.float32),
        "w2": jnp.asarray(rng.standard_normal((32, 1)) * 0.25, jnp.float32),
    }

    def model(p, x):
        return jax.nn.relu(x @ p["w1"]) @ p["w2"]

    fwd = autocast(model, CURRENT)
    tx = mpx_jax.with_loss_scaling(optax.adam(1e-2), "mixed_float16")
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        scale = mpx_jax.get_loss_scale(opt_state)

        def loss(p):
            pred = fwd(p, xs).astype(jnp.float32)
            return jnp.mean((pred - ys) ** 2)

        value, grads = jax.value_and_grad(lambda p: scale.scale(loss(p)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value / scale.loss_scale

    losses = []
    for _ in range(60):
        params, opt_state, value = step(params, opt_state)
        losses.append(float(value))
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.5 * losses[0], losses
    assert step._cache_size() == 1


def test_under_vmap_each_slice_is_quantized_with_its_own_amax():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((3, 4, 8)).astype(np.float32)
    x[1] *= 100.0  # a slice whose amax differs by far
    w = rng.standard_normal((8, 2)).astype(np.float32)
    fn = autocast(lambda x, w: x @ w, F32_FP8)
    mapped = np.asarray(jax.vmap(fn, in_axes=(0, None))(x, w))
    np.testing.assert_array_equal(mapped, np.stack([np.asarray(fn(x[i], w)) for i in range(3)]))
