"""What the compare workers share (framework-free): the batch order, the run record, the loop settings."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Settings", "batches", "record"]


@dataclass(frozen=True)
class Settings:
    """How each run trains: ``epochs`` over the training set in batches of ``batch_size``, Adam at ``lr``.

    ``max_steps`` (None: no limit) stops a run early (tests); ``device`` is the framework's device name.
    """

    epochs: int = 5
    batch_size: int = 64
    lr: float = 1e-3
    max_steps: int | None = None
    device: str = "cpu"


def batches(n: int, settings: Settings, seed: int) -> Iterator[np.ndarray]:
    """Index arrays of each step: a fresh permutation per epoch from ``seed`` (the same for every policy)."""
    rng = np.random.default_rng(seed)
    steps = 0
    for _ in range(settings.epochs):
        order = rng.permutation(n)
        for start in range(0, n - settings.batch_size + 1, settings.batch_size):
            if settings.max_steps is not None and steps >= settings.max_steps:
                return
            steps += 1
            yield order[start : start + settings.batch_size]


def record(backend: str, policy: str, seed: int, losses: list[float], scales: list[float], skipped: int,
           val_loss: float, val_accuracy: float, seconds: float, history: Any = None,
           fp8_layers: int = 0) -> dict[str, Any]:  # fmt: skip
    """One run as ``compare.json`` stores it (losses and scales per optimizer step; accuracy in [0, 1]).

    ``fp8_layers``: how many layers ran FP8 GEMMs (0 without ``fp8=``).

    ``history``: the scaler's :class:`mpx.ScalerHistory` (one entry per step): when it covers every step,
    ``scales`` and ``skipped`` come from it and it is stored too (``history``, its ``to_dict()``).
    """
    extra: dict[str, Any] = {}
    if history is not None and len(history) == len(losses) and len(history):
        scales, skipped = history.scale, sum(history.skipped)
        extra["history"] = history.to_dict()
    return {**extra, "backend": backend, "policy": policy, "seed": seed, "steps": len(losses),
            "losses": [float(x) if math.isfinite(x) else None for x in losses],
            "scales": [float(s) for s in scales], "skipped_steps": int(skipped),
            "final_scale": float(scales[-1]) if scales else None, "val_loss": float(val_loss),
            "val_accuracy": float(val_accuracy), "fp8_layers": int(fp8_layers),
            "seconds": round(seconds, 3)}  # fmt: skip


def run_all(train: Callable[[str, int], dict[str, Any]], policies: list[str], seeds: list[int],
            progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """float32 then every policy, for every seed; ``train(policy, seed)`` returns a :func:`record`."""
    out = []
    runs = [(p, s) for s in seeds for p in ["float32", *[p for p in policies if p != "float32"]]]
    for i, (policy, seed) in enumerate(runs):
        if progress is not None:
            progress(f"run {i + 1}/{len(runs)}: {policy} seed {seed}")
        out.append(train(policy, seed))
    return out
