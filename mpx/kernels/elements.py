"""Small float element formats as integer codes: encode a float32 (times a power of two) and decode.

The block-scaled formats (:mod:`mpx.kernels.blocks`) store their elements in one of five
formats; this module rounds to each from the float32's bits, in int32 arithmetic, so every
table gives the same byte (no framework cast is involved: frameworks disagree on FP8's NaN
byte and most have no FP4/FP6 dtype).

======  =====  =====  ====  ============  ==========  =======================
format  ebits  mbits  bias  largest       NaN code    ml_dtypes type
======  =====  =====  ====  ============  ==========  =======================
e4m3    4      3      7     448 (0x7E)    0x7F        float8_e4m3fn
e5m2    5      2      15    57344 (0x7B)  0x7E        float8_e5m2
e2m1    2      1      1     6 (0x7)       none        float4_e2m1fn
e2m3    2      3      1     7.5 (0x1F)    none        float6_e2m3fn
e3m2    3      2      3     28 (0x1F)     none        float6_e3m2fn
======  =====  =====  ====  ============  ==========  =======================

A code is the format's bits in the low bits of an int32 (sign bit at ``ebits + mbits``),
as ml_dtypes stores one element per byte.  Encoding rounds to nearest, ties to even, and
saturates: a finite value or an infinity beyond the largest magnitude gives the largest
magnitude with its sign.  A NaN gives the format's positive NaN code (frameworks and
devices disagree on a NaN's sign); a format without NaN (FP4, FP6) gives its largest
positive code (the block-scaled kernels mark such a block NaN through its scale).  A float32 subnormal counts as its
value (normalized from its bits, whatever the table flushes).

>>> from mpx.kernels.array_ops import NUMPY_OPS as o
>>> encode(o, o.float32([1.0, 1.25, -7.0, 0.25]), "e2m1").tolist()
[2, 2, 15, 0]
>>> decode(o, o.int32([2, 15, 0x7F]), "e4m3").tolist()[:2]
[0.00390625, 0.029296875]
"""

from __future__ import annotations

import math
from typing import Any

from mpx.errors import Float8Error
from mpx.kernels.array_ops import ArrayOps
from mpx.kernels.bits import from_bits, is_finite, is_nan, split, to_bits

__all__ = ["ELEMENT_FORMATS", "ElementFormat", "decode", "encode", "max_value"]


class ElementFormat:
    """One element format's constants (see the module table)."""

    def __init__(self, name: str, ebits: int, mbits: int, max_code: int, nan_code: int | None) -> None:
        self.name, self.ebits, self.mbits = name, ebits, mbits
        self.bias = 2 ** (ebits - 1) - 1
        self.emin = 1 - self.bias
        self.max_code, self.nan_code = max_code, nan_code
        self.sign_bit = 1 << (ebits + mbits)
        field, mant = max_code >> mbits, max_code & ((1 << mbits) - 1)
        self.max_value = math.ldexp(1.0 + mant / 2**mbits, field - self.bias)
        self.max_exp = field - self.bias  # floor(log2(max)): OCP's emax

    def __repr__(self) -> str:
        return f"ElementFormat({self.name!r})"


#: The element formats by short name.
ELEMENT_FORMATS: dict[str, ElementFormat] = {
    "e4m3": ElementFormat("e4m3", 4, 3, 0x7E, 0x7F),
    "e5m2": ElementFormat("e5m2", 5, 2, 0x7B, 0x7E),
    "e2m1": ElementFormat("e2m1", 2, 1, 0x7, None),
    "e2m3": ElementFormat("e2m3", 2, 3, 0x1F, None),
    "e3m2": ElementFormat("e3m2", 3, 2, 0x1F, None),
}


def _format(name: str) -> ElementFormat:
    if not isinstance(name, str) or name not in ELEMENT_FORMATS:
        raise Float8Error(f"element: {name!r} is not allowed; allowed: {', '.join(ELEMENT_FORMATS)}")
    return ELEMENT_FORMATS[name]


def max_value(name: str) -> float:
    """The largest finite value of an element format (``"e2m1"``: 6.0)."""
    return _format(name).max_value


