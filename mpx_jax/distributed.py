"""Replicas: one skip decision across shards, and the gradient all-reduce in the policy's dtype.

Every replica must take the same decision on a step (DESIGN.md, "Replicas and
accumulation").  In JAX there are two ways to run data parallel:

* ``jax.jit`` over arrays sharded with ``NamedSharding`` (no mapped axis): the
  finiteness check reads the *global* array, so every device computes the same
  flag and nothing needs combining.  XLA inserts the gradient all-reduce
  itself, in the dtype of the computation that produced the partial sums; mpx
  cannot choose it (measured on XLA:CPU, jax 0.10.2: the all-reduce is f32 with
  float32 compute, with bfloat16 compute, with the gradients cast to bfloat16
  after ``jax.grad``, and with a ``custom_vjp`` casting the cotangent to
  bfloat16: XLA reduces before any cast it sees).
* ``shard_map``/``pmap`` (per-shard code): each shard tests its own gradients.
  :func:`mapped_axes` reads the mapped (manual) axes bound where it is traced,
  ``jax.sharding.get_abstract_mesh().manual_axes`` (public API; under
  ``pmap`` it holds the pmap axis, named or not; a named ``vmap`` axis is not
  in it), and :func:`combine_finite` reduces the flag over every one of them
  plus any ``axis_name`` given, so a shard never skips alone.  A global skip is
  always correct; a per-shard one makes the parameters diverge silently.
  :func:`all_reduce_gradients` is the explicit ``pmean`` of the gradients in
  ``policy.reduce_dtype``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import mpx
from mpx_jax._compat import manual_axes
from mpx_jax.casting import is_floating_array

__all__ = ["all_reduce_gradients", "combine_finite", "mapped_axes"]


def mapped_axes() -> tuple[Any, ...]:
    """The mapped axis names bound where this is traced: ``shard_map``'s manual axes, ``pmap``'s axis.

    Empty outside them (eager code, plain ``jit`` with or without a mesh,
    ``vmap``).  Read from ``jax.sharding.get_abstract_mesh().manual_axes``.
    """
    return manual_axes()


def _names(axis_name: Any) -> tuple[Any, ...]:
    if axis_name is None:
        return ()
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def combine_finite(finite: jax.Array, axis_name: Any = None) -> jax.Array:
    """``finite`` and-ed over ``axis_name`` (a name or tuple of names, or None) and every :func:`mapped_axes`.

    One ``psum`` of one int32 per call; nothing when no axis is bound.  So under
    ``shard_map``/``pmap`` every shard gets the same flag whether or not
    ``axis_name`` is given.
    """
    names = _names(axis_name)
    names += tuple(a for a in mapped_axes() if a not in names)
    if not names:
        return finite
    bad = lax.psum(jnp.logical_not(finite).astype(jnp.int32), names)
    return bad == 0


def all_reduce_gradients(grads: Any, axis_name: Any = None, policy: Any = None) -> Any:
    """The mean of ``grads`` over ``axis_name``, communicated in ``policy.reduce_dtype``, for shard_map/pmap.

    Each floating leaf is cast to the reduce dtype, ``lax.pmean``-ed, and cast
    back to its own dtype; other leaves are returned unchanged.  Call it inside
    ``shard_map``/``pmap`` where a native step would call ``lax.pmean(grads,
    axis)``.  Under ``jax.jit`` with sharded arrays there is nothing to call:
    XLA inserts the reduction and picks its dtype (see the module docs).

    Args:
        grads: a pytree of gradients (scaled or not).
        axis_name: a mapped axis name or tuple of names; ``None`` (the default)
            reduces over every axis of :func:`mapped_axes`.
        policy: an :class:`mpx.Policy` or anything :func:`mpx.get_policy`
            reads; ``None`` means float32 (no cast for float32 gradients).
            ``reduce=bfloat16`` halves the bytes sent; the sum is then rounded
            to bfloat16 (8 significant bits) before the cast back.

    Raises:
        MPXError: when no axis is given and none is bound (called outside
            shard_map/pmap).
    """
    names = _names(axis_name) or mapped_axes()
    if not names:
        raise mpx.MPXError(
            "axis_name: all_reduce_gradients was called outside shard_map/pmap and no axis was given; "
            "pass the mapped axis name, or under jax.jit with sharded arrays do not call it (XLA reduces)."
        )
    reduce_dtype = jnp.dtype("float32" if policy is None else mpx.get_policy(policy).reduce_dtype)

    def one(g: Any) -> Any:
        if not is_floating_array(g):
            return g
        g = jnp.asarray(g)
        return lax.pmean(g.astype(reduce_dtype), names).astype(g.dtype)

    return jax.tree_util.tree_map(one, grads)
