"""Block-scaled quantization, once for every backend: MX (E8M0 scales), NVFP4, blockwise and rowwise FP8.

:func:`quantize` turns a 2-D float array into element codes (:mod:`mpx.kernels.elements`)
and one scale per block; :func:`dequantize` multiplies them back.  The recipe
(:class:`mpx.blocks.BlockRecipe`) names the element format, each GEMM role's block, the
scale format and its rule; ``axis`` names the GEMM's reduction dimension of the operand.

Layouts (a linear layer ``y = x @ w.T``, ``x`` of shape (M, K), ``w`` of (N, K)), as
:data:`GEMM_OPERANDS` lists them: the forward GEMM blocks ``x`` and ``w`` along K (axis 1:
MX's rowwise copies); the input gradient ``dy @ w`` blocks ``dy`` along N (axis 1) and ``w``
along N (axis 0: the columnwise copy); the weight gradient ``dy.T @ x`` blocks ``dy`` and
``x`` along M (axis 0).  Each copy is quantized from the high-precision tensor.  An ``NxN``
block is a square tile, so its copies along either axis hold the same bytes.

Blocks and padding
    A block is ``(rows, cols)``: ``cols`` along the reduction axis, ``rows`` across it, 0
    meaning the whole axis (``row``: ``(1, 0)``; ``tensor``: ``(0, 0)``).  A dimension that
    the block does not divide is padded with zeros at its end before the amaxes are taken
    (zeros never raise an amax), and the padding is cropped from the codes.  ``scales``
    has one entry per block, shape ``(ceil(R / rows), ceil(C / cols))`` for the operand
    seen with its reduction axis last (R rows, C reduction entries).

Scales (the rules; every one on the float32 bits, so subnormals count everywhere)
    * ``e8m0`` ``floor`` (OCP MX, torchao FLOOR): ``code = clamp(exponent(amax) - emax, -127,
      128) + 127`` with ``emax = floor(log2(element max))`` (8 for e4m3, 15 for e5m2, 2 for
      e2m1); the exponent is read from the bits (a cast to E8M0 would round to nearest).
      ``even`` (torchao EVEN): the same after rounding the amax's mantissa to the
      element's mantissa bits.  ``rceil`` (Transformer Engine, cuBLAS):
      ``float32(amax / element max)`` rounded up to a power of two (its E8M0 code, at
      most 254).  Elements are ``x / 2**(code - 127)``: exact, the divisor ``2**-126``
      for code 0 under floor/even and 1.0 under rceil (torchao's and TE's choices).
    * ``pow2`` / ``float32``: :func:`mpx.kernels.float8.compute_scale` under current
      scaling (``fp8_max / amax``, the amax floored at 1e-12; ``pow2`` rounds down to a power
      of two); the element is ``fp8(x * scale)``; ``scales`` holds ``float32(1 / scale)``.
    * ``e4m3`` / ``e4m3_f32`` (NVFP4, torchao's ``nvfp4_quantize``): block scale
      ``e4m3(clamp(amax / 6 [/ tensor_scale], 2**-6, 448))``; ``e4m3_f32`` adds the tensor
      scale ``amax(x) / (448 * 6)``; the element is ``e2m1(x * ([1 / tensor_scale] / block
      scale))``, each step a float32 operation.  mpx floors the tensor scale and the block
      amax at float32's smallest normal (``2**-126`` and ``6 * 2**-126``), so no step
      depends on a table's subnormal arithmetic (torchao: a zero tensor gives NaN scales).

Stochastic rounding and the random Hadamard transform (``rounding="stochastic"``, ``hadamard=True``)
    Stochastic rounding applies to the ``grad`` role (Transformer Engine's NVFP4 rounds gradients
    so): every element's scaled value is rounded by :func:`mpx.kernels.elements.encode` with 16
    random bits from :func:`mpx.kernels.rounding.random_bits` of the element's flat index in the
    operand as given, keyed by ``(seed, step, index)``: every backend rounds the same bits, an
    exactly representable value never changes, and the rounding is unbiased to ``2**-16`` of a grid
    step.  The scales are the nearest-rounding ones.  The Hadamard transform applies to the
    weight-gradient operands (``input`` and ``grad`` blocked along axis 0): the operand is first
    :func:`mpx.kernels.hadamard.rht`-transformed along M with the signs of ``(seed, step)``, so its
    codes have M padded to a multiple of 16 and :func:`dequantize` gives the transformed operand
    (the GEMM of two transformed operands is the product of the originals).

Zero, NaN and inf blocks (the same in every table)
    * an all-zero block: E8M0 code 0 (``2**-127``), its elements +-0 (signs kept); under
      pow2/float32 the 1e-12 floor's scale; under NVFP4 the block scale ``2**-6``;
    * a block holding a NaN: E8M0 code 255 (NaN) or an E4M3 NaN scale, and every element
      the format's positive NaN code (FP8) or its largest positive code (FP4/FP6, which have
      no NaN): the block dequantizes to NaN.  Under pow2/float32 a NaN amax gives scale 1.0
      (mpx.float8's current rule) and NaN elements stay NaN codes;
    * an infinity saturates to the element's largest magnitude; its block's amax is inf:
      floor gives code ``255 - emax``, rceil 254 (TE's satfinite), pow2/float32 scale 1.0.

>>> import numpy as np
>>> from mpx.blocks import PRESETS
>>> from mpx.kernels.array_ops import NUMPY_OPS as o
>>> q = quantize(o, o.float32(np.arange(40).reshape(1, 40)), PRESETS["mxfp8"], "input")
>>> q.codes.shape, q.scales.tolist()
((1, 40), [[123, 124]])
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

from mpx.errors import Float8Error
from mpx.kernels import elements, hadamard
from mpx.kernels import float8 as _f8
from mpx.kernels.array_ops import ArrayOps
from mpx.kernels.bits import SIGN_BIT, TINY_BITS, bits_of, from_bits, is_finite, product, split, to_bits, unit
from mpx.kernels.rounding import random_bits

__all__ = ["GEMM_OPERANDS", "BlockQuantized", "BlockSpec", "dequantize", "quantize", "randomized"]

#: Per GEMM of a linear layer (``x`` (M, K), ``w`` (N, K), ``dy`` (M, N)): each operand's
#: ``(tensor, role, reduction axis)``.
GEMM_OPERANDS: dict[str, tuple[tuple[str, str, int], tuple[str, str, int]]] = {
    "forward": (("x", "input", 1), ("w", "weight", 1)),
    "dgrad": (("dy", "grad", 1), ("w", "weight", 0)),
    "wgrad": (("dy", "grad", 0), ("x", "input", 0)),
}
_E8M0_NAN = 255


class BlockSpec(Protocol):
    """What the kernels read of an :class:`mpx.blocks.BlockRecipe`."""

    scale: str
    scale_rule: str
    rounding: str
    hadamard: bool

    def element_of(self, role: str) -> str: ...

    def block_of(self, role: str) -> tuple[int, int]: ...


@dataclass(frozen=True)
class BlockQuantized:
    """A quantized operand: int32 element ``codes`` (the operand's shape and layout), per-block
    ``scales`` (int32 E8M0/E4M3 codes, or float32 ``1 / scale`` for pow2/float32; shape in the
    module docs) and the float32 ``tensor_scale`` (``e4m3_f32``; None otherwise)."""

    codes: Any
    scales: Any
    tensor_scale: Any = None


class _Current:
    """The per-tensor kernel's recipe for a block's float32 scale (current scaling, margin 0)."""

    scaling = "current"
    margin = 0
    amax_compute = "max"

    def __init__(self, power_of_two: bool) -> None:
        self.power_of_two = power_of_two


def _mul(o: ArrayOps, x: Any, s: Any) -> Any:
    """``float32(x) * float32(s)`` rounded once as IEEE does, whatever the table flushes (a non-finite
    ``x`` with a finite ``s`` keeps its value: the kernels' scales are positive)."""
    xf, sf = o.float32(x), o.float32(s)
    if o.exact_float32:
        return o.mul(xf, sf)
    ok = o.logical_and(is_finite(o, xf), is_finite(o, sf))
    exact = product(o, o.where(ok, xf, 0.0), o.where(ok, sf, 1.0))
    return o.where(ok, exact, o.where(is_finite(o, sf), xf, o.mul(xf, sf)))


def _recip(o: ArrayOps, s: Any) -> Any:
    """``float32(1 / s)`` for a positive float32 ``s`` whose inverse is a normal float32 (or inf/NaN),
    correctly rounded everywhere: ``2 / s`` halved on the bits.  (TensorFlow's graph optimizer turns
    ``1 / s`` into an approximate reciprocal, one ulp off; ``2 / s`` stays a division.)"""
    half = from_bits(o, o.sub(to_bits(o, o.div(2.0, s)), 1 << 23))
    return o.where(is_finite(o, s), half, o.div(1.0, s))


def _div_const(o: ArrayOps, x: Any, c: float) -> Any:
    """``float32(x / c)`` correctly rounded for a Python float ``c``.  The divisor depends on ``x``
    (``c``, or 1 where ``x`` is NaN: the quotient is NaN either way), since TensorFlow's graph optimizer
    and XLA turn a division by a constant, or by one they can fold (``x & 0 | c``), into an inexact
    product with the reciprocal (XLA:CPU: 22265 of 10**5 quotients by 2688 one ulp off)."""
    return o.div(x, o.where(o.eq(x, x), o.float32(c), 1.0))


def _geometry(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int, int, int]:
    rows, cols = shape
    br = rows if block[0] == 0 else block[0]
    bc = cols if block[1] == 0 else block[1]
    return max(br, 1), max(bc, 1), -(-rows // max(br, 1)), -(-cols // max(bc, 1))


def _to_blocks(o: ArrayOps, x: Any, shape: tuple[int, int], block: tuple[int, int]) -> Any:
    """(R, C) -> (R / br, C / bc, br * bc), zero-padded."""
    br, bc, nr, nc = _geometry(shape, block)
    xp = o.pad(x, (nr * br, nc * bc))
    return o.reshape(o.transpose(o.reshape(xp, (nr, br, nc, bc)), (0, 2, 1, 3)), (nr, nc, br * bc))


def _from_blocks(o: ArrayOps, b: Any, shape: tuple[int, int], block: tuple[int, int]) -> Any:
    """The inverse of :func:`_to_blocks`, the padding cropped."""
    br, bc, nr, nc = _geometry(shape, block)
    x = o.reshape(o.transpose(o.reshape(b, (nr, nc, br, bc)), (0, 2, 1, 3)), (nr * br, nc * bc))
    return o.crop(x, shape)


def _oriented(o: ArrayOps, x: Any, axis: int) -> Any:
    if axis not in (0, 1, -1):
        raise Float8Error(
            f"axis: {axis!r} is not allowed; allowed: 0 or 1 (the reduction axis of a 2-D operand)"
        )
    return x if axis in (1, -1) else o.transpose(x, (1, 0))


def _e8m0(o: ArrayOps, amax: Any, fmt: str, rule: str) -> Any:
    """The E8M0 code (int32) of each block's float32 ``amax`` under ``rule`` (module docs)."""
    f = elements.ELEMENT_FORMATS[fmt]
    b = to_bits(o, amax)
    nan = o.lt(0x7F800000, b)
    if rule == "rceil":
        _, m, ea, zero = split(o, amax)
        qb = to_bits(o, _div_const(o, unit(o, m), f.max_value))  # a normal quotient, correctly rounded
        eq = o.sub(o.bit_and(o.shr(qb, 23), 0xFF), 127)
        fq = o.bit_and(qb, 0x7FFFFF)
        e = o.add(ea, eq)  # the exponent of float32(amax / max)
        normal = o.minimum(o.add(o.add(e, 127), o.where(o.eq(fq, 0), 0, 1)), 254)
        # below 2**-126 the quotient is a subnormal float32: TE's code is 1 above 2**-127, else 0
        sub = o.where(o.logical_and(o.eq(e, -127), o.lt(1, fq)), 1, 0)
        code = o.where(o.le(-126, e), normal, sub)
        code = o.where(zero, 0, o.where(o.eq(b, 0x7F800000), 254, code))
        return o.where(nan, _E8M0_NAN, code)
    if rule == "even":
        b = o.bit_and(o.add(b, 1 << (22 - f.mbits)), 0x7F800000)
    elif rule != "floor":
        raise Float8Error(f"scale_rule: {rule!r} is not allowed for e8m0 scales; allowed: floor, rceil, even")
    exp = o.sub(o.shr(b, 23), 127)
    code = o.add(o.maximum(o.minimum(o.sub(exp, f.max_exp), 128), -127), 127)
    return o.where(nan, _E8M0_NAN, code)


def randomized(recipe: BlockSpec, role: str, axis: int) -> tuple[bool, bool]:
    """``(stochastic, hadamard)``: whether :func:`quantize` rounds this operand stochastically (the
    ``grad`` role under ``rounding="stochastic"``) and whether it transforms it (``hadamard=True``:
    the weight-gradient operands, ``input`` and ``grad`` along axis 0)."""
    stochastic = getattr(recipe, "rounding", "nearest") == "stochastic" and role == "grad"
    return stochastic, bool(getattr(recipe, "hadamard", False)) and axis == 0 and role in ("input", "grad")


def quantize(
    o: ArrayOps, x: Any, recipe: BlockSpec, role: str, axis: int = 1, *,
    seed: int | None = None, step: Any = 0, index: int = 0,
) -> BlockQuantized:  # fmt: skip
    """Quantize a 2-D operand with ``role``'s element format and block, blocks along ``axis`` (module docs).

    Args:
        o: the backend's table.
        x: a 2-D float array (converted to float32 first).
        recipe: an :class:`mpx.blocks.BlockRecipe`.
        role: ``"input"``, ``"weight"`` or ``"grad"``.
        axis: the GEMM's reduction axis of ``x`` (0 or 1); :data:`GEMM_OPERANDS` lists them.
        seed: the run's seed (a Python int), needed when :func:`randomized` says so.
        step: the step counter (a Python int or an int32 scalar array, >= 0; default 0).
        index: the tensor's key for stochastic rounding (0..65534; default 0).
    """
    fmt, block = recipe.element_of(role), recipe.block_of(role)
    stochastic, transform = randomized(recipe, role, axis)
    if (stochastic or transform) and not isinstance(seed, int):
        raise Float8Error(
            f"seed: {seed!r} is not allowed: the recipe rounds stochastically or transforms this operand "
            "(rounding='stochastic' or hadamard=True); allowed: a Python int"
        )
    if not isinstance(index, int) or not 0 <= index < hadamard.SIGN_PARAM:
        raise Float8Error(f"index: {index!r} is not allowed; allowed: an int in 0..65534")
    xf = o.float32(x)
    if transform:
        xf = hadamard.rht(o, xf, hadamard.sign_mask(o, seed=seed, step=step), axis)
    xt = _oriented(o, xf, axis)
    shape = tuple(xt.shape)
    blocks = _to_blocks(o, xt, shape, block)
    rbits = None
    if stochastic:
        bits = random_bits(o, o.iota(xf), seed=seed, step=step, param=index)
        rbits = _to_blocks(o, _oriented(o, bits, axis), shape, block)
    amax = from_bits(o, o.max_last(o.bit_and(to_bits(o, blocks), 0x7FFFFFFF)))  # (nr, nc, 1); NaN wins
    tensor_scale = None
    nan = math.nan
    if recipe.scale == "e8m0":
        code = _e8m0(o, amax, fmt, recipe.scale_rule)
        shift = o.where(o.eq(code, 0), 0 if recipe.scale_rule == "rceil" else 126, o.sub(127, code))
        data = o.where(o.eq(code, _E8M0_NAN), nan, blocks)
        codes = elements.encode(o, data, fmt, o.where(o.eq(code, _E8M0_NAN), 0, shift), rbits)
        scales = code
    elif recipe.scale in ("pow2", "float32"):
        mult = _f8.compute_scale(o, _Current(recipe.scale == "pow2"), amax, fmt)
        codes = elements.encode(o, _mul(o, blocks, mult), fmt, 0, rbits)
        scales = _recip(o, mult)
    else:  # e4m3, e4m3_f32: NVFP4
        floor = bits_of(6.0 * 2.0**-126)
        block_scale = _div_const(o, from_bits(o, o.maximum(to_bits(o, amax), floor)), 6.0)
        recip = None
        if recipe.scale == "e4m3_f32":
            t_amax = from_bits(o, o.max(o.bit_and(to_bits(o, xt), 0x7FFFFFFF)))
            ts = _div_const(o, t_amax, 448.0 * 6.0)
            ts = o.where(o.lt(to_bits(o, ts), TINY_BITS), 2.0**-126, ts)
            block_scale = o.div(block_scale, ts)
            recip, tensor_scale = _recip(o, ts), ts
        code = elements.encode(o, o.clip(block_scale, 2.0**-6, 448.0), "e4m3")
        sf = elements.decode(o, code, "e4m3")
        r = _recip(o, sf) if recip is None else o.div(recip, sf)
        bad = o.eq(o.bit_and(code, 0x7F), 0x7F)
        codes = elements.encode(o, o.where(bad, nan, _mul(o, blocks, o.where(bad, 1.0, r))), fmt, 0, rbits)
        scales = code
    nr, nc = scales.shape[0], scales.shape[1]
    codes = _oriented(o, _from_blocks(o, codes, shape, block), axis)
    return BlockQuantized(codes, o.reshape(scales, (nr, nc)), tensor_scale)


def _descale(o: ArrayOps, q: BlockQuantized, scale: str) -> Any:
    """Each block's float32 multiplier, shape (nr, nc, 1)."""
    s = o.reshape(q.scales, (*q.scales.shape, 1))
    if scale == "e8m0":
        value = from_bits(o, o.where(o.eq(s, 0), 0x00400000, o.shl(s, 23)))  # code 0 is 2**-127
        return o.where(o.eq(s, _E8M0_NAN), math.nan, value)
    if scale in ("pow2", "float32"):
        return o.float32(s)
    value = elements.decode(o, s, "e4m3")
    return value if q.tensor_scale is None else _mul(o, value, q.tensor_scale)


def dequantize(o: ArrayOps, q: BlockQuantized, recipe: BlockSpec, role: str, axis: int = 1) -> Any:
    """The float32 operand a :func:`quantize` result stands for: ``element * block scale`` (times the
    tensor scale for ``e4m3_f32``), each product rounded once; a NaN scale gives NaN elements; a
    result below float32's smallest normal (2**-126) is a zero of its sign, in every table."""
    fmt, block = recipe.element_of(role), recipe.block_of(role)
    ct = _oriented(o, q.codes, axis)
    shape = tuple(ct.shape)
    values = elements.decode(o, _to_blocks(o, ct, shape, block), fmt)
    b = to_bits(o, _mul(o, values, _descale(o, q, recipe.scale)))
    # below float32's smallest normal a signed zero (what XLA and TF compute; the same bits everywhere)
    out = from_bits(o, o.where(o.lt(o.bit_and(b, 0x7FFFFFFF), TINY_BITS), o.bit_and(b, SIGN_BIT), b))
    return _oriented(o, _from_blocks(o, out, shape, block), axis)
