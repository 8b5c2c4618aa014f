"""The array operations the core's kernels run on: one small table per backend, numpy's the reference.

Every number mpx produces in training (a loss-scale update, an FP8 quantization, a scale
from an amax, an amax-history window, a history row) is computed by a kernel in
:mod:`mpx.kernels`, written once against the operations of an :class:`ArrayOps`.  A
backend hands the kernels its own table (torch tensors, ``jax.numpy``, ``keras.ops``,
TensorFlow) and gets back exactly the bits the numpy table gives: the backend maps
framework objects, it never re-derives the arithmetic.

What a table must do, so that every table gives the same bits:

* integers are int32; ``shr`` is an arithmetic right shift; no kernel lets an int32
  overflow;
* ``where``, ``maximum``/``minimum`` on ints, bit casts, ``clip`` and the casts never
  change a bit they are not asked to (a select passes a float32 subnormal or a NaN
  through unchanged);
* ``cast`` to a float format rounds to nearest, ties to even; to ``int32`` it is
  exact on the values the kernels give it (integers in int32's range);
* ``clip(x, lo, hi)`` keeps a NaN a NaN;
* ``div`` of two normal float32 values is the correctly rounded quotient.

Two facts about a backend's float arithmetic choose how a kernel computes, never what:

* :attr:`ArrayOps.exact_float32`: float32 products keep subnormal operands and results
  (numpy, torch).  XLA:CPU and TensorFlow flush them to zero, so there a kernel forms the
  product from the operands' bits (:func:`mpx.kernels.bits.product`); both give the same
  bits, and every backend's parity test runs the numpy table both ways.
* :attr:`ArrayOps.float64`: float64 arrays exist (numpy, torch; JAX only with x64).
  The loss scale's product ``float32(float64(scale) * factor)`` then runs in float64;
  without it in int32 arithmetic (:func:`mpx.kernels.scale.product_bits`), exactly.

>>> o = NUMPY_OPS
>>> int(o.shr(o.int32(-8), 1)), o.bitcast(o.float32(1.0), "int32").item()
(-4, 1065353216)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["DTYPE_NAMES", "NUMPY_OPS", "ArrayOps", "NumpyOps"]

#: The dtype names a table's ``cast``/``bitcast`` take: the kernels' integers, floats and FP8 formats.
DTYPE_NAMES = ("bool", "int32", "float32", "float64", "float8_e4m3fn", "float8_e5m2", "int8")


class ArrayOps:
    """The operations a backend supplies to :mod:`mpx.kernels` (subclass it; see the module docs).

    Arrays are the backend's own (or Python scalars, which every operation accepts where
    an array is expected, as the weakly typed constant of the other operand's dtype).
    Functional: an operation returns a new array, except that :meth:`set_row` may update
    ``rows`` in place and return it (kernels never read the old ``rows`` afterwards).

    Attributes:
        name: the backend's name, for messages.
        exact_float32: float32 multiplication keeps subnormals (no flush to zero).
        float64: float64 arrays are available.
    """

    name: str = "?"
    exact_float32: bool = False
    float64: bool = False

    # -- values ------------------------------------------------------------------------
    def int32(self, x: Any) -> Any:
        """``x`` (a Python int, a bool or an array) as an int32 array."""
        raise NotImplementedError

    def float32(self, x: Any) -> Any:
        """``x`` as a float32 array (a value conversion, rounding to nearest)."""
        raise NotImplementedError

    def cast(self, x: Any, dtype: str) -> Any:
        """``x`` converted to ``dtype`` (one of :data:`DTYPE_NAMES`), rounding to nearest even."""
        raise NotImplementedError

    def bitcast(self, x: Any, dtype: str) -> Any:
        """``x``'s bits read as ``dtype`` (``"int32"`` <-> ``"float32"``)."""
        raise NotImplementedError

    def from_numpy(self, x: np.ndarray) -> Any:
        """A numpy array as the backend's array, bits unchanged (for parity tests)."""
        raise NotImplementedError

    def to_numpy(self, x: Any) -> np.ndarray:
        """The backend's array as numpy, bits unchanged (a host read)."""
        raise NotImplementedError

    # -- elementwise ---------------------------------------------------------------------
    def where(self, cond: Any, a: Any, b: Any) -> Any:
        raise NotImplementedError

    def add(self, a: Any, b: Any) -> Any:
        raise NotImplementedError

    def sub(self, a: Any, b: Any) -> Any:
        raise NotImplementedError

    def mul(self, a: Any, b: Any) -> Any:
        raise NotImplementedError

    def div(self, a: Any, b: Any) -> Any:
        raise NotImplementedError

    def rem(self, a: Any, b: Any) -> Any:
        """Integer remainder for ``a >= 0``, ``b > 0``."""
        raise NotImplementedError

    def shr(self, a: Any, n: Any) -> Any:
        """Arithmetic right shift of int32 ``a``."""
        raise NotImplementedError

    def shl(self, a: Any, n: Any) -> Any:
        raise NotImplementedError

    def bit_and(self, a: Any, b: Any) -> Any:
        raise NotImplementedError

    def bit_or(self, a: Any, b: Any) -> Any:
        raise NotImplementedError

    def bit_xor(self, a: Any, b: Any) -> Any:
        raise NotImplementedError

    def lt(self, a: Any, b: Any) -> Any:
        raise NotImplementedError

    def le(self, a: Any, b: Any) -> Any:
        raise NotImplementedError

    def eq(self, a: Any, b: Any) -> Any:
        raise NotImplementedError

    def ne(self, a: Any, b: Any) -> Any:
        raise NotImplementedError

    def logical_and(self, a: Any, b: Any) -> Any:
        raise NotImplementedError

    def logical_or(self, a: Any, b: Any) -> Any:
        raise NotImplementedError

    def logical_not(self, a: Any) -> Any:
        raise NotImplementedError

    def maximum(self, a: Any, b: Any) -> Any:
        raise NotImplementedError

    def minimum(self, a: Any, b: Any) -> Any:
        raise NotImplementedError

    def clip(self, x: Any, lo: float, hi: float) -> Any:
        """``x`` clipped to ``[lo, hi]`` (Python floats); a NaN stays a NaN."""
        raise NotImplementedError

    # -- reductions and structure ---------------------------------------------------------
    def max(self, x: Any) -> Any:
        """The largest element of ``x`` (a scalar)."""
        raise NotImplementedError

    def stack(self, xs: Sequence[Any]) -> Any:
        """Scalars (or arrays of one shape) stacked along a new first axis."""
        raise NotImplementedError

    # -- shapes (the block-scaled kernels, :mod:`mpx.kernels.blocks`) -------------------------
    def max_last(self, x: Any) -> Any:
        """The largest element along the last axis, kept as an axis of length 1 (int32 ``x``; the block-scaled and
        blockwise int8 kernels' absmax bits)."""
        raise NotImplementedError

    def reshape(self, x: Any, shape: tuple[int, ...]) -> Any:
        """``x`` reshaped (row-major) to ``shape`` (Python ints; one ``-1`` allowed)."""
        raise NotImplementedError

    def transpose(self, x: Any, perm: tuple[int, ...]) -> Any:
        """``x`` with its axes permuted by ``perm``."""
        raise NotImplementedError

    def pad(self, x: Any, shape: tuple[int, ...]) -> Any:
        """``x`` padded with zeros at the end of each axis to ``shape`` (each >= ``x``'s)."""
        raise NotImplementedError

    def crop(self, x: Any, shape: tuple[int, ...]) -> Any:
        """The leading ``shape`` corner of ``x`` (``x[:shape[0], :shape[1], ...]``)."""
        raise NotImplementedError

    def first(self, x: Any) -> Any:
        """``x[0]`` of a 1-D array (a scalar)."""
        raise NotImplementedError

    def push_front(self, x: Any, value: Any) -> Any:
        """The 1-D ``x`` shifted by one: ``[value, x[0], ..., x[-2]]`` (the oldest dropped)."""
        raise NotImplementedError

    def get_row(self, rows: Any, index: Any) -> Any:
        """``rows[index]`` of a 2-D array, ``index`` an int32 scalar array."""
        raise NotImplementedError

    def resize(self, x: Any, n: int) -> Any:
        """The 1-D ``x`` cut to its first ``n`` elements, or padded with zeros to ``n`` (a static int)."""
        raise NotImplementedError

    def iota(self, x: Any) -> Any:
        """Each element's flat (row-major) index in ``x``, as int32 of ``x``'s shape (the counters of
        :func:`mpx.kernels.rounding.random_bits`)."""
        raise NotImplementedError

    def set_row(self, rows: Any, index: Any, row: Any) -> Any:
        """``rows`` with ``rows[index] = row`` (may update ``rows`` in place and return it)."""
        raise NotImplementedError


