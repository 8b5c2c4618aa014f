"""FP8 in JAX: :mod:`mpx.float8`'s quantization, scaling state machine and GEMM, jit-native.

The arithmetic is the core's kernels (:mod:`mpx.kernels.float8`, :func:`mpx.kernels.bits.abs_max`) run
with JAX's table (:data:`mpx_jax._array_ops.JAX_OPS`), so every number is the reference's bits
(XLA:CPU's flush of float32 subnormals included: the kernels work on the bits where it matters):

* :func:`quantize` gives the reference's bytes for every float32 input
  (``fp8(clip(float32(x) * scale, -fp8_max, fp8_max))``; NaN stays NaN);
* :func:`compute_scale` gives the reference's float32 scale for every amax, recipe and format;
* :func:`amax` is ``max(|x|)`` on the bits (a subnormal amax is recorded, a NaN gives NaN);
* the state types are the core's :class:`mpx.float8.TensorScale` and :class:`mpx.float8.Float8State`,
  registered here as pytrees: ``scale`` (float32 scalar) and ``amax_history`` (float32
  ``(amax_history_len,)``, most recent first; ``(0,)`` under current scaling) are the leaves, the
  role is static, ``tensors`` a dict.  :func:`float8_init` and :func:`float8_update` are
  :func:`mpx.float8.float8_init`/:func:`mpx.float8.float8_update` with ``ops=JAX_OPS``: selects and
  integer arithmetic, ``skipped=`` a Python or traced bool; :func:`mpx.float8.state_dict` reads
  the state (one transfer) and :func:`mpx.float8.load_state_dict`'s host values step here too;
* :func:`window_max` and :func:`reduce_amaxes` take the MAX of amaxes where a NaN wins, within an
  accumulation window and over replicas (``lax.pmax`` on the amaxes' order keys, so every replica
  makes the same update, and the same one as :func:`window_max`);
* :func:`fp8_linear` is the FP8 GEMM with a ``jax.custom_vjp``:
  ``lax.dot_general`` on float8 operands with ``preferred_element_type=float32``,
  inputs and weights in the recipe's forward format, gradients in e5m2 under
  ``hybrid``; the amaxes of input, weight and gradient come back as the
  gradient of an ``amax`` sink (zeros in, amaxes out), so one ``jax.grad`` gives
  both the parameter gradients and what :func:`float8_update` needs.

>>> import mpx
>>> r = mpx.Float8Recipe(amax_history_len=4)
>>> s = float8_init(r, {"x": "input"})
>>> s = float8_update(r, s, {"x": jnp.float32(2.0)})
>>> float(s.tensors["x"].scale), s.tensors["x"].amax_history.tolist()
(224.0, [2.0, 0.0, 0.0, 0.0])
>>> mpx.float8.state_dict(r, s)["tensors"]["x"]["amax_history"]
[2.0, 0.0, 0.0, 0.0]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from mpx import float8 as core
from mpx.float8 import Float8Error, Float8Recipe, Float8State, TensorScale
from mpx.kernels import bits as kbits
from mpx.kernels import float8 as kf8
from mpx_jax._array_ops import JAX_OPS

__all__ = [
    "DTYPES",
    "Float8State",
    "TensorScale",
    "amax",
    "compute_scale",
    "float8_init",
    "float8_update",
    "fp8_dot_general",
    "fp8_linear",
    "quantize",
    "reduce_amaxes",
    "scale_inv",
    "window_max",
]

#: The JAX dtypes of the core's FP8 formats.
DTYPES = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}


def _register_pytrees() -> None:
    """The core's state types as pytrees (once per process: a second registration raises)."""
    for cls, data, meta in (
        (TensorScale, ["scale", "amax_history"], ["role"]),
        (Float8State, ["tensors"], []),
    ):
        try:
            jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)
        except ValueError as exc:  # registered already (a reloaded module)
            if "Duplicate" not in str(exc):
                raise


_register_pytrees()


def quantize(x: Any, scale: Any, fmt: str) -> jax.Array:
    """``fp8(clip(float32(x) * float32(scale), -fp8_max, fp8_max))``: the reference's bytes (NaN stays NaN).

    Args:
        x: an array (any float dtype; upcast to float32 first).
        scale: the float32 scale (a scalar array or number), positive.
        fmt: ``"e4m3"`` (``float8_e4m3fn``) or ``"e5m2"``.

    :func:`mpx.kernels.float8.quantize` with JAX's table.
    """
    return kf8.quantize(JAX_OPS, x, scale, fmt)


