"""TRANSITIONAL (issue #30): the names backends imported before the kernels; removed once every
backend runs :mod:`mpx.kernels`.  Nothing new may import this module."""

from __future__ import annotations

from typing import Any

import numpy as np

from mpx.scaling import FactorSplit

INF_BITS = 0x7F800000


def f32(x: float) -> float:
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def scale_product(scale: float, factor: float) -> float:
    """``float32(float64(scale) * float64(factor))`` as a Python float (inf on overflow).

    torch's rule (its CPU ``_amp_update_scale_`` kernel multiplies the float32
    scale by the factor as doubles, then stores a float32): one product in
    float64, one rounding to float32 (nearest, ties to even; subnormals kept).
    """
    return f32(float(scale) * float(factor))


def product_bits(bits: Any, split: FactorSplit, where: Any) -> Any:
    """The int32 bits of ``scale_product(scale, factor)``, from int32 operations only.

    ``bits`` is the int32 bit pattern of a normal positive float32 scale (an
    array of any backend: numpy, jax, tf with operators), ``split`` the
    :func:`split_factor` of the factor, ``where`` the backend's
    ``where(cond, a, b)``.  The exact 77-bit product of the mantissas is
    built from 12-bit limbs (every intermediate below 2**27), rounded to 53
    bits (float64) and then to 24 bits (float32), both to nearest even, as the
    float64 product does.  Returns the bits of +inf when the result overflows
    float32, and 0 when it lies below :data:`SCALE_FLOOR` (callers floor the
    scale there, so its subnormal value never matters).
    """
    exp_a = bits >> 23
    ma = (bits & 0x7FFFFF) | 0x800000
    a0, a1 = ma & 0xFFF, ma >> 12
    b0, b1, b2, b3, b4 = split.limbs
    columns = (a0 * b0, a1 * b0 + a0 * b1, a1 * b1 + a0 * b2, a1 * b2 + a0 * b3, a1 * b3 + a0 * b4, a1 * b4)
    p: list[Any] = []
    carry: Any = 0
    for column in columns:
        t = column + carry
        p.append(t & 0xFFF)
        carry = t >> 12
    p.append(carry)  # the product has 76 or 77 bits: p[6] < 2**5
    short = p[6] < 16  # 76 bits: shift left once, so 77 bits = 24 dropped + 53 kept
    q = [where(short, ((p[k] << 1) & 0xFFF) | ((p[k - 1] >> 11) if k else 0), p[k]) for k in range(7)]
    # round to 53 bits (float64): drop q[0], q[1]
    dropped = (q[1] << 12) | q[0]
    up = (dropped > 0x800000) | ((dropped == 0x800000) & ((q[2] & 1) == 1))
    carry = where(up, 1, 0)
    for k in range(2, 7):
        t = q[k] + carry
        q[k] = t & 0xFFF if k < 6 else t
        carry = t >> 12
    # round those 53 bits to 24 (float32): drop the low 29
    r = (q[4] >> 5) | (q[5] << 7) | (q[6] << 19)
    rest = q[2] | (q[3] << 12) | ((q[4] & 31) << 24)
    up = (rest > 0x10000000) | ((rest == 0x10000000) & ((r & 1) == 1))
    r = r + where(up, 1, 0)
    over = r >> 24  # 1 when rounding carried to 2**24
    r = r >> over
    field = exp_a + (split.exponent + 53) - where(short, 1, 0) + over
    safe = where(field > 254, 254, where(field < 1, 1, field))
    normal = (safe << 23) | (r & 0x7FFFFF)
    return where(field > 254, INF_BITS, where(field < 1, 0, normal))
