"""FP8 in JAX: :mod:`mpx.float8`'s quantization, scaling state machine and GEMM, jit-native.

Everything here is bit-identical to the core reference (:mod:`mpx.float8`):

* :func:`quantize` gives the reference's bytes for every float32 input
  (``fp8(clip(float32(x) * scale, -fp8_max, fp8_max))``; NaN stays NaN).  XLA:CPU
  flushes float32 subnormals to zero in arithmetic, so the product is formed from
  the operands' bits (each operand normalized, one rounding of the mantissa
  product): a subnormal input or scale quantizes as in numpy.
* :func:`compute_scale` gives the reference's float32 scale for every amax,
  recipe and format without float64: the quotient ``fp8_max / m`` of the amax's
  mantissa ``m`` in float32 (correctly rounded; double rounding through float64
  then float32 is innocuous for a quotient), its exponent and the margin as
  integer arithmetic on the bits, the float32 ceiling and the smallest-normal floor.
* :class:`Float8State` is a pytree of per-tensor ``scale`` (float32 scalar) and
  ``amax_history`` (float32 ``(amax_history_len,)``, most recent first; ``(0,)``
  under current scaling) arrays; roles and the recipe are static metadata.  jit
  and sharding carry it, and :func:`float8_update` is ``jnp.where`` selects and
  integer arithmetic only, equal to :func:`mpx.float8.float8_update` step for
  step, ``skipped=`` included (a traced bool is fine).
* :func:`reduce_amaxes` takes the MAX over mapped axes (``lax.pmax``) so every
  replica makes the same update.
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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpx import float8 as core
from mpx.float8 import Float8Error, Float8Recipe

__all__ = [
    "DTYPES",
    "Float8State",
    "TensorScale",
    "amax",
    "compute_scale",
    "float8_init",
    "float8_state_dict",
    "float8_update",
    "fp8_dot_general",
    "fp8_linear",
    "load_float8_state_dict",
    "quantize",
    "reduce_amaxes",
    "scale_inv",
    "update_tensor",
    "window_max",
]

#: The JAX dtypes of the core's FP8 formats.
DTYPES = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}

_F32_MAX_BITS = 0x7F7FFFFF
_TINY_BITS = 0x00800000  # the smallest normal float32, the floor of a scale that underflows
_MAX_MARGIN = 400  # beyond this every scale underflows to zero (then the floor): keeps int32 exponents small


def _fmt(fmt: str) -> str:
    core.fp8_max(fmt)  # validates
    return fmt


def _bits(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.int32)


def _float(bits: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(bits.astype(jnp.int32), jnp.float32)


def _split(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """A finite float32's sign bit, integer mantissa ``M`` in [2**23, 2**24) and exponent ``e`` (x = M*2**(e-23)).

    Subnormals are normalized from their bits (no float arithmetic, so no flush to zero); zero gives
    ``M = 0``.  Returns (sign, M, e, is_zero).
    """
    bits = _bits(x)
    sign = bits & jnp.int32(-(2**31))
    field = (bits >> 23) & 0xFF
    frac = bits & 0x7FFFFF
    zero = (field == 0) & (frac == 0)
    # a subnormal's leading one is at bit 31 - clz(frac); shift it to bit 23
    shift = lax.clz(jnp.maximum(frac, 1)) - 8
    mant = jnp.where(field == 0, frac << shift, frac | 0x800000)
    exp = jnp.where(field == 0, -126 - shift, field - 127)
    return sign, mant, exp, zero


def _from_mant(sign: jax.Array, mant_f: jax.Array, exp: jax.Array) -> jax.Array:
    """``mant_f * 2**exp`` with sign bit ``sign`` (mant_f a float32 in [1, 4)), built on the bits.

    A result below the smallest normal float32 is a signed zero (every such value quantizes to an FP8
    zero), one above the largest is a signed infinity (the clip takes it to +-fp8_max).
    """
    mb = _bits(mant_f)
    e = ((mb >> 23) & 0xFF) - 127 + exp
    normal = sign | ((e + 127) << 23) | (mb & 0x7FFFFF)
    out = jnp.where(e > 127, sign | 0x7F800000, jnp.where(e < -126, sign, normal))
    return _float(out)


def _product(x: jax.Array, scale: jax.Array) -> jax.Array:
    """``float32(x) * scale`` rounded once as in IEEE arithmetic, for finite operands, without flush to zero.

    A result that would be a float32 subnormal comes back as a signed zero (it is an FP8 zero anyway).
    """
    sx, mx, ex, zx = _split(x)
    ss, ms, es, zs = _split(scale)
    fx = _float(jnp.int32(127 << 23) | (mx & 0x7FFFFF))  # mantissas as floats in [1, 2)
    fs = _float(jnp.int32(127 << 23) | (ms & 0x7FFFFF))
    out = _from_mant(sx ^ ss, fx * fs, ex + es)
    return jnp.where(zx | zs, _float(sx ^ ss), out)


def quantize(x: Any, scale: Any, fmt: str) -> jax.Array:
    """``fp8(clip(float32(x) * float32(scale), -fp8_max, fp8_max))``: the reference's bytes (NaN stays NaN).

    Args:
        x: an array (any float dtype; upcast to float32 first).
        scale: the float32 scale (a scalar array or number), positive.
        fmt: ``"e4m3"`` (``float8_e4m3fn``) or ``"e5m2"``.
    """
    limit = jnp.float32(core.fp8_max(fmt))
    xf = jnp.asarray(x).astype(jnp.float32)
    s = jnp.asarray(scale, jnp.float32)
    finite = jnp.isfinite(xf) & jnp.isfinite(s)
    # a non-finite x keeps its value (the scale is positive); a non-finite scale multiplies as IEEE does
    exact = _product(jnp.where(finite, xf, 0.0), jnp.where(finite, s, 1.0))
    scaled = jnp.where(finite, exact, jnp.where(jnp.isfinite(s), xf, xf * s))
    return jnp.clip(scaled, -limit, limit).astype(DTYPES[fmt])


def scale_inv(scale: Any) -> jax.Array:
    """``float32(1 / scale)`` (:func:`mpx.float8.scale_inv`)."""
    return jnp.float32(1.0) / jnp.asarray(scale, jnp.float32)


def amax(x: Any) -> jax.Array:
    """``max(|x|)`` in float32 (NaN if any element is NaN), the amax the recipe records.

    Taken on the bits (sign cleared, a non-negative float32's bits order as its value; NaN's above
    inf's): XLA:CPU's float ``abs``/``max`` flush a float32 subnormal to zero, which would record a
    zero amax where the reference records the subnormal.
    """
    return _float(jnp.max(_bits(jnp.asarray(x).astype(jnp.float32)) & 0x7FFFFFFF))


def _order_key(bits: jax.Array) -> jax.Array:
    """An int32 that orders float32 bit patterns as their values (an involution)."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _below(x: jax.Array, bound: float) -> jax.Array:
    """``float32 x < bound`` for a Python float ``bound`` (exact, on the bits: no flush to zero)."""
    b32 = float(np.float32(bound))
    limit = np.float32(bound) if b32 >= bound else np.nextafter(np.float32(bound), np.float32(np.inf))
    # x < bound  <=>  x < limit, the smallest float32 >= bound
    return _order_key(_bits(x)) < int(_order_key_np(limit))


def _order_key_np(value: np.float32) -> int:
    b = int(np.float32(value).view(np.int32))
    return b ^ ((b >> 31) & 0x7FFFFFFF)


def _finite(x: jax.Array) -> jax.Array:
    return ((_bits(x) >> 23) & 0xFF) != 0xFF


def _scale_from_amax(recipe: Float8Recipe, a: jax.Array, fmt: str) -> jax.Array:
    """The float32 bits of the reference's scale for a finite, positive float32 amax ``a``."""
    limit = core.fp8_max(fmt)
    _, m_int, ea, _ = _split(a)
    m = _float(jnp.int32(127 << 23) | (m_int & 0x7FFFFF))
    q = jnp.float32(limit) / m  # in (limit / 2, limit], correctly rounded (normal operands)
    qb = _bits(q)
    eq = ((qb >> 23) & 0xFF) - 127
    margin = min(recipe.margin, _MAX_MARGIN)
    e = eq - ea - margin
    normal = ((e + 127) << 23) | (qb & 0x7FFFFF)
    # above float32's range: the largest finite float32; below its smallest normal: that normal (the
    # core's floor, whose inverse is finite).  fl(q) * 2**e rounds like the exact quotient there too.
    bits = jnp.where(e > 127, jnp.int32(_F32_MAX_BITS), jnp.where(e >= -126, normal, jnp.int32(_TINY_BITS)))
    if recipe.power_of_two:
        bits = bits & 0x7F800000
    return bits


def compute_scale(recipe: Float8Recipe, amax_value: Any, fmt: str, previous: Any = 1.0) -> jax.Array:
    """The float32 scale for ``amax_value`` (:func:`mpx.float8.compute_scale`, bit for bit; traceable)."""
    _fmt(fmt)
    a = jnp.asarray(amax_value, jnp.float32)
    prev = jnp.asarray(previous, jnp.float32)
    finite = _finite(a)
    if recipe.scaling == "current":
        floor_bits = int(np.float32(core.compute_scale(recipe, 0.0, fmt)).view(np.int32))
        floored = _below(a, core.CURRENT_AMAX_FLOOR)
        safe = jnp.where(finite & ~floored, a, jnp.float32(1.0))
        bits = jnp.where(floored, jnp.int32(floor_bits), _scale_from_amax(recipe, safe, fmt))
        return jnp.where(finite, _float(bits), jnp.float32(1.0))
    positive = _bits(a) > 0  # +0 is 0, negatives have the sign bit (negative int32)
    ok = finite & positive
    safe = jnp.where(ok, a, jnp.float32(1.0))
    return jnp.where(ok, _float(_scale_from_amax(recipe, safe, fmt)), prev)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TensorScale:
    """One tensor's FP8 scaling state on device: ``scale`` (float32 scalar), ``amax_history``
    (float32 ``(amax_history_len,)``, most recent first; ``(0,)`` under current scaling) and its
    ``role`` (static: ``"input"``, ``"weight"`` or ``"grad"``)."""

    scale: jax.Array
    amax_history: jax.Array
    role: str = dataclasses.field(metadata={"static": True}, default="input")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Float8State:
    """The FP8 state of a model: ``tensors`` (name -> :class:`TensorScale`), a pytree."""

    tensors: dict[str, TensorScale]


def float8_init(recipe: Float8Recipe, roles: Mapping[str, str]) -> Float8State:
    """A fresh state (:func:`mpx.float8.float8_init`): scale 1.0 and a zero history per tensor."""
    return _from_core(recipe, core.float8_init(recipe, roles))


def _from_core(recipe: Float8Recipe, state: core.Float8State) -> Float8State:
    return Float8State(
        {
            name: TensorScale(
                jnp.asarray(ts.scale, jnp.float32), jnp.asarray(ts.amax_history, jnp.float32), ts.role
            )
            for name, ts in state.tensors.items()
        }
    )


def update_tensor(
    recipe: Float8Recipe, ts: TensorScale, amax_value: Any, skipped: Any = False
) -> TensorScale:
    """One tensor's step of :func:`float8_update` (selects only)."""
    fmt = recipe.format_of(ts.role)
    a = jnp.asarray(amax_value, jnp.float32)
    if recipe.scaling == "current":
        new = TensorScale(compute_scale(recipe, a, fmt, ts.scale), ts.amax_history, ts.role)
    else:
        hist = ts.amax_history
        pushed = jnp.concatenate([a[None], hist[:-1]])
        hist_new = jnp.where(_finite(a), pushed, hist)
        if recipe.amax_compute == "most_recent":
            window = hist_new[0]
        else:
            window = _float(_order_key(jnp.max(_order_key(_bits(hist_new)))))
        new = TensorScale(compute_scale(recipe, window, fmt, ts.scale), hist_new, ts.role)
    if skipped is False:
        return new
    skip = jnp.asarray(skipped, jnp.bool_)
    return TensorScale(
        jnp.where(skip, ts.scale, new.scale), jnp.where(skip, ts.amax_history, new.amax_history), ts.role
    )


def float8_update(
    recipe: Float8Recipe, state: Float8State, amaxes: Mapping[str, Any], *, skipped: Any = False
) -> Float8State:
    """The state after one optimizer step that saw ``amaxes`` (:func:`mpx.float8.float8_update`, bit for bit).

    ``amaxes``: tensor name -> float32 scalar (the step's ``max(|x|)``; replicas reduced first with
    :func:`reduce_amaxes`).  ``skipped``: a Python or traced bool; when true the state comes back
    unchanged (a select, so one compiled step serves both).  Unknown names raise :class:`mpx.Float8Error`.
    """
    unknown = [name for name in amaxes if name not in state.tensors]
    if unknown:
        raise Float8Error(f"amaxes: unknown tensor {unknown[0]!r}; known: {', '.join(state.tensors)}")
    tensors = dict(state.tensors)
    for name, value in amaxes.items():
        tensors[name] = update_tensor(recipe, tensors[name], value, skipped)
    return Float8State(tensors)


def window_max(a: Any, b: Any) -> jax.Array:
    """Elementwise MAX of amaxes where NaN wins (as :func:`mpx.float8.reduce_amaxes`), compared on the bits
    (exact for float32 subnormals, which XLA:CPU's float compare flushes): an accumulation window's amax."""
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    out = _float(_order_key(jnp.maximum(_order_key(_bits(a)), _order_key(_bits(b)))))
    return jnp.where(jnp.isnan(a) | jnp.isnan(b), jnp.float32(jnp.nan), out)


def reduce_amaxes(amaxes: Any, axis_name: Any) -> Any:
    """Every amax leaf reduced with MAX over the mapped axis ``axis_name`` (``lax.pmax``; NaN wins).

    NaN wins as in :func:`mpx.float8.reduce_amaxes`: XLA:CPU's max all-reduce drops a NaN (1.0 and NaN
    reduce to 1.0), so a NaN flag is reduced alongside.
    """

    def one(a: Any) -> jax.Array:
        a = jnp.asarray(a, jnp.float32)
        any_nan = lax.pmax(jnp.isnan(a).astype(jnp.int32), axis_name) > 0
        return jnp.where(any_nan, jnp.float32(jnp.nan), lax.pmax(a, axis_name))

    return jax.tree_util.tree_map(one, amaxes)


def to_core(state: Float8State) -> core.Float8State:
    """The core's immutable :class:`mpx.float8.Float8State` of host floats (a device read)."""
    return core.Float8State(
        {
            name: core.TensorScale(
                ts.role,
                float(np.asarray(ts.scale, np.float32)),
                tuple(float(v) for v in np.asarray(ts.amax_history, np.float32)),
            )
            for name, ts in state.tensors.items()
        }
    )


def float8_state_dict(recipe: Float8Recipe, state: Float8State) -> dict[str, Any]:
    """The neutral ``mpx.float8/1`` state dict (:func:`mpx.float8.float8_state_dict`; JSON-safe)."""
    return core.float8_state_dict(recipe, to_core(state))


def load_float8_state_dict(data: Mapping[str, Any]) -> tuple[Float8Recipe, Float8State]:
    """Read an ``mpx.float8/1`` dict (from any backend), validated all or nothing by the core.

    Raises:
        StateDictError: naming the bad field.
    """
    recipe, state = core.load_float8_state_dict(data)
    return recipe, _from_core(recipe, state)


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
