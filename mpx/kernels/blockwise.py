"""8-bit block-quantized optimizer state: linear absmax quantization per block of elements.

``opt_state=int8:BLOCK`` (:mod:`mpx.update_policy`) stores each float32 state tensor (Adam's moments)
between steps as int8 codes plus one float32 scale per block of ``BLOCK`` elements of the flattened
tensor (the last block padded with zeros):

* ``absmax`` of a block is ``max(|x|)`` (on the bits: exact); a block whose absmax is below
  :data:`MIN_ABSMAX` (2**-118) is stored as zeros (absmax 0);
* ``q = round_half_even(x * float32(127 / absmax))``, an int8 in [-127, 127] (a float32 subnormal
  element counts as zero), except that a nonzero element whose code would be 0 gets +-1 (its sign):
  Adam divides by the square root of its second moment, and a small second moment stored as 0 under
  a nonzero first moment turns the update into ``m / eps`` (measured: 8-bit Adam diverged in
  ``mpx compare`` before this rule);
* dequantized, ``x' = q * float32(absmax * float32(1 / 127))``.

Linear (not bitsandbytes' dynamic map) so that every step is a correctly rounded float32 division
(elementwise, per block: XLA turns a division by a broadcast into a reciprocal product),
multiplication or addition, the same bits on every table: the threshold keeps every dequantized
product normal (>= 2**-125), which tables that flush subnormals (XLA:CPU, TensorFlow) compute as
numpy does (a quantize product that is subnormal is below half a code either way).  The error of one
element is at most ``absmax / 254`` (half a code), and below ``absmax / 127`` for the elements kept at +-1.
Finite inputs only (a skipped step never quantizes a non-finite moment).

>>> import numpy as np
>>> from mpx.kernels.array_ops import NUMPY_OPS as o
>>> q, absmax = quantize(o, np.float32([1.0, -0.5, 0.25, 0.0, 3e-3, 1e-6]), 4)
>>> q.tolist(), absmax.tolist()
([[127, -64, 32, 0], [127, 1, 0, 0]], [1.0, 0.003000000026077032])
>>> dequantize(o, q, absmax, 5).tolist()[:3]
[1.0, -0.5039370059967041, 0.25196850299835205]
"""

from __future__ import annotations

from typing import Any

from mpx.kernels.array_ops import ArrayOps
from mpx.kernels.bits import TINY_BITS, below, f32_of, from_bits, split, to_bits

__all__ = ["MIN_ABSMAX", "dequantize", "quantize", "state_bytes"]

#: The smallest absmax a block keeps (smaller blocks are stored as zeros): 2**-118.
MIN_ABSMAX = 2.0**-118
_INV127 = f32_of(1.0 / 127.0)  # the float32 nearest 1/127: a code's step is absmax times it


def quantize(o: ArrayOps, flat: Any, block: int) -> tuple[Any, Any]:
    """The 1-D float32 ``flat`` as int8 codes ``(rows, block)`` and float32 absmaxes ``(rows,)``."""
    n = int(flat.shape[0])
    rows = max(1, -(-n // block))
    x = o.reshape(o.resize(o.float32(flat), rows * block), (rows, block))
    mag = o.bit_and(to_bits(o, x), 0x7FFFFFFF)
    absmax = from_bits(o, o.reshape(o.max_last(mag), (rows,)))
    small = below(o, absmax, MIN_ABSMAX)
    absmax = o.where(small, 0.0, absmax)
    x = o.where(o.lt(mag, TINY_BITS), 0.0, x)
    inv = o.div(127.0, o.where(small, 1.0, absmax))  # elementwise: a division by a broadcast is not
    y = o.mul(x, o.reshape(inv, (rows, 1)))  # correctly rounded under XLA (it becomes a reciprocal)
    code = _round_to_int(o, y)
    # a nonzero element keeps a nonzero code (+-1): a second moment rounded to 0 under a nonzero first
    # moment makes Adam's m / (sqrt(v) + eps) about m / eps (mpx compare: 8-bit Adam diverged so)
    lost = o.logical_and(o.eq(code, 0), o.logical_not(o.lt(mag, TINY_BITS)))
    code = o.where(lost, o.where(o.lt(to_bits(o, x), 0), -1, 1), code)
    code = o.where(o.reshape(small, (rows, 1)), 0, code)
    return o.cast(code, "int8"), absmax


def _round_to_int(o: ArrayOps, y: Any) -> Any:
    """The float32 ``y`` (``|y| < 2**23``) rounded to the nearest integer, ties to even, as int32: on the bits
    (a compiler may fold the float ``(y + 1.5 * 2**23) - 1.5 * 2**23`` back to ``y``)."""
    sign, mant, exp, zero = split(o, y)
    shift = o.minimum(o.maximum(o.sub(23, exp), 1), 25)  # exp < -1 (|y| < 0.5): everything below the point
    whole = o.where(o.lt(24, shift), 0, o.shr(mant, o.minimum(shift, 24)))
    rest = o.bit_and(mant, o.sub(o.shl(1, o.minimum(shift, 24)), 1))
    half = o.shl(1, o.sub(shift, 1))
    rest = o.where(o.lt(24, shift), mant, rest)
    up = o.logical_or(o.lt(half, rest), o.logical_and(o.eq(rest, half), o.eq(o.bit_and(whole, 1), 1)))
    mag = o.where(zero, 0, o.add(whole, o.where(up, 1, 0)))
    return o.where(o.eq(sign, 0), mag, o.sub(0, mag))


def dequantize(o: ArrayOps, q: Any, absmax: Any, n: int) -> Any:
    """The 1-D float32 of ``n`` elements that :func:`quantize` stored as ``q`` and ``absmax``."""
    rows = int(q.shape[0])
    step = o.mul(absmax, _INV127)
    x = o.mul(o.cast(q, "float32"), o.reshape(step, (rows, 1)))
    return o.resize(o.reshape(x, (-1,)), n)


def state_bytes(n: int, block: int) -> int:
    """Bytes :func:`quantize` stores for ``n`` elements: one int8 each (padded to whole blocks) and a float32
    per block."""
    rows = max(1, -(-n // block))
    return rows * block + 4 * rows
