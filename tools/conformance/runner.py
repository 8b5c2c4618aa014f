"""``mpx conformance``: run every backend's worker in its own process and write the reports.

Exit status: 0 when every mpx result passes, 1 when one fails or errors (its
adapter crashed, or a backend's worker did: it cannot pass), 2 for bad usage (an unknown backend, an ``--only`` that matches no case,
an ``--out`` that cannot be written), checked before any framework starts.

Reports are written atomically (:func:`conformance.report.write_all`): a run that
crashes, matches nothing or loses a backend's worker never replaces an earlier
report in ``--out``; a run whose worker crashed writes to ``OUT.failed`` instead.

The runner resolves the cases with the core and writes them to a file
(:func:`conformance.cases.write`); per backend it starts two workers, one after the other, each in
its own process: ``--mode native`` (mpx blocked from its first line, :mod:`conformance.isolation`)
and ``--mode mpx``.  A native worker (or its replicas) that loaded or tried to import mpx is a
crashed worker.  ``report.json`` says per backend what the native run loaded
(``backends.BACKEND.native``: ``mpx_modules``, ``blocked``; ``mpx_free``).
"""

from __future__ import annotations

import argparse
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from conformance import cases as C
from conformance import report
from conformance.progress import ColumnProgress
from conformance.worker import MODES
from mpx_tools.command import Command
from mpx_tools.workers import BACKENDS, ROOT, backend_names, is_installed, run_worker, worker_env


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend", action="append", metavar="NAME",
        help=f"run only this backend (repeatable): {', '.join(BACKENDS)}; default: every installed one",
    )  # fmt: skip
    parser.add_argument(
        "--out", type=Path, default=Path("mpx-report"), help="report folder (default: mpx-report)"
    )
    parser.add_argument(
        "--only", default=None, metavar="PREFIX[,PREFIX...]",
        help="run only cases whose id starts with one of these comma-separated prefixes (scaler,numerics.mlp)",
    )  # fmt: skip
    parser.add_argument(
        "--quiet", action="store_true",
        help="no progress display (otherwise a bar per column with an estimate on a terminal, plain lines off one)",
    )  # fmt: skip


def matches(case_id: str, only: str | None) -> bool:
    """Whether ``case_id`` starts with one of the comma-separated prefixes of ``only`` (None: every case)."""
    return not only or any(case_id.startswith(p.strip()) for p in only.split(",") if p.strip())


def selected(only: str | None) -> list[C.Case]:
    """The cases ``--only`` selects."""
    return [c for c in C.all_cases() if matches(c["id"], only)]


def _skip_rows(backend: str, why: str, only: str | None) -> list[dict]:
    return [
        {
            "case": c["id"],
            "group": c["group"],
            "backend": backend,
            "mode": mode,
            "status": "skip",
            "expected": c["expected"],
            "observed": None,
            "detail": why,
        }
        for c in selected(only)
        for mode in MODES
    ]


def select(data: dict, backend: str, only: str | None) -> dict:
    """The part of the report ``data`` that ``run([backend], out, only=only)`` gives: ``backend``'s rows (and
    its crashed-worker row, if any) of the cases ``only`` selects, those cases, and ``backend``'s metadata."""
    ids = {case for case in data["cases"] if matches(case, only)}
    return {
        **data,
        "backends": {backend: data["backends"][backend]},
        "cases": {case: spec for case, spec in data["cases"].items() if case in ids},
        "results": [r for r in data["results"] if r["backend"] == backend and (r["case"] in ids or r["case"] == "worker")],
    }  # fmt: skip


class NothingToRun(ValueError):
    """``--only`` selects no case."""


def run(backends: list[str], out: Path, only: str | None = None, quiet: bool = False) -> dict:
    """Run the suite and return the report dict, written to ``out`` (``OUT.failed`` when a worker crashed).

    Raises:
        NothingToRun: when ``only`` matches no case (before any worker starts).
        OSError: when ``out`` cannot be written (before any worker starts).
    """
    if not selected(only):
        raise NothingToRun(f"--only {only!r} matches no case; case ids start with {', '.join(C.GROUPS)}")
    staging = report.prepare_out(out)
    try:
        data = _run(backends, only, quiet)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    crashed = any(r["case"] == "worker" for r in data["results"])
    target = out.with_name(out.name + ".failed") if crashed else out
    if crashed:
        shutil.rmtree(staging, ignore_errors=True)
        staging = report.prepare_out(target)
    report.write_all(data, target, staging)
    data["out"] = str(target)
    return data


