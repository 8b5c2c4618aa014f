"""What this machine is: CPU model, cores, the precision-relevant CPU flags, memory (framework-free).

>>> info = machine_info()
>>> sorted(info) == sorted(["platform", "machine", "python", "cpu_model", "cpu_count", "cpu_flags", "memory_bytes",
...                         "load_average", "threads"])
True
>>> len(info["load_average"]) == 3 and "OMP_NUM_THREADS" in info["threads"]["env"]
True
"""

from __future__ import annotations

import os
import platform
import threading
from typing import Any

__all__ = ["PRECISION_FLAGS", "THREAD_ENV", "busy_warning", "cpu_flags", "load_average", "machine_info"]

#: Environment variables that set the thread pools of the frameworks' CPU kernels.
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TF_NUM_INTRAOP_THREADS",
              "TF_NUM_INTEROP_THREADS", "XLA_FLAGS")  # fmt: skip

#: CPU flags that decide half-precision speed: bf16 dot products (avx512_bf16, amx_bf16), fp16 arithmetic
#: (avx512_fp16, amx_fp16), fp16 conversion (f16c) and the vector widths the kernels use.
PRECISION_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                   "amx_tile", "amx_bf16", "amx_fp16", "avx_vnni", "avx_ne_convert", "neon", "asimd",
                   "asimdhp", "bf16", "sve")  # fmt: skip


def _cpuinfo() -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key and key not in out:
                    out[key] = value.strip()
                if not line.strip() and out:
                    break
    except OSError:
        pass
    return out


def cpu_flags() -> list[str]:
    """The :data:`PRECISION_FLAGS` this CPU has (from /proc/cpuinfo on Linux; sysctl on macOS)."""
    info = _cpuinfo()
    flags = set((info.get("flags") or info.get("features") or "").split())
    if not flags and platform.system() == "Darwin":  # pragma: no cover - macOS
        import subprocess

        out = subprocess.run(["sysctl", "-a"], capture_output=True, text=True).stdout
        flags = {line.split(":")[0].rsplit(".", 1)[-1].lower().removeprefix("feat_")
                 for line in out.splitlines() if line.startswith("hw.optional.") and line.endswith(": 1")}  # fmt: skip
    return [f for f in PRECISION_FLAGS if f in flags]


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (runnable processes; ``os.getloadavg``), None where unknown."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):  # pragma: no cover - Windows
        return None


def busy_warning(load: list[float] | None, cores: int | None) -> str | None:
    """A warning when the 1-minute load average is above half the cores: other work is sharing the CPU."""
    if not load or not cores or load[0] <= cores / 2:
        return None
    return (
        f"load average {load[0]:g} on {cores} cores: other processes share the CPU, so step times swing; "
        "ratios of interleaved pairs cancel part of it"
    )


def machine_info() -> dict[str, Any]:
    """The platform, CPU model, core count, precision flags, memory, load average and thread settings.

    ``load_average``: 1/5/15-minute load when called; ``threads``: ``process`` (this process's threads),
    ``env`` (each of :data:`THREAD_ENV`, None when unset).  Each backend's own pool sizes are in
    ``backends[NAME].threads`` of bench.json where the framework reports them.
    """
    info = _cpuinfo()
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        memory = None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        cores = os.cpu_count()
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpu_model": info.get("model name") or platform.processor() or platform.machine(),
        "cpu_count": cores,
        "cpu_flags": cpu_flags(),
        "memory_bytes": memory,
        "load_average": load_average(),
        "threads": {"process": threading.active_count(), "env": {k: os.environ.get(k) for k in THREAD_ENV}},
    }
