"""Dynamic loss scaling as an optax ``GradientTransformation``: :func:`with_loss_scaling`.

Its ``update`` takes the gradients of the *scaled* loss, unscales them
(float32), checks that every one is finite and, on a finite step, runs the
inner optimizer; on a non-finite step (with ``skip_nonfinite``, the default for
dynamic and static scaling) it returns ``-0.0`` updates and the inner state
unchanged: Adam's moments and step count stay bit for bit what they were.  The
:class:`~mpx_jax.LossScale` in the state then takes its step of the mpx state
machine.  The skip is a select made where each state value is computed
(:mod:`mpx_jax.skip`), so the compiled step is the unscaled one plus the
finiteness check; how, and what it costs: ``docs/jax_loss_scaling.md``.  On a
non-finite step the inner update does see the infs and NaNs (its NaN updates
and moments are what the select throws away), so ``jax_debug_nans`` reports
them.

Rules for composing it:

* wrap the *whole* optimizer, clipping included:
  ``with_loss_scaling(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr)))``
  clips the unscaled gradients (clipping scaled gradients is the classic bug);
* gradient accumulation: ``with_loss_scaling(tx, config, accumulate=k)``
  (:mod:`mpx_jax.accumulation`).  Scale every micro-batch's loss with
  ``get_loss_scale(opt_state)``: it is constant inside a window, and
  ``growth_interval`` counts optimizer steps.  ``optax.MultiSteps`` as ``tx``
  raises an ``MPXError``: it would check and move the scale per micro-batch.
  ``optax.MultiSteps(with_loss_scaling(tx), k)`` (MultiSteps outside) is *not*
  equivalent in optax 0.2.8: it resets its accumulator by multiplying it with 0,
  so after one non-finite window the accumulator holds NaN and every later
  window is skipped for good (``tests/jax/test_accumulation.py`` records it);
* data parallelism: inside ``pmap``/``shard_map`` the finite flag is reduced
  over every mapped axis bound there and over ``axis_name`` if given, so every
  replica takes the same decision even without ``axis_name``; under ``jit``
  with sharded arrays the finiteness check is already global
  (:mod:`mpx_jax.distributed`);
* Flax NNX: ``nnx.Optimizer(model, with_loss_scaling(tx), wrt=nnx.Param)``;
  :func:`mpx_jax.get_loss_scale` reads the optimizer (:mod:`mpx_jax.opt_state`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from mpx.accumulation import check_accumulation_steps
from mpx.errors import MPXError, UnsupportedTypeError
from mpx.policy import Policy
from mpx.scaling import ScalerConfig
from mpx_jax.accumulation import accumulate_step, widen
from mpx_jax.casting import is_floating_array
from mpx_jax.distributed import combine_finite
from mpx_jax.loss_scale import LossScale, all_finite
from mpx_jax.skip import kept_update

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


def with_loss_scaling(
    tx: optax.GradientTransformation,
    config: ScalerConfig | Policy | Mapping[str, Any] | str | None = None,
    *,
    axis_name: Any = None,
    accumulate: int = 1,
) -> optax.GradientTransformationExtraArgs:
    """Wrap ``tx`` so that it takes gradients of the scaled loss (see the module docs and docs/jax_loss_scaling.md).

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
            ``accumulate``-th call (:mod:`mpx_jax.accumulation`).

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
        zeros = jax.tree_util.tree_map(lambda p: jnp.zeros_like(widen(p)), params)
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
            # selects, not a cond (mpx_jax.skip): -0.0 leaves every parameter bit-identical,
            # and the NaN updates and moments of a non-finite step are never read
            new_updates, new_inner = kept_update(inner, finite, unscaled, inner_state, params, extra)
        else:
            new_updates, new_inner = inner.update(unscaled, inner_state, params, **extra)
        loss_finite = None if loss is None or cfg.max_consecutive_skips is None else all_finite(loss)
        return new_updates, new_inner, loss_scale.update(finite, loss_finite)

    def update_fn(
        updates: Any, state: LossScalingState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, LossScalingState]:
        if not isinstance(state, LossScalingState):
            raise UnsupportedTypeError(
                "state: expected the LossScalingState made by this transformation's init, "
                f"got {type(state).__name__}."
            )
        loss = extra_args.pop("loss", None)  # for stuck detection only (mpx_jax.history); never forwarded
        if k == 1:
            new_updates, new_inner, new_scale = step(
                updates, state.inner_state, state.loss_scale, params, extra_args, loss
            )
            return new_updates, state._replace(inner_state=new_inner, loss_scale=new_scale)
        if state.accumulated is None or state.micro_step is None:
            raise MPXError(
                f"state: made without accumulation, but this transformation accumulates {k} micro-batches; "
                "build the state with this transformation's init."
            )
        new_updates, new_inner, new_scale, new_acc, micro = accumulate_step(
            k,
            updates,
            state.accumulated,
            state.micro_step,
            boundary=lambda acc: step(acc, state.inner_state, state.loss_scale, params, extra_args, loss),
            accumulating=lambda: (state.inner_state, state.loss_scale),
            update_shapes=lambda acc: jax.eval_shape(
                lambda g, s, p, e: inner.update(g, s, p, **e)[0], acc, state.inner_state, params, extra_args
            ),
        )
        return new_updates, LossScalingState(new_inner, new_scale, new_acc, micro)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
