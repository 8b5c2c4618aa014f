"""The tensor half of :mod:`mpx_keras.float8`: quantization, the scale rules and the FP8 GEMM in ``keras.ops``.

Every function here is the ``keras.ops`` form of one function of :mod:`mpx.float8`, bit for bit on
every Keras backend (TensorFlow, JAX, PyTorch):

* :func:`quantize` is ``mpx.float8.quantize`` (bytes equal, NaN as NaN).  TensorFlow's and XLA's CPU
  kernels flush float32 subnormals to zero and JAX has no float64 by default, so the product
  ``float32(x) * scale`` is formed from the operands' bits (each normalized, one rounding of the
  mantissa product), as :mod:`mpx_jax.float8` does; the clip is two selects (a NaN passes through).
* :func:`compute_scale` is ``mpx.float8.compute_scale``: the quotient ``fp8_max / m`` of the amax's
  mantissa in float32 (correctly rounded), the exponent and the margin as integer arithmetic.
* :func:`update` is one tensor's step of ``mpx.float8.float8_update`` (selects only).
* :func:`fp8_contract` is the FP8 GEMM (``mpx.float8.fp8_dot``, up to float32 rounding of the
  sums) with a ``keras.ops.custom_gradient``: e4m3 input and kernel, the output gradient in e5m2
  under ``hybrid``, dgrad and wgrad from the quantized operands, and the FP8 state's next values
  as the "gradients" of its variables (Keras's ``overwrite_with_gradient``).
"""

from __future__ import annotations

import math
import string
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

from mpx import float8 as core
from mpx.float8 import Float8Recipe

__all__ = [
    "KERAS_FORMATS",
    "amax",
    "compute_scale",
    "contraction",
    "fp8_contract",
    "quantize",
    "record",
    "update",
    "window",
]

ops = keras.ops
#: The Keras dtype name of each FP8 format of :data:`mpx.float8.FORMATS`.
KERAS_FORMATS = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}
_INT_MIN = -(2**31)
_F32_MAX_BITS = 0x7F7FFFFF
_TINY_BITS = 0x00800000  # the smallest normal float32: the floor of a scale that underflows
_MAX_MARGIN = 400  # beyond this every scale is the floor (keeps the int32 exponents small)


def _i32(value: int) -> Any:
    return ops.convert_to_tensor(value, "int32")


def _bits(x: Any) -> Any:
    return ops.view(ops.cast(x, "float32"), "int32")


def _float(bits: Any) -> Any:
    return ops.view(ops.cast(bits, "int32"), "float32")


def _finite(x: Any) -> Any:
    return ops.not_equal(ops.bitwise_and(ops.right_shift(_bits(x), 23), 0xFF), 0xFF)


def _split(x: Any) -> tuple[Any, Any, Any, Any]:
    """A finite float32's sign bit, integer mantissa ``M`` in [2**23, 2**24) and exponent ``e``
    (``x = M * 2**(e - 23)``), subnormals normalized from their bits (no float arithmetic on them, so no
    flush to zero).  Returns (sign, M, e, is_zero)."""
    bits = _bits(x)
    sign = ops.bitwise_and(bits, _INT_MIN)
    field = ops.bitwise_and(ops.right_shift(bits, 23), 0xFF)
    frac = ops.bitwise_and(bits, 0x7FFFFF)
    zero = ops.logical_and(ops.equal(field, 0), ops.equal(frac, 0))
    # the leading one of a subnormal's fraction: the exponent of float32(frac) (exact, frac < 2**23)
    lead = ops.bitwise_and(ops.right_shift(_bits(ops.cast(ops.maximum(frac, 1), "float32")), 23), 0xFF) - 127
    shift = 23 - lead
    subnormal = ops.equal(field, 0)
    mant = ops.where(subnormal, ops.left_shift(frac, shift), ops.bitwise_or(frac, 0x800000))
    exp = ops.where(subnormal, -126 - shift, field - 127)
    return sign, mant, exp, zero


def _unit(mant: Any) -> Any:
    """The integer mantissa as a float32 in [1, 2)."""
    return _float(ops.bitwise_or(_i32(127 << 23), ops.bitwise_and(mant, 0x7FFFFF)))


