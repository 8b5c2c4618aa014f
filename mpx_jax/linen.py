"""Flax linen training with mpx loss scaling: a ``TrainState`` that skips whole, and Flax's ``DynamicScale`` read.

Flax's ``TrainState.apply_gradients`` adds 1 to ``step`` and replaces every
field you pass (``batch_stats=...``) on every call.  With
``mpx_jax.with_loss_scaling(tx)`` a step with non-finite gradients already
leaves ``params`` and ``opt_state`` bit-identical, but ``step`` still counts it
and the batch statistics of the overflowing forward pass are kept.  Flax's own
``DynamicScale`` (its ImageNet example) does the same to ``batch_stats``.

:class:`TrainState` is Flax's ``TrainState`` whose ``apply_gradients`` takes
``step``, ``params``, ``opt_state`` *and every field passed as a keyword*
(``batch_stats``) from the step only when it was applied; on a skipped step
all of them stay what they were, bit for bit.  Add your fields as Flax's
examples do::

    class State(mpx_jax.linen.TrainState):
        batch_stats: Any

    state = State.create(apply_fn=model.apply, params=variables["params"],
                         tx=mpx_jax.with_loss_scaling(optax.adamw(1e-3), "mixed_float16"),
                         batch_stats=variables["batch_stats"])
    ...
    state = state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])

:func:`from_dynamic_scale` moves a run from Flax's
``flax.training.dynamic_scale.DynamicScale`` to mpx without losing its scale.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.training import train_state
from flax.training.dynamic_scale import DynamicScale

import mpx
from mpx_jax.flax import step_applied
from mpx_jax.loss_scale import LossScale, select_tree
from mpx_jax.opt_state import get_loss_scale

__all__ = ["TrainState", "from_dynamic_scale"]

#: The key Flax's fp8 layers use for values that overwrite the parameters with their "gradients".
_OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"


class TrainState(train_state.TrainState):
    """Flax's ``TrainState`` for ``tx = mpx_jax.with_loss_scaling(...)``: a skipped step changes nothing.

    ``step`` counts applied optimizer steps (with ``accumulate=k``, applied
    windows), so a schedule or a checkpoint number driven by it matches what
    was applied.  ``loss_scale`` is the :class:`mpx_jax.LossScale` to multiply
    the loss with.  Works under ``jit`` (a select, no host sync, no retrace).
    """

    @classmethod
    def create(cls, *, apply_fn: Any, params: Any, tx: Any, **kwargs: Any) -> TrainState:
        """Flax's ``TrainState.create`` (``opt_state = tx.init(params)``), with ``step`` an int32 array 0.

        Flax's ``step`` starts as the Python int 0, a weakly typed int32 under
        ``jit``, and an orbax restore brings it back strongly typed, so the first
        step after a resume compiles again; a strong int32 from the start does not.

        Raises:
            mpx.UnsupportedTypeError: when ``tx``'s state holds no mpx loss scale.
        """
        state = super().create(apply_fn=apply_fn, params=params, tx=tx, **kwargs)
        state = state.replace(step=jnp.zeros((), jnp.int32))
        try:
            get_loss_scale(state.opt_state)
        except mpx.UnsupportedTypeError:
            raise mpx.UnsupportedTypeError(
                "tx: mpx_jax.linen.TrainState needs an optimizer built with mpx_jax.with_loss_scaling(tx); "
                "for a plain optax optimizer use flax.training.train_state.TrainState."
            ) from None
        return state

    @property
    def loss_scale(self) -> LossScale:
        """The current :class:`mpx_jax.LossScale`: ``state.loss_scale.scale(loss)`` in the loss function."""
        return get_loss_scale(self.opt_state)

    def apply_gradients(self, *, grads: Any, **kwargs: Any) -> TrainState:
        """Apply the gradients of the *scaled* loss; ``kwargs`` replace fields (``batch_stats=...``).

        On an applied step this is Flax's ``apply_gradients``.  On a skipped
        step (non-finite gradients; with ``accumulate=k`` every micro-step but
        a window's last too) ``step``, ``params`` and every field in ``kwargs``
        keep their old values bit for bit, and ``opt_state`` only records the
        loss scale's transition.  Each field in ``kwargs`` must have the shapes
        and dtypes of the field it replaces; pass fields that must change on
        every call (an RNG key) with ``.replace(...)`` instead.
        """
        new = super().apply_gradients(grads=grads, **kwargs)
        applied = step_applied(self.opt_state, new.opt_state)
        kept = {name: select_tree(applied, getattr(new, name), getattr(self, name)) for name in kwargs}
        if isinstance(grads, dict) and _OVERWRITE_WITH_GRADIENT in grads:  # fp8 state moves with the step
            kept["params"] = select_tree(applied, new.params, self.params)
        return new.replace(step=jnp.where(applied, self.step + 1, self.step), **kept)


def from_dynamic_scale(
    dynamic_scale: DynamicScale, *, flax_cadence: bool = False, **config: Any
) -> LossScale:
    """The :class:`mpx_jax.LossScale` that continues a Flax ``DynamicScale``'s run.

    Flax's ``DynamicScale`` holds ``scale``, ``fin_steps`` (finite steps since
    the last growth or back-off, 0 to ``growth_interval``) and its settings.  It
    grows the scale on the ``growth_interval + 1``-th finite step in a row
    (when ``fin_steps == growth_interval`` on entry); mpx, torch, Keras and jmp
    grow on the ``growth_interval``-th.  The reader maps:

    * ``scale`` -> the scale, exactly (a float32 value);
    * ``growth_factor``, ``backoff_factor`` -> the same config fields;
    * ``growth_interval`` N -> ``growth_interval`` N (default: mpx's cadence from
      here on, so the first growth after the switch comes one finite step
      earlier than Flax's would, and then every N finite steps instead of
      every N + 1), or N + 1 with ``flax_cadence=True`` (the scale trace
      continues exactly as Flax's would have);
    * ``fin_steps`` -> ``growth_tracker`` (at most N - 1 with mpx's cadence:
      Flax's ``fin_steps == N``, "grow on the next finite step", becomes N - 1,
      which grows on the next finite step too) and ``steps`` (a run of at least
      that many steps);
    * ``minimum_scale`` -> ``min_scale`` (Flax's default, float32's smallest
      normal 2**-126, is mpx's floor; None becomes None, whose floor is also
      2**-126, where Flax could go lower);
    * ``max_scale`` None (Flax caps at float32's max; mpx keeps the old scale
      when a growth would overflow float32, which differs only above 2**127);
    * ``hysteresis`` 1 and ``skip_nonfinite`` True (Flax backs off on every
      non-finite step, and its example skips the update);
    * ``consecutive_nonfinite`` and ``skipped_steps`` 0 (Flax does not count them).

    ``config``: fields of :class:`mpx.ScalerConfig` to set instead (for example
    ``max_scale=2.0**24``, ``max_consecutive_skips=50``).  Put the result in the
    optimizer state with :func:`mpx_jax.set_loss_scale` (the transform must be
    built with the same config: ``with_loss_scaling(tx, loss_scale.config)``).

    Raises:
        mpx.UnsupportedTypeError: when ``dynamic_scale`` is not a ``DynamicScale``.
        mpx.ScalerConfigError: for a setting mpx cannot hold (a growth factor
            over 2**32, ...), naming the field.
        mpx.StateDictError: for a scale mpx cannot resume (below 2**-126, or
            outside the config's bounds).
    """
    if not isinstance(dynamic_scale, DynamicScale):
        raise mpx.UnsupportedTypeError(
            "dynamic_scale: expected a flax.training.dynamic_scale.DynamicScale, got "
            f"{type(dynamic_scale).__name__}."
        )
    scale, fin_steps = jax.device_get((dynamic_scale.scale, dynamic_scale.fin_steps))
    interval = int(dynamic_scale.growth_interval)
    fields = {
        "kind": "dynamic",
        "growth_factor": float(dynamic_scale.growth_factor),
        "backoff_factor": float(dynamic_scale.backoff_factor),
        "growth_interval": interval + 1 if flax_cadence else interval,
        "min_scale": None if dynamic_scale.minimum_scale is None else float(dynamic_scale.minimum_scale),
        "max_scale": None,
        "hysteresis": 1,
        "skip_nonfinite": True,
        **config,
    }
    cfg = mpx.ScalerConfig(**fields)
    if cfg.kind != "dynamic":
        raise mpx.ScalerConfigError(f"kind: a DynamicScale resumes as a dynamic scaler, got {cfg.kind!r}")
    tracker = min(int(fin_steps), cfg.growth_interval - 1)
    return LossScale.from_state_dict(
        mpx.state_dict(cfg, mpx.ScalerState(float(np.float32(scale)), tracker, 0, int(fin_steps), 0))
    )
