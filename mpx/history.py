"""Scaler history: the loss scale and the state machine's events per step, framework-neutral.

Every backend records, per step and on its device, the float32 scale after the step
and the step's events as the kernel's transition decides them
(:func:`mpx.kernels.scale.events`, the conditions :func:`mpx.kernels.scale.update`
selects on), and reads them back in one transfer, so the events have one definition,
the kernel's, in every mode of the scaler (DeepSpeed's ``hysteresis_reset="growth"``
and ``first_growth_delay`` too):

* ``skipped``: the step's update was skipped (non-finite, with ``skip_nonfinite``);
* ``growth``: a growth step of a dynamic scaler (the ``growth_interval``-th finite
  step in a row, ``+ first_growth_delay`` after an overflow or the start), even when
  ``max_scale`` keeps the scale where it was;
* ``backoff``: a backoff step of a dynamic scaler (its hysteresis spent), even when
  ``min_scale`` keeps the scale where it was.

``steps`` are the state's step numbers (1 for the first step after a fresh
state).  The JSON file (:meth:`save`, :meth:`load`) is :meth:`to_dict`::

    {"format": "mpx.scaler_history/1", "config": {...ScalerConfig.to_dict()...},
     "steps": [1, 2, ...], "scale": [65536.0, ...], "skipped": [false, ...],
     "growth": [...], "backoff": [...]}

``mpx history plot FILE --out PNG`` draws it.

>>> from mpx.scaling import ScalerConfig
>>> h = ScalerHistory.reference(ScalerConfig(growth_interval=2), [True, True, False])
>>> h.scale, h.growth, h.backoff, h.skipped
([65536.0, 131072.0, 65536.0], [False, True, False], [False, False, True], [False, False, True])
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpx.errors import MPXError
from mpx.kernels import scale as _scale
from mpx.kernels.array_ops import NUMPY_OPS
from mpx.scaling import COUNTER_MAX, ScalerConfig, ScalerState, f32, scaler_init, scaler_update

__all__ = ["HISTORY_FORMAT", "HistoryError", "ScalerHistory"]

#: The ``format`` tag of a scaler history dict / JSON file.
HISTORY_FORMAT = "mpx.scaler_history/1"
_SERIES = ("steps", "scale", "skipped", "growth", "backoff")


_STATE_COUNTERS = ("growth_tracker", "consecutive_nonfinite", "steps", "skipped_steps", "nonfinite_since_growth")


def decode_events(bits: int) -> tuple[bool, bool, bool]:
    """(skipped, growth, backoff) of the kernel's event bits (:data:`mpx.kernels.scale.SKIPPED` ...)."""
    return bool(bits & _scale.SKIPPED), bool(bits & _scale.GROWTH), bool(bits & _scale.BACKOFF)


def encode_events(skipped: bool, growth: bool, backoff: bool) -> int:
    """The kernel's event bits of (skipped, growth, backoff): :func:`decode_events`'s inverse."""
    return _scale.SKIPPED * skipped + _scale.GROWTH * growth + _scale.BACKOFF * backoff


class HistoryError(MPXError):
    """A scaler history (dict or file) is malformed."""


