"""``mpx compare``'s driver: one worker process per backend, then the summary (imports no framework).

``compare.json`` (format ``"mpx.compare/1"``):

* ``format``, ``mpx_version``, ``created`` (UTC), ``command``, ``seconds``, ``machine`` (as ``mpx bench``);
* ``settings``: ``model``, ``dataset``, ``policies``, ``seeds``, ``epochs``, ``batch_size``, ``lr``,
  ``max_steps``, ``criterion_points``, ``device``;
* ``backends``: name -> ``status`` (``ok`` | ``not installed`` | ``failed``), ``versions``, ``device``,
  ``seconds``, ``error``;
* ``runs``: one per backend, policy (``float32`` included) and seed: ``losses`` (training loss per
  optimizer step, None where non-finite), ``scales`` (the loss scale after each step), ``skipped_steps``,
  ``final_scale``, ``val_loss``, ``val_accuracy`` (a fraction), ``seconds``;
* ``summary``: one per backend and policy: ``val_accuracy`` and ``val_loss`` (mean over seeds),
  ``delta_points`` (accuracy minus float32's in percentage points, paired by seed: ``mean``, ``min``,
  ``max``, ``std``, ``n``), ``passed`` (``|mean delta| <= criterion_points``; None for float32),
  ``skipped_steps`` (mean), ``final_scale`` (mean), ``fp8_layers`` (layers that ran FP8 GEMMs) and,
  for a policy with ``fp8=`` whose policy without FP8 ran too (``mixed_bfloat16_fp8`` next to
  ``mixed_bfloat16``), ``vs_without_fp8``: ``policy`` (that one) and ``mean`` (accuracy delta to it in
  percentage points, paired by seed); None otherwise.  Runs also hold ``fp8_layers``.
"""

from __future__ import annotations

import dataclasses
import datetime
import statistics
import time
from collections.abc import Sequence
from typing import Any

import mpx
from mpx_tools.machine import machine_info
from mpx_tools.workers import FRAMEWORKS as BACKENDS
from mpx_tools.workers import Progress, is_installed, run_worker

__all__ = ["FORMAT", "compare", "run", "summarize"]

FORMAT = "mpx.compare/1"


def _worker(backend: str, argv: list[str], progress: Progress, timeout_s: float | None
            ) -> tuple[list[dict[str, Any]], int, str]:  # fmt: skip
    start = time.monotonic()

    def show(row: dict[str, Any]) -> None:
        if row.get("type") == "progress":
            progress.show(f"[{backend} {time.monotonic() - start:5.0f}s] {row.get('text', '')}", force=True)

    return run_worker("mpx_compare.worker", [backend, *argv], show, timeout_s)


def summarize(runs: Sequence[dict[str, Any]], criterion_points: float = 0.5) -> list[dict[str, Any]]:
    """Per backend and policy: mean accuracy and loss, the delta to float32 per seed, pass/fail, skips, scale."""
    out = []
    keys = list(dict.fromkeys((r["backend"], r["policy"]) for r in runs))
    for backend, policy in keys:
        mine = [r for r in runs if r["backend"] == backend and r["policy"] == policy]
        base = {r["seed"]: r for r in runs if r["backend"] == backend and r["policy"] == "float32"}
        deltas = [100.0 * (r["val_accuracy"] - base[r["seed"]]["val_accuracy"]) for r in mine if r["seed"] in base]
        delta = None
        if deltas and policy != "float32":
            delta = {"mean": statistics.fmean(deltas), "min": min(deltas), "max": max(deltas),
                     "std": statistics.stdev(deltas) if len(deltas) > 1 else 0.0, "n": len(deltas)}  # fmt: skip
        scales = [r["final_scale"] for r in mine if r["final_scale"] is not None]
        vs = None
        without = _without_fp8(policy)
        half = {r["seed"]: r for r in runs if r["backend"] == backend and r["policy"] == without}
        paired = [100.0 * (r["val_accuracy"] - half[r["seed"]]["val_accuracy"]) for r in mine if r["seed"] in half]
        if without is not None and paired:
            vs = {"policy": without, "mean": statistics.fmean(paired), "n": len(paired)}
        out.append({"backend": backend, "policy": policy,
                    "val_accuracy": statistics.fmean(r["val_accuracy"] for r in mine),
                    "val_loss": statistics.fmean(r["val_loss"] for r in mine),
                    "delta_points": delta,
                    "passed": None if delta is None else abs(delta["mean"]) <= criterion_points,
                    "skipped_steps": statistics.fmean(r["skipped_steps"] for r in mine),
                    "final_scale": statistics.fmean(scales) if scales else None, "seeds": len(mine),
                    "fp8_layers": max(r.get("fp8_layers", 0) for r in mine), "vs_without_fp8": vs})  # fmt: skip
    return out


def _without_fp8(policy: str) -> str | None:
    """The name ``compare`` gives ``policy`` without its FP8 recipe (None: no ``fp8=`` or not a policy)."""
    try:
        p = mpx.get_policy(policy)
    except mpx.MPXError:
        return None
    if p.fp8 is None:
        return None
    base = dataclasses.replace(p, fp8=None)
    return str(base.name or base)


def _document(settings: dict[str, Any], command: list[str] | None) -> dict[str, Any]:
    return {"format": FORMAT, "mpx_version": mpx.__version__,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command, "machine": machine_info(), "settings": settings, "backends": {}, "runs": [],
            "summary": []}  # fmt: skip


