"""The dynamic scale's next value on Keras tensors, bit for bit the core's :func:`mpx.scaler_update`.

Every scale product is torch's, ``float32(float64(scale) * float64(factor))``
(:func:`mpx.scaling.scale_product`).  Keras tensors may have no float64 (and
TensorFlow's kernels flush float32 subnormals to zero), so the product is the
core's :func:`mpx.scaling.product_bits`: exact integer arithmetic on the
scale's int32 bits.  This module holds the logic once, over a small table of
tensor operations (:class:`TensorOps`): :data:`KERAS_OPS` (``keras.ops``, any
Keras backend) or a backend's own functions (mpx_tf passes TensorFlow's, which
run an eager step about twice as fast as ``keras.ops``' wrappers).
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

import keras
import numpy as np

from mpx.scaling import INF_BITS, FactorSplit, ScalerConfig, product_bits

__all__ = ["KERAS_OPS", "TensorOps", "next_scale"]


class TensorOps(NamedTuple):
    """The tensor operations :func:`next_scale` needs (``view``: a bitcast to a dtype name)."""

    right_shift: Any
    left_shift: Any
    bitwise_and: Any
    bitwise_or: Any
    logical_and: Any
    logical_or: Any
    where: Any
    minimum: Any
    maximum: Any
    view: Any
    int32: Any  # a Python int as an int32 scalar tensor


_k = keras.ops
#: ``keras.ops``: Keras on any backend.
KERAS_OPS = TensorOps(
    _k.right_shift, _k.left_shift, _k.bitwise_and, _k.bitwise_or, _k.logical_and, _k.logical_or,
    _k.where, _k.minimum, _k.maximum, _k.view, lambda x: _k.convert_to_tensor(x, "int32"),
)  # fmt: skip


class _Int32:
    """An int32 (or bool) tensor with the Python operators :func:`mpx.scaling.product_bits` uses.

    Backend tensors do not all have ``>>``/``<<`` and bitwise ``&``/``|`` (TensorFlow's
    have none); this maps them onto ``keras.ops`` (``&``/``|`` of bools onto logical ops).
    """

    __slots__ = ("ops", "t")

    def __init__(self, t: Any, ops: TensorOps) -> None:
        self.t, self.ops = t, ops

    def _binary(self, other: Any, op: Any) -> _Int32:
        return _Int32(op(self.t, other.t if isinstance(other, _Int32) else other), self.ops)

    def _logic(self, other: Any, bitwise: Any, logical: Any) -> _Int32:
        is_bool = keras.backend.standardize_dtype(self.t.dtype) == "bool"
        return self._binary(other, logical if is_bool else bitwise)

    def __rshift__(self, n: Any) -> _Int32:
        return self._binary(n, self.ops.right_shift)

    def __lshift__(self, n: Any) -> _Int32:
        return self._binary(n, self.ops.left_shift)

    def __and__(self, other: Any) -> _Int32:
        return self._logic(other, self.ops.bitwise_and, self.ops.logical_and)

    def __or__(self, other: Any) -> _Int32:
        return self._logic(other, self.ops.bitwise_or, self.ops.logical_or)

    def __add__(self, other: Any) -> _Int32:
        return self._binary(other, operator.add)

    __radd__ = __add__

    def __sub__(self, other: Any) -> _Int32:
        return self._binary(other, operator.sub)

    def __mul__(self, other: Any) -> _Int32:
        return self._binary(other, operator.mul)

    __rmul__ = __mul__

    def __lt__(self, other: Any) -> _Int32:
        return self._binary(other, operator.lt)

    def __gt__(self, other: Any) -> _Int32:
        return self._binary(other, operator.gt)

    def __eq__(self, other: Any) -> _Int32:  # type: ignore[override]
        return self._binary(other, operator.eq)

    __hash__ = None  # type: ignore[assignment]


def _product_bits(bits: Any, split: FactorSplit, ops: TensorOps) -> Any:
    """The int32 bits of ``float32(float64(scale) * factor)`` from the scale's ``bits``
    (0 below 2**-126, +inf's bits on overflow)."""

    def value(x: Any) -> Any:
        return x.t if isinstance(x, _Int32) else ops.int32(x)

    def where(cond: Any, a: Any, b: Any) -> _Int32:
        return _Int32(ops.where(cond.t, value(a), value(b)), ops)

    return product_bits(_Int32(bits, ops), split, where).t


def _bits(value: float) -> int:
    """The int32 bit pattern of a non-negative float32 value."""
    return int(np.float32(value).view(np.int32))


def next_scale(
    config: ScalerConfig, scale: Any, finite: Any, at_interval: Any, back_off: Any, ops: TensorOps = KERAS_OPS
) -> Any:
    """The float32 scale after a step of a dynamic ``config``, from the float32 ``scale`` before it.

    ``finite``: the step's gradients were finite; ``at_interval``: the growth
    tracker reaches ``growth_interval`` with it; ``back_off``: the non-finite
    steps in a row reach ``hysteresis`` (bool scalars).  A growth is kept only
    when the product is finite, capped at ``max_scale``; a backoff is floored at
    ``min_scale`` (2**-126 for None).  Positive float32 values order as their
    bits, so the bounds apply to the bits.  ``ops``: the tensor operations
    (default :data:`KERAS_OPS`).
    """
    lo, hi = config.bounds
    sbits = ops.view(scale, "int32")
    grown = _product_bits(sbits, config.growth_split, ops)
    grown = ops.where(grown < INF_BITS, ops.minimum(grown, _bits(hi)), sbits)
    backed = ops.maximum(_product_bits(sbits, config.backoff_split, ops), _bits(lo))
    new_bits = ops.where(finite, ops.where(at_interval, grown, sbits), ops.where(back_off, backed, sbits))
    return ops.view(new_bits, "float32")