def _from_mant(sign: Any, mant_f: Any, exp: Any) -> Any:
    """``mant_f * 2**exp`` (``mant_f`` a float32 in [1, 4)) with sign bit ``sign``, built on the bits:
    below the smallest normal a signed zero (an FP8 zero anyway), above the largest a signed infinity."""
    mb = _bits(mant_f)
    e = ops.bitwise_and(ops.right_shift(mb, 23), 0xFF) - 127 + exp
    biased = ops.left_shift(ops.clip(e + 127, 0, 255), 23)
    normal = ops.bitwise_or(ops.bitwise_or(sign, biased), ops.bitwise_and(mb, 0x7FFFFF))
    out = ops.where(e > 127, ops.bitwise_or(sign, 0x7F800000), ops.where(e < -126, sign, normal))
    return _float(out)


def _product(x: Any, scale: Any) -> Any:
    """``x * scale`` for finite float32 operands, rounded once as IEEE does, without flush to zero
    (a result below float32's smallest normal is a signed zero)."""
    sx, mx, ex, zx = _split(x)
    ss, ms, es, zs = _split(scale)
    sign = ops.bitwise_xor(sx, ss)
    out = _from_mant(sign, ops.multiply(_unit(mx), _unit(ms)), ex + es)
    return ops.where(ops.logical_or(zx, zs), _float(sign), out)


def quantize(x: Any, scale: Any, fmt: str) -> Any:
    """``fp8(clip(float32(x) * float32(scale), -fp8_max, fp8_max))``: :func:`mpx.float8.quantize`'s bytes.

    Args:
        x: a tensor of any float dtype (upcast to float32 first).
        scale: the float32 scale, positive and finite (a scalar tensor or a number).
        fmt: ``"e4m3"`` (``float8_e4m3fn``) or ``"e5m2"``.

    Returns:
        A Keras tensor of the FP8 dtype; NaN stays NaN (its byte is the backend's).
    """
    limit = core.fp8_max(fmt)
    xf = ops.cast(x, "float32")
    s = ops.cast(ops.convert_to_tensor(scale, "float32"), "float32")
    finite = ops.isfinite(xf)
    exact = _product(ops.where(finite, xf, 0.0), s)
    scaled = ops.where(finite, exact, xf)  # inf is clipped below, NaN passes the selects
    clipped = ops.where(scaled > limit, limit, ops.where(scaled < -limit, -limit, scaled))
    return ops.cast(clipped, KERAS_FORMATS[fmt])


def amax(x: Any) -> Any:
    """``max(|x|)`` as a float32 scalar, on the bits (exact for subnormals; NaN if any element is NaN)."""
    return _float(ops.max(ops.bitwise_and(_bits(x), 0x7FFFFFFF)))


def _scale_bits(recipe: Float8Recipe, a: Any, fmt: str) -> Any:
    """The int32 bits of the core's scale for a finite, positive float32 amax ``a``."""
    _, m_int, ea, _ = _split(a)
    q = ops.divide(ops.convert_to_tensor(core.fp8_max(fmt), "float32"), _unit(m_int))  # (max/2, max]
    qb = _bits(q)
    eq = ops.bitwise_and(ops.right_shift(qb, 23), 0xFF) - 127
    e = eq - ea - min(recipe.margin, _MAX_MARGIN)
    normal = ops.bitwise_or(ops.left_shift(ops.clip(e + 127, 0, 255), 23), ops.bitwise_and(qb, 0x7FFFFF))
    bits = ops.where(e > 127, _i32(_F32_MAX_BITS), ops.where(e >= -126, normal, _i32(_TINY_BITS)))
    if recipe.power_of_two:
        bits = ops.bitwise_and(bits, 0x7F800000)
    return bits


def _bits_of(value: float) -> int:
    return int(np.float32(value).view(np.int32))


