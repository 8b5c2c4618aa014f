"""``python -m mpx_bench.worker BACKEND ...``: time one backend, in its own process, as JSON lines.

Lines on stdout, one JSON object each: ``{"type": "info", ...}`` (framework
versions, device), ``{"type": "progress", ...}``, ``{"type": "config", ...}``
(one per configuration), ``{"type": "probe", ...}`` (with ``--probe``) and
finally ``{"type": "done"}``.  Only this backend's framework is imported.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from mpx_bench.harness import run_configs
from mpx_bench.models import MODELS, SIZES
from mpx_tools.workers import FRAMEWORKS as BACKENDS
from mpx_tools.workers import Emitter


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mpx_bench.worker")
    p.add_argument("backend", choices=sorted(BACKENDS))
    p.add_argument("--model", choices=MODELS, default="mlp")
    p.add_argument("--size", choices=SIZES, default="default")
    p.add_argument("--policy", action="append", default=None)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--budget", type=float, default=30.0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--skip-slower-than", type=float, default=20.0)
    p.add_argument("--probe", action="store_true", help="only probe matmul speed per dtype")
    p.add_argument("--compile", action="store_true", help="also time compiled steps (torch only)")
    p.add_argument("--probe-budget", type=float, default=1.0)
    p.add_argument("--probe-dtypes", default="float32,bfloat16,float16")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    os.environ.setdefault("MPX_NO_SLOW_WARNING", "1")  # the bench measures slowness, it need not be told
    emit = Emitter()
    module = importlib.import_module(f"mpx_bench.workers.{args.backend}")
    emit("info", backend=args.backend, **module.info(args.device))
    if args.probe:
        dtypes = [d for d in args.probe_dtypes.split(",") if d]
        import time

        t0 = time.perf_counter()
        results = module.probe(dtypes, 0.9 * args.probe_budget, args.device) if dtypes else {}
        emit("probe", backend=args.backend, results=results, seconds=time.perf_counter() - t0)
        emit("done")
        return 0
    policies = args.policy or ["mixed_bfloat16", "mixed_float16"]
    slow: dict[str, str] = {}
    if args.skip_slower_than > 0:
        # only combinations whose measured step slowdown in mpx.advice exceeds the threshold are probed (and
        # skipped when the probe agrees): a matmul probe alone misjudges torch's CPU float16 (its linear
        # layers are far faster than its mm) and XLA:CPU float16 (51x on a matmul, 2x on the MLP step)
        from mpx.advice import slow_entry

        def known_slow(policy: str) -> bool:
            entry = slow_entry(args.backend, policy, args.device)
            return entry is not None and entry.slowdown > args.skip_slower_than

        wanted = sorted({module.compute_dtype(p) for p in policies if known_slow(p)})
        if wanted:
            emit("progress", phase="probe", config="matmul " + ",".join(wanted))
            got = module.probe(["float32", *wanted], min(0.5, args.probe_budget), args.device)
            base = got.get("float32", {}).get("seconds")
            for dt in wanted:
                t = got.get(dt, {}).get("seconds")
                if base and t and t / base > args.skip_slower_than:
                    slow[dt] = (f"skipped: a {got[dt]['n']}x{got[dt]['n']} {dt} matmul is {t / base:.0f}x slower "
                                f"than float32 on this device (over --skip-slower-than {args.skip_slower_than:g}); "
                                "pass --skip-slower-than 0 to time it anyway")  # fmt: skip
            emit("probe", backend=args.backend, results=got)
    extra = {"compile": True} if args.compile and args.backend == "torch" else {}
    configs = module.configs(args.model, args.size, policies, args.device, slow, **extra)
    run_configs(configs, steps=args.steps, warmup=args.warmup, budget_s=args.budget, emit=emit)
    emit("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
