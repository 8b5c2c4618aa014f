"""Stuck-scale detection: the framework-neutral decision every backend calls.

A scaler is *stuck* when ``ScalerConfig.max_consecutive_skips`` (N) steps in a
row were skipped: it then raises :class:`mpx.ScalerStuckError` or warns with
:class:`mpx.ScalerStuckWarning` (``ScalerConfig.on_stuck``), at the N-th skip
in a row and again at the 2N-th, 3N-th..., never before the N-th.  The count is
the state's ``consecutive_nonfinite`` (every non-finite step is a skip when
``skip_nonfinite``; a config that does not skip is never stuck).

The message says which of two causes it is:

* the forward loss itself was non-finite on the last step (``loss_finite`` is
  False): no loss scale can help (look at the data, the model, the learning rate);
* the loss was finite and the gradients overflow at the minimum scale (the
  scale has reached ``min_scale``): the model's gradients do not fit float16
  even unscaled, so keep the offending layers in float32 or use bfloat16;
* otherwise the scale is still backing off (N is below what reaches
  ``min_scale``), or the loss was not given to the scaler (``loss_finite`` None).

The floor (``ScalerConfig.on_floor="raise"``, DeepSpeed's rule): a step whose back-off
is due (non-finite, its hysteresis spent) while the scale *before* it is already at
``min_scale`` raises :class:`mpx.ScalerFloorError`.  The kernel decides it
(:func:`mpx.kernels.scale.floor_hit`); the backend raises it where it runs stuck
detection, after the step: the step is counted and skipped, the scale stays at
``min_scale`` (DeepSpeed raises before it counts the step).  A back-off that only
*reaches* ``min_scale`` does not raise; the next one due does.  With ``on_floor="keep"``
nothing is added to a step.

>>> from mpx.scaling import ScalerConfig, ScalerState
>>> cfg = ScalerConfig(max_consecutive_skips=3, min_scale=1.0)
>>> stuck_message(cfg, ScalerState(1.0, consecutive_nonfinite=2, steps=2, skipped_steps=2), True) is None
True
>>> print(stuck_message(cfg, ScalerState(1.0, consecutive_nonfinite=3, steps=3, skipped_steps=3), False))
loss scaler stuck: 3 steps in a row skipped (max_consecutive_skips=3), scale 1: the forward loss itself is non-finite (inf or NaN), so no loss scale can help; check the inputs, the model and the learning rate
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from mpx.errors import ScalerFloorError, ScalerStuckError, ScalerStuckWarning
from mpx.kernels import scale as _kernel
from mpx.kernels.array_ops import NUMPY_OPS
from mpx.scaling import ScalerConfig, ScalerState

__all__ = ["check_floor", "check_stuck", "floor_hit", "floor_message", "is_stuck", "signal_stuck", "stuck_message"]


def is_stuck(config: ScalerConfig, consecutive_skips: int) -> bool:
    """Whether a step that leaves ``consecutive_skips`` skipped steps in a row triggers the detection.

    True at N, 2N, 3N... (N = ``config.max_consecutive_skips``); always False when
    N is None or the config does not skip non-finite steps.
    """
    n = config.max_consecutive_skips
    if n is None or not config.skip_nonfinite:
        return False
    return consecutive_skips > 0 and consecutive_skips % n == 0


def stuck_message(config: ScalerConfig, state: ScalerState, loss_finite: bool | None = None) -> str | None:
    """The stuck message for the state after a step, or None when the step does not trigger (pure).

    ``loss_finite``: whether that step's forward loss was finite (None: unknown,
    the loss was not given to the scaler).
    """
    if not is_stuck(config, state.consecutive_nonfinite):
        return None
    n = config.max_consecutive_skips
    head = (
        f"loss scaler stuck: {state.consecutive_nonfinite} step{'s' if state.consecutive_nonfinite > 1 else ''} "
        "in a row skipped "
        f"(max_consecutive_skips={n}), scale {state.scale:g}"
    )
    lo = config.bounds[0] if config.kind == "dynamic" else state.scale
    if loss_finite is False:
        cause = (
            "the forward loss itself is non-finite (inf or NaN), so no loss scale can help; "
            "check the inputs, the model and the learning rate"
        )
    elif state.scale <= lo:
        cause = (
            f"the loss is {'finite' if loss_finite else 'of unknown finiteness (not given to the scaler)'} "
            f"and the gradients overflow at the minimum scale ({lo:g}); keep the overflowing layers in "
            "float32 (mpx compare / watch name them), lower min_scale, or use bfloat16"
        )
    else:
        cause = f"the gradients keep overflowing while the scale backs off toward min_scale ({lo:g})" + (
            "" if loss_finite else "; pass the loss to the scaler to tell a non-finite loss apart"
        )
    return f"{head}: {cause}"


def signal_stuck(config: ScalerConfig, message: str | None, *, stacklevel: int = 3) -> None:
    """Raise :class:`mpx.ScalerStuckError` or warn (``config.on_stuck``) with ``message``; None does nothing."""
    if message is None:
        return
    if config.on_stuck == "warn":
        warnings.warn(message, ScalerStuckWarning, stacklevel=stacklevel)
        return
    raise ScalerStuckError(message)


def check_stuck(config: ScalerConfig, scale: Any, consecutive: Any, loss_finite: Any = None, *,
                stacklevel: int = 3) -> None:  # fmt: skip
    """The host-side stuck check every backend runs after a step (eagerly or from a host callback).

    ``scale``: the scale after the step (any float-like: a Python float, a numpy or
    framework scalar); ``consecutive``: ``consecutive_nonfinite`` after the step;
    ``loss_finite``: whether that step's loss was finite, as a bool, or an int flag
    (1 finite, 0 non-finite, -1 unknown), or None (unknown).  Raises or warns
    (:func:`signal_stuck`) when :func:`is_stuck`; does nothing otherwise.

    >>> cfg = ScalerConfig(max_consecutive_skips=2, on_stuck="warn")
    >>> check_stuck(cfg, 1.0, 1, -1) is None
    True
    """
    count = int(consecutive)
    if not is_stuck(config, count):
        return
    if loss_finite is None:
        flag = None
    else:
        value = int(loss_finite)
        flag = None if value < 0 else bool(value)
    state = ScalerState(float(np.float32(scale)), consecutive_nonfinite=count, steps=count, skipped_steps=count)
    signal_stuck(config, stuck_message(config, state, flag), stacklevel=stacklevel + 1)


def floor_message(config: ScalerConfig, step: int, scale: float) -> str:
    """The :class:`mpx.ScalerFloorError` message for a back-off due at ``step`` (1-based) at ``scale``."""
    return (
        f"loss scale already at its minimum: step {step} overflowed with the scale at min_scale "
        f"({float(scale):g}) and a back-off due (on_floor='raise', DeepSpeed's 'Current loss scale already "
        "at minimum'); the step was skipped. The gradients overflow float16 even at the floor: keep the "
        "overflowing layers in float32 (mpx compare / watch name them), lower min_scale, use bfloat16, "
        "or set on_floor='keep' to go on at the floor"
    )


def floor_hit(config: ScalerConfig, before: ScalerState, after: ScalerState) -> bool:
    """:func:`mpx.kernels.scale.floor_hit` on host states: the step from ``before`` to ``after`` was due
    to back off with the scale already at its floor."""
    o = NUMPY_OPS
    counters = (o.int32(getattr(after, name)) for name in _kernel.ScaleState._fields[1:])
    return bool(_kernel.floor_hit(o, config, o.float32(before.scale), _kernel.ScaleState(o.float32(after.scale), *counters)))


def check_floor(config: ScalerConfig, hit: Any, step: Any, scale: Any) -> None:
    """Raise :class:`mpx.ScalerFloorError` when ``hit`` (:func:`mpx.kernels.scale.floor_hit` of the
    step, any bool-like) holds and ``config.on_floor`` is ``"raise"``; ``step``: the state's ``steps``
    after it, ``scale``: its scale.

    >>> check_floor(ScalerConfig(on_floor="raise"), False, 3, 1.0) is None
    True
    """
    if config.on_floor == "raise" and bool(hit):
        raise ScalerFloorError(floor_message(config, int(step), float(np.float32(scale))))
