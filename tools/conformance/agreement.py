"""The Keras columns against the core: their mpx-mode scale traces, bit for bit (issue 24).

Keras 3 runs on TensorFlow (the ``tf`` column), JAX (``keras-jax``) and PyTorch (``keras-torch``);
under mpx each of them must produce the core's scale trace (``mpx.scaler_update``'s) exactly, so a run
moved between Keras backends resumes on the same trace.  :func:`keras_traces` checks that from a
report's results; the report prints the line :func:`keras_traces_line` writes.
"""

from __future__ import annotations

import struct
from typing import Any

__all__ = ["KERAS_COLUMNS", "TRACE_GROUPS", "keras_traces", "keras_traces_line"]

#: groups whose results carry a scale trace (one value per optimizer step) to align and plot
TRACE_GROUPS = ("scaler", "portability", "distributed", "accumulation", "deepspeed")
#: The Keras 3 columns (Keras on TensorFlow, JAX, PyTorch): under mpx their scale traces are the core's, bit for bit.
KERAS_COLUMNS = ("tf", "keras-jax", "keras-torch")


def _bits(values: list) -> list[bytes] | None:
    """The float64 bit patterns of ``values`` (None when one is not a number): equality is bit equality."""
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return None
    return [struct.pack("<d", float(v)) for v in values]


def keras_traces(data: dict) -> dict[str, dict[str, Any]]:
    """Per Keras column that ran (:data:`KERAS_COLUMNS`): its mpx-mode scale traces against the core's.

    Every result of a trace group (:data:`TRACE_GROUPS`) whose expectation is a scale trace and that
    was not skipped is compared bit for bit with the core's trace (its ``expected["scales"]``).
    Returns ``{column: {"compared": n, "differ": [case ids whose trace is missing or not the core's]}}``.
    """
    out: dict[str, dict[str, Any]] = {}
    for backend in KERAS_COLUMNS:
        meta = data.get("backends", {}).get(backend)
        if meta is None or meta.get("skipped"):
            continue
        compared, differ = 0, []
        for r in data["results"]:
            if (r["backend"], r["mode"]) != (backend, "mpx") or r["group"] not in TRACE_GROUPS:
                continue
            want = r["expected"].get("scales") if isinstance(r["expected"], dict) else None
            if not isinstance(want, list) or r["status"] == "skip":
                continue
            compared += 1
            got = r["observed"].get("scales") if isinstance(r.get("observed"), dict) else None
            if not isinstance(got, list) or _bits(got) is None or _bits(got) != _bits(want):
                differ.append(r["case"])
        if compared:  # a selection without scale traces (--only fp8) has nothing to say here
            out[backend] = {"compared": compared, "differ": differ}
    return out


def keras_traces_line(agreement: dict[str, dict[str, Any]]) -> str:
    """One line saying, per Keras column, how many of its compared traces are the core's (and which are not)."""
    parts = [f"{b} {a['compared'] - len(a['differ'])}/{a['compared']}" for b, a in agreement.items()]
    bad = [f"{b}: {', '.join(a['differ'])}" for b, a in agreement.items() if a["differ"]]
    return ("Keras scale traces under mpx equal to the core's, bit for bit: " + ", ".join(parts)
            + (f" (not equal: {'; '.join(bad)})" if bad else ""))  # fmt: skip