def scale_inv(scale: Any) -> jax.Array:
    """``float32(1 / scale)`` (:func:`mpx.float8.scale_inv`)."""
    return jnp.float32(1.0) / jnp.asarray(scale, jnp.float32)


def amax(x: Any) -> jax.Array:
    """``max(|x|)`` in float32 (NaN if any element is NaN), the amax the recipe records.

    :func:`mpx.kernels.bits.abs_max` with JAX's table: on the bits, since XLA:CPU's float
    ``abs``/``max`` flush a float32 subnormal to zero.
    """
    return kbits.abs_max(JAX_OPS, x)


def compute_scale(recipe: Float8Recipe, amax_value: Any, fmt: str, previous: Any = 1.0) -> jax.Array:
    """The float32 scale for ``amax_value`` (:func:`mpx.float8.compute_scale`, bit for bit; traceable).

    :func:`mpx.kernels.float8.compute_scale` with JAX's table.
    """
    return kf8.compute_scale(JAX_OPS, recipe, amax_value, fmt, previous)


def float8_init(recipe: Float8Recipe, roles: Mapping[str, str]) -> Float8State:
    """A fresh state of JAX arrays: :func:`mpx.float8.float8_init` with ``ops=JAX_OPS`` (scale 1.0, a zero
    history per tensor)."""
    return core.float8_init(recipe, roles, ops=JAX_OPS)


def float8_update(
    recipe: Float8Recipe, state: Float8State, amaxes: Mapping[str, Any], *, skipped: Any = False
) -> Float8State:
    """The state after one optimizer step that saw ``amaxes``: :func:`mpx.float8.float8_update` with
    ``ops=JAX_OPS`` (bit for bit the reference, selects only).

    ``amaxes``: tensor name -> float32 scalar (the step's ``max(|x|)``; replicas reduced first with
    :func:`reduce_amaxes`).  ``skipped``: a Python or traced bool; when true the state comes back
    unchanged (a select, so one compiled step serves both).  Unknown names raise :class:`mpx.Float8Error`.
    """
    return core.float8_update(recipe, state, amaxes, skipped=skipped, ops=JAX_OPS)


def window_max(a: Any, b: Any) -> jax.Array:
    """Elementwise MAX of amaxes where NaN wins (:func:`mpx.kernels.float8.window_max` with JAX's table):
    an accumulation window's amax."""
    return kf8.window_max(JAX_OPS, a, b)


def reduce_amaxes(amaxes: Any, axis_name: Any) -> Any:
    """Every amax leaf reduced with MAX over the mapped axis ``axis_name`` where a NaN wins: on every
    replica, :func:`window_max` of all the replicas' values.

    ``lax.pmax`` of the amaxes' int32 order keys (:func:`mpx.kernels.bits.order_key`, which order
    float32 bits as their values, subnormals included: XLA:CPU's float max all-reduce flushes those
    and drops a NaN), with a NaN flag reduced alongside.
    """
    o = JAX_OPS

    def one(a: Any) -> jax.Array:
        key = lax.pmax(kbits.order_key(o, kbits.to_bits(o, a)), axis_name)
        any_nan = lax.pmax(o.cast(kbits.is_nan(o, a), "int32"), axis_name) > 0
        return o.where(any_nan, jnp.float32(jnp.nan), kbits.from_bits(o, kbits.order_key(o, key)))

    return jax.tree_util.tree_map(one, amaxes)


# -- the FP8 GEMM --------------------------------------------------------------------------------------


def _scale_for(recipe: Float8Recipe, stored: jax.Array, x: jax.Array, fmt: str) -> jax.Array:
    """The scale a tensor quantizes with: its stored one (delayed) or its own amax's (current)."""
    if recipe.scaling == "current":
        return compute_scale(recipe, amax(x), fmt, stored)
    return jnp.asarray(stored, jnp.float32)


def _gemm(
    qa: jax.Array, qb: jax.Array, sa: jax.Array, sb: jax.Array, dims: Any, finite: jax.Array
) -> jax.Array:
    out = lax.dot_general(qa, qb, dims, preferred_element_type=jnp.float32)
    out = out * scale_inv(sa) * scale_inv(sb)
    # an inf in an operand is an overflow upstream (a scaled loss's gradient, an activation): the
    # quantization's clip would hide it from the loss scaler, so the GEMM's result says NaN instead
    return jnp.where(finite, out, jnp.float32(jnp.nan))


def _mm(a_ndim: int) -> Any:
    return (((a_ndim - 1,), (0,)), ((), ()))