def run(backends: list[str], *, model: str = "mlp", dataset: str = "digits", policies: Sequence[str] = (),
        seeds: int = 1, epochs: int = 5, batch_size: int = 64, lr: float = 1e-3, max_steps: int | None = None,
        criterion_points: float = 0.5, device: str = "cpu", timeout_s: float | None = 3600.0,
        quiet: bool = False, command: list[str] | None = None) -> dict[str, Any]:  # fmt: skip
    """Run every backend's worker and return the ``compare.json`` dict (see the module docs)."""
    policies = [str(mpx.get_policy(p).name or mpx.get_policy(p)) for p in policies or ("mixed_bfloat16",)]
    started = time.monotonic()
    progress = Progress(quiet)
    settings = {"model": model, "dataset": dataset, "policies": policies, "seeds": seeds, "epochs": epochs,
                "batch_size": batch_size, "lr": lr, "max_steps": max_steps, "criterion_points": criterion_points,
                "device": device}  # fmt: skip
    data = _document(settings, command)
    argv = ["--model", model, "--dataset", dataset, "--seeds", str(seeds), "--epochs", str(epochs),
            "--batch-size", str(batch_size), "--lr", str(lr), "--device", device]  # fmt: skip
    if max_steps is not None:
        argv += ["--max-steps", str(max_steps)]
    for p in policies:
        argv += ["--policy", p]
    for backend in backends:
        meta: dict[str, Any] = {"status": "ok", "versions": None, "device": None, "seconds": None, "error": None}
        data["backends"][backend] = meta
        if not is_installed(backend):
            meta.update(status="not installed", error=f"{BACKENDS[backend]} is not installed")
            progress.note(f"{backend}: skipped ({BACKENDS[backend]} is not installed)")
            continue
        t0 = time.monotonic()
        lines, code, tail = _worker(backend, argv, progress, timeout_s)
        meta["seconds"] = round(time.monotonic() - t0, 1)
        for row in lines:
            kind = row.pop("type", None)
            if kind == "info":
                meta.update(versions=row.get("versions"), device=row.get("device"))
            elif kind == "run":
                data["runs"].append(row)
        if code != 0:
            meta.update(status="failed", error=(tail.splitlines() or [f"exit {code}"])[-1][:500])
        progress.note(f"{backend}: {sum(r['backend'] == backend for r in data['runs'])} runs in {meta['seconds']} s"
                      + (f" (failed: {meta['error']})" if meta["status"] == "failed" else ""))  # fmt: skip
    data["summary"] = summarize(data["runs"], criterion_points)
    data["seconds"] = round(time.monotonic() - started, 1)
    return data


def compare(backend: str, make_model: Any, data: Sequence[Any], *, policies: Sequence[str] = ("mixed_bfloat16",),
            seeds: int = 1, epochs: int = 5, batch_size: int = 64, lr: float = 1e-3,
            max_steps: int | None = None, criterion_points: float = 0.5, device: str = "cpu",
            out: Any = None, progress: bool = True) -> dict[str, Any]:  # fmt: skip
    """The same comparison on your own model and data, in this process (which imports ``backend``'s framework).

    Args:
        backend: ``torch``, ``tf`` or ``jax``.
        make_model: ``make_model(seed)`` returning a fresh model with the same initialization for the same
            seed: a ``torch.nn.Module``; a ``keras.Model`` (built inside the run's policy scope); or for JAX
            a ``(flax.linen.Module, variables)`` pair.
        data: ``(x_train, y_train, x_val, y_val)`` numpy arrays, integer class labels (cross-entropy).
        policies: the policies compared with float32 (default ``mixed_bfloat16``).
        seeds: runs per policy, seeds ``0..seeds-1`` (the initialization and the batch order).
        epochs, batch_size, lr: Adam training settings; ``max_steps`` caps each run.
        criterion_points: the pass/fail bound on ``|mean accuracy delta|``, percentage points (default 0.5).
        out: a folder to write ``compare.json``, ``compare.md`` and ``compare.png`` into (None: none).
        progress: print one line per run on stderr.

    Returns:
        the ``compare.json`` dict (see the module docs).
    """
    import importlib

    from mpx_compare.workers.common import Settings

    if backend not in BACKENDS:
        raise mpx.MPXError(f"backend: {backend!r} is not known; choose one of {', '.join(BACKENDS)}")
    policies = [str(mpx.get_policy(p).name or mpx.get_policy(p)) for p in policies]
    module = importlib.import_module(f"mpx_compare.workers.{backend}")
    settings = Settings(epochs=epochs, batch_size=batch_size, lr=lr, max_steps=max_steps, device=device)
    doc = _document({"model": getattr(make_model, "__name__", "custom"), "dataset": "custom", "policies": policies,
                     "seeds": seeds, "epochs": epochs, "batch_size": batch_size, "lr": lr, "max_steps": max_steps,
                     "criterion_points": criterion_points, "device": device}, None)  # fmt: skip
    started = time.monotonic()
    shown = Progress(not progress)
    doc["backends"][backend] = {"status": "ok", **module.info(device), "error": None}
    doc["runs"] = module.compare(make_model, data, policies=policies, seeds=range(seeds), settings=settings,
                                 progress=lambda text: shown.show(f"[{backend}] {text}", force=True))  # fmt: skip
    doc["summary"] = summarize(doc["runs"], criterion_points)
    doc["seconds"] = round(time.monotonic() - started, 1)
    if out is not None:
        from pathlib import Path

        from mpx_compare.report import write_all

        write_all(doc, Path(out))
    return doc
