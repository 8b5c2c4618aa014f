"""The loss-scaling state machine: configuration, state, the transition on host values, state dicts.

Every backend's scaler runs exactly :func:`scaler_update`: it is the one kernel,
:func:`mpx.kernels.scale.update`, which this module runs with the numpy table and
each backend runs with its own arrays.  The scale is a float32 value; each product
is computed as torch's CPU kernel (``torch._amp_update_scale_``) computes it,
``float32(float64(scale) * float64(factor))``: one float64 product, rounded to
float32 (tables without float64 evaluate it exactly in int32 arithmetic,
:func:`mpx.kernels.scale.product_bits`).  The scale never drops below :data:`SCALE_FLOOR` (the smallest positive
normal float32), even with ``min_scale=None``, and the counters saturate at
:data:`COUNTER_MAX` (2**31 - 1), so every backend holds them in int32.

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
from mpx.kernels import scale as _kernel
from mpx.kernels.array_ops import NUMPY_OPS
from mpx.kernels.bits import f32_of

#: The largest value of every counter (steps, skipped_steps, consecutive_nonfinite, and of
#: growth_interval and hysteresis): int32's max, which every backend holds.  Counters saturate there.
COUNTER_MAX = _kernel.COUNTER_MAX

__all__ = [
    "BACKOFF_FACTOR_MIN",
    "SCALER_PRESETS",
    "COUNTER_MAX",
    "GROWTH_FACTOR_MAX",
    "SCALE_FLOOR",
    "STATE_DICT_FORMAT",
    "FactorSplit",
    "ScalerConfig",
    "ScalerState",
    "as_scaler_config",
    "load_state_dict",
    "scaler_init",
    "scaler_update",
    "split_factor",
    "state_dict",
]

#: The ``format`` tag of every scaler state dict this version writes and reads.
STATE_DICT_FORMAT = "mpx.scaler/1"
KINDS = ("dynamic", "static", "none")
#: The values of ``ScalerConfig.on_stuck``.
ON_STUCK = ("raise", "warn")
#: The values of ``ScalerConfig.hysteresis_reset`` and ``ScalerConfig.on_floor``.
HYSTERESIS_RESETS = ("finite", "growth")
ON_FLOOR = ("keep", "raise")
_F32_MAX = float(np.finfo(np.float32).max)
#: The smallest scale there is: the smallest positive normal float32, 2**-126.  Every
#: scale (init, bounds, a loaded state) is at least this, and a backoff never goes below it.
SCALE_FLOOR = 2.0**-126
#: The largest growth_factor and the smallest backoff_factor a config accepts.
GROWTH_FACTOR_MAX = 2.0**32
BACKOFF_FACTOR_MIN = 2.0**-32


def f32(x: float) -> float:
    """``x`` rounded to the nearest float32, as a Python float (inf past float32's range)."""
    return f32_of(x)


@dataclass(frozen=True)
class FactorSplit:
    """A factor as ``mantissa * 2**exponent``, ``mantissa`` a 53-bit int given as five 12-bit limbs.

    ``limbs`` is low limb first; the constants :func:`mpx.kernels.scale.product_bits` needs.
    """

    limbs: tuple[int, int, int, int, int]
    exponent: int


def split_factor(factor: float) -> FactorSplit:
    """The exact split of a positive finite float64 ``factor`` for :func:`mpx.kernels.scale.product_bits`."""
    mant, exp = math.frexp(float(factor))
    if not (mant > 0 and math.isfinite(mant)):
        raise ScalerConfigError(f"factor: expected a positive finite number, got {factor!r}")
    m = int(mant * 2.0**53)  # exact: a float64 mantissa has 53 bits
    return FactorSplit(tuple((m >> (12 * k)) & 0xFFF for k in range(5)), exp - 53)  # type: ignore[arg-type]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(
        value, (bool, np.bool_)
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _show(value: Any) -> str:
    """``repr(value)``, short: a huge int (whose repr may even raise) by its size only."""
    if _is_int(value) and abs(int(value)).bit_length() > 64:
        return f"an int of {abs(int(value)).bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _finite_float(value: Any) -> float | None:
    """``float(value)`` for a finite real number (huge ints included: None), else None."""
    if not _is_number(value):
        return None
    try:
        x = float(value)
    except OverflowError:
        return None
    return x if math.isfinite(x) else None


@dataclass(frozen=True)
class ScalerConfig:
    """How a loss scaler behaves (frozen; validated on construction).

    Args:
        kind: ``"dynamic"`` (grow and back off), ``"static"`` (always
            ``init_scale``) or ``"none"`` (scale 1.0).
        init_scale: the first scale (default 2**16, torch's; Keras starts at 2**15).
        growth_factor: factor applied after ``growth_interval`` finite steps in
            a row, in (1, 2**32] (default 2.0).
        backoff_factor: factor applied on a non-finite step, in [2**-32, 1) (default 0.5).
        growth_interval: finite steps in a row before growing, an int in
            [1, 2**31 - 1] (default 2000).
        min_scale: floor of the scale (default 1.0); None for the smallest
            positive normal float32, 2**-126 (:data:`SCALE_FLOOR`; torch has
            no floor and can reach 0).
        max_scale: ceiling of the scale (default 2**24); None for no ceiling.
            A growth that would overflow float32 keeps the old scale either way.
        hysteresis: non-finite steps before backing off, an int in
            [1, 2**31 - 1] (default 1): in a row (``hysteresis_reset="finite"``)
            or since the last growth (``"growth"``).
        skip_nonfinite: skip the update on a non-finite step; None (default)
            means True for dynamic and static, False for none.
        max_consecutive_skips: stuck detection: after this many skipped steps
            in a row (an int in [1, 2**31 - 1]) the backend raises
            :class:`mpx.ScalerStuckError` or warns (``on_stuck``), again after
            each further multiple; None (the default) turns it off (free: no
            host sync, nothing added to a compiled step).  See :mod:`mpx.stuck`.
        on_stuck: ``"raise"`` (default) or ``"warn"`` (a
            :class:`mpx.ScalerStuckWarning`) when ``max_consecutive_skips`` is reached.
        hysteresis_reset: what refills the hysteresis budget: ``"finite"``
            (default: any finite step; DeepSpeed's ``consecutive_hysteresis=true``)
            or ``"growth"`` (only a growth step; DeepSpeed's default).  Under
            ``"growth"`` the state counts ``nonfinite_since_growth``.
        first_growth_delay: extra finite steps before the first growth after a
            non-finite step or the start, an int >= 0 with ``growth_interval +
            first_growth_delay <= 2**31 - 1`` (default 0; DeepSpeed's rule is 1: it
            grows on the (window+1)-th finite step, then every window steps).
        on_floor: ``"keep"`` (default: a back-off at ``min_scale`` keeps the
            scale there) or ``"raise"`` (DeepSpeed's rule: a back-off due while the
            scale is at ``min_scale`` raises :class:`mpx.ScalerFloorError` after the
            step, where stuck detection raises; see :mod:`mpx.stuck`).

    Scales (``init_scale``, ``min_scale``, ``max_scale``) act as float32
    values and must lie in [2**-126, float32's max]; the factors are used as
    float64 values (torch's rule: ``float32(float64(scale) * float64(factor))``).

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
    max_consecutive_skips: int | None = None
    on_stuck: Literal["raise", "warn"] = "raise"
    hysteresis_reset: Literal["finite", "growth"] = "finite"
    first_growth_delay: int = 0
    on_floor: Literal["keep", "raise"] = "keep"

    def __post_init__(self) -> None:
        err = ScalerConfigError
        if not isinstance(self.kind, str) or self.kind not in KINDS:
            raise err(f"kind: {_show(self.kind)} is not a scaler kind; allowed: {', '.join(KINDS)}")
        f32_max = f"{_F32_MAX:.9g}"
        for name in ("init_scale", "min_scale", "max_scale"):
            value = getattr(self, name)
            if value is None and name != "init_scale":
                continue
            x = _finite_float(value)
            if x is None:
                none = " or None" if name != "init_scale" else ""
                raise err(f"{name}: expected a finite number{none}, got {_show(value)}")
            if not SCALE_FLOOR <= f32(x) <= _F32_MAX:
                raise err(f"{name}: {_show(value)} must lie in [2**-126, {f32_max}] (a normal float32 scale)")
            object.__setattr__(self, name, x)
        ranges = {
            "growth_factor": ("(1, 2**32]", lambda x: 1.0 < x <= GROWTH_FACTOR_MAX),
            "backoff_factor": ("[2**-32, 1)", lambda x: BACKOFF_FACTOR_MIN <= x < 1.0),
        }
        for name, (text, ok) in ranges.items():
            value = getattr(self, name)
            x = _finite_float(value)
            if x is None:
                raise err(f"{name}: expected a finite number in {text}, got {_show(value)}")
            if not ok(x):
                raise err(f"{name}: {_show(value)} must lie in {text}")
            object.__setattr__(self, name, x)
        for name in ("growth_interval", "hysteresis"):
            value = getattr(self, name)
            if not _is_int(value) or not 1 <= value <= COUNTER_MAX:
                raise err(f"{name}: expected an int in [1, 2**31 - 1], got {_show(value)}")
            object.__setattr__(self, name, int(value))
        for name, allowed in (("hysteresis_reset", HYSTERESIS_RESETS), ("on_floor", ON_FLOOR)):
            value = getattr(self, name)
            if not isinstance(value, str) or value not in allowed:
                raise err(f"{name}: {_show(value)} is not allowed; allowed: {', '.join(allowed)}")
        delay, most = self.first_growth_delay, COUNTER_MAX - self.growth_interval
        if not _is_int(delay) or not 0 <= delay <= most:
            raise err(
                f"first_growth_delay: expected an int in [0, 2**31 - 1 - growth_interval] = [0, {most}], "
                f"got {_show(delay)}"
            )
        object.__setattr__(self, "first_growth_delay", int(delay))
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
            raise err(f"skip_nonfinite: expected True, False or None, got {_show(self.skip_nonfinite)}")
        else:
            object.__setattr__(self, "skip_nonfinite", bool(self.skip_nonfinite))
        limit = self.max_consecutive_skips
        if limit is not None:
            if not _is_int(limit) or not 1 <= limit <= COUNTER_MAX:
                raise err(f"max_consecutive_skips: expected None or an int in [1, 2**31 - 1], got {_show(limit)}")
            object.__setattr__(self, "max_consecutive_skips", int(limit))
        if not isinstance(self.on_stuck, str) or self.on_stuck not in ON_STUCK:
            raise err(f"on_stuck: {_show(self.on_stuck)} is not allowed; allowed: {', '.join(ON_STUCK)}")
        # the constants every step reads, computed once (not fields: equality and hashing ignore them)
        lo = SCALE_FLOOR if self.min_scale is None else f32(self.min_scale)
        hi = math.inf if self.max_scale is None else f32(self.max_scale)
        first = 1.0 if self.kind == "none" else f32(self.init_scale)
        splits = (split_factor(self.growth_factor), split_factor(self.backoff_factor))
        object.__setattr__(self, "_constants", (first, (lo, hi), *splits))

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
        return self._constants[0]  # type: ignore[attr-defined, no-any-return]

    @property
    def bounds(self) -> tuple[float, float]:
        """(floor, ceiling) as float32 values: the floor is :data:`SCALE_FLOOR` for
        ``min_scale=None``, the ceiling inf for ``max_scale=None``."""
        return self._constants[1]  # type: ignore[attr-defined, no-any-return]

    @property
    def scale_can_drop_below_one(self) -> bool:
        """Whether the scale can be below 1, so that unscaling (dividing by it) can
        overflow finite gradients: backends then test the unscaled gradients."""
        if self.kind == "dynamic":
            return self.bounds[0] < 1.0
        return self.first_scale < 1.0

    @property
    def growth_split(self) -> FactorSplit:
        """:func:`split_factor` of ``growth_factor`` (for tables without float64)."""
        return self._constants[2]  # type: ignore[attr-defined, no-any-return]

    @property
    def backoff_split(self) -> FactorSplit:
        """:func:`split_factor` of ``backoff_factor`` (for tables without float64)."""
        return self._constants[3]  # type: ignore[attr-defined, no-any-return]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ScalerConfig:
        """Read :meth:`to_dict` back; unknown keys raise ScalerConfigError, missing ones take their defaults
        (so a dict written before a field existed, e.g. without ``max_consecutive_skips``, loads with it off)."""
        if not isinstance(data, Mapping):
            raise ScalerConfigError(f"config: expected a mapping, got {type(data).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in data if k not in names]
        if unknown:
            raise ScalerConfigError(f"config: unknown key {_show(unknown[0])}; allowed: {', '.join(names)}")
        return cls(**data)


#: Named scaler configs, read by :func:`as_scaler_config` (and so by every backend's scaler) by name.
#: ``deepspeed_fp16`` is DeepSpeed's fp16 ``DynamicLossScaler`` with its ds_config defaults
#: (``initial_scale_power`` 16, ``loss_scale_window`` 1000, ``hysteresis`` 2,
#: ``consecutive_hysteresis`` false, ``min_loss_scale`` 1, no ceiling, raise at the floor).
SCALER_PRESETS: dict[str, ScalerConfig] = {
    "deepspeed_fp16": ScalerConfig(
        init_scale=2.0**16,
        growth_interval=1000,
        hysteresis=2,
        hysteresis_reset="growth",
        first_growth_delay=1,
        min_scale=1.0,
        max_scale=None,
        on_floor="raise",
    ),
}



def as_scaler_config(config: Any = None, *, field: str = "config") -> ScalerConfig:
    """Read what every backend's scaler accepts as its config, the same way everywhere.

    Accepted:

    * ``None``: ``ScalerConfig()`` (dynamic, torch's defaults);
    * an :class:`ScalerConfig`, returned as it is;
    * a name in :data:`SCALER_PRESETS` (``"deepspeed_fp16"``);
    * a dict with a ``"kind"`` key: :meth:`ScalerConfig.from_dict` (``to_dict()``'s form);
    * a policy (:class:`mpx.Policy`, a spec string such as ``"mixed_float16"``, or a
      policy dict): :meth:`ScalerConfig.for_policy`, dynamic for float16 compute, none otherwise.

    Raises:
        ScalerConfigError: for any other type, or a bad config dict, naming ``field``.
        PolicyError: for a string or dict that is not a policy spec.

    >>> as_scaler_config("mixed_float16").kind, as_scaler_config("mixed_bfloat16").kind
    ('dynamic', 'none')
    >>> as_scaler_config({"kind": "static", "init_scale": 128.0}).init_scale
    128.0
    """
    from mpx.policy import Policy, get_policy

    if config is None:
        return ScalerConfig()
    if isinstance(config, ScalerConfig):
        return config
    if isinstance(config, str) and config in SCALER_PRESETS:
        return SCALER_PRESETS[config]
    if isinstance(config, Mapping) and "kind" in config:
        return ScalerConfig.from_dict(config)  # its errors name the bad key
    if isinstance(config, (Policy, str, Mapping)):
        return ScalerConfig.for_policy(get_policy(config))
    raise ScalerConfigError(
        f"{field}: expected an mpx.ScalerConfig, its to_dict() dict, a scaler preset name "
        f"({', '.join(SCALER_PRESETS)}), a policy (mpx.Policy, spec string "
        f"or policy dict) or None, got {type(config).__name__}"
    )

@dataclass(frozen=True)
class ScalerState:
    """The state of one scaler: ``scale`` (a float32 value) and five counters
    (``nonfinite_since_growth`` counts only under ``hysteresis_reset="growth"``)."""

    scale: float
    growth_tracker: int = 0
    consecutive_nonfinite: int = 0
    steps: int = 0
    skipped_steps: int = 0
    nonfinite_since_growth: int = 0


def scaler_init(config: ScalerConfig) -> ScalerState:
    """The state before the first step."""
    return ScalerState(scale=config.first_scale)


def scaler_update(config: ScalerConfig, state: ScalerState, finite: bool) -> ScalerState:
    """The transition after one step whose gradients were ``finite`` (pure; host values).

    :func:`mpx.kernels.scale.update` run with the numpy table, the kernel every backend
    runs on its own arrays.  A step is skipped (its update not applied) when it is not
    finite and ``config.skip_nonfinite``.  A dynamic scale grows by ``growth_factor`` on the
    ``growth_interval``-th finite step in a row, up to ``max_scale`` (and never to a
    non-finite float32), and backs off by ``backoff_factor`` once ``hysteresis`` non-finite
    steps have come in a row, down to ``min_scale`` (:data:`SCALE_FLOOR` for None).  Each
    product is ``float32(float64(scale) * float64(factor))``.  The counters saturate at
    :data:`COUNTER_MAX`.

    Raises:
        MPXError: when ``finite`` is not a bool.
    """
    if not isinstance(finite, (bool, np.bool_)):
        raise MPXError(f"finite: expected a bool, got {finite!r} ({type(finite).__name__})")
    o = NUMPY_OPS
    arrays = _kernel.ScaleState(
        o.float32(state.scale), *(o.int32(getattr(state, name)) for name in _COUNTERS_IN_ORDER)
    )
    out = _kernel.update(o, config, arrays, np.bool_(finite))
    return ScalerState(float(out.scale), *(int(v) for v in out[1:]))


_COUNTERS_IN_ORDER = ("growth_tracker", "consecutive_nonfinite", "steps", "skipped_steps", "nonfinite_since_growth")


# -- state dicts -----------------------------------------------------------------
_COUNTERS = _COUNTERS_IN_ORDER
_KEYS = ("format", "config", "scale", *_COUNTERS)
#: Keys a state dict written before they existed may lack (read as 0).
_OPTIONAL = ("nonfinite_since_growth",)


def state_dict(config: ScalerConfig, state: ScalerState) -> dict[str, Any]:
    """The neutral, JSON-safe state dict every backend writes and reads.

    ``nonfinite_since_growth`` is written only where it counts (``hysteresis_reset="growth"``),
    so a default config's dict is the one earlier versions wrote."""
    names = _COUNTERS if config.hysteresis_reset == "growth" else _COUNTERS[:4]
    return {
        "format": STATE_DICT_FORMAT,
        "config": config.to_dict(),
        "scale": float(state.scale),
        **{name: int(getattr(state, name)) for name in names},
    }


def load_state_dict(data: Mapping[str, Any]) -> tuple[ScalerConfig, ScalerState]:
    """Validate a :func:`state_dict` dict and return its (config, state).

    Counters are ints in [0, 2**31 - 1] (:data:`COUNTER_MAX`), so every
    backend loads whatever this accepts.

    Raises:
        StateDictError: for a wrong format tag, missing or unknown keys, an
            invalid config, or any field a run of the state machine cannot
            produce (among them: growth_tracker > steps; growth_tracker and
            consecutive_nonfinite both positive; consecutive_nonfinite >
            skipped_steps with skipping on; a scale off its bounds).
    """
    err = StateDictError
    if not isinstance(data, Mapping):
        raise err(f"state dict: expected a mapping, got {type(data).__name__}")
    fmt = data.get("format")
    if not (isinstance(fmt, str) and fmt == STATE_DICT_FORMAT):
        raise err(f"format: expected {STATE_DICT_FORMAT!r}, got {_show(data.get('format'))}")
    missing = [k for k in _KEYS if k not in data and k not in _OPTIONAL]
    if missing:
        raise err(
            f"state dict: missing key {missing[0]!r}; a {STATE_DICT_FORMAT} dict has {', '.join(_KEYS)}"
        )
    unknown = [k for k in data if k not in _KEYS]
    if unknown:
        raise err(f"state dict: unknown key {_show(unknown[0])}; allowed: {', '.join(_KEYS)}")
    try:
        config = ScalerConfig.from_dict(data["config"])
    except ScalerConfigError as e:
        raise err(f"config: {e}") from None
    data = {**{name: 0 for name in _OPTIONAL}, **data}
    for name in _COUNTERS:
        value = data[name]
        if not _is_int(value) or not 0 <= value <= COUNTER_MAX:
            raise err(f"{name}: expected an int in [0, 2**31 - 1], got {_show(value)}")
    scale = data["scale"]
    x = _finite_float(scale)
    if x is None or x <= 0:
        raise err(f"scale: expected a finite positive number, got {_show(scale)}")
    if f32(x) != x:
        raise err(f"scale: {_show(scale)} is not a float32 value")
    if x < SCALE_FLOOR:
        raise err(f"scale: {_show(scale)} is below the smallest scale, 2**-126")
    state = ScalerState(x, *(int(data[name]) for name in _COUNTERS))
    if state.skipped_steps > state.steps or state.consecutive_nonfinite > state.steps:
        raise err("steps: skipped_steps and consecutive_nonfinite cannot exceed steps")
    if state.growth_tracker > state.steps:
        raise err(f"growth_tracker: {state.growth_tracker} cannot exceed steps {state.steps}")
    if state.growth_tracker and state.consecutive_nonfinite:
        raise err(
            "growth_tracker: a finite step resets consecutive_nonfinite and a non-finite one resets "
            f"growth_tracker, so both cannot be positive (got {state.growth_tracker} and "
            f"{state.consecutive_nonfinite})"
        )
    if config.skip_nonfinite and state.consecutive_nonfinite > state.skipped_steps:
        raise err(
            f"consecutive_nonfinite: {state.consecutive_nonfinite} cannot exceed skipped_steps "
            f"{state.skipped_steps} when every non-finite step is skipped"
        )
    since = state.nonfinite_since_growth
    if config.kind == "dynamic" and config.hysteresis_reset == "growth":
        if since > state.steps or since < state.consecutive_nonfinite:
            raise err(
                f"nonfinite_since_growth: {since} must lie in [consecutive_nonfinite, steps] = "
                f"[{state.consecutive_nonfinite}, {state.steps}]"
            )
    elif since:
        raise err(f"nonfinite_since_growth: counts only under hysteresis_reset='growth', got {since}")
    if config.kind == "dynamic":
        lo, hi = config.bounds
        if not lo <= state.scale <= hi:
            raise err(f"scale: {_show(scale)} lies outside [min_scale, max_scale] = [{lo}, {hi}]")
        if state.growth_tracker >= config.growth_interval + config.first_growth_delay:
            limit = f"growth_interval {config.growth_interval}" + (
                f" + first_growth_delay {config.first_growth_delay}" if config.first_growth_delay else ""
            )
            raise err(f"growth_tracker: {state.growth_tracker} must be below {limit}")
    else:
        if state.scale != config.first_scale:
            raise err(f"scale: a {config.kind} scaler's scale is {config.first_scale}, got {_show(scale)}")
        if state.growth_tracker != 0:
            raise err(f"growth_tracker: a {config.kind} scaler never counts, got {state.growth_tracker}")
    if not config.skip_nonfinite and state.skipped_steps:
        raise err("skipped_steps: this config never skips, but the state counts skipped steps")
    return config, state
