"""The scaler surface every backend shares, as checks a backend's tests run against its scaler.

mpx's promise is one vocabulary: torch's ``GradScaler``, the Keras
``LossScaleOptimizer`` and JAX's ``LossScale`` take the same config forms, give
the current scale with ``get_scale()`` (a Python float) and the state as an
:class:`mpx.ScalerState`, multiply a loss with ``scale(...)``, save and load
``mpx.scaler/1`` dicts with ``state_dict()``/``load_state_dict(state_dict)``,
record their history with ``record_history()``/``history()``, say whether the
last step was skipped with ``last_step_skipped()``, and raise the same error for
the same misuse.  This module writes that contract down once;
each backend's ``tests/<backend>/test_surface.py`` runs every check in
:data:`SURFACE_CHECKS` with a small :class:`ScalerAdapter` that knows how to make
a scaler and run one optimizer step in that framework.  It imports no framework
(and no test runner).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Protocol

from mpx.errors import PolicyError, ScalerConfigError, ScalerFloorError, ScalerStuckError, StateDictError
from mpx.history import ScalerHistory
from mpx.policy import get_policy
from mpx.scaling import (
    SCALER_PRESETS,
    ScalerConfig,
    ScalerState,
    as_scaler_config,
    scaler_init,
    scaler_update,
    state_dict,
)

__all__ = ["SURFACE_CHECKS", "SURFACE_NAMES", "ScalerAdapter"]

#: The public names every backend's scaler object has, with the same meaning.  The methods among them:
#: ``get_scale()`` (a Python float), ``scale(x)`` (``x`` times the scale), ``state_dict()``,
#: ``load_state_dict(state_dict)``, ``record_history(enabled=True, *, capacity=65536)`` (start or stop
#: recording the state after each step, on device), ``history()`` (an :class:`mpx.ScalerHistory`) and
#: ``last_step_skipped()`` (a bool scalar of the framework: no host read).
SURFACE_NAMES = (
    "config",
    "state",
    "get_scale",
    "scale",
    "state_dict",
    "load_state_dict",
    "record_history",
    "history",
    "last_step_skipped",
)
#: The methods of :data:`SURFACE_NAMES` whose parameters every backend names alike (checked by signature).
SURFACE_PARAMETERS = {"load_state_dict": ("state_dict",), "record_history": ("enabled", "capacity")}


class ScalerAdapter(Protocol):
    """How a backend's test drives its scaler; every method returns the scaler to use next
    (the same object for torch and Keras, a new value for JAX's immutable ``LossScale``)."""

    def make(self, config: Any) -> Any:
        """The backend's scaler object built from ``config`` (any form :func:`mpx.as_scaler_config` reads)."""

    def step(self, scaler: Any, finite: bool) -> Any:
        """One optimizer step whose scaled gradients are finite or not (eagerly)."""

    def multiply(self, scaler: Any, value: float) -> float:
        """``scaler.scale(x)`` for a framework scalar ``x`` holding ``value``, read back as a float."""

    def load(self, scaler: Any, data: dict[str, Any]) -> Any:
        """``scaler.load_state_dict(data)``."""

    def history(self, config: ScalerConfig, flags: list[bool]) -> ScalerHistory:
        """The backend's recorded history of a fresh scaler over ``flags`` steps (``record_history()``,
        the steps, ``history()``)."""


def _raises(error: type[BaseException], match: str, fn: Callable[[], Any]) -> BaseException:
    try:
        fn()
    except error as exc:
        assert match in str(exc), f"{type(exc).__name__} {str(exc)!r} does not say {match!r}"
        return exc
    raise AssertionError(f"expected {error.__name__} ({match!r})")


def check_names(adapter: ScalerAdapter) -> None:
    import inspect

    scaler = adapter.make(None)
    missing = [name for name in SURFACE_NAMES if not hasattr(type(scaler), name) and not hasattr(scaler, name)]
    assert not missing, f"{type(scaler).__name__} lacks {missing}"
    for name in ("get_scale", "scale", "state_dict", "load_state_dict", "record_history", "history",
                 "last_step_skipped"):  # fmt: skip
        assert callable(getattr(scaler, name)), f"{type(scaler).__name__}.{name} is not a method"
    for name, wanted in SURFACE_PARAMETERS.items():
        params = list(inspect.signature(getattr(scaler, name)).parameters)
        assert params[: len(wanted)] == list(wanted), f"{type(scaler).__name__}.{name}{tuple(params)}: want {wanted}"


def check_config_forms(adapter: ScalerAdapter) -> None:
    forms = [
        None,
        ScalerConfig(growth_interval=3, init_scale=256.0),
        {"kind": "static", "init_scale": 8.0},
        "mixed_float16",
        "bf16-mixed",
        get_policy("params=float32,compute=float16"),
        get_policy("mixed_bfloat16").to_dict(),
    ]
    for form in forms:
        assert adapter.make(form).config == as_scaler_config(form), form


def check_bad_config(adapter: ScalerAdapter) -> None:
    _raises(ScalerConfigError, "config: expected an mpx.ScalerConfig", lambda: adapter.make(3.5))
    _raises(
        ScalerConfigError, "unknown key", lambda: adapter.make({"kind": "dynamic", "growth_intervall": 2})
    )
    _raises(PolicyError, "mixed_float17", lambda: adapter.make("mixed_float17"))


def check_fresh_state(adapter: ScalerAdapter) -> None:
    for config in (ScalerConfig(), ScalerConfig(kind="static", init_scale=8.0), ScalerConfig(kind="none")):
        scaler = adapter.make(config)
        scale = scaler.get_scale()
        assert type(scale) is float and scale == config.first_scale, (config.kind, scale)
        assert isinstance(scaler.state, ScalerState) and scaler.state == scaler_init(config)


def check_trace(adapter: ScalerAdapter) -> None:
    config = ScalerConfig(growth_interval=2, init_scale=4.0, backoff_factor=0.25)
    scaler, ref = adapter.make(config), scaler_init(config)
    for finite in (True, True, False, True, False, False, True, True):
        scaler, ref = adapter.step(scaler, finite), scaler_update(config, ref, finite)
        assert scaler.state == ref, (scaler.state, ref)
        assert scaler.get_scale() == ref.scale


def check_scale_multiplies(adapter: ScalerAdapter) -> None:
    scaler = adapter.make(ScalerConfig(init_scale=1024.0))
    assert adapter.multiply(scaler, 3.0) == 3.0 * 1024.0


def check_state_dict_round_trip(adapter: ScalerAdapter) -> None:
    config = ScalerConfig(growth_interval=3, init_scale=64.0, max_consecutive_skips=50)
    scaler = adapter.make(config)
    for finite in (True, False, True):
        scaler = adapter.step(scaler, finite)
    saved = scaler.state_dict()
    assert saved == state_dict(config, scaler.state)
    restored = adapter.load(adapter.make(None), json.loads(json.dumps(saved)))
    assert restored.config == config and restored.state == scaler.state


def check_bad_state_dict_changes_nothing(adapter: ScalerAdapter) -> None:
    scaler = adapter.step(adapter.make(ScalerConfig(init_scale=32.0)), True)
    before_config, before_state = scaler.config, scaler.state
    bad = {**scaler.state_dict(), "scale": -1.0}
    _raises(StateDictError, "scale", lambda: adapter.load(scaler, bad))
    assert scaler.config == before_config and scaler.state == before_state
    _raises(
        StateDictError, "format", lambda: adapter.load(scaler, {**bad, "scale": 32.0, "format": "other/1"})
    )


def check_stuck(adapter: ScalerAdapter) -> None:
    scaler = adapter.step(adapter.make(ScalerConfig(max_consecutive_skips=2)), False)
    _raises(ScalerStuckError, "2 steps in a row skipped", lambda: adapter.step(scaler, False))


def check_history(adapter: ScalerAdapter) -> None:
    config = ScalerConfig(growth_interval=2, init_scale=16.0)
    flags = [True, True, False, True, True, True]
    assert adapter.history(config, flags) == ScalerHistory.reference(config, flags)
    # DeepSpeed's mode: growth on the 3rd clean step (window 2 + 1), hysteresis 2 refilled only by a growth,
    # so the overflow at step 6 backs off though a clean step came between (DeepSpeed's own trace)
    ds = ScalerConfig(**{**SCALER_PRESETS["deepspeed_fp16"].to_dict(), "init_scale": 16.0, "growth_interval": 2})
    flags = [True, True, True, False, True, False, True, True, True]
    h = adapter.history(ds, flags)
    assert h == ScalerHistory.reference(ds, flags)
    assert h.scale == [16.0, 16.0, 32.0, 32.0, 32.0, 16.0, 16.0, 16.0, 32.0]
    assert [i + 1 for i, g in enumerate(h.growth) if g] == [3, 9]
    assert [i + 1 for i, b in enumerate(h.backoff) if b] == [6] and [i + 1 for i, s in enumerate(h.skipped) if s] == [4, 6]


def check_skip_flag(adapter: ScalerAdapter) -> None:
    for config in (ScalerConfig(init_scale=8.0), ScalerConfig(init_scale=8.0, skip_nonfinite=False)):
        scaler = adapter.make(config)
        for finite in (True, False, False, True):
            scaler = adapter.step(scaler, finite)
            skipped = scaler.last_step_skipped()
            assert bool(skipped) is ((not finite) and config.skip_nonfinite), (config.skip_nonfinite, finite)


def _deepspeed_mode(**changes: Any) -> ScalerConfig:
    """DeepSpeed's rule (:data:`mpx.SCALER_PRESETS` ``deepspeed_fp16``) at a size a test runs."""
    fields = {**SCALER_PRESETS["deepspeed_fp16"].to_dict(), "init_scale": 64.0, "growth_interval": 2, **changes}
    return ScalerConfig(**fields)


def check_deepspeed_mode(adapter: ScalerAdapter) -> None:
    """DeepSpeed's modes (refill on growth or on any finite step, the delayed first growth) trace as
    :func:`mpx.scaler_update` does, and the preset's name is a config form."""
    assert adapter.make("deepspeed_fp16").config == SCALER_PRESETS["deepspeed_fp16"]
    flags = (True, True, True, False, True, False, True, True, True, True, False, False, True, True)
    for reset in ("growth", "finite"):
        config = _deepspeed_mode(hysteresis_reset=reset)
        scaler, ref = adapter.make(config), scaler_init(config)
        for finite in flags:
            scaler, ref = adapter.step(scaler, finite), scaler_update(config, ref, finite)
            assert scaler.state == ref, (reset, scaler.state, ref)
        assert ref.nonfinite_since_growth == (0 if reset == "finite" else 2)


def check_deepspeed_state_dict(adapter: ScalerAdapter) -> None:
    """The ``nonfinite_since_growth`` counter is saved and restored, into a scaler built without it too."""
    config = _deepspeed_mode()
    scaler = adapter.make(config)
    for finite in (True, True, True, False):
        scaler = adapter.step(scaler, finite)
    saved = scaler.state_dict()
    assert saved["nonfinite_since_growth"] == 1 and saved == state_dict(config, scaler.state)
    restored = adapter.load(adapter.make(None), json.loads(json.dumps(saved)))
    assert restored.config == config and restored.state == scaler.state


def check_floor(adapter: ScalerAdapter) -> None:
    """``on_floor="raise"``: reaching ``min_scale`` does not raise; the next back-off due there does."""
    scaler = adapter.step(adapter.make(_deepspeed_mode(init_scale=2.0, hysteresis=1)), False)
    assert scaler.get_scale() == 1.0
    _raises(ScalerFloorError, "step 2 overflowed with the scale at min_scale", lambda: adapter.step(scaler, False))


#: Every check, by name: ``@pytest.mark.parametrize("check", SURFACE_CHECKS.values(), ids=SURFACE_CHECKS)``.
SURFACE_CHECKS: dict[str, Callable[[ScalerAdapter], None]] = {
    "names": check_names,
    "config_forms": check_config_forms,
    "bad_config": check_bad_config,
    "fresh_state": check_fresh_state,
    "trace": check_trace,
    "scale_multiplies": check_scale_multiplies,
    "state_dict_round_trip": check_state_dict_round_trip,
    "bad_state_dict_changes_nothing": check_bad_state_dict_changes_nothing,
    "stuck": check_stuck,
    "history": check_history,
    "skip_flag": check_skip_flag,
    "deepspeed_mode": check_deepspeed_mode,
    "deepspeed_state_dict": check_deepspeed_state_dict,
    "floor": check_floor,
}
