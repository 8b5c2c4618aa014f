"""Run every case for one backend in this process; print one JSON line per result.

    python -m conformance.worker BACKEND [--states DIR] [--save-states]

With ``--save-states`` the worker only writes ``DIR/BACKEND.json``, the scaler
state its backend saves after the portability prefix, for the other backends
to resume from.  Otherwise it prints ``{"type": "info", ...}`` then one
``{"type": "result", ...}`` line per case and mode.

A case that raises is judged by who raised it (:func:`blame`, the innermost frame that is not the
standard library's):

- the framework (natively) or mpx or the framework (under mpx): what the case observed, so natively
  ``differs`` (a finding: the framework cannot do this) and under mpx ``fail``;
- the adapter itself (``conformance/``), or mpx's code in a native run: an ``error``, with the
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

from conformance import cases as C
from conformance.adapters._common import Skip
from mpx._workers import BACKENDS, ROOT

MODES = ("native", "mpx")
#: Result statuses: ``error`` is a crash of the adapter (the harness), never the framework's or mpx's verdict.
STATUSES = ("pass", "differs", "fail", "skip", "error")
_STDLIB = tuple({str(Path(sysconfig.get_paths()[k]).resolve()) for k in ("stdlib", "platstdlib")})


def _origin(filename: str) -> str:
    """``stdlib``, ``adapter`` (conformance/), ``mpx`` (mpx's packages) or ``framework`` for a frame's file."""
    if filename.startswith("<frozen "):
        return "stdlib"
    path = Path(filename).resolve()
    try:
        first = path.relative_to(ROOT).parts[0]
    except (ValueError, IndexError):
        first = ""
    if first == "conformance":
        return "adapter"
    if first.startswith("mpx"):
        return "mpx"
    text = str(path)
    if text.startswith(_STDLIB) and not {"site-packages", "dist-packages"} & set(path.parts):
        return "stdlib"
    return "framework"


def blame(err: BaseException) -> tuple[str, str]:
    """Who raised ``err`` and where: (``adapter``, ``mpx`` or ``framework``; ``FILE:LINE in FUNCTION``).

    The innermost frame of its traceback that is not the standard library's decides; a traceback of
    standard-library frames only is the adapter's (it called them).
    """
    frames = traceback.extract_tb(err.__traceback__)
    for frame in reversed(frames):
        origin = _origin(frame.filename)
        if origin != "stdlib":
            return origin, _where(frame)
    return "adapter", _where(frames[-1]) if frames else "?"


def _where(frame: traceback.FrameSummary) -> str:
    path = Path(frame.filename)
    try:
        path = path.resolve().relative_to(ROOT)
    except ValueError:
        pass
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
    if backend == "tf" and "keras" in sys.modules:
        sys.modules["keras"].config.disable_traceback_filtering()
    if backend == "tf" and "tensorflow" in sys.modules:
        sys.modules["tensorflow"].debugging.disable_traceback_filtering()


def load_adapter(backend: str) -> Any:
    return importlib.import_module(f"conformance.adapters.{backend}")


def judge(case: C.Case, observed: Any) -> bool:
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


def run_case(adapter: Any, case: C.Case, mode: str, states: Path | None) -> dict:
    params = dict(case["params"])
    if case["kind"] == "portability":
        source = params["source"]
        if source == "core":
            params["state_dict"] = C.saved_prefix_state()
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
        if who == "adapter" or (who == "mpx" and mode == "native"):
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
    parser.add_argument("--states", type=Path, default=None)
    parser.add_argument("--save-states", action="store_true")
    parser.add_argument("--only", default=None, help="run only cases whose id starts with one of these "
                        "comma-separated prefixes")  # fmt: skip
    args = parser.parse_args(argv)
    unfiltered_tracebacks(args.backend)
    adapter = load_adapter(args.backend)
    unfiltered_tracebacks(args.backend)
    if args.save_states:
        args.states.mkdir(parents=True, exist_ok=True)
        state = adapter.save_state(dict(C.PORTABILITY_CONFIG), list(C.PORTABILITY_PREFIX))
        (args.states / f"{args.backend}.json").write_text(json.dumps(state))
        return 0
    chosen = [c for c in C.all_cases()
              if not args.only or any(c["id"].startswith(p.strip()) for p in args.only.split(",") if p.strip())]  # fmt: skip
    if any(c["kind"] == "distributed" for c in chosen):
        from conformance import distributed

        distributed.start(args.backend)  # the replicas run in the background while the other cases do
    out = sys.stdout
    out.write(json.dumps({"type": "info", "backend": args.backend, **adapter.info()}) + "\n")
    out.flush()
    for case in chosen:
        for mode in MODES:
            result = run_case(adapter, case, mode, args.states)
            row = {"type": "result", "case": case["id"], "group": case["group"], "backend": args.backend,
                   "mode": mode, "expected": case["expected"], **result}  # fmt: skip
            out.write(json.dumps(row) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