def _run(backends: list[str], only: str | None, quiet: bool) -> dict:
    installed = [b for b in backends if is_installed(b)]
    cases = selected(only)
    per_worker = len(cases)
    total = per_worker * len(MODES) * len(installed)
    progress = ColumnProgress(total, quiet=quiet)
    started = time.monotonic()
    results: list[dict] = []
    meta: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="mpx-states-") as states:
        cases_file = C.write(cases, Path(states) / "cases.json")
        # each backend a selected portability case resumes from saves its state first
        sources = {c["params"]["source"] for c in cases if c["kind"] == "portability"}
        for backend in (b for b in installed if b in sources):
            subprocess.run(
                [sys.executable, "-m", "conformance.worker", backend, "--states", states, "--save-states"],
                env=worker_env(backend), cwd=ROOT, capture_output=True, text=True,
            )  # fmt: skip
        for backend in backends:
            if backend not in installed:
                meta[backend] = {
                    "version": None,
                    "device": None,
                    "skipped": f"{BACKENDS[backend]} is not installed",
                }
                results.extend(_skip_rows(backend, f"{BACKENDS[backend]} is not installed", only))
                continue
            t0 = time.monotonic()
            progress.start(backend, per_worker * len(MODES))
            rows: list[dict] = []
            failures: dict[str, tuple[str, str]] = {}
            for mode in MODES:  # native first: a process of its own, nothing of mpx loaded
                args = [backend, "--mode", mode, "--cases", str(cases_file), "--states", states]
                seen = 0
                got: dict[str, dict] = {}

                def collect(row: dict, got: dict = got, rows: list = rows) -> None:
                    nonlocal seen
                    kind = row.pop("type", None)
                    if kind in ("info", "done"):
                        row.pop("backend", None)
                        got[kind] = row
                        return
                    rows.append(row)
                    seen += 1
                    progress.advance(row["mode"], row["case"])

                w0 = time.monotonic()
                _, code, stderr = run_worker("conformance.worker", args, collect, backend=backend)
                info = {k: v for k, v in got.get("info", {}).items() if k != "mode"}
                if mode == "mpx" or backend not in meta:
                    meta[backend] = {**meta.get(backend, {}), **info}
                end_row = got.get("done", {})
                isolation = {"seconds": round(time.monotonic() - w0, 1),
                             "mpx_modules": end_row.get("mpx_modules", info.get("mpx_modules")),
                             "blocked": end_row.get("blocked"), "replicas": end_row.get("replicas")}  # fmt: skip
                meta[backend].pop("mpx_modules", None)
                meta[backend][mode] = isolation if mode == "native" else {"seconds": isolation["seconds"]}
                failure = None
                if code != 0 or seen < per_worker:
                    tail = stderr.strip().splitlines()[-1:] or ["no output"]
                    failure = (f"exit {code} after {seen} results", tail[0][:300])
                elif mode == "native" and not _mpx_free(isolation):
                    failure = ("mpx loaded in the native run", _loaded(isolation))
                if mode == "native":
                    meta[backend]["mpx_free"] = _mpx_free(isolation)
                if failure is not None:
                    failures[mode] = failure
            if failures:
                rows.append(_crash_row(backend, failures))
            meta.setdefault(backend, {"version": None, "device": None})
            meta[backend]["seconds"] = round(time.monotonic() - t0, 1)
            order = {c["id"]: i for i, c in enumerate(cases)}  # per case native then mpx, as one process gave
            rows.sort(key=lambda r: (order.get(r["case"], len(order)), MODES.index(r["mode"])))
            results.extend(rows)
            progress.note(f"{backend}: {sum(r['case'] != 'worker' for r in rows)} results in "
                          f"{meta[backend]['seconds']}s (native mpx-free: {meta[backend].get('mpx_free')})")  # fmt: skip
    data = {
        "mpx_version": _version(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "seconds": round(time.monotonic() - started, 1),
        "backends": meta,
        "cases": {
            c["id"]: {"group": c["group"], "spec": c["spec"], "params": c["params"]} for c in selected(only)
        },
        "results": results,
    }
    return data


def _crash_row(backend: str, failures: dict[str, tuple[str, str]]) -> dict:
    """One ``worker`` error row for a backend whose workers crashed: ``failures`` maps a mode to (what was
    observed, the detail).  Its mode is ``mpx`` when the mpx worker crashed (it cannot pass), else ``native``."""
    mode = "mpx" if "mpx" in failures else "native"
    observed, detail = failures[mode]
    if mode == "mpx" and "native" in failures:
        detail = f"{detail}; the native worker too: {failures['native'][0]}: {failures['native'][1]}"
    return {
        "case": "worker",
        "group": "worker",
        "backend": backend,
        "mode": mode,
        "status": "error",
        "expected": "the worker runs every case" + (", nothing of mpx loaded" if mode == "native" else ""),
        "observed": observed,
        "detail": detail[:300],
    }


def _loaded(isolation: dict) -> str:
    """What of mpx a native worker's isolation report says was loaded or refused ('' when nothing)."""
    replicas = isolation.get("replicas") or {}
    parts = [
        ("mpx modules loaded", isolation.get("mpx_modules") or []),
        ("mpx imports refused", isolation.get("blocked") or []),
        ("mpx modules loaded by the replicas", replicas.get("mpx_modules") or []),
        ("mpx imports refused in the replicas", replicas.get("blocked") or []),
    ]
    return "; ".join(f"{what}: {', '.join(names)}" for what, names in parts if names)


def _mpx_free(isolation: dict) -> bool:
    return isolation.get("mpx_modules") == [] and not _loaded(isolation)


def _version() -> str:
    from mpx import __version__

    return __version__


def main(args: argparse.Namespace) -> int:
    try:
        names = backend_names(args.backend)
    except ValueError as err:
        print(f"mpx conformance: {err}", file=sys.stderr)
        return 2
    try:
        data = run(names, args.out, only=args.only, quiet=args.quiet)
    except NothingToRun as err:
        print(f"mpx conformance: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        why = str(err) if len(err.args) == 1 else err.strerror  # ours carry one message; the OS's an errno
        print(f"mpx conformance: --out {args.out}: cannot write there ({why})", file=sys.stderr)
        return 2
    print(report.terminal(data))
    out = Path(data["out"])
    if out != args.out:
        print(f"mpx conformance: a worker crashed; {args.out} is left as it was", file=sys.stderr)
    print(f"reports: {out / 'report.json'}, {out / 'report.md'}, {out / 'report.html'}")
    crashed = any(r["case"] == "worker" for r in data["results"])  # a native worker's too
    return 0 if report.mpx_passes(data) and not crashed else 1


#: ``mpx conformance`` (the ``mpx.commands`` entry point, tools/pyproject.toml).
COMMAND = Command(
    "run the conformance suite on every installed backend and write reports", add_arguments, main
)