def fp8_linear(
    x: jax.Array,
    kernel: jax.Array,
    scales: Mapping[str, Any],
    sinks: Mapping[str, Any],
    recipe: Float8Recipe,
) -> jax.Array:
    """``x @ kernel`` as an FP8 GEMM (float32 result), differentiable.

    Args:
        x: ``(..., in)``, any float dtype.
        kernel: ``(in, out)``.
        scales: ``{"input", "weight", "grad"}`` -> float32 scalar: the stored scales (under current
            scaling each tensor's own amax gives its scale and these are not read).
        sinks: ``{"input", "weight", "grad"}`` -> float32 scalar zeros: their gradient is the step's
            amaxes of ``x``, ``kernel`` and the output's cotangent (each sink must feed one call only:
            gradients of a shared sink add).
        recipe: the :class:`mpx.Float8Recipe`: e4m3 forward operands, and e5m2 gradients under
            ``hybrid``.

    The forward is :func:`mpx.float8.fp8_dot`'s: quantized operands, ``lax.dot_general`` with
    ``preferred_element_type=float32``, then both inverse scales.  The backward quantizes the
    cotangent ``g`` and computes ``dx = fp8_dot(g, kernel.T)``, ``dk = fp8_dot(x.T, g)`` from the
    forward's quantized operands.  Both match the reference within float32 rounding of the sums.

    One rule beyond the reference: a non-finite value in an operand (``x``, ``kernel``, or the
    cotangent) makes that GEMM's result NaN instead of being clipped to +-fp8_max, so a scaled loss
    that overflowed, or an inf activation, still reaches the loss scaler as a non-finite gradient
    and the step is skipped (the clip alone would turn it into a finite, wrong update).
    """
    for where, tree in (("scales", scales), ("sinks", sinks)):
        if not isinstance(tree, Mapping) or set(tree) != set(core.ROLES):
            raise Float8Error(f"{where}: expected a mapping with exactly the keys input, weight, grad")
    return _fp8_linear(recipe, x, kernel, dict(scales), dict(sinks))


@dataclasses.dataclass(frozen=True)
class _Static:
    recipe: Float8Recipe
    x_dtype: Any
    k_dtype: Any


def _fp8_linear(recipe: Float8Recipe, x: Any, kernel: Any, scales: Any, sinks: Any) -> jax.Array:
    x, kernel = jnp.asarray(x), jnp.asarray(kernel)
    return _fp8_linear_vjp(_Static(recipe, x.dtype, kernel.dtype), x, kernel, scales, sinks)


def _forward(static: _Static, x: Any, kernel: Any, scales: Any) -> tuple[jax.Array, Any]:
    recipe = static.recipe
    fi, fw = recipe.format_of("input"), recipe.format_of("weight")
    sx = _scale_for(recipe, scales["input"], x, fi)
    sw = _scale_for(recipe, scales["weight"], kernel, fw)
    qx, qw = quantize(x, sx, fi), quantize(kernel, sw, fw)
    ax, aw = amax(x), amax(kernel)
    y = _gemm(qx, qw, sx, sw, _mm(x.ndim), jnp.isfinite(ax) & jnp.isfinite(aw))
    return y, (qx, qw, sx, sw, ax, aw)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_linear_vjp(static: _Static, x: Any, kernel: Any, scales: Any, sinks: Any) -> jax.Array:
    return _forward(static, x, kernel, scales)[0]


def _fwd(static: _Static, x: Any, kernel: Any, scales: Any, sinks: Any) -> tuple[jax.Array, Any]:
    y, (qx, qw, sx, sw, ax, aw) = _forward(static, x, kernel, scales)
    return y, (qx, qw, sx, sw, ax, aw, scales, sinks)


def _bwd(static: _Static, res: Any, g: jax.Array) -> tuple[Any, ...]:
    recipe = static.recipe
    qx, qw, sx, sw, ax, aw, scales, sinks = res
    fg = recipe.format_of("grad")
    sg = _scale_for(recipe, scales["grad"], g, fg)
    qg = quantize(g, sg, fg)
    # dx[..., i] = sum_o g[..., o] * w[i, o];  dk[i, o] = sum_batch x[b, i] * g[b, o]
    ag = amax(g)
    ok = jnp.isfinite(ag) & jnp.isfinite(ax) & jnp.isfinite(aw)
    dx = _gemm(qg, qw, sg, sw, (((qg.ndim - 1,), (1,)), ((), ())), ok)
    qx2 = qx.reshape(-1, qx.shape[-1])
    qg2 = qg.reshape(-1, qg.shape[-1])
    dk = _gemm(qx2, qg2, sx, sg, (((0,), (0,)), ((), ())), ok)
    d_scales = jax.tree_util.tree_map(jnp.zeros_like, scales)
    d_sinks = {
        "input": ax.astype(jnp.result_type(sinks["input"])),
        "weight": aw.astype(jnp.result_type(sinks["weight"])),
        "grad": ag.astype(jnp.result_type(sinks["grad"])),
    }
    return dx.astype(static.x_dtype), dk.astype(static.k_dtype), d_scales, d_sinks


