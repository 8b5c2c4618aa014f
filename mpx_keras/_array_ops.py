"""The ``keras.ops`` table of array operations for the core's kernels (:mod:`mpx.kernels`): :data:`KERAS_ARRAY_OPS`.

Every number mpx_keras produces in training (the loss scale's transition, FP8 quantize,
``compute_scale``, the amax history, ``max(|x|)``, the scaler-history ring) is a kernel of
:mod:`mpx.kernels` run with this table, on whichever backend Keras runs (TensorFlow, JAX,
PyTorch), so it gives the numpy reference's bits.  Each operation is a ``keras.ops`` call
(a select for ``clip``), traceable inside ``tf.function``, ``jax.jit`` and ``torch.compile``;
a Python number is Keras's weakly typed constant, taking the other operand's dtype.

The two facts about the backend's arithmetic the kernels read (checked by
``tests/keras/test_kernel_parity.py`` on each backend):

* ``exact_float32``: True on torch (its float32 products keep subnormals); False on
  TensorFlow (its CPU kernels flush float32 subnormals to zero) and JAX (XLA:CPU does);
* ``float64``: True on torch and TensorFlow, whose float64 product rounded to float32 is the
  reference's; False on JAX, which has no float64 by default (the kernels then use int32
  arithmetic on the scale's bits: the same float32, one compiled graph whatever
  ``jax_enable_x64`` says).

>>> import numpy as np
>>> from mpx.kernels import bits
>>> float(KERAS_ARRAY_OPS.to_numpy(bits.abs_max(KERAS_ARRAY_OPS, KERAS_ARRAY_OPS.from_numpy(np.float32([1, -3])))))
3.0
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import ml_dtypes
import numpy as np

from mpx.errors import UnsupportedTypeError
from mpx.kernels.array_ops import ArrayOps

__all__ = ["KERAS_ARRAY_OPS", "KerasOps"]

ops = keras.ops
_NUMPY_FP8 = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}


def _is_number(x: Any) -> bool:
    return isinstance(x, (bool, int, float, np.generic))


def _dtype(x: Any) -> str:
    return keras.backend.standardize_dtype(x.dtype)


def _pair(a: Any, b: Any) -> tuple[Any, Any]:
    """``a`` and ``b`` for a binary ``keras.ops`` call.  A Python number stays Keras's weakly typed
    constant (it takes an int32 or float32 operand's dtype), except beside a float64 operand: ``keras.ops``
    would make it a float32 first, rounding a factor that multiplies a float64.  Two numbers become int32
    or float32 constants, as the kernels mean them."""
    if _is_number(a) and _is_number(b):
        kind = np.float32 if isinstance(a, float) or isinstance(b, float) else np.int32
        return ops.convert_to_tensor(np.asarray(a, kind)), ops.convert_to_tensor(np.asarray(b, kind))
    if _is_number(a) and _dtype(b) == "float64":
        return ops.convert_to_tensor(a, "float64"), b
    if _is_number(b) and _dtype(a) == "float64":
        return a, ops.convert_to_tensor(b, "float64")
    return a, b


class KerasOps(ArrayOps):
    """``keras.ops`` on the backend Keras runs (use :data:`KERAS_ARRAY_OPS`).

    Args:
        backend: the Keras backend whose arithmetic the flags describe (default: the running one).
    """

    name = "keras"

    def __init__(self, backend: str | None = None) -> None:
        self.backend = keras.config.backend() if backend is None else backend
        self.exact_float32 = self.backend == "torch"
        self.float64 = self.backend in ("torch", "tensorflow")

    def __repr__(self) -> str:
        return f"KerasOps(backend={self.backend!r})"

    # -- values ------------------------------------------------------------------------
    def int32(self, x: Any) -> Any:
        if _is_number(x) or isinstance(x, (list, tuple)):
            return ops.convert_to_tensor(np.asarray(x, np.int32))
        return ops.cast(x, "int32")

    def float32(self, x: Any) -> Any:
        if _is_number(x) or isinstance(x, (list, tuple)):
            with np.errstate(over="ignore"):
                return ops.convert_to_tensor(np.asarray(x, np.float32))
        return ops.cast(x, "float32")

    def cast(self, x: Any, dtype: str) -> Any:
        if _is_number(x):  # a constant made in its dtype (a Python float would become a float32 first)
            if dtype in _NUMPY_FP8:
                return ops.cast(ops.convert_to_tensor(np.float32(x)), dtype)
            return ops.convert_to_tensor(x, dtype)
        return ops.cast(x, dtype)

    def bitcast(self, x: Any, dtype: str) -> Any:
        return ops.view(x, dtype)

    def from_numpy(self, x: np.ndarray) -> Any:
        """``x`` as a tensor of this backend, bits unchanged.

        Raises:
            UnsupportedTypeError: for a dtype the backend would convert (float64 on JAX without x64).
        """
        x = np.asarray(x)
        out = ops.convert_to_tensor(x)
        if _dtype(out) != x.dtype.name:
            raise UnsupportedTypeError(
                f"x: Keras's {self.backend} backend holds {x.dtype} as {_dtype(out)}; pass an array of a dtype "
                "it keeps, bits unchanged"
            )
        return out

    def to_numpy(self, x: Any) -> np.ndarray:
        dtype = _dtype(x)
        if dtype in _NUMPY_FP8 and self.backend == "torch":  # torch hands no FP8 tensor to numpy: its bytes
            return np.asarray(ops.convert_to_numpy(ops.view(x, "uint8"))).view(_NUMPY_FP8[dtype])
        return np.asarray(ops.convert_to_numpy(x))

    # -- elementwise ---------------------------------------------------------------------
    def where(self, cond: Any, a: Any, b: Any) -> Any:
        return ops.where(cond, *_pair(a, b))

    def add(self, a: Any, b: Any) -> Any:
        a, b = _pair(a, b)
        if self.backend == "tensorflow" and not _is_number(b) and tuple(a.shape) != tuple(b.shape):
            # Keras 3's TensorFlow ``ops.add`` runs ``tf.nn.bias_add`` when ``b`` squeezes to a vector as long
            # as ``a``'s axis 1 or last axis, whichever axis that vector sits on: (32, 1, 32) + (32, 1, 1) adds
            # along the last axis.  ``a - (-b)`` is ``a + b`` bit for bit (IEEE; int32 wraps alike).
            return ops.subtract(a, ops.negative(b))
        return ops.add(a, b)

    def sub(self, a: Any, b: Any) -> Any:
        return ops.subtract(*_pair(a, b))

    def mul(self, a: Any, b: Any) -> Any:
        return ops.multiply(*_pair(a, b))

    def div(self, a: Any, b: Any) -> Any:
        return ops.divide(*_pair(a, b))

    def rem(self, a: Any, b: Any) -> Any:
        return ops.mod(*_pair(a, b))

    def shr(self, a: Any, n: Any) -> Any:
        return ops.right_shift(*_pair(a, n))  # arithmetic on int32 on every backend

    def shl(self, a: Any, n: Any) -> Any:
        return ops.left_shift(*_pair(a, n))

    def bit_and(self, a: Any, b: Any) -> Any:
        return ops.bitwise_and(*_pair(a, b))

    def bit_or(self, a: Any, b: Any) -> Any:
        return ops.bitwise_or(*_pair(a, b))

    def bit_xor(self, a: Any, b: Any) -> Any:
        return ops.bitwise_xor(*_pair(a, b))

    def lt(self, a: Any, b: Any) -> Any:
        return ops.less(*_pair(a, b))

    def le(self, a: Any, b: Any) -> Any:
        return ops.less_equal(*_pair(a, b))

    def eq(self, a: Any, b: Any) -> Any:
        return ops.equal(*_pair(a, b))

    def ne(self, a: Any, b: Any) -> Any:
        return ops.not_equal(*_pair(a, b))

    def logical_and(self, a: Any, b: Any) -> Any:
        return ops.logical_and(a, b)

    def logical_or(self, a: Any, b: Any) -> Any:
        return ops.logical_or(a, b)

    def logical_not(self, a: Any) -> Any:
        return ops.logical_not(a)

    def maximum(self, a: Any, b: Any) -> Any:
        return ops.maximum(*_pair(a, b))

    def minimum(self, a: Any, b: Any) -> Any:
        return ops.minimum(*_pair(a, b))

    def clip(self, x: Any, lo: float, hi: float) -> Any:
        # two selects: a NaN fails both comparisons and passes through (not every backend's min/max keeps it)
        return ops.where(ops.greater(x, hi), hi, ops.where(ops.less(x, lo), lo, x))

    # -- reductions and structure ---------------------------------------------------------
    def max(self, x: Any) -> Any:
        return ops.max(x)

    def stack(self, xs: Sequence[Any]) -> Any:
        return ops.stack(list(xs))

    def max_last(self, x: Any) -> Any:
        return ops.max(x, axis=-1, keepdims=True)

    def reshape(self, x: Any, shape: tuple[int, ...]) -> Any:
        return ops.reshape(x, shape)

    def transpose(self, x: Any, perm: tuple[int, ...]) -> Any:
        return ops.transpose(x, perm)

    def pad(self, x: Any, shape: tuple[int, ...]) -> Any:
        return ops.pad(x, [(0, n - m) for m, n in zip(x.shape, shape, strict=True)])

    def crop(self, x: Any, shape: tuple[int, ...]) -> Any:
        return x[tuple(slice(0, n) for n in shape)]

    def first(self, x: Any) -> Any:
        return x[0]

    def push_front(self, x: Any, value: Any) -> Any:
        head = ops.reshape(ops.cast(value, _dtype(x)), (1,))
        return ops.concatenate([head, x[:-1]], axis=0)

    def get_row(self, rows: Any, index: Any) -> Any:
        start = [ops.cast(index, "int32"), ops.zeros((), "int32")]
        return ops.slice(rows, start, (1, rows.shape[1]))[0]

    def resize(self, x: Any, n: int) -> Any:
        return ops.pad(x[:n], [[0, max(0, n - int(x.shape[0]))]])

    def iota(self, x: Any) -> Any:
        size = int(np.prod(x.shape))  # static shapes (a kernel's tensors are the optimizer's variables)
        return ops.reshape(ops.arange(size, dtype="int32"), x.shape)

    def set_row(self, rows: Any, index: Any, row: Any) -> Any:
        start = [ops.cast(index, "int32"), ops.zeros((), "int32")]
        return ops.slice_update(rows, start, ops.reshape(ops.cast(row, _dtype(rows)), (1, rows.shape[1])))


#: The table every mpx_keras module hands to :mod:`mpx.kernels` (the running backend's flags).
KERAS_ARRAY_OPS = KerasOps()
