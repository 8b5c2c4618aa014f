"""Rounding float32 to bfloat16: to nearest, stochastically (counter-based random bits), and Kahan-compensated.

Every kernel here takes and returns float32 arrays; a "bfloat16 value" is a float32 whose low 16
bits are zero (what a bfloat16 widens to), so a backend's cast to its bfloat16 dtype afterwards is
exact.  The rounding is integer arithmetic on the bits (int32 adds that never overflow, masks), the
same on every table, subnormals included.

* :func:`round_bf16`: round to nearest, ties to even (the bits torch, JAX, TensorFlow and ml_dtypes
  give for a float32 -> bfloat16 cast; a NaN becomes a quiet NaN of the same sign).
* :func:`random_bits`: 16 random bits per element from a counter-based generator (a Philox-style
  network on 16-bit words: 10 rounds of multiply, split, xor with a Weyl key schedule), a pure function
  of ``(seed, step, param, element index)``; every table computes the same bits, so torch, JAX and
  Keras round the same update alike.  ``seed`` and ``param`` enter as 16-bit keys (``seed`` also
  xors its high 16 bits into the step's high word); ``step`` and the element index are 32-bit
  counters.  Multiplications are of a 16-bit word by a 15-bit constant, so no int32 product overflows.
* :func:`stochastic_round_bf16`: add the 16 random bits to the float32's low 16 bits and truncate
  (torchao's ``_fp32_to_bf16_sr``, with counter-based bits instead of ``torch.randint``): a value is
  rounded up with probability (its distance to the lower bfloat16) / (the bfloat16 gap), so the
  rounding is unbiased, and a float32 exactly representable in bfloat16 is never changed.  A value
  above bfloat16's largest finite rounds up to infinity with that probability, as torchao's does.
* :func:`kahan_add`: optimi's Kahan-compensated update of a bfloat16 weight ``w`` with a bfloat16
  compensation ``c`` by a float32 update ``u``, each operation a float32 add rounded to bfloat16 as
  torch's bfloat16 arithmetic does: ``c1 = bf16(c + u)``, ``w1 = bf16(w + c1)``,
  ``c2 = bf16(c1 + bf16(w - w1))``.  Its adds are the table's float32 adds: a table that flushes
  subnormals (XLA:CPU, TensorFlow) differs only where a sum falls below 2**-126.

>>> import numpy as np
>>> from mpx.kernels.array_ops import NUMPY_OPS as o
>>> round_bf16(o, np.float32([1.00390625, 1.01171875, 3.0])).tolist()
[1.0, 1.015625, 3.0]
>>> r = stochastic_round_bf16(o, np.full(4096, 1.001953125, np.float32), seed=0, step=0, param=0)
>>> sorted(set(r.tolist())), round(float(r.mean()), 3)
([1.0, 1.0078125], 1.002)
"""

from __future__ import annotations

from typing import Any

from mpx.kernels.array_ops import ArrayOps
from mpx.kernels.bits import from_bits, is_finite, is_nan, to_bits

__all__ = ["ROUNDS", "kahan_add", "random_bits", "round_bf16", "stochastic_round_bf16"]

#: The rounds of the generator's network.
ROUNDS = 10
_M0, _M1 = 0x7A35, 0x6C8D  # odd 15-bit multipliers: a 16-bit word times one stays below 2**31
_W0, _W1 = 0x9E37, 0xBB67  # the Weyl increments of the two 16-bit keys (golden ratio, sqrt(3) - 1)
_HIGH = -65536  # 0xFFFF0000 as an int32: a float32's bfloat16 bits
_QUIET_NAN = 0x7FC00000


def _finish(o: ArrayOps, b: Any, rounded: Any) -> Any:
    """``rounded`` (bits) where ``b`` is finite; an infinity as it is; a NaN as a quiet NaN of its sign."""
    nan = o.bit_or(o.bit_and(b, -(2**31)), _QUIET_NAN)
    out = o.where(is_finite(o, from_bits(o, b)), rounded, o.where(is_nan(o, from_bits(o, b)), nan, b))
    return from_bits(o, out)


def round_bf16(o: ArrayOps, x: Any) -> Any:
    """``x`` (float32) rounded to the nearest bfloat16, ties to even, as float32 (low 16 bits zero)."""
    b = to_bits(o, x)
    safe = o.where(is_finite(o, x), b, 0)  # below 0x7F800000 in magnitude: the add cannot overflow
    bias = o.add(o.bit_and(o.shr(safe, 16), 1), 0x7FFF)
    return _finish(o, b, o.bit_and(o.add(safe, bias), _HIGH))


def random_bits(o: ArrayOps, index: Any, *, seed: int, step: Any, param: int) -> Any:
    """16 random bits (int32 in [0, 2**16)) for each element index in ``index`` (int32, >= 0).

    Args:
        index: the elements' counters (int32 array, usually :meth:`ArrayOps.iota` of the tensor).
        seed: the run's seed (a Python int; its low 16 bits are a key, its high 16 bits xor the step's).
        step: the optimizer step (a Python int or an int32 scalar array, >= 0).
        param: the parameter's index in the optimizer (a Python int; its low 16 bits are a key).
    """
    step = o.int32(step)
    x0, x1 = o.bit_and(index, 0xFFFF), o.bit_and(o.shr(index, 16), 0xFFFF)
    x2 = o.bit_and(step, 0xFFFF)
    x3 = o.bit_and(o.bit_xor(o.shr(step, 16), (seed >> 16) & 0xFFFF), 0xFFFF)
    k0, k1 = seed & 0xFFFF, param & 0xFFFF
    for _ in range(ROUNDS):
        p0, p1 = o.mul(x0, _M0), o.mul(x2, _M1)
        x0, x1, x2, x3 = (
            o.bit_xor(o.bit_xor(o.shr(p1, 16), x1), k0),
            o.bit_and(p1, 0xFFFF),
            o.bit_xor(o.bit_xor(o.shr(p0, 16), x3), k1),
            o.bit_and(p0, 0xFFFF),
        )
        k0, k1 = (k0 + _W0) & 0xFFFF, (k1 + _W1) & 0xFFFF
    return x0


def stochastic_round_bf16(o: ArrayOps, x: Any, *, seed: int, step: Any, param: int) -> Any:
    """``x`` (float32) rounded stochastically to bfloat16, as float32 (low 16 bits zero).

    The random bits are :func:`random_bits` of each element's flat index (see the module docs).
    """
    x = o.float32(x)
    b = to_bits(o, x)
    bits = random_bits(o, o.iota(x), seed=seed, step=step, param=param)
    safe = o.where(is_finite(o, x), b, 0)
    return _finish(o, b, o.bit_and(o.add(safe, bits), _HIGH))


def kahan_add(o: ArrayOps, w: Any, c: Any, u: Any) -> tuple[Any, Any]:
    """optimi's Kahan step: the bfloat16 weight ``w`` and compensation ``c`` (float32 holding bfloat16
    values) after the float32 update ``u``; returns ``(w1, c2)`` (see the module docs)."""
    c1 = round_bf16(o, o.add(c, u))
    w1 = round_bf16(o, o.add(w, c1))
    c2 = round_bf16(o, o.add(c1, round_bf16(o, o.sub(w, w1))))
    return w1, c2