_NP_DTYPES = {
    "bool": np.dtype(np.bool_),
    "int32": np.dtype(np.int32),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "int8": np.dtype(np.int8),
}


def _weak(x: Any, other: Any) -> np.ndarray:
    """``x`` as an array; a Python number takes ``other``'s dtype (int32/float32 when both are numbers),
    as the weakly typed constants of JAX and torch do."""
    if isinstance(x, (bool, int, float)):
        if isinstance(other, (bool, int, float)):
            kind = np.bool_ if isinstance(x, bool) else np.int32 if isinstance(x, int) else np.float32
            return np.asarray(x, kind)
        return np.asarray(x, np.asarray(other).dtype)
    return np.asarray(x)


class NumpyOps(ArrayOps):
    """numpy (with ml_dtypes): the reference table.  Results are numpy arrays (0-d for scalars).

    ``exact_float32`` and ``float64`` are True for the reference; the parity tests also
    build ``NumpyOps(exact_float32=False, float64=False)``, which runs every kernel the
    way XLA and TensorFlow tables do (the same bits, from integer arithmetic).
    """

    name = "numpy"

    def __init__(self, *, exact_float32: bool = True, float64: bool = True) -> None:
        self.exact_float32 = exact_float32
        self.float64 = float64

    def __repr__(self) -> str:
        return f"NumpyOps(exact_float32={self.exact_float32}, float64={self.float64})"

    def int32(self, x: Any) -> Any:
        return np.asarray(x).astype(np.int32)

    def float32(self, x: Any) -> Any:
        with np.errstate(over="ignore"):
            return np.asarray(x).astype(np.float32)

    def cast(self, x: Any, dtype: str) -> Any:
        with np.errstate(over="ignore", invalid="ignore"):
            return np.asarray(x).astype(_NP_DTYPES[dtype])

    def bitcast(self, x: Any, dtype: str) -> Any:
        return np.asarray(x).view(_NP_DTYPES[dtype])

    def from_numpy(self, x: np.ndarray) -> Any:
        return np.asarray(x)

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.asarray(x)

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        a, b = _weak(a, b), _weak(b, a)
        return np.where(cond, a, b).astype(np.result_type(a, b))

    def add(self, a: Any, b: Any) -> Any:
        with np.errstate(over="ignore", invalid="ignore"):
            return np.add(a, b)

    def sub(self, a: Any, b: Any) -> Any:
        with np.errstate(over="ignore", invalid="ignore"):
            return np.subtract(a, b)

    def mul(self, a: Any, b: Any) -> Any:
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            return np.multiply(a, b)

    def div(self, a: Any, b: Any) -> Any:
        with np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
            return np.divide(a, b)

    def rem(self, a: Any, b: Any) -> Any:
        return np.remainder(a, b)

    def shr(self, a: Any, n: Any) -> Any:
        return np.right_shift(a, n)

    def shl(self, a: Any, n: Any) -> Any:
        return np.left_shift(a, n)

    def bit_and(self, a: Any, b: Any) -> Any:
        return np.bitwise_and(a, b)

    def bit_or(self, a: Any, b: Any) -> Any:
        return np.bitwise_or(a, b)

    def bit_xor(self, a: Any, b: Any) -> Any:
        return np.bitwise_xor(a, b)

    def lt(self, a: Any, b: Any) -> Any:
        return np.less(a, b)

    def le(self, a: Any, b: Any) -> Any:
        return np.less_equal(a, b)

    def eq(self, a: Any, b: Any) -> Any:
        return np.equal(a, b)

    def ne(self, a: Any, b: Any) -> Any:
        return np.not_equal(a, b)

    def logical_and(self, a: Any, b: Any) -> Any:
        return np.logical_and(a, b)

    def logical_or(self, a: Any, b: Any) -> Any:
        return np.logical_or(a, b)

    def logical_not(self, a: Any) -> Any:
        return np.logical_not(a)

    def maximum(self, a: Any, b: Any) -> Any:
        return np.maximum(a, b)

    def minimum(self, a: Any, b: Any) -> Any:
        return np.minimum(a, b)

    def clip(self, x: Any, lo: float, hi: float) -> Any:
        x = np.asarray(x)
        return np.clip(x, x.dtype.type(lo), x.dtype.type(hi))

    def max(self, x: Any) -> Any:
        return np.max(x)

    def stack(self, xs: Sequence[Any]) -> Any:
        return np.stack([np.asarray(x) for x in xs])

    def max_last(self, x: Any) -> Any:
        return np.max(x, axis=-1, keepdims=True)

    def reshape(self, x: Any, shape: tuple[int, ...]) -> Any:
        return np.reshape(x, shape)

    def transpose(self, x: Any, perm: tuple[int, ...]) -> Any:
        return np.transpose(x, perm)

    def pad(self, x: Any, shape: tuple[int, ...]) -> Any:
        x = np.asarray(x)
        return np.pad(x, [(0, n - m) for m, n in zip(x.shape, shape, strict=True)])

    def crop(self, x: Any, shape: tuple[int, ...]) -> Any:
        return np.asarray(x)[tuple(slice(0, n) for n in shape)]

    def first(self, x: Any) -> Any:
        return np.asarray(x)[0]

    def push_front(self, x: Any, value: Any) -> Any:
        x = np.asarray(x)
        return np.concatenate([np.asarray(value, x.dtype).reshape(1), x[:-1]])

    def get_row(self, rows: Any, index: Any) -> Any:
        return np.asarray(rows)[int(index)]

    def resize(self, x: Any, n: int) -> Any:
        x = np.asarray(x)
        return np.concatenate([x[:n], np.zeros(max(0, n - x.shape[0]), x.dtype)])

    def iota(self, x: Any) -> Any:
        x = np.asarray(x)
        return np.arange(x.size, dtype=np.int32).reshape(x.shape)

    def set_row(self, rows: Any, index: Any, row: Any) -> Any:
        out = np.array(rows, copy=True)
        out[int(index)] = row
        return out


#: The reference table: numpy with float64 and IEEE float32 (subnormals kept).
NUMPY_OPS = NumpyOps()
