"""``python -m mpx_compare.worker BACKEND ...``: one backend's runs, in its own process, as JSON lines.

Lines on stdout: ``{"type": "info", ...}``, ``{"type": "progress", "text": ...}``,
``{"type": "run", ...}`` (one per policy and seed) and ``{"type": "done"}``.
Only this backend's framework is imported.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from mpx_compare import data as datasets
from mpx_compare.workers.common import Settings
from mpx_tools.workers import FRAMEWORKS as BACKENDS
from mpx_tools.workers import Emitter


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mpx_compare.worker")
    p.add_argument("backend", choices=sorted(BACKENDS))
    p.add_argument("--model", default="mlp")
    p.add_argument("--dataset", default="digits")
    p.add_argument("--policy", action="append", default=[])
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    os.environ.setdefault("MPX_NO_SLOW_WARNING", "1")  # the report says which policies were slow
    emit = Emitter()
    module = importlib.import_module(f"mpx_compare.workers.{args.backend}")
    emit("info", backend=args.backend, **module.info(args.device))
    data = datasets.load(args.dataset)
    settings = Settings(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, max_steps=args.max_steps,
                        device=args.device)  # fmt: skip
    make = module.build(args.model, datasets.classes(args.dataset))
    for run in module.compare(make, data, policies=args.policy, seeds=range(args.seeds), settings=settings,
                              progress=lambda text: emit("progress", text=text)):  # fmt: skip
        emit("run", **run)
    emit("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
