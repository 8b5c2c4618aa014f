"""The random Hadamard transform (RHT) of NVFP4's weight-gradient GEMM, once for every backend.

Transformer Engine's NVFP4 recipe multiplies every block of 16 elements along the reduction
dimension of both weight-gradient operands (``dy`` and ``x``, blocked along M) by ``S H``:
``S`` a diagonal matrix of random signs, ``H`` the 16x16 Sylvester Hadamard matrix divided by 4
(``H H^T = I``).  Since ``(u S H) (v S H)^T = u v^T``, the GEMM's result is unchanged while
outliers spread over their block before the FP4 quantization.

* :func:`sign_mask`: the 16 signs of one step, a pure function of ``(seed, step)`` through the core's
  counter generator (:func:`mpx.kernels.rounding.random_bits` of the indices 0..15 under the key
  :data:`SIGN_PARAM`; an element is negated where its bit 0 is 1).  One vector per step, shared by
  both operands of every weight-gradient GEMM (Transformer Engine's docs: "shared across all modules
  and changed randomly for each iteration"; its code uses one fixed vector, :data:`TE_SIGNS`).
* :func:`rht`: ``x`` with each 16-block along ``axis`` multiplied by ``S H``: the signs flipped on
  the bits, then a 4-stage butterfly of float32 adds in a fixed order, then the factor 1/4 on the
  exponent.  A dimension that 16 does not divide is padded with zeros to a multiple of 16 and the
  padding is kept (its transformed entries are not zero; both operands carry it, so the GEMM over
  the padded length is the same product).

Every table computes the same bits: a float32 subnormal input, any stage's result below float32's
smallest normal (2**-126) and a quarter below it are zeros of their sign (what XLA:CPU and
TensorFlow flush to; numpy and torch are made to agree).  An inf or NaN spreads over its block
(inf - inf is NaN).  Where mpx differs from Transformer Engine: TE's GPU kernel multiplies bfloat16
inputs by ``S H`` on tensor cores (products accumulated in float32) with its fixed sign vector;
mpx's butterfly rounds each float32 add, and its signs change every step.

>>> import numpy as np
>>> from mpx.kernels.array_ops import NUMPY_OPS as o
>>> y = rht(o, o.float32(np.eye(16)[:1]), o.int32(np.zeros(16, np.int32)), axis=1)
>>> y.tolist()[0][:4]
[0.25, 0.25, 0.25, 0.25]
"""

from __future__ import annotations

from typing import Any

from mpx.errors import Float8Error
from mpx.kernels.array_ops import ArrayOps
from mpx.kernels.bits import SIGN_BIT, TINY_BITS, from_bits, to_bits
from mpx.kernels.rounding import random_bits

__all__ = ["SIGN_PARAM", "SIZE", "TE_SIGNS", "rht", "sign_mask"]

#: The transform's block (Transformer Engine's 16).
SIZE = 16
#: The generator's parameter key of the sign vector (stochastic rounding keys tensors 0..65534).
SIGN_PARAM = 0xFFFF
#: Transformer Engine's fixed sign vector (``get_wgrad_sign_vector``), as the 0/1 mask :func:`rht` reads.
TE_SIGNS = (0, 0, 0, 1, 0, 1, 1, 1, 1, 1, 1, 0, 1, 0, 1, 1)


def sign_mask(o: ArrayOps, *, seed: int, step: Any) -> Any:
    """The 16 signs of ``(seed, step)`` as an int32 mask (1: negate), shape (16,)."""
    index = o.stack([o.int32(i) for i in range(SIZE)])
    return o.bit_and(random_bits(o, index, seed=seed, step=step, param=SIGN_PARAM), 1)


def _flush(o: ArrayOps, b: Any) -> Any:
    """Bits ``b`` with a magnitude below 2**-126 replaced by a zero of their sign."""
    return o.where(o.lt(o.bit_and(b, 0x7FFFFFFF), TINY_BITS), o.bit_and(b, SIGN_BIT), b)


def _pick(o: ArrayOps, y: Any, lead: int, rest: tuple[int, ...], i: int) -> Any:
    """``y[i]`` of ``y`` shaped ``(lead, *rest)``."""
    n = 1
    for d in rest:
        n *= d
    return o.reshape(o.get_row(o.reshape(y, (lead, n)), o.int32(i)), rest)


def rht(o: ArrayOps, x: Any, mask: Any, axis: int = 0) -> Any:
    """``x`` (2-D, float32) with every block of 16 along ``axis`` multiplied by ``S H`` (module docs).

    Args:
        o: the backend's table.
        x: a 2-D float array (converted to float32).
        mask: the signs (int32, shape (16,), 1 negates): :func:`sign_mask` or :data:`TE_SIGNS`.
        axis: the GEMM's reduction axis of ``x`` (0 or 1).

    Returns:
        float32, ``x``'s shape with the ``axis`` dimension padded to a multiple of 16.
    """
    if axis not in (0, 1):
        raise Float8Error(f"axis: {axis!r} is not allowed; allowed: 0 or 1 (the reduction axis)")
    xt = o.float32(x) if axis == 1 else o.transpose(o.float32(x), (1, 0))
    rows, cols = xt.shape
    nb = -(-cols // SIZE)
    xp = o.reshape(o.pad(xt, (rows, nb * SIZE)), (rows * nb, SIZE))
    b = o.bit_xor(_flush(o, to_bits(o, xp)), o.mul(o.int32(mask), SIGN_BIT))
    y = from_bits(o, b)
    h = 1
    while h < SIZE:  # x[j], x[j + h] -> x[j] + x[j + h], x[j] - x[j + h] in each run of 2h
        g = SIZE // (2 * h)
        pairs = o.transpose(o.reshape(y, (rows * nb, g, 2, h)), (2, 0, 1, 3))
        a, c = (_pick(o, pairs, 2, (rows * nb, g, h), i) for i in (0, 1))
        y = o.reshape(o.transpose(o.stack([o.add(a, c), o.sub(a, c)]), (1, 2, 0, 3)), (rows * nb, SIZE))
        y = from_bits(o, _flush(o, to_bits(o, y)))
        h *= 2
    b = to_bits(o, y)
    field = o.bit_and(o.shr(b, 23), 0xFF)
    quarter = o.where(
        o.lt(2, field), o.where(o.lt(field, 0xFF), o.sub(b, 2 << 23), b), o.bit_and(b, SIGN_BIT)
    )
    out = o.reshape(from_bits(o, quarter), (rows, nb * SIZE))
    return out if axis == 1 else o.transpose(out, (1, 0))
