"""The ``distributed`` group's scenarios, run in processes of their own (one launch per backend).

Replicas need an engine set up before the framework starts: torch spawns 2 gloo processes,
TensorFlow must configure 2 logical CPUs before it initialises, JAX (and Keras on JAX, whose engine is
``keras.distribution``: script ``keras_jax``) needs ``--xla_force_host_platform_device_count=4`` before it
is imported.  So the worker (which has
already imported its framework) starts ``python -m conformance.distributed.BACKEND IN OUT`` once:
``IN`` lists every distributed case's params, the script runs each case in the worker's mode
(environment ``MPX_CONFORMANCE_MODES``, :func:`conformance.isolation.modes_from_env`: a native
worker's replicas install the mpx import blocker too) on its engine and writes ``OUT``:
``{case id: {mode: observed}}``, where ``observed`` is the observation, ``{"skip": why}`` or
``{"raised": message}``, plus ``"_isolation"``: the script's :func:`conformance.isolation.report`.
:func:`results` caches it for the worker's lifetime, so the whole group costs one launch per
backend and worker.

This package is mpx-free: native workers import it with mpx blocked.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from conformance.isolation import MODES_ENV

#: The folder holding ``conformance`` and ``mpx_tools`` (where the scripts run).
ROOT = Path(__file__).resolve().parents[2]
MODES = ("native", "mpx")

#: How long one backend's launch may take before its cases skip (seconds).
TIMEOUT_S = 150.0
_FOUR = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
#: Extra environment per backend (JAX and Keras on JAX: 4 host devices; the others none).
ENV = {"jax": _FOUR, "keras-jax": {**_FOUR, "KERAS_BACKEND": "jax"}}
#: backend -> its script's module under ``conformance.distributed`` (a backend without one runs no replicas:
#: its adapter says why without a launch, as keras-torch does: Keras on PyTorch has no engine).
SCRIPTS = {"torch": "torch", "tf": "tf", "jax": "jax", "keras-jax": "keras_jax"}

_CACHE: dict[str, dict[str, Any]] = {}
_PENDING: dict[str, _Launch] = {}


class _Launch:
    """One run of a backend's script, started in the background; :meth:`wait` reads its results."""

    def __init__(
        self, backend: str, cases: list[dict], modes: tuple[str, ...] = MODES, python: str | None = None
    ) -> None:
        self.backend = backend
        self.specs = {c["id"]: c["params"] for c in cases if c["kind"] == "distributed"}
        self.start = time.perf_counter()
        self.tmp = tempfile.TemporaryDirectory(prefix="mpx-distributed-")
        folder = Path(self.tmp.name)
        self.dst, self.log = folder / "out.json", folder / "stderr.txt"
        (folder / "in.json").write_text(json.dumps(self.specs))
        # the worker's environment (the runner's worker_env), ROOT importable, the modes to run
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path, MODES_ENV: ",".join(modes), **ENV.get(backend, {})}
        cmd = [python or sys.executable, "-m", f"conformance.distributed.{SCRIPTS[backend]}", str(folder / "in.json"),
               str(self.dst)]  # fmt: skip
        self.proc: subprocess.Popen | None = None
        self.failed: str | None = None
        try:
            with open(self.log, "w") as err:  # a file, not a pipe: nothing blocks on a full buffer
                self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err,
                                             start_new_session=True)  # fmt: skip
        except (OSError, subprocess.SubprocessError) as err:
            self.failed = f"cannot launch the {backend} replicas: {type(err).__name__}: {err}"

    def wait(self) -> dict[str, Any]:
        try:
            return self._wait()
        finally:
            self.tmp.cleanup()

    def _wait(self) -> dict[str, Any]:
        if self.failed is None and self.proc is not None:
            left = max(1.0, TIMEOUT_S - (time.perf_counter() - self.start))
            try:
                code = self.proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the script and the ranks it spawned
                self.proc.wait()
                self.failed = f"the {self.backend} replicas did not finish within {TIMEOUT_S:g} s"
            else:
                if not self.dst.exists():
                    lines = self.log.read_text(errors="replace").strip().splitlines()
                    tail = (lines or ["no output"])[-1]
                    self.failed = f"the {self.backend} replicas did not start (exit {code}): {tail[:240]}"
        if self.failed is not None:
            return {cid: {"launch_failed": self.failed} for cid in self.specs}
        out = json.loads(self.dst.read_text())
        out["_seconds"] = round(time.perf_counter() - self.start, 2)
        return out


