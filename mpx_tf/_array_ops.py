"""TensorFlow's table of array operations for the core's kernels (:mod:`mpx.kernels`): :data:`TF_ARRAY_OPS`.

:class:`mpx_tf.LossScaleOptimizer` runs the scaler's transition and its history ring with this
table: TensorFlow's own functions (``tf.bitwise``, ``tf.where``, ``tf.bitcast``...), which run
an eager step faster than ``keras.ops``' wrappers of the same kernels
(:data:`mpx_keras._array_ops.KERAS_ARRAY_OPS`, which the rest of mpx_keras uses on every
backend).  Each operation is traceable inside ``tf.function`` (with and without
``jit_compile``); a Python number takes the other operand's dtype.

The two facts about TensorFlow's arithmetic the kernels read (checked by
``tests/tf/test_kernel_parity.py``, eagerly and inside ``tf.function``):

* ``exact_float32`` is False: TensorFlow's CPU kernels flush float32 subnormals to zero, so
  the kernels form products on the bits;
* ``float64`` is True: ``float32(float64(scale) * factor)`` is the reference's product.

>>> import numpy as np
>>> from mpx.kernels import bits
>>> float(bits.abs_max(TF_ARRAY_OPS, TF_ARRAY_OPS.from_numpy(np.float32([1.0, -3.0]))))
3.0
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np
import tensorflow as tf

from mpx.kernels.array_ops import ArrayOps

__all__ = ["TF_ARRAY_OPS", "TensorFlowOps"]

_DTYPES = {
    "bool": tf.bool,
    "int32": tf.int32,
    "float32": tf.float32,
    "float64": tf.float64,
    "float8_e4m3fn": tf.as_dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": tf.as_dtype(ml_dtypes.float8_e5m2),
    "int8": tf.int8,
}


def _is_number(x: Any) -> bool:
    return isinstance(x, (bool, int, float, np.generic))


def _pair(a: Any, b: Any) -> tuple[Any, Any]:
    """``a`` and ``b`` as tensors of one dtype: a Python number takes the other operand's dtype (int32 or
    float32 when both are numbers), as the kernels mean their constants."""
    if _is_number(a) and _is_number(b):
        kind = tf.float32 if isinstance(a, float) or isinstance(b, float) else tf.int32
        return tf.constant(a, kind), tf.constant(b, kind)
    if _is_number(a):
        b = tf.convert_to_tensor(b)
        return tf.constant(a, b.dtype), b
    if _is_number(b):
        a = tf.convert_to_tensor(a)
        return a, tf.constant(b, a.dtype)
    return a, b


class TensorFlowOps(ArrayOps):
    """TensorFlow's own functions (use :data:`TF_ARRAY_OPS`); results are ``tf.Tensor`` (0-d for scalars)."""

    name = "tensorflow"
    exact_float32 = False
    float64 = True

    def __repr__(self) -> str:
        return "TensorFlowOps()"

    # -- values ------------------------------------------------------------------------
    def int32(self, x: Any) -> Any:
        if _is_number(x) or isinstance(x, (list, tuple)):
            return tf.constant(np.asarray(x, np.int32))
        return tf.cast(x, tf.int32)

    def float32(self, x: Any) -> Any:
        if _is_number(x) or isinstance(x, (list, tuple)):
            with np.errstate(over="ignore"):
                return tf.constant(np.asarray(x, np.float32))
        return tf.cast(x, tf.float32)

    def cast(self, x: Any, dtype: str) -> Any:
        if _is_number(x):  # a constant made in its dtype (tf.cast would make a Python float a float32 first)
            if dtype.startswith("float8"):
                return tf.cast(tf.constant(np.float32(x)), _DTYPES[dtype])
            return tf.constant(x, _DTYPES[dtype])
        return tf.cast(x, _DTYPES[dtype])

    def bitcast(self, x: Any, dtype: str) -> Any:
        return tf.bitcast(x, _DTYPES[dtype])

    def from_numpy(self, x: np.ndarray) -> Any:
        return tf.constant(np.asarray(x))

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.asarray(x.numpy())

    # -- elementwise ---------------------------------------------------------------------
    def where(self, cond: Any, a: Any, b: Any) -> Any:
        return tf.where(cond, *_pair(a, b))

    def add(self, a: Any, b: Any) -> Any:
        return tf.math.add(*_pair(a, b))

    def sub(self, a: Any, b: Any) -> Any:
        return tf.math.subtract(*_pair(a, b))

    def mul(self, a: Any, b: Any) -> Any:
        return tf.math.multiply(*_pair(a, b))

    def div(self, a: Any, b: Any) -> Any:
        return tf.math.truediv(*_pair(a, b))

    def rem(self, a: Any, b: Any) -> Any:
        return tf.math.floormod(*_pair(a, b))

    def shr(self, a: Any, n: Any) -> Any:
        return tf.bitwise.right_shift(*_pair(a, n))  # arithmetic on int32

    def shl(self, a: Any, n: Any) -> Any:
        return tf.bitwise.left_shift(*_pair(a, n))

    def bit_and(self, a: Any, b: Any) -> Any:
        return tf.bitwise.bitwise_and(*_pair(a, b))

    def bit_or(self, a: Any, b: Any) -> Any:
        return tf.bitwise.bitwise_or(*_pair(a, b))

    def bit_xor(self, a: Any, b: Any) -> Any:
        return tf.bitwise.bitwise_xor(*_pair(a, b))

    def lt(self, a: Any, b: Any) -> Any:
        return tf.math.less(*_pair(a, b))

    def le(self, a: Any, b: Any) -> Any:
        return tf.math.less_equal(*_pair(a, b))

    def eq(self, a: Any, b: Any) -> Any:
        return tf.math.equal(*_pair(a, b))

    def ne(self, a: Any, b: Any) -> Any:
        return tf.math.not_equal(*_pair(a, b))

    def logical_and(self, a: Any, b: Any) -> Any:
        return tf.math.logical_and(a, b)

    def logical_or(self, a: Any, b: Any) -> Any:
        return tf.math.logical_or(a, b)

    def logical_not(self, a: Any) -> Any:
        return tf.math.logical_not(a)

    def maximum(self, a: Any, b: Any) -> Any:
        return tf.math.maximum(*_pair(a, b))

    def minimum(self, a: Any, b: Any) -> Any:
        return tf.math.minimum(*_pair(a, b))

    def clip(self, x: Any, lo: float, hi: float) -> Any:
        # two selects: a NaN fails both comparisons and passes through
        x = tf.convert_to_tensor(x)
        lo_t, hi_t = tf.constant(lo, x.dtype), tf.constant(hi, x.dtype)
        return tf.where(x > hi_t, hi_t, tf.where(x < lo_t, lo_t, x))

    # -- reductions and structure ---------------------------------------------------------
    def max(self, x: Any) -> Any:
        return tf.reduce_max(x)

    def stack(self, xs: Sequence[Any]) -> Any:
        return tf.stack(list(xs))

    def max_last(self, x: Any) -> Any:
        return tf.reduce_max(x, axis=-1, keepdims=True)

    def reshape(self, x: Any, shape: tuple[int, ...]) -> Any:
        return tf.reshape(x, shape)

    def transpose(self, x: Any, perm: tuple[int, ...]) -> Any:
        return tf.transpose(x, perm)

    def pad(self, x: Any, shape: tuple[int, ...]) -> Any:
        return tf.pad(x, [(0, n - m) for m, n in zip(x.shape, shape, strict=True)])

    def crop(self, x: Any, shape: tuple[int, ...]) -> Any:
        return x[tuple(slice(0, n) for n in shape)]

    def first(self, x: Any) -> Any:
        return tf.convert_to_tensor(x)[0]

    def push_front(self, x: Any, value: Any) -> Any:
        x = tf.convert_to_tensor(x)
        return tf.concat([tf.reshape(tf.cast(value, x.dtype), [1]), x[:-1]], axis=0)

    def get_row(self, rows: Any, index: Any) -> Any:
        return tf.gather(rows, index)

    def resize(self, x: Any, n: int) -> Any:
        x = tf.convert_to_tensor(x)
        return tf.pad(x[:n], [[0, max(0, n - int(x.shape[0]))]])

    def iota(self, x: Any) -> Any:
        x = tf.convert_to_tensor(x)
        return tf.reshape(tf.range(tf.size(x, out_type=tf.int32), dtype=tf.int32), tf.shape(x))

    def set_row(self, rows: Any, index: Any, row: Any) -> Any:
        return tf.tensor_scatter_nd_update(rows, tf.reshape(index, [1, 1]), tf.reshape(row, [1, -1]))


#: The table mpx_tf's LossScaleOptimizer hands to :mod:`mpx.kernels`.
TF_ARRAY_OPS = TensorFlowOps()
