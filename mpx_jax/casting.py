"""Cast the floating leaves of a pytree to a policy's param, compute or output dtype.

Only floating arrays change: jax arrays (and tracers, so the functions work
under ``jit``), numpy arrays and numpy scalars of a floating dtype (bfloat16
included).  Integer, boolean and complex arrays, PRNG keys (typed or raw
``uint32``), ``float0`` tangents and every non-array leaf (Python numbers,
strings, None) are returned as they are.  numpy inputs stay numpy.

>>> import numpy as np, jax.numpy as jnp
>>> tree = {"w": jnp.ones(2), "step": jnp.int32(3), "x": np.zeros(2, np.float64), "lr": 0.1}
>>> out = cast_to_compute("mixed_bfloat16", tree)
>>> out["w"].dtype, out["step"].dtype, out["x"].dtype, type(out["x"]).__name__, out["lr"]
(dtype(bfloat16), dtype('int32'), dtype(bfloat16), 'ndarray', 0.1)
"""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

import mpx
from mpx.policy import PolicySpec

__all__ = ["cast_to_compute", "cast_to_output", "cast_to_param", "cast_tree", "is_floating_array"]

T = TypeVar("T")


def is_floating_array(x: Any) -> bool:
    """Whether ``x`` is a jax or numpy array (or numpy scalar) of a real floating dtype."""
    if not isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return False
    dtype = x.dtype
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return False
    return bool(jnp.issubdtype(dtype, jnp.floating))


def cast_tree(tree: T, dtype: Any) -> T:
    """``tree`` with every floating array leaf cast to ``dtype``.

    ``dtype``: an mpx dtype name or alias, or a dtype object: ``jnp.bfloat16`` (a jax.numpy
    scalar type), ``jnp.dtype(...)``, ``ml_dtypes.bfloat16``, a numpy dtype or scalar type.
    """
    target = mpx.numpy_dtype(mpx.canonical_dtype(dtype))

    def cast(x: Any) -> Any:
        if not is_floating_array(x) or x.dtype == target:
            return x
        return x.astype(target)  # numpy stays numpy, jax stays jax

    return jax.tree_util.tree_map(cast, tree)


def cast_to_param(policy: PolicySpec, tree: T) -> T:
    """Cast the floating leaves of ``tree`` to ``policy.param_dtype``."""
    return cast_tree(tree, mpx.get_policy(policy).param_dtype)


def cast_to_compute(policy: PolicySpec, tree: T) -> T:
    """Cast the floating leaves of ``tree`` to ``policy.compute_dtype``."""
    return cast_tree(tree, mpx.get_policy(policy).compute_dtype)


def cast_to_output(policy: PolicySpec, tree: T) -> T:
    """Cast the floating leaves of ``tree`` to ``policy.output_dtype``."""
    return cast_tree(tree, mpx.get_policy(policy).output_dtype)