#: backend -> {case id: params} of the cases its launch runs (what :func:`case_id` looks params up in)
_SPECS: dict[str, dict[str, dict]] = {}


def start(backend: str, cases: list[dict] | None = None, modes: tuple[str, ...] = MODES) -> None:
    """Start ``backend``'s replicas for the distributed cases among ``cases`` in ``modes`` in the
    background (the worker calls this first, so they run while the other groups do); :func:`results`
    then waits for them.  Idempotent.

    ``cases`` default to every case of :mod:`conformance.cases` (which imports mpx: a native worker
    passes the cases it read from its file).
    """
    if backend not in SCRIPTS:
        return
    if backend not in _CACHE and backend not in _PENDING:
        if cases is None:
            from conformance import cases as C

            cases = C.all_cases()
        launch = _Launch(backend, cases, tuple(modes))
        _SPECS[backend] = launch.specs
        _PENDING[backend] = launch


def results(backend: str) -> dict[str, Any]:
    """``{case id: {mode: observed}}`` for every distributed case on ``backend`` (launched once, then cached).

    When the launch fails (a sandbox that cannot spawn processes or open sockets, a timeout),
    every case maps to ``{"launch_failed": why}``.
    """
    if backend not in _CACHE:
        start(backend)
        _CACHE[backend] = _PENDING.pop(backend).wait()
    return _CACHE[backend]


def isolation_report(backend: str) -> dict[str, Any]:
    """What ``backend``'s replica script reported of its isolation (``mpx_modules``, ``blocked``), or
    ``{}`` when it reported nothing (it did not run, or it predates the report)."""
    if backend not in SCRIPTS or (backend not in _CACHE and backend not in _PENDING):
        return {}
    return results(backend).get("_isolation") or {}


def _launch(
    backend: str, cases: list[dict], modes: tuple[str, ...] = MODES, python: str | None = None
) -> dict[str, Any]:
    """Run the backend's script once with ``python`` (default: this interpreter), wait, read its results."""
    return _Launch(backend, cases, modes, python).wait()


def case_id(backend: str, params: dict) -> str:
    """The id of the distributed case of ``backend``'s launch whose params are ``params`` (what
    ``run_distributed`` is given)."""
    for cid, p in _SPECS.get(backend, {}).items():
        if p == params:
            return cid
    raise KeyError(f"no distributed case launched on {backend} has params {params!r}")


def observed(backend: str, params: dict, mode: str) -> dict:
    """The observation of the case with ``params`` in ``mode``, for an adapter's ``run_distributed``.

    Raises:
        conformance.adapters._common.Skip: when the engine does not exist in ``backend`` or the
            replicas could not be launched (saying why).
        RuntimeError: when the scenario raised in its replicas (a native finding, an mpx failure).
    """
    from mpx_tools.skip import Skip

    if backend not in _CACHE and backend not in _PENDING:
        start(backend)
    cid = case_id(backend, params)
    row = results(backend).get(cid)
    if row is None:
        raise RuntimeError(f"the {backend} replicas returned nothing for {cid}")
    if "launch_failed" in row:
        raise Skip(row["launch_failed"])
    got = row.get(mode)
    if got is None:
        raise RuntimeError(f"the {backend} replicas returned no {mode} result for {cid}")
    if "skip" in got:
        raise Skip(got["skip"])
    if "raised" in got:
        raise RuntimeError(got["raised"])
    return {**got, "launch_seconds": results(backend).get("_seconds")}
