"""The loss-scaling state machine: configuration, state, the reference transition.

Every backend's scaler runs exactly :func:`scaler_update`.  The scale is a
float32 value: each product is ``float32(scale) * float32(factor)``, rounded to
float32, so a pure-Python trace and a device tensor agree bit for bit.

>>> cfg = ScalerConfig(growth_interval=2)
>>> s = scaler_init(cfg)
>>> for finite in (True, True, False):
...     s = scaler_update(cfg, s, finite)
>>> s.scale, s.skipped_steps
(65536.0, 1)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from mpx.errors import MPXError, ScalerConfigError, StateDictError

__all__ = [
    "STATE_DICT_FORMAT",
    "LossScaler",
    "ScalerConfig",
    "ScalerState",
    "load_state_dict",
    "scaler_init",
    "scaler_update",
    "state_dict",
]

#: The ``format`` tag of every scaler state dict this version writes and reads.
STATE_DICT_FORMAT = "mpx.scaler/1"
KINDS = ("dynamic", "static", "none")
_F32_MAX = float(np.finfo(np.float32).max)


def f32(x: float) -> float:
    """``x`` rounded to the nearest float32, as a Python float (inf past float32's range)."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def mul32(a: float, b: float) -> float:
    """``float32(a) * float32(b)`` rounded to float32 (inf on overflow), as a Python float."""
    with np.errstate(over="ignore"):
        return float(np.float32(a) * np.float32(b))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(
        value, (bool, np.bool_)
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


@dataclass(frozen=True)
class ScalerConfig:
    """How a loss scaler behaves (frozen; validated on construction).

    Args:
        kind: ``"dynamic"`` (grow and back off), ``"static"`` (always
            ``init_scale``) or ``"none"`` (scale 1.0).
        init_scale: the first scale (default 2**16, torch's; Keras starts at 2**15).
        growth_factor: factor applied after ``growth_interval`` finite steps in a row (> 1, default 2.0).
        backoff_factor: factor applied on a non-finite step, in (0, 1) (default 0.5).
        growth_interval: finite steps in a row before growing, an int >= 1 (default 2000).
        min_scale: floor of the scale (default 1.0); None for no floor (torch).
        max_scale: ceiling of the scale (default 2**24); None for no ceiling.
            A growth that would overflow float32 keeps the old scale either way.
        hysteresis: consecutive non-finite steps before backing off, an int >= 1 (default 1).
        skip_nonfinite: skip the update on a non-finite step; None (default)
            means True for dynamic and static, False for none.

    Factors and bounds act as float32 numbers.

    Raises:
        ScalerConfigError: naming the field and its allowed range.
    """

    kind: Literal["dynamic", "static", "none"] = "dynamic"
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float | None = 1.0
    max_scale: float | None = 2.0**24
    hysteresis: int = 1
    skip_nonfinite: bool | None = None

    def __post_init__(self) -> None:
        err = ScalerConfigError
        if self.kind not in KINDS:
            raise err(f"kind: {self.kind!r} is not a scaler kind; allowed: {', '.join(KINDS)}")
        for name in ("init_scale", "growth_factor", "backoff_factor"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value):
                raise err(f"{name}: expected a finite number, got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in ("min_scale", "max_scale"):
            value = getattr(self, name)
            if value is None:
                continue
            if not _is_number(value) or not math.isfinite(value):
                raise err(f"{name}: expected a finite number or None, got {value!r}")
            if not 0 < f32(value) <= _F32_MAX:
                raise err(f"{name}: {value!r} must be positive and at most float32's max")
            object.__setattr__(self, name, float(value))
        for name in ("growth_interval", "hysteresis"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise err(f"{name}: expected an int >= 1, got {value!r}")
            object.__setattr__(self, name, int(value))
        if not 0 < f32(self.init_scale) <= _F32_MAX:
            raise err(f"init_scale: {self.init_scale!r} must be positive and at most float32's max")
        if not f32(self.growth_factor) > 1.0:
            raise err(f"growth_factor: {self.growth_factor!r} must be > 1 (as a float32)")
        if not 0.0 < f32(self.backoff_factor) < 1.0:
            raise err(f"backoff_factor: {self.backoff_factor!r} must lie in (0, 1) (as a float32)")
        lo, hi = self.min_scale, self.max_scale
        if lo is not None and hi is not None and lo > hi:
            raise err(f"min_scale: {lo!r} is greater than max_scale {hi!r}")
        if lo is not None and self.init_scale < lo:
            raise err(f"init_scale: {self.init_scale!r} is below min_scale {lo!r}")
        if hi is not None and self.init_scale > hi:
            raise err(f"init_scale: {self.init_scale!r} is above max_scale {hi!r}")
        if self.skip_nonfinite is None:
            object.__setattr__(self, "skip_nonfinite", self.kind != "none")
        elif not isinstance(self.skip_nonfinite, (bool, np.bool_)):
            raise err(f"skip_nonfinite: expected True, False or None, got {self.skip_nonfinite!r}")
        else:
            object.__setattr__(self, "skip_nonfinite", bool(self.skip_nonfinite))

    @classmethod
    def for_policy(cls, policy: Any, **changes: Any) -> ScalerConfig:
        """Dynamic scaling for a float16 compute dtype, none otherwise (``changes`` override fields)."""
        from mpx.policy import get_policy

        kind = "dynamic" if get_policy(policy).compute_dtype == "float16" else "none"
        return cls(**{"kind": kind, **changes})

    # Float32 constants for device implementations ------------------------------
    @property
    def first_scale(self) -> float:
        """The float32 scale a fresh state starts at (1.0 for kind ``none``)."""
        return 1.0 if self.kind == "none" else f32(self.init_scale)

    @property
    def bounds(self) -> tuple[float, float]:
        """(floor, ceiling) as float32 values; (0.0, inf) where unbounded."""
        lo = 0.0 if self.min_scale is None else f32(self.min_scale)
        hi = math.inf if self.max_scale is None else f32(self.max_scale)
        return lo, hi

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ScalerConfig:
        """Read :meth:`to_dict` back; unknown or missing keys raise ScalerConfigError."""
        if not isinstance(data, Mapping):
            raise ScalerConfigError(f"config: expected a mapping, got {type(data).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in data if k not in names]
        if unknown:
            raise ScalerConfigError(f"config: unknown key {unknown[0]!r}; allowed: {', '.join(names)}")
        return cls(**data)


@dataclass(frozen=True)
class ScalerState:
    """The state of one scaler: ``scale`` (a float32 value) and four counters."""

    scale: float
    growth_tracker: int = 0
    consecutive_nonfinite: int = 0
    steps: int = 0
    skipped_steps: int = 0


def scaler_init(config: ScalerConfig) -> ScalerState:
    """The state before the first step."""
    return ScalerState(scale=config.first_scale)


def scaler_update(config: ScalerConfig, state: ScalerState, finite: bool) -> ScalerState:
    """The reference transition after one step whose gradients were ``finite`` (pure).

    A step is skipped (its update not applied) when it is not finite and
    ``config.skip_nonfinite``.  A dynamic scale grows by ``growth_factor`` on the
    ``growth_interval``-th finite step in a row, up to ``max_scale`` (and never
    to a non-finite float32), and backs off by ``backoff_factor`` once
    ``hysteresis`` non-finite steps have come in a row, down to ``min_scale``.
    """
    if not isinstance(finite, (bool, np.bool_)):
        raise MPXError(f"finite: expected a bool, got {finite!r} ({type(finite).__name__})")
    finite = bool(finite)
    skipped = (not finite) and config.skip_nonfinite
    scale = state.scale
    tracker = state.growth_tracker
    consecutive = 0 if finite else state.consecutive_nonfinite + 1
    if config.kind == "dynamic":
        lo, hi = config.bounds
        if finite:
            tracker += 1
            if tracker == config.growth_interval:
                grown = mul32(scale, config.growth_factor)
                if math.isfinite(grown):
                    scale = min(grown, hi)
                tracker = 0
        else:
            tracker = 0
            if consecutive >= config.hysteresis:
                scale = max(mul32(scale, config.backoff_factor), lo)
    return ScalerState(
        scale=scale,
        growth_tracker=tracker,
        consecutive_nonfinite=consecutive,
        steps=state.steps + 1,
        skipped_steps=state.skipped_steps + int(skipped),
    )


# -- state dicts -----------------------------------------------------------------
_COUNTERS = ("growth_tracker", "consecutive_nonfinite", "steps", "skipped_steps")
_KEYS = ("format", "config", "scale", *_COUNTERS)


def state_dict(config: ScalerConfig, state: ScalerState) -> dict[str, Any]:
    """The neutral, JSON-safe state dict every backend writes and reads."""
    return {
        "format": STATE_DICT_FORMAT,
        "config": config.to_dict(),
        "scale": float(state.scale),
        **{name: int(getattr(state, name)) for name in _COUNTERS},
    }


def load_state_dict(data: Mapping[str, Any]) -> tuple[ScalerConfig, ScalerState]:
    """Validate a :func:`state_dict` dict and return its (config, state).

    Raises:
        StateDictError: for a wrong format tag, missing or unknown keys, an
            invalid config, or any field a run of the state machine cannot produce.
    """
    err = StateDictError
    if not isinstance(data, Mapping):
        raise err(f"state dict: expected a mapping, got {type(data).__name__}")
    if data.get("format") != STATE_DICT_FORMAT:
        raise err(f"format: expected {STATE_DICT_FORMAT!r}, got {data.get('format')!r}")
    missing = [k for k in _KEYS if k not in data]
    if missing:
        raise err(
            f"state dict: missing key {missing[0]!r}; a {STATE_DICT_FORMAT} dict has {', '.join(_KEYS)}"
        )
    unknown = [k for k in data if k not in _KEYS]
    if unknown:
        raise err(f"state dict: unknown key {unknown[0]!r}; allowed: {', '.join(_KEYS)}")
    try:
        config = ScalerConfig.from_dict(data["config"])
    except ScalerConfigError as e:
        raise err(f"config: {e}") from None
    for name in _COUNTERS:
        value = data[name]
        if not _is_int(value) or value < 0:
            raise err(f"{name}: expected an int >= 0, got {value!r}")
    scale = data["scale"]
    if not _is_number(scale) or not math.isfinite(scale) or scale <= 0:
        raise err(f"scale: expected a finite positive number, got {scale!r}")
    if f32(scale) != scale:
        raise err(f"scale: {scale!r} is not a float32 value")
    state = ScalerState(float(scale), *(int(data[name]) for name in _COUNTERS))
    if state.skipped_steps > state.steps or state.consecutive_nonfinite > state.steps:
        raise err("steps: skipped_steps and consecutive_nonfinite cannot exceed steps")
    if config.kind == "dynamic":
        lo, hi = config.bounds
        if not lo <= state.scale <= hi:
            raise err(f"scale: {scale!r} lies outside [min_scale, max_scale] = [{lo}, {hi}]")
        if state.growth_tracker >= config.growth_interval:
            raise err(
                f"growth_tracker: {state.growth_tracker} must be below growth_interval {config.growth_interval}"
            )
    else:
        if state.scale != config.first_scale:
            raise err(f"scale: a {config.kind} scaler's scale is {config.first_scale}, got {scale!r}")
        if state.growth_tracker != 0:
            raise err(f"growth_tracker: a {config.kind} scaler never counts, got {state.growth_tracker}")
    if not config.skip_nonfinite and state.skipped_steps:
        raise err("skipped_steps: this config never skips, but the state counts skipped steps")
    return config, state


class LossScaler:
    """The state machine for eager use: holds a config and the current state.

    >>> scaler = LossScaler(ScalerConfig(growth_interval=1))
    >>> _ = scaler.update(True)
    >>> scaler.scale
    131072.0
    >>> LossScaler.from_state_dict(scaler.state_dict()).state == scaler.state
    True
    """

    def __init__(self, config: ScalerConfig | None = None) -> None:
        if config is None:
            config = ScalerConfig()
        if not isinstance(config, ScalerConfig):
            raise ScalerConfigError(
                f"config: expected an mpx.ScalerConfig or None, got {type(config).__name__}"
            )
        self._config = config
        self._state = scaler_init(config)

    @property
    def config(self) -> ScalerConfig:
        """The configuration (read-only)."""
        return self._config

    @property
    def state(self) -> ScalerState:
        """The current state (an immutable value)."""
        return self._state

    @property
    def scale(self) -> float:
        """The current loss scale, a float32 value."""
        return self._state.scale

    def update(self, finite: bool) -> bool:
        """Advance one step; returns True when this step's update must be skipped."""
        before = self._state.skipped_steps
        self._state = scaler_update(self._config, self._state, finite)
        return self._state.skipped_steps != before

    def state_dict(self) -> dict[str, Any]:
        """The neutral JSON-safe state dict (format ``mpx.scaler/1``)."""
        return state_dict(self._config, self._state)

    def load_state_dict(self, data: Mapping[str, Any]) -> None:
        """Restore config and state from a state dict; on error nothing changes."""
        self._config, self._state = load_state_dict(data)

    @classmethod
    def from_state_dict(cls, data: Mapping[str, Any]) -> LossScaler:
        """A scaler resumed from a state dict."""
        scaler = cls()
        scaler.load_state_dict(data)
        return scaler

    def __repr__(self) -> str:
        return f"LossScaler(kind={self._config.kind!r}, scale={self.scale}, steps={self._state.steps})"
