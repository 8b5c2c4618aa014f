"""Medians, pair ratios and the comparisons ``mpx bench`` reports (framework-free).

>>> pair_ratios([2.0, 4.0, 6.0], [1.0, 2.0, 2.0])
{'median': 2.0, 'min': 2.0, 'max': 3.0, 'pairs': 3}
"""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["TARGETS", "comparisons", "pair_ratios", "summary"]

#: The issue's targets: mpx at most 2% slower than native, loss scaling at most 5% on an unscaled float16 step,
#: activations under a mixed policy at most 0.55x float32's (mlp and transformer).
TARGETS = {"mpx/native": 1.02, "scaling/mpx": 1.05, "activations/mpx": 0.55}


def summary(times_s: list[float]) -> dict[str, Any] | None:
    """Median, min and max of a list of step times in seconds, in milliseconds."""
    if not times_s:
        return None
    ms = [t * 1e3 for t in times_s]
    return {"median": statistics.median(ms), "min": min(ms), "max": max(ms), "n": len(ms)}


def pair_ratios(a: list[float], b: list[float]) -> dict[str, Any] | None:
    """Ratios ``a[i] / b[i]`` of the rounds both ran: median, min, max, number of pairs."""
    ratios = [x / y for x, y in zip(a, b, strict=False) if y > 0]
    if not ratios:
        return None
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "pairs": len(ratios)}


def comparisons(backend: str, model: str, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every ratio of one backend's configurations: speed against fp32 and native, scaling cost, activations."""
    by_id = {r["id"]: r for r in records if not r.get("skipped") and r.get("times_s")}
    policies = list(dict.fromkeys(r["policy"] for r in records if r["mode"] != "fp32"))
    out: list[dict[str, Any]] = []

    def add(kind: str, policy: str, num: str, den: str, target_key: str | None = None) -> None:
        if num not in by_id or den not in by_id:
            return
        if kind == "time":
            ratio = pair_ratios(by_id[num]["times_s"], by_id[den]["times_s"])
        else:
            a, b = by_id[num].get("activation_bytes"), by_id[den].get("activation_bytes")
            if not a or not b:
                return
            ratio = {"median": a / b, "min": a / b, "max": a / b, "pairs": None}
        if ratio is None:
            return
        target = TARGETS.get(target_key) if target_key else None
        name = target_key or f"{num.split('/')[-1]}/{den.split('/')[-1]}"
        out.append({"backend": backend, "policy": policy, "kind": kind, "name": name, "numerator": num,
                    "denominator": den, **ratio, "target": target,
                    "meets_target": None if target is None else ratio["median"] <= target})  # fmt: skip

    for policy in policies:
        p = f"{policy}/"
        add("time", policy, p + "native", "fp32")
        add("time", policy, p + "mpx", "fp32")
        if p + "native" in by_id:
            add("time", policy, p + "mpx", p + "native", "mpx/native")
        else:  # a float32 policy: the native reference is the fp32 step
            add("time", policy, p + "mpx", "fp32", "mpx/native")
        add("time", policy, p + "native-noscale", "fp32")
        add("time", policy, p + "mpx-noscale", p + "native-noscale")
        add("time", policy, p + "native", p + "native-noscale")
        add("time", policy, p + "mpx", p + "mpx-noscale", "scaling/mpx")
        add("activations", policy, p + "native", "fp32")
        add(
            "activations",
            policy,
            p + "mpx",
            "fp32",
            "activations/mpx" if model in ("mlp", "transformer") else None,
        )
    for row in out:  # readable names
        if row["name"] == "native/native-noscale":
            row["name"] = "scaling/native"
        if row["kind"] == "activations" and row["name"] == "native/fp32":
            row["name"] = "activations/native"
        if row["kind"] == "activations" and row["name"] == "mpx/fp32":
            row["name"] = "activations/mpx"
    return out
