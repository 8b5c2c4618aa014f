"""Run the cases of one backend in one mode in this process; print one JSON line per result.

    python -m conformance.worker BACKEND --mode native --cases FILE [--states DIR] [--only PREFIXES]
    python -m conformance.worker BACKEND [--mode mpx] [--cases FILE] [--states DIR] [--only PREFIXES]
    python -m conformance.worker BACKEND --states DIR --save-states

The runner (:mod:`conformance.runner`) resolves the cases with the mpx core and writes them to
``FILE`` (:func:`conformance.cases.write`); it starts this worker twice per backend, once per mode,
each in its own process.  In ``--mode native`` the worker installs the mpx import blocker
(:mod:`conformance.isolation`) before it imports anything else of the harness, so the framework's
own machinery runs in a process where nothing of mpx is loaded; it needs ``--cases`` (the cases
module imports mpx).  ``--mode mpx`` computes the cases itself when no file is given.

With ``--save-states`` the worker only writes ``DIR/BACKEND.json``, the scaler
state its backend saves (under mpx) after the portability prefix, for the other backends
to resume from.  Otherwise it prints ``{"type": "info", ...}`` (with ``mode`` and
``mpx_modules``, the mpx modules loaded: none natively), one ``{"type": "result", ...}`` line
per case, and last ``{"type": "done", "mode", "mpx_modules", "blocked"}``: the mpx modules loaded
at the end and the mpx imports the blocker refused (the runner fails a native run that lists any).

A case that raises is judged by who raised it (:func:`blame`, the innermost frame that is not the
standard library's):

- the framework (natively) or mpx or the framework (under mpx): what the case observed, so natively
  ``differs`` (a finding: the framework cannot do this) and under mpx ``fail``;
- the adapter itself (``conformance/``), or mpx's code in a native run, or an import of mpx that
  the native run's blocker refused (wherever it came from): an ``error``, with the
  exception's line in ``detail`` and where it was raised in ``at``.  An error is the harness's
  failure, never a finding against the framework; under mpx it fails the run (exit status 1).

The frameworks' own traceback filters (JAX's, Keras's, TensorFlow's) are turned off in the worker,
so their frames stay visible to :func:`blame`.  A framework function implemented in C that raises
on an adapter's line leaves no frame of its own, so it is blamed on the adapter; an adapter that
expects such a call to raise catches it and returns ``{"raised": ...}`` (:func:`raised`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import sysconfig
import time
import traceback
from pathlib import Path
from typing import Any

from conformance import isolation
from mpx_tools.skip import Skip
from mpx_tools.workers import BACKENDS

# Nothing of mpx, of the cases or of the adapters is imported here: a native worker installs the
# mpx import blocker first (main), then loads its adapter.
Case = dict[str, Any]
MODES = ("native", "mpx")
#: The folder holding ``conformance`` and ``mpx_tools`` (mpx_tools.workers.ROOT).
ROOT = Path(__file__).resolve().parents[1]
#: The harness's packages: a frame in one of them is the adapter's.
HARNESS = ("conformance", "mpx_tools")
_ISOLATION = Path(isolation.__file__).resolve()
#: Result statuses: ``error`` is a crash of the adapter (the harness), never the framework's or mpx's verdict.
STATUSES = ("pass", "differs", "fail", "skip", "error")
_STDLIB = tuple({str(Path(sysconfig.get_paths()[k]).resolve()) for k in ("stdlib", "platstdlib")})


def _origin(filename: str) -> str:
    """``stdlib``, ``adapter`` (conformance/, mpx_tools/), ``mpx`` (mpx's packages, wherever the library is
    installed) or ``framework`` for a frame's file."""
    if filename.startswith("<frozen "):
        return "stdlib"
    path = Path(filename).resolve()
    first = _first_part(path, ROOT)
    if first in HARNESS:
        return "adapter"
    if isolation.is_mpx_name(first) or isolation.is_mpx_name(_first_part(path, isolation.library_folder())):
        return "mpx"
    text = str(path)
    if text.startswith(_STDLIB) and not {"site-packages", "dist-packages"} & set(path.parts):
        return "stdlib"
    return "framework"


def _first_part(path: Path, folder: Path | None) -> str:
    """The first part of ``path`` under ``folder`` ('' when it is not under it)."""
    try:
        return path.relative_to(folder).parts[0] if folder is not None else ""
    except (ValueError, IndexError):
        return ""


