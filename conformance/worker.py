"""Run every case for one backend in this process; print one JSON line per result.

    python -m conformance.worker BACKEND [--states DIR] [--save-states]

With ``--save-states`` the worker only writes ``DIR/BACKEND.json``, the scaler
state its backend saves after the portability prefix, for the other backends
to resume from.  Otherwise it prints ``{"type": "info", ...}`` then one
``{"type": "result", ...}`` line per case and mode.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from conformance import cases as C
from conformance.adapters._common import Skip
from mpx._workers import BACKENDS

MODES = ("native", "mpx")


def load_adapter(backend: str) -> Any:
    return importlib.import_module(f"conformance.adapters.{backend}")


def judge(case: C.Case, observed: Any) -> bool:
    """Whether ``observed`` meets the case's expectation."""
    expected = case["expected"]
    if case["kind"] in ("numerics", "op_value"):
        err = observed.get("max_rel_error")
        return isinstance(err, float) and math.isfinite(err) and err <= expected["max_rel_error_at_most"]
    if case["kind"] in ("distributed", "accumulation"):  # observations also name the engine, per-replica traces
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
    start = time.perf_counter()
    try:
        observed = getattr(adapter, f"run_{case['kind']}")(params, mode)
    except Skip as why:
        return {"status": "skip", "observed": None, "detail": str(why)}
    except Exception as err:  # a crash is a finding natively and a failure under mpx
        tb = traceback.format_exception_only(type(err), err)[-1].strip()
        status = "differs" if mode == "native" else "fail"
        return {"status": status, "observed": {"raised": tb[:300]}, "detail": f"raised {tb[:300]}"}
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
    adapter = load_adapter(args.backend)
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
