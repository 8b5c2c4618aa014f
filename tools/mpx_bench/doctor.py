"""``mpx doctor``: frameworks, devices, hardware precision support, a short probe, a policy per backend.

Each framework is probed in its own process (``python -m mpx_bench.worker
BACKEND --probe``): a square matmul timed in float32, bfloat16 and float16
for at most ``probe_s`` seconds in all (the import of the framework is not
counted).  A compute dtype is flagged slow when its matmul takes more than
:data:`SLOW_RATIO` times the float32 time, or when :data:`mpx.advice.SLOW_POLICIES`
lists the combination (measured on whole training steps).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import time
from typing import Any

import mpx
from mpx.advice import slow_entry
from mpx_bench.bench import run_worker
from mpx_tools.machine import machine_info
from mpx_tools.workers import BACKENDS, is_installed

__all__ = ["SLOW_RATIO", "hardware_support", "recommend", "run", "text"]

#: A half-precision matmul this many times slower than float32 is flagged.
SLOW_RATIO = 1.5
#: A half-precision matmul must be this much faster than float32 (time ratio) to be recommended.
FAST_RATIO = 0.9
_PACKAGES = {
    "torch": ["torch"],
    "tf": ["tensorflow", "tensorflow-cpu", "keras"],
    "jax": ["jax", "jaxlib", "flax", "optax"],
}


def hardware_support(flags: list[str]) -> dict[str, Any]:
    """What the CPU flags say about bfloat16 and float16 arithmetic."""
    bf16 = [f for f in ("amx_bf16", "avx512_bf16", "avx_ne_convert", "bf16") if f in flags]
    fp16 = [f for f in ("amx_fp16", "avx512_fp16", "asimdhp") if f in flags]
    return {
        "bfloat16": {"native": bool(bf16), "flags": bf16,
                     "meaning": "bfloat16 dot products in hardware" if bf16 else "bfloat16 is converted to float32"},
        "float16": {"native": bool(fp16), "flags": fp16,
                    "meaning": "float16 arithmetic in hardware" if fp16 else
                    ("float16 is converted in hardware (f16c) and computed in float32" if "f16c" in flags
                     else "float16 is emulated")},
    }  # fmt: skip


def _versions(backend: str) -> dict[str, str]:
    out = {}
    for name in _PACKAGES[backend]:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def recommend(
    backend: str, probe: dict[str, Any] | None, device: str = "cpu", support: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The policy to use on ``backend``: the fastest mixed dtype that is not flagged, else float32.

    A half dtype qualifies when its matmul takes at most :data:`FAST_RATIO` times the
    float32 time, or, on a CPU whose flags (``support``, from :func:`hardware_support`)
    say it computes that dtype in hardware, when it is no slower than float32: the
    probe's ratio moves by 0.1-0.3 between runs on a shared machine, and a dtype the
    hardware computes natively still halves activation memory at no cost in speed.
    Combinations that :data:`mpx.advice.SLOW_POLICIES` lists (measured on whole
    training steps) never qualify.

    >>> probe = {"float32": {"seconds": 1.0}, "bfloat16": {"seconds": 0.98}}
    >>> recommend("tf", probe)["policy"]
    'float32'
    >>> recommend("tf", probe, support={"bfloat16": {"native": True, "flags": ["avx512_bf16"]}})["policy"]
    'mixed_bfloat16'
    """
    if not probe or "float32" not in probe:
        return {"policy": "float32", "why": "no probe result: float32 is the safe default"}
    base = probe["float32"]["seconds"]
    on_cpu = not device.startswith(("cuda", "gpu"))
    candidates = []
    for dtype, policy in (("bfloat16", "mixed_bfloat16"), ("float16", "mixed_float16")):
        if dtype not in probe or slow_entry(backend, policy, device) is not None:
            continue
        ratio = probe[dtype]["seconds"] / base
        hw = (support or {}).get(dtype, {}) if on_cpu else {}
        if ratio <= FAST_RATIO or (hw.get("native") and ratio <= 1.0):
            candidates.append((ratio, policy, dtype, hw.get("flags", [])))
    if not candidates:
        return {"policy": "float32",
                "why": "no half-precision dtype beat float32 on this device's matmul probe (or mpx.advice lists "
                       "it as slow), so mixed precision would not make training faster here"}  # fmt: skip
    ratio, policy, dtype, flags = min(candidates)
    scaling = " with dynamic loss scaling (mpx's default for float16)" if dtype == "float16" else ""
    why = f"a {dtype} matmul takes {ratio:.2f}x the float32 time on this device{scaling}"
    if ratio > FAST_RATIO:
        why += (f", no slower, and this CPU computes {dtype} in hardware ({', '.join(flags)}): "
                "the policy halves activation memory at no cost in speed")  # fmt: skip
    return {"policy": policy, "why": why}


