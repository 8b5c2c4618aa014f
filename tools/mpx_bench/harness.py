"""The framework-free part of a bench worker: warm-up, budget, interleaved rounds, JSON lines.

A backend module (``mpx_bench.workers.<name>``) builds a list of :class:`Config`;
:func:`run_configs` warms each one up (the first call, which traces and
compiles, is timed on its own), drops or shortens configurations that would
not fit the per-configuration time budget, then runs the timed steps
interleaved, one step of each configuration per round (A B C A B C ...), so
that drift on the machine hits every configuration alike.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from mpx_tools.workers import Emitter

__all__ = ["Config", "run_configs"]


@dataclasses.dataclass
class Config:
    """One configuration to time: ``make()`` returns a :class:`Runner`-like object.

    The object has ``step()`` (one full training step, blocking until the
    device is done) and may have ``measure() -> dict`` (extra figures measured
    once, after the timed steps: activation bytes, traces, host transfers).
    """

    id: str
    policy: str
    mode: str  # fp32 | native | native-noscale | mpx | mpx-noscale
    make: Callable[[], Any]
    skip: str | None = None  # a reason to skip it without building it


def _now() -> float:
    return time.perf_counter()


def run_configs(
    configs: list[Config], *, steps: int, warmup: int, budget_s: float, emit: Emitter
) -> list[dict[str, Any]]:
    """Time every configuration; emits ``progress`` and ``config`` lines and returns the config records."""
    records: dict[str, dict[str, Any]] = {}
    runners: dict[str, Any] = {}
    for cfg in configs:
        rec: dict[str, Any] = {"id": cfg.id, "policy": cfg.policy, "mode": cfg.mode, "skipped": cfg.skip,
                               "times_s": [], "first_call_s": None, "warmup_s": [], "build_s": None}  # fmt: skip
        records[cfg.id] = rec
        if cfg.skip:
            emit("progress", phase="skip", config=cfg.id, note=cfg.skip)
            continue
        emit("progress", phase="warmup", config=cfg.id)
        try:
            t0 = _now()
            runner = cfg.make()
            rec["build_s"] = _now() - t0
            t0 = _now()
            runner.step()
            rec["first_call_s"] = _now() - t0
            for _ in range(max(0, warmup - 1)):
                if rec["first_call_s"] + sum(rec["warmup_s"]) > budget_s / 2:
                    break
                t0 = _now()
                runner.step()
                rec["warmup_s"].append(_now() - t0)
        except Exception as err:  # a backend that cannot run this configuration
            rec["skipped"] = (
                f"failed: {type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"
            )
            emit("progress", phase="skip", config=cfg.id, note=rec["skipped"])
            continue
        if not rec["warmup_s"] and warmup > 1:
            rec["skipped"] = (f"skipped: its first step took {rec['first_call_s']:.1f} s (compilation included), over "
                              f"half the per-configuration budget of {budget_s:g} s (--budget)")  # fmt: skip
            emit("progress", phase="skip", config=cfg.id, note=rec["skipped"])
            continue
        # without a warm-up step after the first call (--warmup 1) there is no estimate of a step without
        # compilation: every configuration runs all its steps
        per_step = min(rec["warmup_s"]) if rec["warmup_s"] else 0.0
        left = budget_s - rec["first_call_s"] - sum(rec["warmup_s"])
        rounds = steps if per_step * steps <= left else int(left // max(per_step, 1e-9))
        if rounds < 2:
            rec["skipped"] = (f"skipped: one step takes {per_step:.2f} s: fewer than 2 timed steps fit the "
                              f"per-configuration budget of {budget_s:g} s (--budget)")  # fmt: skip
            emit("progress", phase="skip", config=cfg.id, note=rec["skipped"])
            continue
        if rounds < steps:
            rec["note"] = (
                f"capped at {rounds} of {steps} steps by the {budget_s:g} s per-configuration budget"
            )
        rec["rounds"] = rounds
        runners[cfg.id] = runner
    total = max((r.get("rounds", 0) for r in records.values()), default=0)
    for i in range(total):
        emit("progress", phase="timed", round=i + 1, rounds=total)
        for cid, runner in runners.items():
            rec = records[cid]
            if i >= rec["rounds"]:
                continue
            t0 = _now()
            runner.step()
            rec["times_s"].append(_now() - t0)
    for cid, runner in runners.items():
        measure = getattr(runner, "measure", None)
        if measure is None:
            continue
        emit("progress", phase="measure", config=cid)
        try:
            records[cid].update(measure())
        except Exception as err:  # a measurement the framework refuses is reported, not fatal
            records[cid]["measure_error"] = f"{type(err).__name__}: {err}"[:300]
    out = []
    for rec in records.values():
        emit("config", **rec)
        out.append(rec)
    return out
