"""JAX's table of array operations for the core's kernels (:mod:`mpx.kernels`): :data:`JAX_OPS`.

Every number mpx_jax produces in training (the loss scale's transition, FP8 quantize,
``compute_scale``, the amax history, ``max(|x|)``, the scaler-history ring) is a kernel of
:mod:`mpx.kernels` run with this table, so it gives the numpy reference's bits.  Each
operation is one ``jax.numpy``/``lax`` call: traceable under ``jit``, ``vmap``, ``grad``
(where a gradient exists), ``scan`` and ``shard_map``; a Python number is passed through
as JAX's weakly typed constant, so it takes the other operand's dtype.

The two facts about JAX's arithmetic the kernels read:

* ``exact_float32`` is False: XLA:CPU flushes float32 subnormals to zero in arithmetic and
  comparisons, so the kernels form products on the bits;
* ``float64`` is False, also when a user enables ``jax_enable_x64``: the int32 evaluation of
  the scale's product gives the same float32 (the parity tests run it against numpy's
  float64 product), keeps one compiled graph whatever that global flag says, and needs no
  float64 arithmetic, which TPUs emulate and most GPUs run slowly.

>>> import numpy as np
>>> from mpx.kernels import bits
>>> float(bits.abs_max(JAX_OPS, JAX_OPS.from_numpy(np.float32([1.0, -3.0]))))
3.0
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpx.errors import UnsupportedTypeError
from mpx.kernels.array_ops import ArrayOps

__all__ = ["JAX_OPS", "JaxOps"]

_DTYPES = {
    "bool": jnp.bool_,
    "int32": jnp.int32,
    "float32": jnp.float32,
    "float64": jnp.float64,
    "float8_e4m3fn": jnp.float8_e4m3fn,
    "float8_e5m2": jnp.float8_e5m2,
    "int8": jnp.int8,
}


def _array(x: Any) -> Any:
    """A list or tuple (a host state's amax history) as an array; anything else as it is."""
    return jnp.asarray(x) if isinstance(x, (list, tuple)) else x


class JaxOps(ArrayOps):
    """``jax.numpy`` and ``lax``: the table mpx_jax hands the kernels (use :data:`JAX_OPS`).

    Results are JAX arrays (0-d for scalars), traced under a transformation.
    """

    name = "jax"
    exact_float32 = False
    float64 = False

    def __repr__(self) -> str:
        return "JaxOps()"

    # -- values ------------------------------------------------------------------------
    def int32(self, x: Any) -> Any:
        return jnp.asarray(_array(x), jnp.int32)

    def float32(self, x: Any) -> Any:
        return jnp.asarray(_array(x), jnp.float32)

    def cast(self, x: Any, dtype: str) -> Any:
        return jnp.asarray(_array(x)).astype(_DTYPES[dtype])

    def bitcast(self, x: Any, dtype: str) -> Any:
        return lax.bitcast_convert_type(jnp.asarray(x), _DTYPES[dtype])

    def from_numpy(self, x: np.ndarray) -> Any:
        """``x`` on the default device, bits unchanged.

        Raises:
            UnsupportedTypeError: for a dtype JAX would convert (float64 or int64 without ``jax_enable_x64``).
        """
        x = np.asarray(x)
        out = jnp.asarray(x)
        if out.dtype != x.dtype:
            raise UnsupportedTypeError(
                f"x: JAX holds {x.dtype} as {out.dtype} here (jax_enable_x64 is off); pass an array of "
                "a dtype JAX keeps, bits unchanged"
            )
        return out

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.asarray(jax.device_get(x))

    # -- elementwise ---------------------------------------------------------------------
    def where(self, cond: Any, a: Any, b: Any) -> Any:
        return jnp.where(cond, _array(a), _array(b))

    def add(self, a: Any, b: Any) -> Any:
        return jnp.add(a, b)

    def sub(self, a: Any, b: Any) -> Any:
        return jnp.subtract(a, b)

    def mul(self, a: Any, b: Any) -> Any:
        return jnp.multiply(a, b)

    def div(self, a: Any, b: Any) -> Any:
        return jnp.divide(a, b)

    def rem(self, a: Any, b: Any) -> Any:
        # a >= 0, b > 0: lax.rem is the remainder (jnp.remainder adds a sign fix-up)
        a = jnp.asarray(a)
        return lax.rem(a, jnp.asarray(b, a.dtype))

    def shr(self, a: Any, n: Any) -> Any:
        return jnp.right_shift(a, n)  # arithmetic on int32

    def shl(self, a: Any, n: Any) -> Any:
        return jnp.left_shift(a, n)

    def bit_and(self, a: Any, b: Any) -> Any:
        return jnp.bitwise_and(a, b)

    def bit_or(self, a: Any, b: Any) -> Any:
        return jnp.bitwise_or(a, b)

    def bit_xor(self, a: Any, b: Any) -> Any:
        return jnp.bitwise_xor(a, b)

    def lt(self, a: Any, b: Any) -> Any:
        return jnp.less(a, b)

    def le(self, a: Any, b: Any) -> Any:
        return jnp.less_equal(a, b)

    def eq(self, a: Any, b: Any) -> Any:
        return jnp.equal(a, b)

    def ne(self, a: Any, b: Any) -> Any:
        return jnp.not_equal(a, b)

    def logical_and(self, a: Any, b: Any) -> Any:
        return jnp.logical_and(a, b)

    def logical_or(self, a: Any, b: Any) -> Any:
        return jnp.logical_or(a, b)

    def logical_not(self, a: Any) -> Any:
        return jnp.logical_not(a)

    def maximum(self, a: Any, b: Any) -> Any:
        return jnp.maximum(a, b)

    def minimum(self, a: Any, b: Any) -> Any:
        return jnp.minimum(a, b)

    def clip(self, x: Any, lo: float, hi: float) -> Any:
        return jnp.clip(x, lo, hi)  # XLA's max and min propagate a NaN

    # -- reductions and structure ---------------------------------------------------------
    def max(self, x: Any) -> Any:
        return jnp.max(x)

    def stack(self, xs: Sequence[Any]) -> Any:
        return jnp.stack(list(xs))

    def max_last(self, x: Any) -> Any:
        return jnp.max(x, axis=-1, keepdims=True)

    def reshape(self, x: Any, shape: tuple[int, ...]) -> Any:
        return jnp.reshape(x, shape)

    def transpose(self, x: Any, perm: tuple[int, ...]) -> Any:
        return jnp.transpose(x, perm)

    def pad(self, x: Any, shape: tuple[int, ...]) -> Any:
        return jnp.pad(x, [(0, n - m) for m, n in zip(x.shape, shape, strict=True)])

    def crop(self, x: Any, shape: tuple[int, ...]) -> Any:
        return x[tuple(slice(0, n) for n in shape)]

    def first(self, x: Any) -> Any:
        return _array(x)[0]

    def push_front(self, x: Any, value: Any) -> Any:
        x = _array(x)
        return jnp.concatenate([jnp.reshape(jnp.asarray(value, x.dtype), (1,)), x[:-1]])

    def get_row(self, rows: Any, index: Any) -> Any:
        return lax.dynamic_index_in_dim(rows, index, axis=0, keepdims=False)

    def resize(self, x: Any, n: int) -> Any:
        return jnp.pad(x[:n], (0, max(0, n - x.shape[0])))

    def iota(self, x: Any) -> Any:
        x = jnp.asarray(x)
        return jnp.arange(x.size, dtype=jnp.int32).reshape(x.shape)

    def set_row(self, rows: Any, index: Any, row: Any) -> Any:
        # a dynamic_update_slice: in place when the caller donates the buffer
        return lax.dynamic_update_index_in_dim(rows, jnp.asarray(row, rows.dtype), index, axis=0)


#: The table every mpx_jax module hands to :mod:`mpx.kernels`.
JAX_OPS = JaxOps()
