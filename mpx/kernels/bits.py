"""Float32 values through their bits: the helpers every kernel shares (written once, for every table).

XLA:CPU and TensorFlow flush float32 subnormals to zero in arithmetic and comparisons,
and JAX has no float64 by default; selects, bit casts and integer operations are exact
everywhere.  So the kernels read signs, exponents and mantissas from the bits, compare
non-negative floats as their bits (which order as the values), and form a product from
the operands' mantissas when a table's float32 arithmetic is not exact.

>>> from mpx.kernels.array_ops import NUMPY_OPS as o
>>> float(abs_max(o, o.float32([1.0, -3.0, 2.0]))), bool(is_finite(o, o.float32(float("inf"))))
(3.0, False)
"""

from __future__ import annotations

import struct
from typing import Any

from mpx.kernels.array_ops import ArrayOps

__all__ = [
    "F32_MAX_BITS",
    "INF_BITS",
    "SIGN_BIT",
    "TINY_BITS",
    "abs_max",
    "below",
    "bits_of",
    "f32_of",
    "from_bits",
    "from_mantissa",
    "is_finite",
    "is_nan",
    "order_key",
    "product",
    "split",
    "to_bits",
    "unit",
]

#: The bits of float32 +inf (and the exponent field's mask).
INF_BITS = 0x7F800000
#: The bits of the largest finite float32.
F32_MAX_BITS = 0x7F7FFFFF
#: The bits of the smallest positive normal float32, 2**-126.
TINY_BITS = 0x00800000
#: The sign bit as an int32.
SIGN_BIT = -(2**31)


def bits_of(value: float) -> int:
    """The int32 bit pattern of the float32 nearest ``value`` (round to nearest even; +-inf past
    float32's range): a Python int, for constants.

    Plain Python (``struct``), so a kernel traced by a compiler (dynamo, jit) computes its
    constants without calling into numpy.
    """
    try:
        return struct.unpack("<i", struct.pack("<f", value))[0]
    except OverflowError:  # rounds past float32's max
        return INF_BITS if value > 0 else INF_BITS | SIGN_BIT


def f32_of(value: float) -> float:
    """The float32 nearest ``value`` as a Python float (+-inf past float32's range)."""
    return struct.unpack("<f", struct.pack("<i", bits_of(value)))[0]


def order_key_of(value: float) -> int:
    """:func:`order_key` of a Python float's float32 (a Python int, for constants)."""
    b = bits_of(value)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


def to_bits(o: ArrayOps, x: Any) -> Any:
    """The int32 bits of ``x`` converted to float32."""
    return o.bitcast(o.float32(x), "int32")


def from_bits(o: ArrayOps, b: Any) -> Any:
    """The float32 whose bits are the int32 ``b``."""
    return o.bitcast(o.int32(b), "float32")


def is_finite(o: ArrayOps, x: Any) -> Any:
    """``x`` is neither inf nor NaN (from the exponent field: exact for subnormals)."""
    return o.ne(o.bit_and(to_bits(o, x), INF_BITS), INF_BITS)


def is_nan(o: ArrayOps, x: Any) -> Any:
    """``x`` is a NaN (magnitude bits above inf's)."""
    return o.lt(INF_BITS, o.bit_and(to_bits(o, x), 0x7FFFFFFF))


def order_key(o: ArrayOps, b: Any) -> Any:
    """An int32 that orders float32 bit patterns ``b`` as their values (-NaN lowest, +NaN highest);
    its own inverse."""
    return o.bit_xor(b, o.bit_and(o.shr(b, 31), 0x7FFFFFFF))


def below(o: ArrayOps, x: Any, bound: float) -> Any:
    """``float32 x < bound`` for a Python float ``bound``, exactly (on the bits: nothing flushed)."""
    # x < bound  <=>  x < limit, the smallest float32 >= bound (one order-key step above a float32 below it)
    key = order_key_of(bound) + (1 if f32_of(bound) < bound else 0)
    return o.lt(order_key(o, to_bits(o, x)), key)


def abs_max(o: ArrayOps, x: Any) -> Any:
    """``max(|x|)`` as a float32 scalar: a NaN element gives a NaN, a subnormal stays (on the bits)."""
    return from_bits(o, o.max(o.bit_and(to_bits(o, x), 0x7FFFFFFF)))


def split(o: ArrayOps, x: Any) -> tuple[Any, Any, Any, Any]:
    """A finite float32's sign bit, integer mantissa ``M`` and exponent ``e`` with ``x = M * 2**(e - 23)``.

    ``M`` lies in [2**23, 2**24) (subnormals normalized from their bits) and is 0 for a zero.
    Returns ``(sign, M, e, is_zero)``.
    """
    b = to_bits(o, x)
    sign = o.bit_and(b, SIGN_BIT)
    field = o.bit_and(o.shr(b, 23), 0xFF)
    frac = o.bit_and(b, 0x7FFFFF)
    subnormal = o.eq(field, 0)
    zero = o.logical_and(subnormal, o.eq(frac, 0))
    # a subnormal's leading one: the exponent of float32(frac), a normal number (exact: frac < 2**23)
    lead = o.sub(o.bit_and(o.shr(to_bits(o, o.cast(o.maximum(frac, 1), "float32")), 23), 0xFF), 127)
    shift = o.sub(23, lead)
    mant = o.where(subnormal, o.shl(frac, shift), o.bit_or(frac, 0x800000))
    exp = o.where(subnormal, o.sub(-126, shift), o.sub(field, 127))
    return sign, mant, exp, zero


def unit(o: ArrayOps, mant: Any) -> Any:
    """The integer mantissa ``M`` of :func:`split` as a float32 in [1, 2)."""
    return from_bits(o, o.bit_or(127 << 23, o.bit_and(mant, 0x7FFFFF)))


def from_mantissa(o: ArrayOps, sign: Any, mant_f: Any, exp: Any) -> Any:
    """``mant_f * 2**exp`` (``mant_f`` a float32 in [1, 4)) with sign bit ``sign``, built on the bits:
    below the smallest normal float32 a signed zero, above the largest a signed infinity."""
    mb = to_bits(o, mant_f)
    e = o.add(o.sub(o.bit_and(o.shr(mb, 23), 0xFF), 127), exp)
    biased = o.shl(o.maximum(o.minimum(o.add(e, 127), 255), 0), 23)
    normal = o.bit_or(o.bit_or(sign, biased), o.bit_and(mb, 0x7FFFFF))
    out = o.where(o.lt(127, e), o.bit_or(sign, INF_BITS), o.where(o.lt(e, -126), sign, normal))
    return from_bits(o, out)


def product(o: ArrayOps, x: Any, scale: Any) -> Any:
    """``x * scale`` in float32 for finite operands, rounded once as IEEE does.

    With an :attr:`~mpx.kernels.array_ops.ArrayOps.exact_float32` table this is the table's
    multiply.  Otherwise the product is formed from the operands' bits (each operand
    normalized, one float32 product of the mantissas in [1, 2), the exponents added as
    integers), so subnormal operands count; a result below float32's smallest normal is
    then a signed zero (every caller rounds it to a zero of a narrower format anyway).
    """
    if o.exact_float32:
        return o.mul(o.float32(x), o.float32(scale))
    sx, mx, ex, zx = split(o, x)
    ss, ms, es, zs = split(o, scale)
    sign = o.bit_xor(sx, ss)
    out = from_mantissa(o, sign, o.mul(unit(o, mx), unit(o, ms)), o.add(ex, es))
    return o.where(o.logical_or(zx, zs), from_bits(o, sign), out)
