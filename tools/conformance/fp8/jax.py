"""The ``fp8`` group on JAX: under mpx ``mpx_jax.float8`` (quantize, float8_update, fp8_linear), natively
Flax's FP8 ops (``flax.linen.fp8_ops``: ``quantize`` and ``Fp8DirectDotGeneralOp``, whose scales and amax
histories live in the ``_overwrite_with_gradient`` collection and travel through the gradient;
``Fp8DotGeneralOp`` is deprecated in flax 0.12 for it).

Flax keeps the *inverse* scale (``x / scale``): a native run is given ``float32(1 / scale)`` and reports
``float32(1 / stored)``.  A step the loss scaler skips keeps the old collection (Flax's DynamicScale idiom:
``jnp.where(is_finite, new, old)`` over the whole variables tree).

No mpx import at module level: the native paths import nothing of mpx (:mod:`conformance.fp8` is mpx-free).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from conformance.fp8 import (
    bits_to_f32,
    encode_fp8,
    f32_to_bits,
    matmul_inputs,
    quantize_inputs,
    require_native_recipe,
    trace_input,
    within_bound,
)

JAX_FP8 = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
OWG = "_overwrite_with_gradient"
DIMS = (((1,), (0,)), ((), ()))


def _float8():
    from mpx_jax import float8

    return float8


def _recipe(p: dict):
    import mpx

    return mpx.Float8Recipe.from_dict(p["recipe"])


def _array(x: np.ndarray, dtype: str) -> jax.Array:
    return jnp.asarray(x, jnp.bfloat16 if dtype == "bfloat16" else jnp.float32)


def _bytes(q: jax.Array, fmt: str) -> str:
    return encode_fp8(np.asarray(q).view(np.uint8), fmt)


def run_fp8_quantize(p: dict, mode: str) -> dict:
    """The quantized bytes (mpx: ``mpx_jax.float8.quantize``; native: ``flax.linen.fp8_ops.quantize`` with
    the inverse scale, in the input's dtype as Flax's ops compute)."""
    x = _array(quantize_inputs(p["kind"], p["seed"], p["n"], p["dtype"]), p["dtype"])
    if mode == "native":
        from flax.linen import fp8_ops

        inverse = jnp.float32(1.0) / jnp.float32(p["scale"])
        q = fp8_ops.quantize(x, JAX_FP8[p["fmt"]], inverse, x.dtype)
    else:
        q = _float8().quantize(x, jnp.float32(p["scale"]), p["fmt"])
    return {"bytes": _bytes(q, p["fmt"])}


def _mpx_trace(p: dict) -> list[int]:
    float8, recipe = _float8(), _recipe(p)

    @jax.jit
    def step(state, x, skipped):
        return float8.float8_update(recipe, state, {"t": float8.amax(x)}, skipped=skipped)

    state = float8.float8_init(recipe, {"t": p["role"]})
    scales = []
    for bits, skipped in zip(p["amaxes"], p["skipped"], strict=True):
        state = step(state, jnp.asarray(trace_input(float(bits_to_f32([bits])[0]))), jnp.asarray(skipped))
        scales.append(np.float32(state.tensors["t"].scale))
    return f32_to_bits(scales)


def _flax_op(length: int):
    from flax.linen import fp8_ops

    return fp8_ops.Fp8DirectDotGeneralOp(amax_history_length=length)


def _native_trace(p: dict) -> list[int]:
    recipe = p["recipe"]
    require_native_recipe(recipe, "Flax's FP8 ops")
    op = _flax_op(recipe["amax_history_len"])
    kernel = jnp.ones((4, 4), jnp.float32)
    grad_role = p["role"] == "grad"
    name = "output_grad_scale" if grad_role else "input_scale"

    @jax.jit
    def new_collection(fp8, x, g):
        def loss(v):
            return jnp.sum(op.apply({OWG: v}, x, kernel, DIMS) * g)

        return jax.grad(loss)(fp8)

    fp8 = op.init(jax.random.PRNGKey(0), jnp.ones((2, 4)), kernel, DIMS)[OWG]
    ones = jnp.ones((2, 4), jnp.float32)
    scales = []
    for bits, skipped in zip(p["amaxes"], p["skipped"], strict=True):
        amax = jnp.asarray(trace_input(float(bits_to_f32([bits])[0])))
        new = new_collection(fp8, ones if grad_role else amax, amax if grad_role else ones)
        if not skipped:
            fp8 = new
        # the scale the next step quantizes with: what Flax computes from this collection at its next call
        probe = new_collection(fp8, ones, ones)
        scales.append(np.float32(1.0) / np.float32(np.asarray(probe[name]).reshape(-1)[0]))
    return f32_to_bits(scales)


def run_fp8_trace(p: dict, mode: str) -> dict:
    """The scale each step leaves for the next (mpx: ``mpx_jax.float8.float8_update`` jitted, amaxes measured
    on device; native: a Flax ``Fp8DirectDotGeneralOp``'s collection after each step's gradient)."""
    return {"scales": _mpx_trace(p) if mode == "mpx" else _native_trace(p)}


def run_fp8_matmul(p: dict, mode: str) -> dict:
    """``a @ b`` in FP8 (mpx: ``mpx_jax.float8.fp8_linear``, current scaling; native: a Flax
    ``Fp8DirectDotGeneralOp`` whose history holds the operands' amaxes from one earlier call, so its scales
    are ``fp8_max / amax`` as current scaling's)."""
    a, b = matmul_inputs(p["seed"], p["m"], p["k"], p["n"], p["bad"])
    a, b = jnp.asarray(a), jnp.asarray(b)
    if mode == "mpx":
        float8 = _float8()
        zeros = {r: jnp.float32(0.0) for r in ("input", "weight", "grad")}
        ones = {r: jnp.float32(1.0) for r in ("input", "weight", "grad")}
        out = float8.fp8_linear(a, b, ones, zeros, _recipe(p))
        return within_bound(np.asarray(out), p["reference"], p["bound"])
    op = _flax_op(16)
    fp8 = op.init(jax.random.PRNGKey(0), a, b, DIMS)[OWG]
    fp8 = jax.grad(lambda v: jnp.sum(op.apply({OWG: v}, a, b, DIMS)))(fp8)  # records amax(a), amax(b)
    out = op.apply({OWG: fp8}, a, b, DIMS)
    return within_bound(np.asarray(out), p["reference"], p["bound"])