def blame(err: BaseException) -> tuple[str, str]:
    """Who raised ``err`` and where: (``adapter``, ``mpx`` or ``framework``; ``FILE:LINE in FUNCTION``).

    The innermost frame of its traceback that is not the standard library's decides; a traceback of
    standard-library frames only is the adapter's (it called them).
    """
    frames = traceback.extract_tb(err.__traceback__)
    for frame in reversed(frames):
        if Path(frame.filename).resolve() == _ISOLATION:  # the blocker: the import's line is to blame
            continue
        origin = _origin(frame.filename)
        if origin != "stdlib":
            return origin, _where(frame)
    return "adapter", _where(frames[-1]) if frames else "?"


def _where(frame: traceback.FrameSummary) -> str:
    path = Path(frame.filename)
    for folder in (ROOT, isolation.library_folder()):  # the harness's files, then the library's
        if folder is not None and path.resolve().is_relative_to(folder):
            path = path.resolve().relative_to(folder)
            break
    return f"{path}:{frame.lineno} in {frame.name}"


def exception_line(err: BaseException) -> str:
    """``Type: message`` of ``err`` (the traceback's last line, without notes), at most 300 characters."""
    lines = traceback.format_exception_only(type(err), err)
    notes = getattr(err, "__notes__", None) or []
    kept = lines[: len(lines) - len(notes)] if notes and len(lines) > len(notes) else lines
    return "".join(kept).strip()[:300]


def raised(err: BaseException) -> dict:
    """The observation of a framework call that raised ``err``: ``{"raised": "Type: message"}``."""
    return {"raised": exception_line(err)}


def unfiltered_tracebacks(backend: str) -> None:
    """Turn off the framework's traceback filtering, so :func:`blame` sees its frames.

    JAX reads ``JAX_TRACEBACK_FILTERING`` when it is imported (call this first); Keras and
    TensorFlow are switched off through their public config once imported.
    """
    os.environ["JAX_TRACEBACK_FILTERING"] = "off"
    if (backend == "tf" or backend.startswith("keras-")) and "keras" in sys.modules:
        sys.modules["keras"].config.disable_traceback_filtering()
    if backend == "tf" and "tensorflow" in sys.modules:
        sys.modules["tensorflow"].debugging.disable_traceback_filtering()


def load_adapter(backend: str) -> Any:
    """The adapter module of ``backend`` (``keras-jax`` -> ``conformance.adapters.keras_jax``)."""
    return importlib.import_module(f"conformance.adapters.{backend.replace('-', '_')}")


def read_cases(path: Path) -> list[Case]:
    """The cases in ``path``, a file :func:`conformance.cases.write` wrote (read without importing mpx).

    Raises:
        ValueError: when the file is not such a file.
    """
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or data.get("format") != "mpx.conformance-cases/1":
        raise ValueError(f"{path}: not a conformance cases file (conformance.cases.write writes them)")
    return data["cases"]


def judge(case: Case, observed: Any) -> bool:
    """Whether ``observed`` meets the case's expectation."""
    expected = case["expected"]
    if case["kind"] in ("numerics", "op_value"):
        err = observed.get("max_rel_error")
        return isinstance(err, float) and math.isfinite(err) and err <= expected["max_rel_error_at_most"]
    if case["kind"] in (
        "distributed",
        "accumulation",
        "models",
    ):  # observations also name the engine, per-replica traces, a model's op dtypes and bytes
        return isinstance(observed, dict) and {k: observed.get(k) for k in expected} == expected
    return observed == expected


