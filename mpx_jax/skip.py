"""The skip of :func:`~mpx_jax.with_loss_scaling`: selects made where the optimizer state is computed.

:func:`kept_update` runs the inner optax update with its new state kept (the
old state, bit for bit, on a skipped step) *at the equation that computes each
state leaf*: the update is traced to a jaxpr and run equation by equation, and
each value that becomes a leaf of the new state is replaced, as soon as it is
computed, by ``select(finite, new, old)``, so every later use (the updates
included) reads the selected value.  The updates are then ``where(finite, u,
-0.0)``: ``p + (-0.0)`` is ``p`` bit for bit for every ``p``, while ``-0.0 +
0.0`` is ``+0.0``.  Why it is built so, and what it costs compiled:
``docs/jax_loss_scaling.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpx.errors import MPXError
from mpx_jax._compat import INLINE_CALL_PRIMITIVES, ClosedJaxpr, Literal, param
from mpx_jax._jaxpr import bind, eqn_context
from mpx_jax.casting import is_floating_array
from mpx_jax.loss_scale import select_tree

__all__ = ["kept_update", "skip_where"]


def skip_where(finite: jax.Array, u: Any) -> Any:
    """``u`` on a finite step, else a zero that adds to any parameter without changing a bit."""
    if not is_floating_array(u):
        return jnp.where(finite, u, jnp.zeros_like(u))
    return jnp.where(finite, u, jnp.asarray(-0.0, u.dtype))


def _keep(finite: jax.Array, new: Any, old: Any) -> Any:
    """``new`` on a finite step, else ``old`` (one state leaf; shapes and dtypes must agree)."""
    return select_tree(finite, {"x": new}, {"x": old})["x"]


def _run_keeping(
    jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], keep: dict[Any, Any], finite: jax.Array
) -> list[Any]:
    """Evaluate ``jaxpr``; each variable in ``keep`` becomes ``select(finite, value, keep[var])`` where it
    is defined, so every later use (the updates included) reads the selected value."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        body = param(eqn, "jaxpr") if eqn.primitive.name in INLINE_CALL_PRIMITIVES else None
        with eqn_context(eqn):
            # inlined only where it computes kept state (run as one call elsewhere, as the inner update
            # would run it: an eager jit call compiles its body as a whole)
            if isinstance(body, ClosedJaxpr) and not body.effects and any(v in keep for v in eqn.outvars):
                inner = {iv: keep[ov] for iv, ov in zip(body.jaxpr.outvars, eqn.outvars, strict=True)
                         if ov in keep and not isinstance(iv, Literal)}  # fmt: skip
                outs = _run_keeping(body.jaxpr, body.consts, invals, inner, finite)
            else:
                outs = bind(eqn, invals)
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = _keep(finite, x, keep[v]) if v in keep else x
    return [read(v) for v in jaxpr.outvars]


def kept_update(
    inner: Any, finite: jax.Array, grads: Any, state: Any, params: Any, extra: dict[str, Any]
) -> Any:
    """``inner.update(grads, state, params, **extra)`` with its new state kept (old on a skipped step)
    *where each state value is computed*, and its updates ``-0.0`` on a skipped step.

    The updates then read the selected state, the buffer that is written anyway: Adam's parameter pass
    reads the new moments (as an unscaled step does) instead of recomputing them from the gradients and
    the old moments, and under donation nothing reads the old moments after they are overwritten, so
    XLA updates them in place with no copies.  On a finite step every selected value is the new one, so
    the updates are the inner optimizer's; on a skipped step they are thrown away.
    """
    args = (grads, state, params, extra)
    leaves, treedef = jax.tree_util.tree_flatten(args)
    traced = [isinstance(x, (jax.Array, np.ndarray, np.generic)) for x in leaves]
    dynamic = [x for x, t in zip(leaves, traced, strict=True) if t]

    def flat_update(*dyn: Any) -> Any:
        it = iter(dyn)
        full = [next(it) if t else x for x, t in zip(leaves, traced, strict=True)]
        g, s, p, e = jax.tree_util.tree_unflatten(treedef, full)
        return inner.update(g, s, p, **e)

    closed, out_shape = jax.make_jaxpr(flat_update, return_shape=True)(*dynamic)
    out_tree = jax.tree_util.tree_structure(out_shape)
    n_updates = len(jax.tree_util.tree_leaves(out_shape[0]))
    old = jax.tree_util.tree_leaves(state)
    state_vars = closed.jaxpr.outvars[n_updates:]
    new_state_tree = jax.tree_util.tree_structure(out_shape[1])
    if new_state_tree != jax.tree_util.tree_structure(state):
        raise MPXError(
            f"with_loss_scaling: the inner update returned a state of structure {new_state_tree}, "
            f"not that of the state it was given, {jax.tree_util.tree_structure(state)}."
        )
    defined = {v for eqn in closed.jaxpr.eqns for v in eqn.outvars}
    owners: dict[Any, list[int]] = {}
    for i, v in enumerate(state_vars):
        if not isinstance(v, Literal) and v in defined:
            owners.setdefault(v, []).append(i)
    # a value returned as two state leaves has two old values: it is selected at the output only
    keep = {v: old[ix[0]] for v, ix in owners.items() if len(ix) == 1}
    outs = _run_keeping(closed.jaxpr, closed.consts, dynamic, keep, finite)
    updates = [skip_where(finite, u) for u in outs[:n_updates]]
    new_state = [
        x if (not isinstance(v, Literal) and v in keep) else _keep(finite, x, o)
        for v, x, o in zip(state_vars, outs[n_updates:], old, strict=True)
    ]
    return jax.tree_util.tree_unflatten(out_tree, updates + new_state)