_fp8_linear_vjp.defvjp(_fwd, _bwd)


# -- a stateless FP8 dot_general (current scaling), for autocast's LOWER dots ---------------------------


def fp8_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    recipe: Float8Recipe,
    *,
    out_dtype: Any = None,
) -> jax.Array:
    """``lax.dot_general(lhs, rhs, dimension_numbers)`` as an FP8 GEMM with current scaling (no state).

    Each operand is quantized with the scale its own amax gives (:func:`compute_scale` under
    ``recipe`` with ``scaling="current"``, whatever the recipe's scaling: there is no state to delay
    with), in the recipe's forward format; ``lax.dot_general`` runs on the float8 operands with
    ``preferred_element_type=float32`` and the inverse scales follow.  The backward quantizes the
    cotangent (e5m2 under ``hybrid``) with its own amax and computes both transposed products on the
    quantized values in float32 (exact products, float32 sums: the FP8 GEMM's numbers; the backward
    dots themselves run in float32).  A non-finite operand or cotangent gives NaN (as
    :func:`fp8_linear`).  ``out_dtype``: the result's dtype (default: ``lhs``'s).
    """
    current = dataclasses.replace(recipe, scaling="current")
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    dtype = jnp.dtype(out_dtype) if out_dtype is not None else lhs.dtype
    dims = jax.tree_util.tree_map(int, dimension_numbers)
    dims = (tuple(tuple(d) for d in dims[0]), tuple(tuple(d) for d in dims[1]))
    return _fp8_dg(_DGStatic(current, dims, lhs.dtype, rhs.dtype, dtype), lhs, rhs)


@dataclasses.dataclass(frozen=True)
class _DGStatic:
    recipe: Float8Recipe
    dims: Any
    lhs_dtype: Any
    rhs_dtype: Any
    out_dtype: Any


def _dg_forward(static: _DGStatic, lhs: Any, rhs: Any) -> tuple[jax.Array, Any]:
    fmt = static.recipe.format_of("input")
    al, ar = amax(lhs), amax(rhs)
    sl, sr = compute_scale(static.recipe, al, fmt), compute_scale(static.recipe, ar, fmt)
    ql, qr = quantize(lhs, sl, fmt), quantize(rhs, sr, fmt)
    y = _gemm(ql, qr, sl, sr, static.dims, jnp.isfinite(al) & jnp.isfinite(ar))
    return y.astype(static.out_dtype), (ql, qr, sl, sr, jnp.isfinite(al) & jnp.isfinite(ar))


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_dg(static: _DGStatic, lhs: Any, rhs: Any) -> jax.Array:
    return _dg_forward(static, lhs, rhs)[0]


def _dg_fwd(static: _DGStatic, lhs: Any, rhs: Any) -> tuple[jax.Array, Any]:
    return _dg_forward(static, lhs, rhs)


def _dg_bwd(static: _DGStatic, res: Any, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    ql, qr, sl, sr, ok = res
    fg = static.recipe.format_of("grad")
    ag = amax(g)
    sg = compute_scale(static.recipe, ag, fg)
    qg = quantize(g, sg, fg).astype(jnp.float32)
    _, transpose = jax.vjp(
        lambda a, b: lax.dot_general(a, b, static.dims, preferred_element_type=jnp.float32),
        ql.astype(jnp.float32),
        qr.astype(jnp.float32),
    )
    dl, dr = transpose(qg)
    ok = ok & jnp.isfinite(ag)
    nan = jnp.float32(jnp.nan)
    dl = jnp.where(ok, dl * scale_inv(sg) * scale_inv(sr), nan)
    dr = jnp.where(ok, dr * scale_inv(sl) * scale_inv(sg), nan)
    return dl.astype(static.lhs_dtype), dr.astype(static.rhs_dtype)


_fp8_dg.defvjp(_dg_fwd, _dg_bwd)