def run_case(adapter: Any, case: Case, mode: str, states: Path | None) -> dict:
    params = dict(case["params"])
    if case["kind"] == "portability":
        source = params["source"]
        if source == "core":
            if "state_dict" not in params:  # conformance.cases precomputes it
                raise ValueError(f"{case['id']}: the core's state_dict is missing from its params")
        else:
            path = states / f"{source}.json" if states else None
            if path is None or not path.exists():
                return {
                    "status": "skip",
                    "observed": None,
                    "detail": f"no state saved by {source} (not installed?)",
                }
            params["state_dict"] = json.loads(path.read_text())
    run = getattr(adapter, f"run_{case['kind']}", None)
    if run is None:  # a group this backend has no subjects for (the models group: torch's HF models)
        return {"status": "skip", "observed": None, "detail": f"no {case['group']} cases in this backend"}
    start = time.perf_counter()
    try:
        observed = run(params, mode)
    except Skip as why:
        return {"status": "skip", "observed": None, "detail": str(why)}
    except Exception as err:  # see the module docstring: who raised decides
        who, where = blame(err)
        line = exception_line(err)
        blocked = isolation.blocked_by(err)
        if blocked is not None and blocked is not err:
            line = f"{exception_line(blocked)} (raised as {line})"[:300]
        if who == "adapter" or (who == "mpx" and mode == "native") or blocked is not None:
            return {"status": "error", "observed": None, "detail": line, "at": where}
        status = "differs" if mode == "native" else "fail"
        return {"status": status, "observed": {"raised": line}, "detail": f"raised {line}", "at": where}
    ok = judge(case, observed)
    status = "pass" if ok else ("differs" if mode == "native" else "fail")
    detail = "" if ok else f"spec: {case['spec']}; observed {json.dumps(observed)[:300]}"
    if ok and isinstance(observed, dict) and observed.get("engine"):
        detail = f"engine: {observed['engine']}"
    return {
        "status": status,
        "observed": observed,
        "detail": detail,
        "seconds": round(time.perf_counter() - start, 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.worker")
    parser.add_argument("backend", choices=sorted(BACKENDS))
    parser.add_argument("--mode", choices=MODES, default="mpx",
                        help="native: the framework's own machinery, mpx blocked; mpx (default): under mpx")  # fmt: skip
    parser.add_argument("--cases", type=Path, default=None,
                        help="the cases file the runner wrote (required with --mode native)")  # fmt: skip
    parser.add_argument("--states", type=Path, default=None)
    parser.add_argument("--save-states", action="store_true")
    parser.add_argument("--only", default=None, help="run only cases whose id starts with one of these "
                        "comma-separated prefixes")  # fmt: skip
    args = parser.parse_args(argv)
    if args.mode == "native":
        if args.save_states:
            parser.error("--save-states saves the state mpx's scaler saves: it runs in --mode mpx")
        if args.cases is None:
            parser.error("--mode native needs --cases FILE: the cases module imports mpx, which a native "
                         "run blocks (mpx conformance writes the file)")  # fmt: skip
        isolation.install()  # first: before the cases, the adapter or the framework is imported
    unfiltered_tracebacks(args.backend)
    adapter = load_adapter(args.backend)
    unfiltered_tracebacks(args.backend)
    if args.save_states:
        from conformance import cases as C

        args.states.mkdir(parents=True, exist_ok=True)
        state = adapter.save_state(dict(C.PORTABILITY_CONFIG), list(C.PORTABILITY_PREFIX))
        (args.states / f"{args.backend}.json").write_text(json.dumps(state))
        return 0
    if args.cases is not None:
        every = read_cases(args.cases)
    else:
        from conformance import cases as C

        every = C.all_cases()
    chosen = [c for c in every
              if not args.only or any(c["id"].startswith(p.strip()) for p in args.only.split(",") if p.strip())]  # fmt: skip
    if any(c["kind"] == "distributed" for c in chosen):
        from conformance import distributed

        # the replicas run in the background while the other cases do, in this worker's mode only
        distributed.start(args.backend, chosen, modes=(args.mode,))
    out = sys.stdout
    info = {"type": "info", "backend": args.backend, **adapter.info(), "mode": args.mode,
            "mpx_modules": isolation.mpx_modules()}  # fmt: skip
    out.write(json.dumps(info) + "\n")
    out.flush()
    for case in chosen:
        result = run_case(adapter, case, args.mode, args.states)
        row = {"type": "result", "case": case["id"], "group": case["group"], "backend": args.backend,
               "mode": args.mode, "expected": case["expected"], **result}  # fmt: skip
        out.write(json.dumps(row) + "\n")
        out.flush()
    done = {"type": "done", "backend": args.backend, "mode": args.mode, **isolation.report()}
    if any(c["kind"] == "distributed" for c in chosen):
        from conformance import distributed

        done["replicas"] = distributed.isolation_report(args.backend)
    out.write(json.dumps(done) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
