"""The config and state-dict glue of ``mpx_torch.GradScaler``: what it accepts as a
config, and torch's own ``torch.amp.GradScaler`` state dicts read as neutral ones.

Everything is validated through the core (:mod:`mpx.scaling`) before a scaler
changes, and every failure is an :class:`mpx.StateDictError` (or
:class:`mpx.ScalerConfigError`/:class:`mpx.PolicyError` for a config).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from mpx import (
    SCALE_FLOOR,
    PolicyError,
    ScalerConfig,
    ScalerConfigError,
    ScalerState,
    StateDictError,
    as_scaler_config,
    state_dict,
)
from mpx.scaling import _finite_float, _is_int, _show, f32

__all__ = ["NATIVE_KEYS", "as_config", "as_neutral", "native_to_neutral", "new_scale_value"]

#: The keys of a ``torch.amp.GradScaler.state_dict()``.
NATIVE_KEYS = frozenset({"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"})
_DEVICE_NAMES = ("cpu", "cuda", "mps", "xpu", "hpu", "mtia", "meta", "xla", "privateuseone")


def as_config(config: Any) -> ScalerConfig:
    """A GradScaler's ``config`` argument as an :class:`mpx.ScalerConfig` (:func:`mpx.as_scaler_config`).

    A device name first (``GradScaler("cuda")``, torch's argument order) gets its own error.
    """
    if isinstance(config, str) and config.split(":")[0] in _DEVICE_NAMES:
        raise PolicyError(
            f"config: {config!r} is a device, not a scaler config or policy; torch.amp.GradScaler takes the "
            f"device first, mpx_torch.GradScaler takes it second: GradScaler(device={config!r})"
        )
    return as_scaler_config(config)


def as_neutral(data: Any) -> Any:
    """What ``GradScaler.load_state_dict`` reads: a ``torch.amp.GradScaler`` dict becomes a neutral one
    (:func:`native_to_neutral`); anything else is returned for :func:`mpx.load_state_dict` to check.

    Raises:
        StateDictError: for an empty dict (what a disabled scaler saves) or a bad native one.
    """
    if isinstance(data, Mapping) and "format" not in data:
        if len(data) == 0:
            raise StateDictError(
                "state dict: the source state dict is empty, possibly because it was saved from a "
                "disabled GradScaler; nothing to load"
            )
        if set(data) == NATIVE_KEYS:
            return native_to_neutral(data)
    return data


def new_scale_value(config: ScalerConfig, new_scale: Any) -> float:
    """``GradScaler.update(new_scale)``'s float, as a float32 value the config allows.

    Raises:
        ScalerConfigError: for a scaler that is not dynamic, or a value outside [min_scale, max_scale].
    """
    finite = _finite_float(new_scale)
    value = math.nan if finite is None else f32(finite)
    lo, hi = config.bounds
    if config.kind != "dynamic":
        raise ScalerConfigError(f"new_scale: a {config.kind} scaler's scale cannot be changed")
    if not (math.isfinite(value) and value > 0 and lo <= value <= hi):
        raise ScalerConfigError(
            f"new_scale: {new_scale!r} lies outside [min_scale, max_scale] = [{lo}, {hi}]"
        )
    return value


def native_to_neutral(data: Mapping[str, Any]) -> dict[str, Any]:
    """A ``torch.amp.GradScaler.state_dict()`` as a neutral dict, with torch's semantics.

    A dynamic config with ``min_scale=None``, ``max_scale=None``,
    ``hysteresis=1``, ``init_scale`` the saved scale (rounded to float32 as
    torch's ``fill_`` does; a scale below 2**-126, which torch can reach and
    mpx cannot, is read as 2**-126), the step counters at 0.

    Raises:
        StateDictError: naming the bad key.
    """
    err = StateDictError
    for key in ("scale", "growth_factor", "backoff_factor"):
        if _finite_float(data[key]) is None:
            raise err(
                f"{key}: expected a finite number in a torch.amp.GradScaler state dict, got {_show(data[key])}"
            )
    for key in ("growth_interval", "_growth_tracker"):
        if not _is_int(data[key]):
            raise err(f"{key}: expected an int in a torch.amp.GradScaler state dict, got {_show(data[key])}")
    scale = f32(float(data["scale"]))
    if not 0.0 < scale < float("inf"):
        raise err(f"scale: expected a positive float32 scale, got {_show(data['scale'])}")
    scale = max(scale, SCALE_FLOOR)
    try:
        config = ScalerConfig(
            kind="dynamic",
            init_scale=scale,
            growth_factor=data["growth_factor"],
            backoff_factor=data["backoff_factor"],
            growth_interval=data["growth_interval"],
            min_scale=None,
            max_scale=None,
            hysteresis=1,
        )
    except ScalerConfigError as e:
        raise err(f"config: {e}") from None
    tracker = int(data["_growth_tracker"])
    # steps: the tracker counts finite steps, so at least that many were taken
    return state_dict(config, ScalerState(scale, growth_tracker=tracker, steps=tracker))