def encode(o: ArrayOps, x: Any, fmt: str, shift: Any = 0, rbits: Any = None) -> Any:
    """The int32 codes of ``float32(x) * 2**shift`` in format ``fmt``, rounded to nearest even (exact:
    no float32 product is formed), saturated, NaN as the module docs say.

    ``shift``: an int32 array broadcastable to ``x`` (or a Python int), ``|shift| <= 300``.
    ``rbits``: None (round to nearest even), or 16 random bits per element (int32 in ``[0, 2**16)``,
    :func:`mpx.kernels.rounding.random_bits`) for stochastic rounding: the magnitude rounds up when
    the top 16 bits of its remainder below the format's grid, plus ``rbits``, pass ``2**16 - 1``, so
    a value ``f`` of the way (0 <= f < 1) from its lower neighbour rounds up with probability
    ``floor(f * 2**16) / 2**16`` (unbiased to ``2**-16`` of a grid step; an exactly representable
    value never changes); saturation, zeros, infinities and NaN as above.
    """
    f = _format(fmt)
    xf = o.float32(x)
    sign, mant, exp, zero = split(o, xf)
    e = o.add(exp, shift)  # x * 2**shift = mant * 2**(e - 23), mant in [2**23, 2**24)
    eff = o.maximum(e, f.emin)  # the binade of the result: below emin the subnormal grid
    dropped = o.add(o.sub(eff, e), 23 - f.mbits)  # bits dropped from mant (>= 20)
    s = o.minimum(dropped, 30)
    q = o.shr(mant, s)
    if rbits is None:
        rem = o.bit_and(mant, o.sub(o.shl(1, s), 1))
        half = o.shl(1, o.sub(s, 1))
        up = o.logical_or(o.lt(half, rem), o.logical_and(o.eq(rem, half), o.eq(o.bit_and(q, 1), 1)))
        tiny = o.lt(e, f.emin - f.mbits - 2)  # below half the smallest subnormal: zero
    else:  # the remainder's top 16 bits (zero once 24 or more bits drop: mant < 2**24)
        frac = o.bit_and(o.shr(mant, o.minimum(o.sub(dropped, 16), 30)), 0xFFFF)
        up = o.lt(0xFFFF, o.add(frac, rbits))
        tiny = o.lt(e, f.emin - f.mbits - 17)  # below 2**-16 of the smallest subnormal: never up
    q = o.add(q, o.where(up, 1, 0))
    # the code is monotone in the value: ((eff - emin) << mbits) + q covers normals, subnormals and a
    # carry into the next binade alike; past the largest code it saturates
    code = o.add(o.shl(o.minimum(o.sub(eff, f.emin), 64), f.mbits), q)
    code = o.where(o.logical_or(zero, tiny), 0, o.minimum(code, f.max_code))
    finite = is_finite(o, xf)
    nan_code = f.max_code if f.nan_code is None else f.nan_code
    code = o.where(finite, code, o.where(is_nan(o, xf), nan_code, f.max_code))
    signed = o.logical_and(o.ne(sign, 0), o.logical_not(is_nan(o, xf)))  # a NaN's sign is no one's
    return o.bit_or(code, o.where(signed, f.sign_bit, 0))


def decode(o: ArrayOps, code: Any, fmt: str) -> Any:
    """The float32 value of int32 codes in format ``fmt`` (exact; a NaN code gives NaN, e5m2's
    infinity code infinity)."""
    f = _format(fmt)
    c = o.int32(code)
    mag = o.bit_and(c, f.sign_bit - 1)
    field = o.shr(mag, f.mbits)
    frac = o.bit_and(mag, (1 << f.mbits) - 1)
    normal = from_bits(o, o.bit_or(o.shl(o.add(field, 127 - f.bias), 23), o.shl(frac, 23 - f.mbits)))
    # a subnormal is frac * 2**(emin - mbits): an exact float32 (normal, >= 2**-17)
    sub = o.mul(o.cast(frac, "float32"), math.ldexp(1.0, f.emin - f.mbits))
    value = o.where(o.eq(field, 0), sub, normal)
    if f.name == "e5m2":
        value = o.where(o.eq(mag, 0x7C), math.inf, value)
        value = o.where(o.lt(0x7C, mag), math.nan, value)
    elif f.nan_code is not None:
        value = o.where(o.eq(mag, f.nan_code), math.nan, value)
    bits = o.bit_or(to_bits(o, value), o.where(o.eq(o.bit_and(c, f.sign_bit), 0), 0, -(2**31)))
    return from_bits(o, bits)
