"""Two gloo processes for the multi-rank tests: the launcher (:func:`run_ranks`) and the workers' main (:func:`worker_main`).

A worker is ``python WORKER SUITE RANK OUT_DIR``; it runs ``SUITE`` and saves what it saw to
``OUT_DIR/SUITE-RANK.pt`` (``{"error": traceback}`` when the suite raised).  The launcher starts both
ranks, waits (a rank that fails stops its peer at once; ``HANG_GUARD_S`` only guards against a hang),
shows both logs when a rank fails, and returns both ranks' dicts.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Only a hang guard: a loaded machine must not fail a suite, and a rank that dies is noticed at once.
HANG_GUARD_S = 1800
LOG_TAIL = 20_000  # characters of each rank's log shown when a rank fails


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous_env() -> dict[str, str]:
    """The env:// rendezvous of two ranks on this machine: ``MASTER_ADDR``, a free ``MASTER_PORT``, ``WORLD_SIZE``."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}


def ranked_env(rank: int) -> dict[str, str]:
    """``RANK``, ``LOCAL_RANK`` and ``NODE_RANK`` of ``rank`` on one node (as a cluster launcher sets them)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0"}


def run_ranks(
    worker: Path,
    suite: str,
    tmp: Path,
    *,
    env: Mapping[str, str] | None = None,
    rank_env: Callable[[int], Mapping[str, str]] | None = None,
) -> list[dict]:
    """Run ``suite`` of ``worker`` on ranks 0 and 1; returns each rank's saved dict.

    Args:
        worker: the worker script.
        suite: its suite name (the first argument).
        tmp: the directory for the logs and results (the worker's ``OUT_DIR``).
        env: added to this process's environment for both ranks (``PYTHONPATH`` gets the repository root).
        rank_env: each rank's own additions (e.g. :func:`ranked_env`).
    """
    base = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        **(env or {}),
    }
    log_paths = [tmp / f"{suite}-{rank}.log" for rank in range(2)]
    procs = []
    for rank, log_path in enumerate(log_paths):
        with open(log_path, "w") as log:  # a file, not a pipe: a chatty rank never blocks on a full pipe
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(worker), suite, str(rank), str(tmp)],
                    env={**base, **(rank_env(rank) if rank_env else {})},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    deadline = time.monotonic() + HANG_GUARD_S
    try:
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break  # a rank failed (its peer would wait for it), or the suite hangs
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = "\n".join(
        f"rank {rank} (exit {p.returncode}):\n{path.read_text()[-LOG_TAIL:]}"
        for rank, (p, path) in enumerate(zip(procs, log_paths, strict=True))
    )
    assert all(p.returncode == 0 for p in procs), logs
    import torch

    results = []
    for rank in range(2):
        path = tmp / f"{suite}-{rank}.pt"
        assert path.exists(), f"rank {rank} saved nothing:\n{logs}"
        result = torch.load(path, weights_only=False)
        assert "error" not in result, result.get("error")
        results.append(result)
    return results


def init_gloo(rank: int, init_method: str = "env://") -> None:
    """The gloo process group of ``rank`` of two (env://: ``MASTER_ADDR``/``MASTER_PORT`` from the environment).

    A collective whose peer never comes fails after 15 minutes (saved as this rank's error) instead
    of gloo's default 30: only a hang guard, far above any wait a loaded machine causes.
    """
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=2, timeout=datetime.timedelta(minutes=15)
    )


def worker_main(
    argv: list[str],
    suites: Mapping[str, Callable[[int, str], dict]],
    *,
    init: Callable[[str, int, str], None] | None = None,
) -> None:
    """A worker's main: ``argv`` is ``[script, SUITE, RANK, OUT_DIR]``.

    Makes the process group (``init(suite, rank, out_dir)``; None: :func:`init_gloo` env://), runs
    ``suites[SUITE](rank, out_dir)``, saves its dict (or the traceback) to ``OUT_DIR/SUITE-RANK.pt``,
    then a barrier (every rank done before teardown: gloo can abort a rank that tears down
    mid-exchange) and the teardown.
    """
    suite, rank, out_dir = argv[1], int(argv[2]), argv[3]
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if init is None:
        init_gloo(rank)
    else:
        init(suite, rank, out_dir)
    try:
        result = suites[suite](rank, out_dir)
    except Exception:
        result = {"error": traceback.format_exc()}
    torch.save(result, os.path.join(out_dir, f"{suite}-{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
