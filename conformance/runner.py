"""``mpx conformance``: run every backend's worker in its own process and write the reports.

Exit status: 0 when every mpx result passes, 1 when one fails or errors (its
adapter crashed, or a backend's worker did: it cannot pass), 2 for bad usage (an unknown backend, an ``--only`` that matches no case,
an ``--out`` that cannot be written), checked before any framework starts.

Reports are written atomically (:func:`conformance.report.write_all`): a run that
crashes, matches nothing or loses a backend's worker never replaces an earlier
report in ``--out``; a run whose worker crashed writes to ``OUT.failed`` instead.
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
from conformance.worker import MODES
from mpx._workers import BACKENDS, ROOT, Progress, backend_names, is_installed, run_worker, worker_env


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
    parser.add_argument("--quiet", action="store_true", help="no progress display")


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
    per_backend = len(selected(only)) * len(MODES)
    total, done = per_backend * len(installed), 0
    progress = Progress(quiet)
    started = time.monotonic()
    results: list[dict] = []
    meta: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="mpx-states-") as states:
        for backend in installed:  # each backend saves the state the others resume from
            subprocess.run(
                [sys.executable, "-m", "conformance.worker", backend, "--states", states, "--save-states"],
                env=worker_env(), cwd=ROOT, capture_output=True, text=True,
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
            args = [backend, "--states", states] + (["--only", only] if only else [])
            seen = 0

            def collect(row: dict, backend: str = backend) -> None:
                nonlocal seen, done
                if row.pop("type", None) == "info":
                    row.pop("backend", None)
                    meta[backend] = row
                else:
                    results.append(row)
                    seen += 1
                    done += 1
                    progress.show(f"[{done:4d}/{total}] {backend:<5} {row['case']}", force=done == total)

            _, code, stderr = run_worker("conformance.worker", args, collect)
            meta.setdefault(backend, {"version": None, "device": None})
            meta[backend]["seconds"] = round(time.monotonic() - t0, 1)
            if code != 0 or seen < per_backend:
                tail = stderr.strip().splitlines()[-1:] or ["no output"]
                results.append(
                    {
                        "case": "worker",
                        "group": "worker",
                        "backend": backend,
                        "mode": "mpx",
                        "status": "error",
                        "expected": "the worker runs every case",
                        "observed": f"exit {code} after {seen} results",
                        "detail": tail[0][:300],
                    }
                )
            progress.note(f"{backend}: {seen} results in {meta[backend]['seconds']}s")
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
    return 0 if report.mpx_passes(data) else 1
