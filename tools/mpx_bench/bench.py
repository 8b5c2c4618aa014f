"""``mpx bench``: run each backend's worker in its own process, collect, compare, write the reports.

The documented output is ``DIR/bench.json`` (format ``"mpx.bench/1"``):

* ``format``, ``mpx_version``, ``created`` (UTC, ISO 8601), ``command``, ``seconds`` (wall time of the run);
* ``machine``: ``platform``, ``machine``, ``python``, ``cpu_model``, ``cpu_count``, ``cpu_flags``, ``memory_bytes``,
  ``load_average`` and ``load_average_end`` (1/5/15-minute load before and after the run), ``threads``
  (``process``, and ``env``: the thread-pool environment variables, None when unset);
* ``settings``: ``model``, ``size``, ``policies``, ``steps``, ``warmup``, ``budget_s``, ``device``;
* ``units``: the unit of every suffix (``_ms`` milliseconds, ``_s`` seconds, ``_bytes`` bytes; ratios are unitless);
* ``backends``: name -> ``status`` (``ok`` | ``not installed`` | ``failed``), ``framework``, ``versions``,
  ``device``, ``device_name``, ``seconds``, ``error``;
* ``configs``: one per backend and configuration: ``backend``, ``id`` (``fp32``, ``POLICY/MODE``),
  ``policy``, ``mode`` (``fp32`` | ``native`` | ``native-noscale`` | ``mpx`` | ``mpx-noscale``),
  ``status`` (``ok`` | ``skipped``), ``note``, ``step_ms`` (``median``, ``min``, ``max``, ``n``),
  ``times_ms`` (every timed step, in round order), ``first_call_ms`` (the first step: tracing and
  compilation included), ``warmup_ms``, ``compile_ms`` (first call minus the median step),
  ``activation_bytes``, ``activation_profile`` (where those bytes go: ``producer``, ``dtype``,
  ``bytes``, ``tensors``, largest first; torch and JAX), ``xla_temp_bytes``, ``traces_per_step``,
  ``host_transfers_per_step``, ``host_syncs_per_step`` (None where not measured), and the worker's notes;
  under a policy with ``fp8=`` (torch), ``fp8_layers``, ``fp8_gemm`` (``emulate`` | ``scaled_mm``) and
  ``fp8_note`` (``CPU emulation: ...`` unless every FP8 GEMM ran ``torch._scaled_mm`` on a CUDA device;
  the FP8 state commits after each step as in training; memory is ``activation_bytes``, FP8 inputs saved
  as one byte each); with ``--compile`` (torch) also the modes ``fp32-compiled``, ``native-compiled``, ``mpx-compiled`` and
  their ``frames_compiled``, ``graphs``, ``graph_breaks`` and ``frames_compiled_after_warmup`` (dynamo's
  counters over that configuration's steps), with the comparisons ``mpx-compiled/native-compiled``,
  ``mpx-compiled/mpx`` and ``native-compiled/native``;
* ``comparisons``: ``backend``, ``policy``, ``kind`` (``time`` | ``activations``), ``name``
  (``native/fp32``, ``mpx/fp32``, ``mpx/native``, ``scaling/mpx``, ``scaling/native``,
  ``mpx-noscale/native-noscale``, ``activations/mpx``...), ``numerator``, ``denominator`` (config ids),
  ``median``, ``min``, ``max``, ``q1``, ``q3`` (of the per-round ratios), ``pairs``, ``target`` (see
  ``stats.TARGET_HELP``; None for a policy with ``fp8=``, whose ``target_note`` says why), ``meets_target``, ``warning`` (when the pairs spread wider than what the ratio shows);
* ``warnings``: a busy machine (load average above half the cores) and every noisy comparison;
* ``backends[NAME].threads``: the framework's thread pools where it reports them (torch, TensorFlow).
* ``block_formats``: per storage format (``float32``, ``bfloat16`` and each block preset of
  :data:`mpx.blocks.PRESETS`) the bytes of the model's Linear weights (``weight_bytes``: the forward
  copy, blocks along the input dimension) and of the inputs they save for the weight gradient
  (``saved_activation_bytes``: one step's inputs, blocks along the batch dimension, as Transformer
  Engine keeps the columnwise copy), elements packed at their bits plus the scales
  (:func:`mpx.blocks.storage_bytes`), and both as ratios to bfloat16.  Deterministic: counted from the
  shapes, not measured (the CPU emulation saves the high-precision input);
* ``backends.torch.hf_activations``: saved-activation bytes of HF GPT-2 and Llama (2 blocks, hidden 128,
  sequence 256) in float32, under native autocast and under mpx, with ``mpx/native``.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import mpx
from mpx_bench import stats
from mpx_tools import workers
from mpx_tools.machine import busy_warning, load_average, machine_info
from mpx_tools.workers import BACKENDS, Progress, is_installed

__all__ = ["FORMAT", "UNITS", "block_bytes", "run", "run_worker"]

FORMAT = "mpx.bench/1"
UNITS = {
    "_ms": "milliseconds",
    "_s": "seconds",
    "_bytes": "bytes",
    "ratio": "unitless (numerator / denominator)",
}


def run_worker(backend: str, argv: list[str], progress: Progress | None = None, timeout_s: float | None = None
               ) -> tuple[list[dict[str, Any]], int, str]:  # fmt: skip
    """Run ``python -m mpx_bench.worker BACKEND ARGV``; returns its JSON lines, exit status and stderr tail."""
    start = time.monotonic()

    def show(row: dict[str, Any]) -> None:
        if progress is None or row.get("type") != "progress":
            return
        phase = row.get("phase")
        what = f"round {row['round']}/{row['rounds']}" if phase == "timed" else row.get("config", "")
        progress.show(f"[{backend} {time.monotonic() - start:5.0f}s] {phase} {what}")
        if phase == "skip":
            progress.note(f"{backend}: {row.get('config')}: {row.get('note')}")

    return workers.run_worker("mpx_bench.worker", [backend, *argv], show, timeout_s)


def _config_row(backend: str, rec: dict[str, Any]) -> dict[str, Any]:
    step = stats.summary(rec.get("times_s") or [])
    first = rec.get("first_call_s")
    row = {
        "backend": backend,
        "id": rec["id"],
        "policy": rec["policy"],
        "mode": rec["mode"],
        "status": "skipped" if rec.get("skipped") or not step else "ok",
        "note": rec.get("skipped") or rec.get("note"),
        "step_ms": step,
        "times_ms": [t * 1e3 for t in rec.get("times_s") or []],
        "first_call_ms": None if first is None else first * 1e3,
        "warmup_ms": [t * 1e3 for t in rec.get("warmup_s") or []],
        "compile_ms": None if first is None or not step else max(0.0, first * 1e3 - step["median"]),
        "build_ms": None if rec.get("build_s") is None else rec["build_s"] * 1e3,
    }
    for key in ("activation_bytes", "saved_weight_copy_bytes", "xla_temp_bytes", "xla_argument_bytes",
                "traces_total", "traces_per_step", "host_transfers_per_step", "host_syncs_per_step",
                "frames_compiled", "graphs", "graph_breaks", "frames_compiled_after_warmup",
                "fp8_layers", "fp8_gemm"):  # fmt: skip
        row[key] = rec.get(key)
    for key in (
        "activation_profile",
        "activation_note",
        "traces_note",
        "host_transfers_note",
        "fp8_note",
        "measure_error",
    ):
        if rec.get(key):
            row[key] = rec[key]
    return row


def block_bytes(model: str, size: str) -> dict[str, dict[str, Any]]:
    """``block_formats`` of ``bench.json`` (module docs) for ``model`` at ``size``."""
    from mpx.blocks import PRESETS, storage_bytes
    from mpx_bench.models import linears

    layers = linears(model, size)
    out: dict[str, dict[str, Any]] = {}
    for name, fmt in [("float32", "float32"), ("bfloat16", "bfloat16"), *PRESETS.items()]:
        weights = sum(storage_bytes(fmt, "weight", w, 1) for _, w, _ in layers)
        saved = sum(storage_bytes(fmt, "input", (m, w[1]), 0) for _, w, m in layers)
        out[name] = {"weight_bytes": weights, "saved_activation_bytes": saved}
    for row in out.values():
        row["weight/bfloat16"] = round(row["weight_bytes"] / out["bfloat16"]["weight_bytes"], 4)
        row["activation/bfloat16"] = round(
            row["saved_activation_bytes"] / out["bfloat16"]["saved_activation_bytes"], 4
        )
    return out


def run(
    backends: list[str],
    *,
    model: str = "mlp",
    size: str = "default",
    policies: list[str] | None = None,
    steps: int = 20,
    warmup: int = 3,
    budget_s: float = 10.0,
    device: str = "cpu",
    skip_slower_than: float = 20.0,
    timeout_s: float | None = 1800.0,
    quiet: bool = False,
    command: list[str] | None = None,
    compile: bool = False,
) -> dict[str, Any]:
    """Run the benchmark on ``backends`` and return the ``bench.json`` dict (see the module docs)."""
    policies = [
        str(mpx.get_policy(p).name or mpx.get_policy(p))
        for p in (policies or ["mixed_bfloat16", "mixed_float16"])
    ]
    progress = Progress(quiet)
    started = time.monotonic()
    data: dict[str, Any] = {
        "format": FORMAT,
        "mpx_version": mpx.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "machine": machine_info(),
        "settings": {
            "model": model,
            "size": size,
            "policies": policies,
            "steps": steps,
            "warmup": warmup,
            "budget_s": budget_s,
            "device": device,
            "skip_slower_than": skip_slower_than,
        },
        "units": UNITS,
        "block_formats": block_bytes(model, size),
        "backends": {},
        "configs": [],
        "comparisons": [],
    }
    argv = ["--model", model, "--size", size, "--steps", str(steps), "--warmup", str(warmup),
            "--budget", str(budget_s), "--device", device, "--skip-slower-than", str(skip_slower_than)]  # fmt: skip
    for p in policies:
        argv += ["--policy", p]
    if compile:  # torch: compiled mpx, compiled native and compiled fp32 next to the eager steps
        argv.append("--compile")
    for backend in backends:
        meta: dict[str, Any] = {"status": "ok", "framework": backend, "versions": None, "device": None,
                                "device_name": None, "seconds": None, "error": None}  # fmt: skip
        data["backends"][backend] = meta
        if not is_installed(backend):
            meta.update(status="not installed", error=f"{BACKENDS[backend]} is not installed")
            progress.note(f"{backend}: skipped ({BACKENDS[backend]} is not installed)")
            continue
        t0 = time.monotonic()
        lines, code, tail = run_worker(backend, argv, progress, timeout_s)
        meta["seconds"] = round(time.monotonic() - t0, 1)
        records = []
        for row in lines:
            kind = row.pop("type", None)
            if kind == "info":
                row.pop("backend", None)
                meta.update(row)
            elif kind == "config":
                records.append(row)
            elif kind == "probe":
                meta.setdefault("probe", row.get("results"))
        if code != 0:
            meta.update(status="failed", error=(tail.splitlines() or [f"exit {code}"])[-1][:500], exit=code)
        data["configs"] += [_config_row(backend, r) for r in records]
        data["comparisons"] += stats.comparisons(backend, model, records)
        progress.note(
            f"{backend}: {len(records)} configurations in {meta['seconds']} s"
            + (f" (failed: {meta['error']})" if meta["status"] == "failed" else "")
        )
    data["seconds"] = round(time.monotonic() - started, 1)
    data["machine"]["load_average_end"] = load_average()
    data["warnings"] = [w for w in (busy_warning(data["machine"]["load_average"], data["machine"]["cpu_count"]),
                                    busy_warning(data["machine"]["load_average_end"], data["machine"]["cpu_count"]))
                        if w][:1] + [f"{c['backend']} {c['policy']} {c['name']}: {c['warning']}"
                                     for c in data["comparisons"] if c.get("warning")]  # fmt: skip
    return data