def compute_scale(recipe: Float8Recipe, amax_value: Any, fmt: str, previous: Any = 1.0) -> Any:
    """The float32 scale for ``amax_value`` (:func:`mpx.float8.compute_scale`, bit for bit)."""
    core.fp8_max(fmt)  # validates
    a = ops.cast(ops.convert_to_tensor(amax_value, "float32"), "float32")
    prev = ops.cast(ops.convert_to_tensor(previous, "float32"), "float32")
    finite = _finite(a)
    bits = _bits(a)
    if recipe.scaling == "current":
        floor = _bits_of(core.compute_scale(recipe, 0.0, fmt))
        bound = np.float32(core.CURRENT_AMAX_FLOOR)
        if float(bound) < core.CURRENT_AMAX_FLOOR:
            bound = np.nextafter(bound, np.float32(np.inf))
        floored = ops.less(bits, _bits_of(float(bound)))  # a >= 0: float32 order is the bits' order
        safe = ops.where(ops.logical_and(finite, ops.logical_not(floored)), a, 1.0)
        out = ops.where(floored, _i32(floor), _scale_bits(recipe, safe, fmt))
        return ops.where(finite, _float(out), 1.0)
    ok = ops.logical_and(finite, bits > 0)  # +0 is 0; a negative has the sign bit (a negative int32)
    safe = ops.where(ok, a, 1.0)
    return ops.where(ok, _float(_scale_bits(recipe, safe, fmt)), prev)


def update(recipe: Float8Recipe, role: str, scale: Any, history: Any, amax_value: Any) -> tuple[Any, Any]:
    """One tensor's step of :func:`mpx.float8.float8_update`: ``(scale, amax_history)`` after it.

    ``history``: the float32 ``(amax_history_len,)`` history, most recent first (None under
    current scaling, which keeps none).  A non-finite amax is not recorded and keeps the scale.
    """
    fmt = recipe.format_of(role)
    a = ops.cast(ops.convert_to_tensor(amax_value, "float32"), "float32")
    if recipe.scaling == "current":
        return compute_scale(recipe, a, fmt, scale), history
    new_history = record(history, a)
    return compute_scale(recipe, window(recipe, new_history), fmt, scale), new_history


def record(history: Any, amax_value: Any) -> Any:
    """``history`` with a finite ``amax_value`` pushed at the front (the oldest dropped); a non-finite one
    is not recorded."""
    a = ops.cast(ops.convert_to_tensor(amax_value, "float32"), "float32")
    pushed = ops.concatenate([ops.reshape(a, (1,)), history[:-1]], axis=0)
    return ops.where(_finite(a), pushed, history)


def window(recipe: Float8Recipe, history: Any) -> Any:
    """The amax delayed scaling computes the scale from: the history's first (``most_recent``) or its max."""
    if recipe.amax_compute == "most_recent":
        return history[0]
    return _float(ops.max(_bits(history)))  # finite amaxes >= 0: their order is their bits' order


# -- the FP8 GEMM ---------------------------------------------------------------------------------------


def contraction(equation: str | None, x_ndim: int) -> tuple[str, str, str]:
    """The three einsum equations (forward, dgrad, wgrad) of a Dense (``equation`` None) or EinsumDense.

    An ellipsis is spelled out for ``x_ndim``; every index of an operand must appear in the other
    operand or the output, once per operand (the backward GEMMs are einsums of the same indices).

    Raises:
        mpx.Float8Error: for an equation whose backward is not such a pair of einsums.
    """
    if equation is None:
        letters = string.ascii_lowercase[: x_ndim - 1]
        x, w, out = letters + "y", "yz", letters + "z"
    else:
        spec = equation.replace(" ", "")
        try:
            inputs, out = spec.split("->")
            x, w = inputs.split(",")
        except ValueError:
            raise core.Float8Error(
                f"equation: {equation!r} is not an 'x,w->out' einsum equation; FP8 needs one"
            ) from None
        if "..." in x:
            free = [c for c in string.ascii_letters if c not in spec]
            fill = "".join(free[: x_ndim - len(x.replace("...", ""))])
            x, w, out = (part.replace("...", fill) for part in (x, w, out))
        for name, part, others in (("input", x, w + out), ("kernel", w, x + out), ("output", out, x + w)):
            if "." in part or len(set(part)) != len(part) or any(c not in others for c in part):
                raise core.Float8Error(
                    f"equation: {equation!r}: each index of the {name} must appear once in it and in another "
                    "operand for an FP8 EinsumDense (its backward GEMMs are einsums of the same indices)"
                )
    return f"{x},{w}->{out}", f"{out},{w}->{x}", f"{x},{out}->{w}"


def _nan_unless(ok: Any, y: Any) -> Any:
    return ops.where(ok, y, math.nan)


