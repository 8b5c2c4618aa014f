"""FP8 per-tensor arithmetic, once for every backend: quantize, the scale from an amax, the amax history.

The rules are :mod:`mpx.float8`'s (its module docs list them); this module is their one
implementation.  Each function takes an :class:`~mpx.kernels.array_ops.ArrayOps` table
first and is traceable: selects and integer arithmetic, no Python branch on a value.

* :func:`quantize`: ``fp8(clip(float32(x) * scale, -fp8_max, fp8_max))``, NaN stays NaN.
* :func:`compute_scale`: ``float32((fp8_max / amax) / 2**margin)`` with Transformer Engine's
  keep-previous rule, the float32 ceiling, the smallest-normal floor and power-of-two
  rounding.  No float64: the quotient ``fp8_max / m`` of the amax's mantissa ``m`` in
  [1, 2) is a correctly rounded float32 division, the exponent and the margin are integer
  arithmetic on the bits (the double rounding of float64-then-float32 is innocuous for a
  quotient of 24-bit values, so both give the same float32).
* :func:`record`, :func:`window`: the amax history, most recent first.
* :func:`update_tensor`: one tensor's step of :func:`mpx.float8.float8_update`.
* :func:`window_max`: an accumulation window's (or replicas') MAX of amaxes, NaN winning.

>>> from mpx.kernels.array_ops import NUMPY_OPS as o
>>> quantize(o, o.float32([1.0, 3.0, -1e9]), 224.0, "e4m3").astype("float32").tolist()
[224.0, 448.0, -448.0]
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from mpx.formats import DTYPE_NAMES, fp8_max
from mpx.kernels.array_ops import ArrayOps
from mpx.kernels.bits import (
    F32_MAX_BITS,
    TINY_BITS,
    below,
    bits_of,
    f32_of,
    from_bits,
    is_finite,
    is_nan,
    order_key,
    product,
    split,
    to_bits,
    unit,
)

__all__ = [
    "CURRENT_AMAX_FLOOR",
    "ScaleRecipe",
    "compute_scale",
    "quantize",
    "record",
    "update_tensor",
    "window",
    "window_max",
]

#: The amax floor of ``current`` scaling (torchao's ``EPS``).
CURRENT_AMAX_FLOOR = 1e-12
_F32_MAX = math.ldexp(2.0 - 2.0**-23, 127)
_F32_TINY = 2.0**-126
_MAX_MARGIN = 400  # beyond this every scale is the floor: keeps the int32 exponents small


class ScaleRecipe(Protocol):
    """What the kernels read of an :class:`mpx.Float8Recipe`."""

    scaling: str
    amax_compute: str
    margin: int
    power_of_two: bool

    def format_of(self, role: str) -> str: ...


def quantize(o: ArrayOps, x: Any, scale: Any, fmt: str) -> Any:
    """``fp8(clip(float32(x) * float32(scale), -fp8_max, fp8_max))`` in the table's FP8 dtype.

    Args:
        o: the backend's table.
        x: an array of any float dtype (converted to float32 first).
        scale: the positive float32 scale (an array scalar or a number).
        fmt: ``"e4m3"`` or ``"e5m2"``.

    The product is exact for every finite float32 (subnormals included, whatever the
    backend flushes); an inf is clipped to ``+-fp8_max``; a NaN stays a NaN (its byte is
    the backend's).

    Raises:
        Float8Error: for an unknown ``fmt``.
    """
    limit = fp8_max(fmt)
    xf, s = o.float32(x), o.float32(scale)
    if o.exact_float32:
        scaled = o.mul(xf, s)
    else:
        ok = o.logical_and(is_finite(o, xf), is_finite(o, s))
        exact = product(o, o.where(ok, xf, 0.0), o.where(ok, s, 1.0))
        # a non-finite x keeps its value (the scale is positive); a non-finite scale multiplies as IEEE does
        scaled = o.where(ok, exact, o.where(is_finite(o, s), xf, o.mul(xf, s)))
    return o.cast(o.clip(scaled, -limit, limit), DTYPE_NAMES[fmt])


def _round_scale(value: float, power_of_two: bool) -> float:
    """A float64 ``fp8_max / amax / 2**margin`` as the float32 scale (ceiling, floor, power of two)."""
    scale = _F32_MAX if value >= _F32_MAX else f32_of(value)
    scale = max(scale, _F32_TINY)  # zero or subnormal: its float32 inverse would overflow
    if power_of_two:
        scale = math.ldexp(1.0, math.frexp(scale)[1] - 1)
    return scale


def _scale_bits(o: ArrayOps, recipe: ScaleRecipe, a: Any, fmt: str) -> Any:
    """The int32 bits of the scale for a finite, positive float32 amax ``a``."""
    _, m_int, ea, _ = split(o, a)
    q = o.div(o.float32(fp8_max(fmt)), unit(o, m_int))  # in (fp8_max / 2, fp8_max], correctly rounded
    qb = to_bits(o, q)
    eq = o.sub(o.bit_and(o.shr(qb, 23), 0xFF), 127)
    e = o.sub(o.sub(eq, ea), min(recipe.margin, _MAX_MARGIN))
    biased = o.shl(o.maximum(o.minimum(o.add(e, 127), 255), 0), 23)
    normal = o.bit_or(biased, o.bit_and(qb, 0x7FFFFF))
    # above float32's range the largest finite float32 (TE's ceiling); below its smallest normal that
    # normal (mpx's floor, whose inverse is finite)
    out = o.where(o.lt(127, e), F32_MAX_BITS, o.where(o.le(-126, e), normal, TINY_BITS))
    if recipe.power_of_two:
        out = o.bit_and(out, 0x7F800000)
    return out


def compute_scale(o: ArrayOps, recipe: ScaleRecipe, amax: Any, fmt: str, previous: Any = 1.0) -> Any:
    """The float32 scale for a float32 ``amax`` (:func:`mpx.float8.compute_scale`'s rules).

    Delayed scaling: a zero or non-finite amax keeps ``previous``.  Current scaling: a
    non-finite amax gives 1.0, an amax below :data:`CURRENT_AMAX_FLOOR` the floor's scale.
    """
    a, prev = o.float32(amax), o.float32(previous)
    finite = is_finite(o, a)
    if recipe.scaling == "current":
        floored = below(o, a, CURRENT_AMAX_FLOOR)
        floor = _round_scale(
            math.ldexp(fp8_max(fmt) / CURRENT_AMAX_FLOOR, -recipe.margin), recipe.power_of_two
        )
        safe = o.where(o.logical_and(finite, o.logical_not(floored)), a, 1.0)
        out = o.where(floored, bits_of(floor), _scale_bits(o, recipe, safe, fmt))
        return o.where(finite, from_bits(o, out), 1.0)
    ok = o.logical_and(finite, o.lt(0, to_bits(o, a)))  # +0 is 0; a negative has the sign bit
    safe = o.where(ok, a, 1.0)
    return o.where(ok, from_bits(o, _scale_bits(o, recipe, safe, fmt)), prev)


def record(o: ArrayOps, history: Any, amax: Any) -> Any:
    """``history`` (float32, most recent first) with a finite ``amax`` pushed at the front and the
    oldest dropped; a non-finite amax is not recorded."""
    a = o.float32(amax)
    return o.where(is_finite(o, a), o.push_front(history, a), history)


def window(o: ArrayOps, recipe: ScaleRecipe, history: Any) -> Any:
    """The amax delayed scaling computes the scale from: the most recent (``most_recent``) or the
    history's largest (``max``; its values are finite and >= 0, so they order as their bits)."""
    if recipe.amax_compute == "most_recent":
        return o.first(history)
    return from_bits(o, o.max(to_bits(o, history)))


def update_tensor(
    o: ArrayOps,
    recipe: ScaleRecipe,
    role: str,
    scale: Any,
    history: Any,
    amax: Any,
    skipped: Any = None,
) -> tuple[Any, Any]:
    """One tensor's step of :func:`mpx.float8.float8_update`: ``(scale, history)`` after it.

    ``history``: float32 ``(amax_history_len,)``, most recent first (ignored and returned as it
    is under current scaling).  ``skipped``: None, or a bool scalar (traced or not); where it is
    True the tensor's scale and history come back unchanged (a select: one compiled step
    serves both).
    """
    fmt = recipe.format_of(role)
    a = o.float32(amax)
    if recipe.scaling == "current":
        new_scale, new_history = compute_scale(o, recipe, a, fmt, scale), history
    else:
        new_history = record(o, history, a)
        new_scale = compute_scale(o, recipe, window(o, recipe, new_history), fmt, scale)
    if skipped is None:
        return new_scale, new_history
    new_scale = o.where(skipped, o.float32(scale), new_scale)
    if recipe.scaling != "current":
        new_history = o.where(skipped, history, new_history)
    return new_scale, new_history


def window_max(o: ArrayOps, a: Any, b: Any) -> Any:
    """Elementwise MAX of float32 amaxes where a NaN wins (:func:`mpx.float8.reduce_amaxes`'s rule),
    compared on the bits (exact for subnormals)."""
    ka, kb = order_key(o, to_bits(o, a)), order_key(o, to_bits(o, b))
    out = from_bits(o, order_key(o, o.maximum(ka, kb)))
    return o.where(o.logical_or(is_nan(o, a), is_nan(o, b)), o.float32(math.nan), out)
