"""Helpers shared by the backend workers (framework-free)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import mpx
from mpx_bench.harness import Config

__all__ = ["modes_for", "timed_probe"]


def modes_for(policy: mpx.Policy) -> list[str]:
    """The modes timed for ``policy``: native and mpx, and the unscaled pair for float16 compute."""
    if not policy.lowers_precision:
        return ["mpx"]
    modes = ["native", "mpx"]
    if policy.compute_dtype == "float16":
        modes += ["native-noscale", "mpx-noscale"]
    return modes


def plan(
    policies: list[str], slow: dict[str, str], make: Callable[[str, mpx.Policy | None], Callable[[], Any]]
) -> list[Config]:
    """fp32 once, then every policy's modes; ``make(mode, policy)`` returns the config's builder."""
    out = [Config("fp32", "float32", "fp32", make("fp32", None))]
    seen: set[str] = set()
    for spec in policies:
        policy = mpx.get_policy(spec)
        key = str(policy)
        if key in seen:
            continue
        seen.add(key)
        name = policy.name or key
        for mode in modes_for(policy):
            out.append(
                Config(f"{name}/{mode}", name, mode, make(mode, policy), slow.get(policy.compute_dtype))
            )
    return out


def timed_probe(run: Callable[[], Any], flops: float, budget_s: float) -> dict[str, Any]:
    """Call ``run`` (one blocking matmul) until ``budget_s`` is spent; the fastest call wins."""
    start = time.perf_counter()
    run()  # warm-up (and compilation)
    best = float("inf")
    calls = 0
    while True:
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
        calls += 1
        if time.perf_counter() - start + best > budget_s:  # the next call would overrun the budget
            break
    return {"seconds": best, "gflops": flops / best / 1e9, "calls": calls}