def fp8_contract(
    recipe: Float8Recipe,
    equations: tuple[str, str, str],
    x: Any,
    kernel: Any,
    state: Sequence[Any],
    training: bool,
) -> Any:
    """``einsum(x, kernel)`` as an FP8 GEMM (a float32 result), differentiable, updating its FP8 state.

    ``state``: ``[input scale, input history, weight scale, weight history, grad scale, grad history]``
    (the histories None under current scaling) as tensors read from the layer's variables.

    Delayed scaling stores, per tensor, the history of the amaxes of steps <= t-1 and the scale step
    t-1 quantized with; step t quantizes with ``compute_scale(window(history), previous=that scale)``,
    which is the scale :func:`mpx.float8.float8_update` computed at the end of step t-1 (its
    keep-previous rule needs the older one).  The "gradients" the optimizer writes are the history with
    this step's amax recorded and the scale this step used.  Stored so, an accumulation window (Keras's
    inner ``gradient_accumulation_steps`` takes the MAX of overwrite-with-gradient values over its
    micro-batches) records the MAX of the micro-batches' amaxes once, and every micro-batch writes the
    same scale: exactly one ``float8_update`` of the window.  Current scaling quantizes each tensor
    with its own amax's scale and records it.

    The forward contracts the quantized ``x`` and ``kernel`` (e4m3) in float32 and multiplies by both
    inverse scales; a non-finite operand makes the result NaN.  The backward quantizes the output
    gradient (e5m2 under ``hybrid``) and computes dgrad and wgrad from the quantized operands the same
    way.  ``training`` False: the state's "gradients" are its values unchanged.
    """
    forward_eq, dgrad_eq, wgrad_eq = equations
    current = recipe.scaling == "current"
    fi, fw, fg = (recipe.format_of(role) for role in core.ROLES)
    names = [(role, i) for i, role in enumerate(core.ROLES)]
    x_dtype = keras.backend.standardize_dtype(x.dtype)
    k_dtype = keras.backend.standardize_dtype(kernel.dtype)
    args = [x, kernel] + [t for t in state if t is not None]

    def unpack(flat: Sequence[Any]) -> list[tuple[Any, Any]]:
        it = iter(flat)
        return [(next(it), None if current else next(it)) for _ in names]

    @ops.custom_gradient
    def gemm(*flat: Any) -> Any:
        xv, kv = flat[0], flat[1]
        tensors = unpack(flat[2:])
        ax, aw = amax(xv), amax(kv)
        if current:
            sx, sw = compute_scale(recipe, ax, fi), compute_scale(recipe, aw, fw)
            used = [None, None, None]
        else:  # the scales float8_update gave at the end of the last step (see the docstring)
            used = [
                compute_scale(recipe, window(recipe, h), fmt, s)
                for (s, h), fmt in zip(tensors, (fi, fw, fg), strict=True)
            ]
            sx, sw = used[0], used[1]
        qx = ops.cast(quantize(xv, sx, fi), "float32")
        qw = ops.cast(quantize(kv, sw, fw), "float32")
        inv_x, inv_w = ops.divide(1.0, sx), ops.divide(1.0, sw)
        ok = ops.logical_and(ops.isfinite(ax), ops.isfinite(aw))
        y = _nan_unless(ok, ops.einsum(forward_eq, qx, qw) * inv_x * inv_w)

        def grad(*args: Any, upstream: Any = None, variables: Any = None) -> Any:
            if upstream is None:
                (upstream,) = args
            ag = amax(upstream)
            sg = compute_scale(recipe, ag, fg) if current else used[2]
            qg = ops.cast(quantize(upstream, sg, fg), "float32")
            inv_g = ops.divide(1.0, sg)
            ok_g = ops.logical_and(ok, ops.isfinite(ag))
            dx = _nan_unless(ok_g, ops.einsum(dgrad_eq, qg, qw) * inv_g * inv_w)
            dk = _nan_unless(ok_g, ops.einsum(wgrad_eq, qx, qg) * inv_x * inv_g)
            out = [ops.cast(dx, x_dtype), ops.cast(dk, k_dtype)]
            for (role, _), (scale, history), observed, this in zip(
                names, tensors, (ax, aw, ag), used, strict=True
            ):
                if training and current:
                    scale = compute_scale(recipe, observed, recipe.format_of(role), scale)
                elif training:
                    scale, history = this, record(history, observed)
                out.append(ops.convert_to_tensor(scale) + 0.0)
                if history is not None:
                    out.append(ops.convert_to_tensor(history) + 0.0)
            return tuple(out)

        return y, grad

    return gemm(*args)
