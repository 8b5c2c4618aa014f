"""Scaler history and stuck detection for :class:`mpx_jax.LossScale` / :func:`mpx_jax.with_loss_scaling`.

History: the loss scale itself records, in the ring buffer every backend keeps
(:mod:`mpx.kernels.ring`).  ``loss_scale.record_history()`` returns a ``LossScale``
that carries the ring (two more pytree leaves); each ``update`` writes the state
after the step into it on device, inside the compiled step (no host sync, in
place under buffer donation), and ``loss_scale.history()`` reads it in one
transfer as an :class:`mpx.ScalerHistory`.  For an optimizer state:

    state = set_loss_scale(state, get_loss_scale(state).record_history())  # or an nnx.Optimizer
    ...                                                                    # the training steps
    get_loss_scale(state).history().save("scale.json")

Stuck detection (``ScalerConfig.max_consecutive_skips``): only with the option
on, :meth:`LossScale.update` adds a ``jax.debug.callback`` that calls
:func:`mpx.check_stuck` (the one check every backend runs) on the host with the new consecutive count,
the scale and whether the loss was finite (``update(finite, loss_finite=...)``;
``with_loss_scaling``'s update takes ``loss=`` for it, the loss or the scaled
loss).  Warn mode warns from the callback.  Raise mode raises
:class:`mpx.ScalerStuckError` there; inside ``jax.jit`` JAX re-raises it as a
``jax.errors.JaxRuntimeError`` whose message holds the ``ScalerStuckError``
text (a traced value cannot raise a Python exception of its own).

This module imports no other module of mpx_jax.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from mpx.scaling import ScalerConfig
from mpx.stuck import check_floor, check_stuck

__all__ = ["floor_callback", "stuck_callback"]


def stuck_callback(config: ScalerConfig, scale: Any, consecutive: Any, loss_finite: Any = None) -> None:
    """Add the host-side stuck check, :func:`mpx.check_stuck` in a ``jax.debug.callback``, for the state
    after a step (``loss_finite``: a bool scalar or None, sent as the int flag 1/0/-1)."""
    flag = jnp.int8(-1) if loss_finite is None else jnp.asarray(loss_finite).astype(jnp.int8)

    def host_check(scale: Any, consecutive: Any, flag: Any) -> None:
        check_stuck(config, scale, consecutive, flag, stacklevel=2)

    jax.debug.callback(host_check, scale, consecutive, flag)


def floor_callback(config: ScalerConfig, hit: Any, steps: Any, scale: Any) -> None:
    """Add the host-side floor check (``on_floor="raise"``), :func:`mpx.check_floor` in a
    ``jax.debug.callback`` as stuck detection's: ``hit`` is :func:`mpx.kernels.scale.floor_hit` of the step."""

    def host_check(hit: Any, steps: Any, scale: Any) -> None:
        check_floor(config, hit, steps, scale)

    jax.debug.callback(host_check, jnp.asarray(hit), steps, scale)