def _flags(backend: str, probe: dict[str, Any] | None, device: str) -> list[dict[str, Any]]:
    out = []
    base = (probe or {}).get("float32", {}).get("seconds")
    for dtype in ("bfloat16", "float16"):
        entry = slow_entry(backend, f"params=float32,compute={dtype}", device)
        got = (probe or {}).get(dtype)
        ratio = got["seconds"] / base if got and base else None
        if ratio is not None and ratio > SLOW_RATIO:
            out.append({"dtype": dtype, "slowdown": ratio, "source": "probe",
                        "message": f"{dtype} matmul is {ratio:.1f}x slower than float32 here"})  # fmt: skip
        elif entry is not None:
            out.append({"dtype": dtype, "slowdown": entry.slowdown, "source": "mpx.advice",
                        "message": f"{entry.measured}: {entry.slowdown:g}x slower than float32 "
                                   f"(the matmul probe: {'-' if ratio is None else f'{ratio:.2f}x'}); {entry.advice}"})  # fmt: skip
    return out


def run(backends: list[str], probe_s: float = 1.0, device: str = "cpu") -> dict[str, Any]:
    """Everything ``mpx doctor`` reports, as a JSON-safe dict."""
    machine = machine_info()
    data: dict[str, Any] = {"mpx_version": mpx.__version__, "machine": machine,
                            "precision_support": hardware_support(machine["cpu_flags"]), "backends": {}}  # fmt: skip
    for backend in backends:
        entry: dict[str, Any] = {"installed": is_installed(backend),
                                 "versions": _versions(backend)}  # fmt: skip
        data["backends"][backend] = entry
        if not entry["installed"]:
            entry["recommendation"] = {"policy": None, "why": f"{BACKENDS[backend]} is not installed"}
            continue
        argv = ["--probe", "--probe-budget", str(probe_s), "--device", device]
        if probe_s <= 0:
            argv += ["--probe-dtypes", ""]
        t0 = time.monotonic()
        lines, code, tail = run_worker(backend, argv, None, timeout_s=120 + 10 * probe_s)
        entry["seconds"] = round(time.monotonic() - t0, 2)
        for row in lines:
            if row.get("type") == "info":
                entry.update({k: v for k, v in row.items() if k not in ("type", "backend", "versions")})
            elif row.get("type") == "probe":
                entry["probe"] = row["results"] or None
                entry["probe_seconds"] = row.get("seconds")
        if code != 0:
            entry["error"] = (tail.splitlines() or [f"exit {code}"])[-1][:300]
        entry["slow"] = _flags(backend, entry.get("probe"), device)
        entry["recommendation"] = recommend(backend, entry.get("probe"), device, data["precision_support"])
    return data


def text(data: dict[str, Any]) -> str:
    """The doctor's report as plain text."""
    m = data["machine"]
    lines = [f"mpx {data['mpx_version']} doctor",
             f"machine: {m['cpu_model']}, {m['cpu_count']} cores, {m['platform']}, Python {m['python']}",
             f"CPU precision flags: {' '.join(m['cpu_flags']) or 'none'}"]  # fmt: skip
    for dtype, s in data["precision_support"].items():
        lines.append(f"  {dtype}: {s['meaning']}" + (f" ({', '.join(s['flags'])})" if s["flags"] else ""))
    for backend, b in data["backends"].items():
        versions = ", ".join(f"{k} {v}" for k, v in b["versions"].items()) or "-"
        if not b["installed"]:
            lines.append(f"\n{backend}: not installed")
            continue
        lines.append(f"\n{backend}: {versions}")
        lines.append(f"  device: {b.get('device')} ({b.get('device_name')})")
        for extra in ("compute_capability", "gpus", "devices"):
            if b.get(extra):
                lines.append(f"  {extra.replace('_', ' ')}: {b[extra]}")
        if b.get("error"):
            lines.append(f"  probe failed: {b['error']}")
        for dtype, r in (b.get("probe") or {}).items():
            base = b["probe"].get("float32", {}).get("seconds")
            rel = f", {r['seconds'] / base:.2f}x float32's time" if base and dtype != "float32" else ""
            lines.append(f"  probe {dtype:<8} {r['n']}x{r['n']} matmul {r['seconds'] * 1e3:8.3f} ms, "
                         f"{r['gflops']:7.1f} GFLOP/s{rel}")  # fmt: skip
        if b.get("probe_seconds") is not None:
            lines.append(f"  probe time: {b['probe_seconds']:.2f} s")
        for flag in b.get("slow", []):
            lines.append(f"  SLOW {flag['dtype']}: {flag['message']}")
        rec = b["recommendation"]
        lines.append(f"  recommended policy: {rec['policy']} -- {rec['why']}")
    lines.append("\nSlow policies warn once per process (mpx.advice.SlowPolicyWarning); "
                 "set MPX_NO_SLOW_WARNING=1 to silence them.")  # fmt: skip
    return "\n".join(lines)