@dataclass(frozen=True)
class ScalerHistory:
    """Per-step loss scale and events of one scaler (parallel lists, one entry per step).

    Attributes:
        config: the scaler's :class:`mpx.ScalerConfig`.
        steps: step numbers (ints >= 1).
        scale: the scale after each step (float32 values).
        skipped, growth, backoff: the step's events (bools, see the module docs).
    """

    config: ScalerConfig
    steps: list[int] = field(default_factory=list)
    scale: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    growth: list[bool] = field(default_factory=list)
    backoff: list[bool] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.steps)

    # -- building --------------------------------------------------------------
    @staticmethod
    def events(config: ScalerConfig, before: ScalerState, after: ScalerState) -> tuple[bool, bool, bool]:
        """(skipped, growth, backoff) of the step from ``before`` to ``after`` (pure):
        :func:`mpx.kernels.scale.events` with the numpy table."""
        o = NUMPY_OPS
        new = _scale.ScaleState(o.float32(after.scale), *(o.int32(getattr(after, k)) for k in _STATE_COUNTERS))
        return decode_events(int(_scale.events(o, config, o.int32(before.growth_tracker), new)))

    @classmethod
    def from_events(
        cls, config: ScalerConfig, steps: int | Sequence[int], scales: Sequence[float], events: Sequence[int]
    ) -> ScalerHistory:
        """A history from the scale after each step and the step's event bits (:func:`mpx.kernels.scale.events`).

        ``steps``: the step numbers, or the first one (then ``steps, steps + 1, ...``).
        """
        if isinstance(steps, int):
            steps = [min(steps + i, COUNTER_MAX) for i in range(len(scales))]
        if not (len(steps) == len(scales) == len(events)):
            raise HistoryError("history: steps, scales and events must have the same length")
        rows = [decode_events(int(e)) for e in events]
        return cls(
            config,
            steps=[int(x) for x in steps],
            scale=[f32(float(s)) for s in scales],
            skipped=[r[0] for r in rows],
            growth=[r[1] for r in rows],
            backoff=[r[2] for r in rows],
        )

    @classmethod
    def from_rows(cls, config: ScalerConfig, rows: Any, recorded: int) -> ScalerHistory:
        """A history from a backend's ring buffer of recorded rows (the one row layout every backend uses).

        ``rows``: an integer array of shape ``(capacity, 4)``, one row per step
        (:data:`mpx.kernels.ring.ROW_FIELDS`): ``[float32 bits of the scale, the step's event bits,
        consecutive_nonfinite, steps]``
        (the scale's bits in the low 32 bits, read as a signed or unsigned int).
        ``recorded``: how many rows were ever written; row ``i`` went to slot
        ``i % capacity``, so when ``recorded > capacity`` the oldest rows were
        overwritten and the history holds the last ``capacity`` steps.

        >>> import numpy as np
        >>> bits = int(np.float32(65536.0).view(np.int32))
        >>> h = ScalerHistory.from_rows(ScalerConfig(), np.array([[bits, 2, 0, 1], [0, 0, 0, 0]]), 1)
        >>> h.scale, h.growth
        ([65536.0], [True])
        """
        import numpy as np

        table = np.asarray(rows, dtype=np.int64)
        if table.ndim != 2 or table.shape[1] != 4:
            raise HistoryError(f"history: rows must have shape (capacity, 4), got {table.shape}")
        capacity, recorded = table.shape[0], int(recorded)
        n = min(recorded, capacity)
        if recorded > capacity:
            start = recorded % capacity
            table = np.concatenate([table[start:], table[:start]])
        table = table[:n]
        scales = (table[:, 0] & 0xFFFFFFFF).astype(np.uint32).view(np.float32).tolist()
        return cls.from_events(config, table[:, 3].tolist(), scales, table[:, 1].tolist())

    @classmethod
    def reference(
        cls, config: ScalerConfig, flags: Iterable[bool], state: ScalerState | None = None
    ) -> ScalerHistory:
        """The history :func:`mpx.scaler_update` produces for the finite ``flags``, from ``state`` (default fresh)."""
        s = scaler_init(config) if state is None else state
        first = s.steps + 1
        scales, events = [], []
        for finite in flags:
            before, s = s, scaler_update(config, s, finite)
            scales.append(s.scale)
            events.append(encode_events(*cls.events(config, before, s)))
        return cls.from_events(config, first, scales, events)

    def extend(self, other: ScalerHistory) -> ScalerHistory:
        """This history followed by ``other`` (a new object)."""
        return ScalerHistory(
            other.config,
            *(getattr(self, k) + getattr(other, k) for k in _SERIES),  # type: ignore[arg-type]
        )

    # -- files -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON-safe dict (format ``mpx.scaler_history/1``)."""
        return {"format": HISTORY_FORMAT, "config": self.config.to_dict(),
                **{k: list(getattr(self, k)) for k in _SERIES}}  # fmt: skip

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ScalerHistory:
        """Read :meth:`to_dict` back.

        Raises:
            HistoryError: for a wrong format tag, a missing key, series of different lengths or bad values.
        """
        if not isinstance(data, Mapping):
            raise HistoryError(f"history: expected a mapping, got {type(data).__name__}")
        if data.get("format") != HISTORY_FORMAT:
            raise HistoryError(f"format: expected {HISTORY_FORMAT!r}, got {str(data.get('format'))[:60]!r}")
        missing = [k for k in ("config", *_SERIES) if k not in data]
        if missing:
            raise HistoryError(f"history: missing key {missing[0]!r}")
        try:
            config = ScalerConfig.from_dict(data["config"])
        except MPXError as e:
            raise HistoryError(f"config: {e}") from None
        series = {k: data[k] for k in _SERIES}
        for k, v in series.items():
            if not isinstance(v, list):
                raise HistoryError(f"{k}: expected a list, got {type(v).__name__}")
        if len({len(v) for v in series.values()}) > 1:
            raise HistoryError("history: steps, scale, skipped, growth and backoff must have the same length")
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in series["steps"]):
            raise HistoryError("steps: expected ints >= 1")
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0
                   for x in series["scale"]):  # fmt: skip
            raise HistoryError("scale: expected finite positive numbers")
        for k in ("skipped", "growth", "backoff"):
            if not all(isinstance(x, bool) for x in series[k]):
                raise HistoryError(f"{k}: expected true/false values")
        return cls(config, [int(x) for x in series["steps"]], [float(x) for x in series["scale"]],
                   *(list(series[k]) for k in ("skipped", "growth", "backoff")))  # fmt: skip

    def save(self, path: str | Path) -> Path:
        """Write the JSON file; returns its path."""
        path = Path(path)
        path.write_text(json.dumps(self.to_dict()) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> ScalerHistory:
        """Read a file written by :meth:`save`.

        Raises:
            HistoryError: when the file cannot be read, is not JSON, or is not a scaler history.
        """
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise HistoryError(
                f"{path}: cannot read the history file ({e.__class__.__name__}: {e})"
            ) from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise HistoryError(f"{path}: not a JSON scaler history ({e})") from None
        return cls.from_dict(data)
