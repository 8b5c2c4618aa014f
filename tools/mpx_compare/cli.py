"""Command-line wiring of ``mpx compare`` (:data:`COMMAND`, the ``mpx.commands`` entry point).

Bad arguments exit 2 with one line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mpx
from mpx_compare.data import DATASETS
from mpx_tools.command import Command
from mpx_tools.workers import FRAMEWORKS as BACKENDS  # the frameworks: Keras columns are conformance's
from mpx_tools.workers import backend_names

__all__ = ["COMMAND", "add_arguments", "main"]

MODELS = ("mlp", "cnn", "transformer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mpx compare``."""
    parser.description = (
        "Train the same model from the same initialization in float32 and under each policy, per backend "
        "(each in its own process), over N seeds; report validation accuracy and loss, the delta to float32 "
        "with its spread, pass/fail against a criterion, skipped steps and the final loss scale."
    )
    parser.add_argument("--backend", action="append", metavar="NAME",
                        help=f"a backend (repeatable): {', '.join(BACKENDS)}; default: every installed one")
    parser.add_argument("--policy", action="append", metavar="SPEC",
                        help="a policy compared with float32 (repeatable; default: mixed_bfloat16); FP8 "
                             "policies too (mixed_bfloat16_fp8, mixed_bfloat16,fp8=hybrid)")
    parser.add_argument("--model", default="mlp", metavar="NAME", help=f"{', '.join(MODELS)} (default: mlp)")
    parser.add_argument("--dataset", default=None, metavar="NAME",
                        help=f"{', '.join(DATASETS)} (default: digits; sequence for the transformer)")
    parser.add_argument("--seeds", default="3", metavar="N", help="seeds per policy (default: 3)")
    parser.add_argument("--epochs", default="5", metavar="N", help="epochs per run (default: 5)")
    parser.add_argument("--batch-size", default="64", metavar="N", help="batch size (default: 64)")
    parser.add_argument("--lr", default="1e-3", metavar="LR", help="Adam learning rate (default: 1e-3)")
    parser.add_argument("--max-steps", default=None, metavar="N", help="cap every run at N steps (tests)")
    parser.add_argument("--criterion", default="0.5", metavar="POINTS",
                        help="pass when |mean accuracy delta| is within POINTS percentage points (default: 0.5)")
    parser.add_argument("--device", default="cpu", metavar="DEVICE", help="cpu or cuda (default: cpu)")
    parser.add_argument("--timeout", default="3600", metavar="SECONDS", help="limit per backend process")
    parser.add_argument("--out", type=Path, default=Path("mpx-compare"),
                        help="folder for compare.json, compare.md and compare.png (default: mpx-compare)")
    parser.add_argument("--quiet", action="store_true", help="no progress display")  # fmt: skip


def _number(value: str | None, name: str, kind: type, low: float) -> float | int | None:
    if value is None:
        return None
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected {'an integer' if kind is int else 'a number'}, got {value!r}") from None
    if not number >= low:
        raise ValueError(f"{name}: must be at least {low:g}, got {value}")
    return number


def main(args: argparse.Namespace) -> int:
    """Run ``mpx compare``; returns 0, 1 when a policy fails the criterion or a worker failed, 2 for bad usage."""
    from mpx_compare import engine, report

    prog = "mpx compare"
    try:
        names = backend_names(args.backend, BACKENDS)
        if args.model not in MODELS:
            raise ValueError(f"--model: unknown model {args.model!r}; available: {', '.join(MODELS)}")
        dataset = args.dataset or ("sequence" if args.model == "transformer" else "digits")
        if dataset not in DATASETS:
            raise ValueError(f"--dataset: unknown dataset {dataset!r}; available: {', '.join(DATASETS)}")
        numbers = {"seeds": _number(args.seeds, "--seeds", int, 1), "epochs": _number(args.epochs, "--epochs", int, 1),
                   "batch_size": _number(args.batch_size, "--batch-size", int, 1),
                   "lr": _number(args.lr, "--lr", float, 1e-12),
                   "max_steps": _number(args.max_steps, "--max-steps", int, 1),
                   "criterion_points": _number(args.criterion, "--criterion", float, 0),
                   "timeout_s": _number(args.timeout, "--timeout", float, 1)}  # fmt: skip
        policies = [str(mpx.get_policy(p).name or mpx.get_policy(p)) for p in args.policy or ["mixed_bfloat16"]]
    except (ValueError, mpx.MPXError) as err:
        print(f"{prog}: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    if args.out.exists() and not args.out.is_dir():
        print(f"{prog}: --out: {args.out} exists and is not a folder", file=sys.stderr)
        return 2
    command = ["mpx", "compare", *sys.argv[2:]] if sys.argv[1:2] == ["compare"] else None
    data = engine.run(names, model=args.model, dataset=dataset, policies=policies, device=args.device,
                      quiet=args.quiet, command=command, **numbers)  # fmt: skip
    paths = report.write_all(data, args.out)
    print(report.terminal(data))
    print("reports: " + ", ".join(str(p) for p in paths.values()))
    failed = any(m["status"] == "failed" for m in data["backends"].values())
    return 1 if failed or any(s["passed"] is False for s in data["summary"]) else 0


#: ``mpx compare`` (the ``mpx.commands`` entry point, tools/pyproject.toml).
COMMAND = Command(
    "train float32 and mixed precision side by side per backend; report the accuracy delta", add_arguments, main
)
