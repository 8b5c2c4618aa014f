"""Dynamic loss scaling as an optax ``GradientTransformation``.

:func:`with_loss_scaling` wraps an optimizer: its ``update`` takes the
gradients of the *scaled* loss, unscales them (float32), checks that every
one is finite and, on a finite step, runs the inner optimizer; on a
non-finite step (with ``skip_nonfinite``, the default for dynamic and static
scaling) it returns zero updates and the inner state unchanged: Adam's
moments and step count stay bit for bit what they were.  The
:class:`~mpx_jax.LossScale` in the state then takes its step of the mpx state
machine.

The skip is a select, not a ``jax.lax.cond``: the inner update always runs
on the unscaled gradients, then every update leaf is ``where(finite, u, -0.0)``
and the inner state ``select_tree(finite, new, old)``.  XLA fuses the selects
into the optimizer's own elementwise pass, where a ``cond`` materializes the
updates and costs a whole extra pass over the parameters.  What it costs on
XLA:CPU, for the float16 MLP 1024-4096-1024 with AdamW
(``tests/jax/bench_loss_scaling.py``, which also prints the compiled step's
bytes): the compiled step accesses 1.14x the unscaled step's bytes, 1.08x of it
the finiteness check, which must read every gradient once more before anything
may be written (that pass is the floor of any skip); the rest is XLA
recomputing the new moments inside the parameter pass.  In time that is +3 to
+7% (the check alone +3 to +5%), against +27-39% for a ``cond``.  When the
step *donates* the optimizer state (``jax.jit(..., donate_argnums=...)``), XLA
copies every moment before updating it in place, because the parameter pass
still reads the old moments: 1.37x the bytes and +24% in time (``--donate``);
a ``cond`` costs about as much there, and no formulation tried (barriers,
bitwise selects, recomputing the state after the update) avoids the copies.
The skipped update is ``-0.0``, not ``+0.0``: ``p + (-0.0)`` is
``p`` bit for bit for every ``p``, while ``-0.0 + 0.0`` is ``+0.0``.  On a
non-finite step the inner update does see the infs and NaNs (its NaN updates
and moments are what the select throws away), so ``jax_debug_nans`` reports
them.

Rules for composing it:

* wrap the *whole* optimizer, clipping included:
  ``with_loss_scaling(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr)))``
  clips the unscaled gradients (clipping scaled gradients is the classic bug);
* gradient accumulation: ``with_loss_scaling(optax.MultiSteps(tx, k))``. Scale
  each microbatch's loss with ``get_loss_scale(opt_state)`` as it is at that
  microbatch.  Every microbatch's gradients are unscaled and checked on their
  own before ``MultiSteps`` accumulates them, so the accumulator only ever
  holds unscaled, finite float32 gradients: a non-finite microbatch is
  dropped (``MultiSteps``' state, its accumulator and its counter stay as they
  were, and the next microbatch takes its place) and the scale backs off at
  once, mid-window, which is harmless because what is summed is already
  unscaled.  The loss scale therefore counts microbatches (``growth_interval``
  is in microbatches).  Do not nest the other way round,
  ``MultiSteps(with_loss_scaling(tx), k)``: optax 0.2.8 resets its accumulator
  by multiplying it with 0, so one inf becomes NaN and every later window is
  skipped for good;
* data parallelism: inside ``pmap``/``shard_map`` pass ``axis_name`` so every
  replica reduces its finite flag with the others and all take the same
  decision; under ``jit`` with sharded arrays the finiteness check is already
  global and no axis is needed.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from mpx.scaling import ScalerConfig
from mpx_jax.casting import is_floating_array
from mpx_jax.loss_scale import LossScale, all_finite, select_tree

__all__ = ["LossScalingState", "get_loss_scale", "with_loss_scaling"]


class LossScalingState(NamedTuple):
    """The state of :func:`with_loss_scaling`: the inner optimizer's state and the loss scale."""

    inner_state: Any
    loss_scale: LossScale


def _skip_where(finite: jax.Array, u: Any) -> Any:
    """``u`` on a finite step, else a zero that adds to any parameter without changing a bit."""
    if not is_floating_array(u):
        return jnp.where(finite, u, jnp.zeros_like(u))
    return jnp.where(finite, u, jnp.asarray(-0.0, u.dtype))


def with_loss_scaling(
    tx: optax.GradientTransformation,
    config: ScalerConfig | None = None,
    *,
    axis_name: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """Wrap ``tx`` so that it takes gradients of the scaled loss (see the module docs).

    Args:
        tx: the inner optax transformation (extra args such as ``value`` are
            forwarded); an ``optax.MultiSteps`` accumulates unscaled gradients.
        config: the :class:`mpx.ScalerConfig` (default ``mpx.ScalerConfig()``:
            dynamic, 2**16, growth every 2000 finite steps, floor 1, ceiling 2**24).
        axis_name: a mapped axis name (or tuple of names) of ``pmap``/``shard_map``
            over which the finite flag is reduced, so all replicas agree.

    Returns:
        A transformation whose state is a :class:`LossScalingState`.

    """
    if isinstance(tx, optax.MultiSteps):
        tx = tx.gradient_transformation()
    scale0 = LossScale.create(config)
    cfg = scale0.config
    inner = optax.with_extra_args_support(tx)

    def init_fn(params: Any) -> LossScalingState:
        return LossScalingState(inner_state=inner.init(params), loss_scale=LossScale.create(cfg))

    def update_fn(
        updates: Any, state: LossScalingState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, LossScalingState]:
        if not isinstance(state, LossScalingState):
            raise ValueError(
                f"state: expected the LossScalingState made by this transformation's init, got {type(state).__name__}."
            )
        loss_scale = state.loss_scale
        # XLA fuses the unscaling into the check's reduction and into the optimizer's elementwise update
        finite = all_finite(loss_scale.unscale(updates))
        if axis_name is not None:
            bad = jax.lax.psum(jnp.logical_not(finite).astype(jnp.int32), axis_name)
            finite = bad == 0

        new_updates, new_inner = inner.update(
            loss_scale.unscale(updates), state.inner_state, params, **extra_args
        )
        if cfg.skip_nonfinite:
            # a select, not a cond (see the module docs): -0.0 leaves every parameter bit-identical,
            # and the NaN updates and moments of a non-finite step are never read
            new_updates = jax.tree_util.tree_map(lambda u: _skip_where(finite, u), new_updates)
            new_inner = select_tree(finite, new_inner, state.inner_state)
        return new_updates, LossScalingState(inner_state=new_inner, loss_scale=loss_scale.update(finite))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def get_loss_scale(opt_state: Any) -> LossScale:
    """The :class:`~mpx_jax.LossScale` inside ``opt_state`` (at any depth: chain, MultiSteps...).

    Multiply the loss with it: ``get_loss_scale(opt_state).scale(loss)``.

    Raises:
        ValueError: when ``opt_state`` holds no loss scale, or more than one.
    """
    found = [
        leaf
        for leaf in jax.tree_util.tree_leaves(opt_state, is_leaf=lambda x: isinstance(x, LossScale))
        if isinstance(leaf, LossScale)
    ]
    if not found:
        raise ValueError(
            "opt_state: holds no LossScale; build the optimizer with mpx_jax.with_loss_scaling(tx)."
        )
    if len(found) > 1:
        raise ValueError(f"opt_state: holds {len(found)} LossScale objects; expected exactly one.")
    return found[0]
