"""The state machine for eager use on host values: :class:`LossScaler`, the core's scaler object.

It has the surface every backend's scaler has (:data:`mpx.testing.SURFACE_NAMES`), on Python
values: the transition is :func:`mpx.scaler_update` (the one kernel, run with the numpy table),
the history the same ring buffer every backend keeps (:mod:`mpx.kernels.ring`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from mpx.errors import MPXError
from mpx.history import ScalerHistory, encode_events
from mpx.kernels import ring as _ring
from mpx.kernels.array_ops import NUMPY_OPS
from mpx.scaling import (
    ScalerConfig,
    ScalerState,
    as_scaler_config,
    load_state_dict,
    scaler_init,
    scaler_update,
    state_dict,
)
from mpx.stuck import check_floor, floor_hit

__all__ = ["LossScaler"]


class LossScaler:
    """The state machine for eager use: holds a config and the current state.

    >>> scaler = LossScaler(ScalerConfig(growth_interval=1))
    >>> _ = scaler.update(True)
    >>> scaler.get_scale(), float(scaler.scale(0.5))
    (131072.0, 65536.0)
    >>> LossScaler.from_state_dict(scaler.state_dict()).state == scaler.state
    True
    """

    def __init__(self, config: ScalerConfig | Mapping[str, Any] | str | None = None) -> None:
        config = as_scaler_config(config)
        self._config = config
        self._state = scaler_init(config)
        self._history: tuple[np.ndarray, Any] | None = None  # the ring's rows and count

    @property
    def config(self) -> ScalerConfig:
        """The configuration (read-only)."""
        return self._config

    @property
    def state(self) -> ScalerState:
        """The current state (an immutable value)."""
        return self._state

    def scale(self, x: Any) -> Any:
        """``x`` (a number or a numpy array, usually the loss) times the current scale, in float32 at least:
        what every backend's ``scale(loss)`` returns, on host values."""
        value = np.asarray(x)
        dtype = np.result_type(value.dtype, np.float32) if value.dtype.kind == "f" else np.float32
        with np.errstate(over="ignore", invalid="ignore"):
            out = value.astype(dtype) * dtype.type(self._state.scale)
        return out

    def get_scale(self) -> float:
        """The current loss scale as a Python float (every backend's scaler has this method)."""
        return self._state.scale

    def update(self, finite: bool) -> bool:
        """Advance one step; returns True when this step's update must be skipped."""
        previous = self._state
        self._state = s = scaler_update(self._config, previous, finite)
        if self._history is not None:
            o = NUMPY_OPS
            events = encode_events(*ScalerHistory.events(self._config, previous, s))
            row = _ring.row(o, np.float32(s.scale), events, s.consecutive_nonfinite, s.steps)
            self._history = _ring.record(o, *self._history, row)
        if self._config.on_floor == "raise":  # mpx.stuck: after the step, as every backend
            check_floor(self._config, floor_hit(self._config, previous, s), s.steps, s.scale)
        return s.skipped_steps != previous.skipped_steps

    def last_step_skipped(self) -> bool:
        """Whether the last :meth:`update` skipped its step (False before the first)."""
        return ScalerHistory.events(self._config, self._state, self._state)[0]  # skipped: from the state after

    def record_history(self, enabled: bool = True, *, capacity: int = 65536) -> None:
        """Start (or with False stop) recording the state after each :meth:`update` (the last ``capacity``
        steps, default 65536, in the ring buffer every backend keeps: :mod:`mpx.kernels.ring`); starting
        again clears the record.

        Raises:
            MPXError: for a ``capacity`` that is not an int in [1, 2**31 - 1].
        """
        if not enabled:
            self._history = None
            return
        rows = np.zeros((_ring.check_capacity(capacity), len(_ring.ROW_FIELDS)), np.int32)
        self._history = (rows, np.int32(0))

    def history(self) -> ScalerHistory:
        """The recorded steps as an :class:`mpx.ScalerHistory`.

        Raises:
            MPXError: when :meth:`record_history` was not called.
        """
        if self._history is None:
            raise MPXError("history: not recording; call scaler.record_history() before the steps.")
        rows, recorded = self._history
        return ScalerHistory.from_rows(self._config, rows, int(recorded))

    def state_dict(self) -> dict[str, Any]:
        """The neutral JSON-safe state dict (format ``mpx.scaler/1``)."""
        return state_dict(self._config, self._state)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore config and state from a state dict (any backend's); on error nothing changes."""
        self._config, self._state = load_state_dict(state_dict)

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, Any]) -> LossScaler:
        """A scaler resumed from a state dict."""
        scaler = cls()
        scaler.load_state_dict(state_dict)
        return scaler

    def __repr__(self) -> str:
        return f"LossScaler(kind={self._config.kind!r}, scale={self.get_scale()}, steps={self._state.steps})"
