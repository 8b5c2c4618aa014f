"""Gradient accumulation: one semantics for every backend.

A window is ``steps`` micro-batches whose gradients add up to one optimizer
step.  mpx's rule, the same in torch, Keras and JAX:

- the loss scale is constant inside a window (the scaler has not moved);
- the finiteness check runs once, on the accumulated gradients at the
  window's last micro-batch (a non-finite micro-batch leaves them non-finite);
- a window holding a non-finite micro-batch is skipped whole: parameters and
  optimizer state stay bit-identical, the accumulators restart at zero;
- the scaler makes one transition per window (:func:`mpx.scaler_update` with
  the window's flag), so a config grows and backs off per optimizer step, never
  per micro-batch.

This is what torch's ``GradScaler`` does when ``scale(loss).backward()`` runs
``steps`` times before one ``step``/``update``, without any extra pass.  Keras's
``gradient_accumulation_steps`` under its own LossScaleOptimizer and a loss
scale updated inside ``optax.MultiSteps`` instead drop only the bad micro-batch
and move the scale once per micro-batch, so the same config grows ``steps``
times faster per optimizer step there (``mpx_jax.with_loss_scaling`` takes
``accumulate=k`` and refuses a ``MultiSteps``).

>>> import mpx
>>> cfg = mpx.ScalerConfig(init_scale=8.0, growth_interval=1)
>>> [(w["applied"], w["scale"]) for w in accumulation_trace(cfg, [True, True, True, False], 2)]
[(True, 16.0), (False, 8.0)]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mpx.errors import MPXError
from mpx.loss_scaler import LossScaler
from mpx.scaling import ScalerConfig

__all__ = ["accumulation_trace", "check_accumulation_steps", "window_flags"]


def check_accumulation_steps(value: Any, field: str = "accumulate") -> int:
    """``value`` as a number of micro-batches per optimizer step: an int >= 1.

    Raises:
        MPXError: naming ``field`` for a bool, a non-int or an int below 1.
    """
    if isinstance(value, (bool, np.bool_)) or not hasattr(value, "__index__"):
        raise MPXError(f"{field}: expected an int >= 1 (micro-batches per optimizer step), got {value!r}")
    steps = int(value.__index__())
    if steps < 1:
        raise MPXError(f"{field}: expected an int >= 1 (micro-batches per optimizer step), got {steps}")
    return steps


def window_flags(micro_flags: Sequence[bool], steps: int) -> list[bool]:
    """One flag per window of ``steps`` micro-batches: True when every one is finite.

    Raises:
        MPXError: when ``len(micro_flags)`` is not a whole number of windows.
    """
    steps = check_accumulation_steps(steps, "steps")
    flags = [bool(f) for f in micro_flags]
    if len(flags) % steps:
        raise MPXError(f"micro_flags: {len(flags)} micro-batches is not a whole number of windows of {steps}")
    return [all(flags[i : i + steps]) for i in range(0, len(flags), steps)]


def accumulation_trace(
    config: ScalerConfig | None, micro_flags: Sequence[bool], steps: int
) -> list[dict[str, Any]]:
    """The reference each backend's accumulation must reproduce, one dict per optimizer step.

    Args:
        config: the scaler config (default ``ScalerConfig()``).
        micro_flags: whether each micro-batch's gradients are finite, in order.
        steps: micro-batches per optimizer step (``accumulate=``,
            ``gradient_accumulation_steps``).

    Returns:
        ``[{"applied": bool, "scale": float}, ...]``: whether the window's update
        was applied, and the scale after the window's one transition (the scale
        the next window's losses are multiplied by).
    """
    scaler = LossScaler(config)
    out = []
    for finite in window_flags(micro_flags, steps):
        scaler.update(finite)
        out.append({"applied": finite or not scaler.config.skip_nonfinite, "scale": scaler.get_scale()})
    return out
