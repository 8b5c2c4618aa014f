"""Gradient accumulation inside :func:`~mpx_jax.with_loss_scaling` (``accumulate=k``).

mpx's one accumulation semantics (:mod:`mpx.accumulation`): the scaled
gradients of a window's ``k`` micro-batches are summed in (at least) float32;
at the window's last micro-step they are checked once, unscaled and divided by
``k`` (the mean), and the inner optimizer runs once, or the whole window is
skipped (parameters and inner state bit-identical, the accumulator restarts at
zero).  The loss scale makes one transition per window.  Updates on the other
micro-steps are ``-0.0``.  The boundary is a ``lax.cond`` on the micro-step
counter, so the inner optimizer and the check run once per window and nothing
retraces per micro-step; under ``shard_map`` both branches are cast to vary
over the same mapped axes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from mpx_jax._compat import pcast_to_varying, varying_axes
from mpx_jax.casting import is_floating_array

__all__ = ["accumulate_step", "widen"]


def widen(x: Any) -> Any:
    """``x`` as an accumulator leaf: floating leaves at least float32, others unchanged."""
    if not is_floating_array(x):
        return x
    x = jnp.asarray(x)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _skipped_updates(shapes: Any) -> Any:
    """An update that leaves every parameter bit-identical: ``-0.0`` (``0`` for non-floating leaves)."""

    def one(sd: Any) -> Any:
        fill = -0.0 if jnp.issubdtype(sd.dtype, jnp.floating) else 0
        return jnp.full(sd.shape, fill, sd.dtype)

    return jax.tree_util.tree_map(one, shapes)


def _vma(x: Any) -> frozenset:
    """The mapped axes ``x`` (a value or an aval) varies over under ``shard_map`` (empty elsewhere)."""
    return varying_axes(x)


def _union_vma(a: Sequence[Any], b: Sequence[Any]) -> list[frozenset]:
    """Per output, the union of two branches' varying axes (from their jaxprs' ``out_avals``)."""
    return [_vma(x) | _vma(y) for x, y in zip(a, b, strict=True)]


def _to_vma(tree: Any, vma: list[frozenset]) -> Any:
    """Each leaf of ``tree`` cast to vary over its entry of ``vma`` (``lax.pcast``; values unchanged)."""
    leaves, treedef = jax.tree.flatten(tree)
    out = []
    for x, want in zip(leaves, vma, strict=True):
        missing = tuple(sorted(want - _vma(x), key=str))
        out.append(pcast_to_varying(x, missing) if missing else x)
    return jax.tree.unflatten(treedef, out)


def accumulate_step(
    k: int,
    grads: Any,
    accumulated: Any,
    micro_step: jax.Array,
    boundary: Callable[[Any], tuple[Any, Any, Any]],
    accumulating: Callable[[], tuple[Any, Any]],
    update_shapes: Callable[[Any], Any],
) -> tuple[Any, Any, Any, Any, jax.Array]:
    """One micro-step of a ``k``-micro-batch window.

    ``grads`` (the micro-batch's scaled gradients) are added to ``accumulated``.
    On the window's last micro-step (``micro_step == k - 1``) ``boundary(sum)``
    runs the optimizer step on the sum (it returns updates, inner state, loss
    scale); otherwise ``accumulating()`` returns the unchanged (inner state,
    loss scale) and the updates are ``-0.0``, shaped as ``update_shapes(sum)``
    (the ``jax.ShapeDtypeStruct`` tree of the inner update's updates).

    Returns:
        ``(updates, inner_state, loss_scale, accumulated, micro_step)`` after this micro-step.
    """
    acc = jax.tree_util.tree_map(
        lambda a, g: a + g.astype(a.dtype) if is_floating_array(a) else g, accumulated, grads
    )
    last = micro_step == k - 1

    def on_boundary() -> tuple[Any, Any, Any]:
        return boundary(acc)

    def in_window() -> tuple[Any, Any, Any]:
        return (_skipped_updates(update_shapes(acc)), *accumulating())

    # one branch per window runs the check and the inner optimizer; the others only add.  Under
    # shard_map both branches must return values varying over the same mapped axes
    vma = _union_vma(jax.make_jaxpr(on_boundary)().out_avals, jax.make_jaxpr(in_window)().out_avals)
    updates, inner_state, loss_scale = jax.lax.cond(
        last, lambda: _to_vma(on_boundary(), vma), lambda: _to_vma(in_window(), vma)
    )
    new_acc = jax.tree_util.tree_map(
        lambda a: jnp.where(last, jnp.zeros_like(a), a) if is_floating_array(a) else a, acc
    )
    micro = jnp.where(last, jnp.int32(0), micro_step + 1).astype(jnp.int32)
    return updates, inner_state, loss_scale, new_acc, micro
