"""Dynamic loss scaling as an optax ``GradientTransformation``.

:func:`with_loss_scaling` wraps an optimizer: its ``update`` takes the
gradients of the *scaled* loss, unscales them (float32), checks that every
one is finite and, on a finite step, runs the inner optimizer; on a
non-finite step (with ``skip_nonfinite``, the default for dynamic and static
scaling) it returns zero updates and the inner state unchanged: Adam's
moments and step count stay bit for bit what they were.  The
:class:`~mpx_jax.LossScale` in the state then takes its step of the mpx state
machine.

The skip is a select, not a ``jax.lax.cond``, made where the state is
computed: the inner update is traced to a jaxpr and run equation by equation,
and each value that becomes a leaf of the new inner state is replaced, as soon
as it is computed, by ``select(finite, new, old)``; every later use, the
updates included, reads the selected value, and the updates are then
``where(finite, u, -0.0)``.  On a finite step every select passes the new value,
so updates and state are the inner optimizer's values (compiled, to rounding:
XLA fuses the two programs differently); on a skipped step the state is the old
one bit for bit and the updates are thrown away.  XLA fuses the selects
into the optimizer's own passes, and Adam's parameter pass reads the selected
moments, the buffers written anyway.  Selecting only the outputs (the previous
implementation) left that pass reading the unselected new moments, which XLA
recomputed from the gradients and the old moments, and under donation
(``jax.jit(..., donate_argnums=...)``) XLA copied every moment before updating
it in place: 1.14x the unscaled step's bytes, 1.37x and nine more buffer copies
when donated.  Now the compiled step is the unscaled one plus the finiteness
check, with and without donation: for the float16 MLP 1024-4096-1024 with AdamW
(``tests/jax/bench_loss_scaling.py``; ``tests/jax/test_compiled_cost.py``
holds the bounds) 1.084x the bytes, no array copied, no more temporaries, the
donated state aliased in place; +3.5 to +5.3% in CPU time (wall +4 to +8%, on a
loaded machine; docs/jax_loss_scaling.md), against +34 to +49% before.  That check is the floor XLA:CPU leaves: the
select needs the flag before anything is written, so every gradient is read
once more (1.056x here), and XLA:CPU writes ``is_finite`` of each gradient as
a bool per element and reads it back in a ``reduce-window``, fusing no producer
into the reduction (0.028x); sums of ``g * 0``, ``max(abs(g))``, integer maxima
of the bit patterns and matrix-vector products with zeros all cost as much or
more (see ``docs/jax_loss_scaling.md``).
The skipped update is ``-0.0``, not ``+0.0``: ``p + (-0.0)`` is
``p`` bit for bit for every ``p``, while ``-0.0 + 0.0`` is ``+0.0``.  On a
non-finite step the inner update does see the infs and NaNs (its NaN updates
and moments are what the select throws away), so ``jax_debug_nans`` reports
them.

Rules for composing it:

* wrap the *whole* optimizer, clipping included:
  ``with_loss_scaling(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr)))``
  clips the unscaled gradients (clipping scaled gradients is the classic bug);
* gradient accumulation: ``with_loss_scaling(tx, config, accumulate=k)``
  (mpx's one semantics, :mod:`mpx.accumulation`).  Scale every micro-batch's
  loss with ``get_loss_scale(opt_state)``: it is constant inside a window.  The
  scaled gradients are summed in (at least) float32; at the window's last
  micro-step they are checked once, unscaled and divided by ``k`` (the mean),
  and the inner optimizer runs once, or the whole window is skipped
  (parameters and inner state bit-identical, the accumulator restarts at zero);
  the loss scale makes one transition per window, so ``growth_interval`` counts
  optimizer steps.  Updates on the other micro-steps are ``-0.0``.  The
  boundary is a ``lax.cond`` on the micro-step counter, so the inner optimizer
  and the check run once per window and nothing retraces per micro-step.
  ``optax.MultiSteps`` as ``tx`` raises an ``MPXError``: it would check and
  move the scale per micro-batch.  ``optax.MultiSteps(with_loss_scaling(tx), k)``
  (MultiSteps outside) is *not* equivalent in optax 0.2.8: it resets its
  accumulator by multiplying it with 0, so after one non-finite window the
  accumulator holds NaN and every later window is skipped for good
  (``tests/jax/test_accumulation.py`` records it);
* data parallelism: inside ``pmap``/``shard_map`` the finite flag is reduced
  over every mapped axis bound there (``jax.sharding.get_abstract_mesh()
  .manual_axes``) and over ``axis_name`` if given, so every replica takes the
  same decision even without ``axis_name``; under ``jit`` with sharded arrays
  the finiteness check is already global (:mod:`mpx_jax.distributed`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpx.accumulation import check_accumulation_steps
from mpx.errors import MPXError, UnsupportedTypeError
from mpx.scaling import ScalerConfig
from mpx_jax._compat import INLINE_CALL_PRIMITIVES, ClosedJaxpr, Literal, pcast_to_varying, varying_axes
from mpx_jax._jaxpr import bind, eqn_context
from mpx_jax.casting import is_floating_array
from mpx_jax.distributed import combine_finite
from mpx_jax.loss_scale import LossScale, all_finite, select_tree

__all__ = ["LossScalingState", "with_loss_scaling"]


class LossScalingState(NamedTuple):
    """The state of :func:`with_loss_scaling`: the inner optimizer's state and the loss scale.

    With ``accumulate=k > 1`` also ``accumulated`` (the sum of the window's
    scaled gradients so far, at least float32, shaped like the parameters) and
    ``micro_step`` (int32 scalar, 0 to k - 1: micro-steps done in this window);
    both are ``None`` (empty subtrees) with ``accumulate=1``.
    """

    inner_state: Any
    loss_scale: LossScale
    accumulated: Any = None
    micro_step: Any = None


def _skip_where(finite: jax.Array, u: Any) -> Any:
    """``u`` on a finite step, else a zero that adds to any parameter without changing a bit."""
    if not is_floating_array(u):
        return jnp.where(finite, u, jnp.zeros_like(u))
    return jnp.where(finite, u, jnp.asarray(-0.0, u.dtype))


def _keep(finite: jax.Array, new: Any, old: Any) -> Any:
    """``new`` on a finite step, else ``old`` (one state leaf; shapes and dtypes must agree)."""
    return select_tree(finite, {"x": new}, {"x": old})["x"]


#: Call primitives whose body is run inline, so state computed inside them is kept at its definition too.
_INLINE_CALLS = INLINE_CALL_PRIMITIVES


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
        body = eqn.params.get("jaxpr") if eqn.primitive.name in _INLINE_CALLS else None
        with eqn_context(eqn):
            # inlined only where it computes kept state (run as one call elsewhere, as the inner update
            # would run it: an eager jit call compiles its body as a whole)
            if (
                isinstance(body, ClosedJaxpr)
                and not body.effects
                and any(v in keep for v in eqn.outvars)
            ):
                inner = {iv: keep[ov] for iv, ov in zip(body.jaxpr.outvars, eqn.outvars, strict=True)
                         if ov in keep and not isinstance(iv, Literal)}  # fmt: skip
                outs = _run_keeping(body.jaxpr, body.consts, invals, inner, finite)
            else:
                outs = bind(eqn, invals)
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = _keep(finite, x, keep[v]) if v in keep else x
    return [read(v) for v in jaxpr.outvars]


def _kept_update(
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
        raise ValueError(
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
    updates = [_skip_where(finite, u) for u in outs[:n_updates]]
    new_state = [
        x if (not isinstance(v, Literal) and v in keep) else _keep(finite, x, o)
        for v, x, o in zip(state_vars, outs[n_updates:], old, strict=True)
    ]
    return jax.tree_util.tree_unflatten(out_tree, updates + new_state)


def _widen(x: Any) -> Any:
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


def with_loss_scaling(
    tx: optax.GradientTransformation,
    config: ScalerConfig | Mapping[str, Any] | str | None = None,
    *,
    axis_name: Any = None,
    accumulate: int = 1,
) -> optax.GradientTransformationExtraArgs:
    """Wrap ``tx`` so that it takes gradients of the scaled loss (see the module docs).

    Args:
        tx: the inner optax transformation (extra args such as ``value`` are
            forwarded); not an ``optax.MultiSteps`` (use ``accumulate``).
        config: anything :func:`mpx.as_scaler_config` reads: an
            :class:`mpx.ScalerConfig`, its ``to_dict()`` dict, a policy (an
            ``mpx.Policy``, a spec string such as ``"mixed_float16"``, a policy
            dict: dynamic scaling for float16 compute, none otherwise) or None
            (default ``mpx.ScalerConfig()``: dynamic, 2**16, growth every 2000
            finite optimizer steps, floor 1, ceiling 2**24).
        axis_name: a mapped axis name (or tuple of names) of ``pmap``/``shard_map``
            over which the finite flag is reduced, on top of every mapped axis
            bound where ``update`` is traced (:func:`mpx_jax.distributed.mapped_axes`);
            so replicas agree with or without it.
        accumulate: micro-batches per optimizer step (default 1, no
            accumulation): ``update`` is called once per micro-batch and applies
            the inner optimizer to the window's mean gradient on every
            ``accumulate``-th call (see the module docs).

    The returned ``update`` also takes ``loss=`` (the step's loss or scaled
    loss; consumed, not forwarded): with ``config.max_consecutive_skips`` set,
    stuck detection then says whether the loss itself was non-finite
    (:mod:`mpx_jax.history`; with accumulation, the loss of the window's last
    micro-batch).

    Returns:
        A transformation whose state is a :class:`LossScalingState`.

    Raises:
        UnsupportedTypeError: when ``tx`` is not an optax ``GradientTransformation``.
        ScalerConfigError, PolicyError: for a bad ``config`` (as :func:`mpx.as_scaler_config`).
        MPXError: for an ``optax.MultiSteps`` ``tx`` or an ``accumulate`` that is
            not an int >= 1.
    """
    if not isinstance(tx, (optax.GradientTransformation, optax.MultiSteps)):
        raise UnsupportedTypeError(
            f"tx: with_loss_scaling wraps an optax GradientTransformation (optax.adamw(...), optax.chain(...)), "
            f"got {type(tx).__name__}."
        )
    if isinstance(tx, optax.MultiSteps):
        raise MPXError(
            "tx: with_loss_scaling got an optax.MultiSteps, which would check every micro-batch and move "
            "the loss scale once per micro-batch; pass the inner optimizer and accumulate=k instead "
            "(MultiSteps outside, optax.MultiSteps(with_loss_scaling(tx), k), is not equivalent either: "
            "its accumulator turns NaN after one non-finite window)."
        )
    k = check_accumulation_steps(accumulate, "accumulate")
    scale0 = LossScale.create(config)
    cfg = scale0.config
    inner = optax.with_extra_args_support(tx)

    def init_fn(params: Any) -> LossScalingState:
        state = LossScalingState(inner_state=inner.init(params), loss_scale=LossScale.create(cfg))
        if k == 1:
            return state
        zeros = jax.tree_util.tree_map(lambda p: jnp.zeros_like(_widen(p)), params)
        return state._replace(accumulated=zeros, micro_step=jnp.zeros([], jnp.int32))

    def step(
        grads: Any, inner_state: Any, loss_scale: LossScale, params: Any, extra: dict[str, Any], loss: Any
    ) -> tuple[Any, Any, LossScale]:
        """One optimizer step on the (scaled) ``grads``: check, combine over replicas, apply or skip."""
        # With a scale >= 1 unscaling cannot overflow a finite gradient, so the scaled gradients are
        # tested as they come: XLA:CPU runs the check as its own pass over every gradient, and with the
        # unscaling fused into it that pass took ~20% of a float16 MLP step's CPU time, against ~3%
        # (tests/jax/bench_loss_scaling.py; same bytes).  A scale that can drop below 1 tests the
        # unscaled gradients.
        unscaled = loss_scale.unscale(grads)
        if k > 1:
            unscaled = jax.tree_util.tree_map(
                lambda g: g / jnp.asarray(k, g.dtype) if is_floating_array(g) else g, unscaled
            )
        finite = combine_finite(all_finite(unscaled if cfg.scale_can_drop_below_one else grads), axis_name)
        if cfg.skip_nonfinite:
            # selects, not a cond (see the module docs): -0.0 leaves every parameter bit-identical,
            # and the NaN updates and moments of a non-finite step are never read
            new_updates, new_inner = _kept_update(inner, finite, unscaled, inner_state, params, extra)
        else:
            new_updates, new_inner = inner.update(unscaled, inner_state, params, **extra)
        loss_finite = None if loss is None or cfg.max_consecutive_skips is None else all_finite(loss)
        return new_updates, new_inner, loss_scale.update(finite, loss_finite)

    def update_fn(
        updates: Any, state: LossScalingState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, LossScalingState]:
        if not isinstance(state, LossScalingState):
            raise UnsupportedTypeError(
                f"state: expected the LossScalingState made by this transformation's init, got {type(state).__name__}."
            )
        loss = extra_args.pop("loss", None)  # for stuck detection only (mpx_jax.history); never forwarded
        if k == 1:
            new_updates, new_inner, new_scale = step(
                updates, state.inner_state, state.loss_scale, params, extra_args, loss
            )
            return new_updates, state._replace(inner_state=new_inner, loss_scale=new_scale)
        if state.accumulated is None or state.micro_step is None:
            raise ValueError(
                f"state: made without accumulation, but this transformation accumulates {k} micro-batches; "
                "build the state with this transformation's init."
            )
        acc = jax.tree_util.tree_map(
            lambda a, g: a + g.astype(a.dtype) if is_floating_array(a) else g, state.accumulated, updates
        )
        last = state.micro_step == k - 1
        shapes = jax.eval_shape(
            lambda g, s, p, e: inner.update(g, s, p, **e)[0], acc, state.inner_state, params, extra_args
        )

        def boundary() -> tuple[Any, Any, LossScale]:
            return step(acc, state.inner_state, state.loss_scale, params, extra_args, loss)

        def accumulating() -> tuple[Any, Any, LossScale]:
            return _skipped_updates(shapes), state.inner_state, state.loss_scale

        # one branch per window runs the check and the inner optimizer; the others only add.  Under
        # shard_map both branches must return values varying over the same mapped axes
        vma = _union_vma(jax.make_jaxpr(boundary)().out_avals, jax.make_jaxpr(accumulating)().out_avals)
        new_updates, new_inner, new_scale = jax.lax.cond(
            last, lambda: _to_vma(boundary(), vma), lambda: _to_vma(accumulating(), vma)
        )
        new_acc = jax.tree_util.tree_map(
            lambda a: jnp.where(last, jnp.zeros_like(a), a) if is_floating_array(a) else a, acc
        )
        micro = jnp.where(last, jnp.int32(0), state.micro_step + 1).astype(jnp.int32)
        return new_updates, LossScalingState(new_inner, new_scale, new_acc, micro)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
