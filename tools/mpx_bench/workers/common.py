"""Helpers shared by the backend workers (framework-free)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import mpx
from mpx_bench.harness import Config

__all__ = ["CPU_PROBE_N", "activation_profile", "modes_for", "plan", "timed_probe"]


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


#: The square matmul's side on a CPU (a GPU uses 4096): at 256 the call is short enough that dispatch
#: overhead and noise moved Keras's bfloat16 ratio across doctor's cut-off (0.76-0.88x float32 over two
#: runs, against 0.65-0.70x at 512 and 0.72x for whole bench steps).
CPU_PROBE_N = 512


def timed_probe(
    runs: dict[str, Callable[[], Any]],
    flops: float,
    budget_s: float,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, dict[str, Any]]:
    """Time every ``runs[name]()`` (one blocking matmul of ``flops``) within ``budget_s`` seconds in all.

    Each is called once to warm up (compilation), then the calls are
    interleaved, one of each per round, so drift on the machine hits every
    dtype alike; rounds stop when the next one would overrun the budget, and
    the fastest call of each wins.  Every dtype gets at least one timed call.
    ``clock`` (seconds; default :func:`time.perf_counter`) is read around each call.
    """
    start = clock()
    for run in runs.values():
        run()
    best = dict.fromkeys(runs, float("inf"))
    calls = dict.fromkeys(runs, 0)
    while True:
        for name, run in runs.items():
            t0 = clock()
            run()
            best[name] = min(best[name], clock() - t0)
            calls[name] += 1
        if clock() - start + sum(best.values()) > budget_s:  # the next round would overrun
            break
    return {
        name: {"seconds": best[name], "gflops": flops / best[name] / 1e9, "calls": calls[name]}
        for name in runs
    }


def activation_profile(items: Iterable[tuple[str, str, int]], top: int = 8) -> list[dict[str, Any]]:
    """Saved-for-backward bytes grouped by (producer, dtype), largest first: where the activation bytes go.

    ``items`` are ``(producer, dtype, nbytes)`` per saved tensor, ``producer`` the
    op that made it (torch: its ``grad_fn``, JAX: the primitive), ``input`` for data.
    The first ``top`` groups are kept and the rest summed into one ``(other)`` row.

    >>> activation_profile([("mm", "bfloat16", 4), ("mm", "bfloat16", 4), ("softmax", "float32", 6)], top=1)
    [{'producer': 'mm', 'dtype': 'bfloat16', 'bytes': 8, 'tensors': 2}, {'producer': '(other)', 'dtype': '-', 'bytes': 6, 'tensors': 1}]
    """
    groups: dict[tuple[str, str], list[int]] = {}
    for producer, dtype, nbytes in items:
        g = groups.setdefault((producer, dtype), [0, 0])
        g[0] += nbytes
        g[1] += 1
    rows = [{"producer": p, "dtype": d, "bytes": b, "tensors": n}
            for (p, d), (b, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])]  # fmt: skip
    if len(rows) > top:
        other = {"producer": "(other)", "dtype": "-", "bytes": sum(r["bytes"] for r in rows[top:]),
                 "tensors": sum(r["tensors"] for r in rows[top:])}  # fmt: skip
        rows = [*rows[:top], other]
    return rows
