"""Command-line wiring of ``mpx bench`` and ``mpx doctor`` (:data:`BENCH` and :data:`DOCTOR`, the ``mpx.commands``
entry points that ``mpx.cli`` finds).

Bad arguments exit 2 with a one-line message on stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mpx
from mpx_bench.models import MODELS, SIZES
from mpx_tools.command import Command
from mpx_tools.workers import FRAMEWORKS as BACKENDS  # the frameworks: Keras columns are conformance's
from mpx_tools.workers import backend_names

__all__ = ["BENCH", "DOCTOR", "add_bench_arguments", "add_doctor_arguments", "run_bench", "run_doctor"]

DEFAULT_POLICIES = ("mixed_bfloat16", "mixed_float16")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mpx bench``."""
    parser.description = (
        "Time full training steps (forward, backward, loss scaling, optimizer) of one model in each backend: "
        "float32, the framework's own mixed precision, and mpx with the same policy (float16 also without "
        "loss scaling). Each backend runs in its own process; steps are interleaved so drift cancels."
    )
    parser.add_argument(
        "--backend",
        action="append",
        metavar="NAME",
        help=f"a backend to time (repeatable): {', '.join(BACKENDS)}; default: every installed one",
    )
    parser.add_argument(
        "--model",
        default="mlp",
        metavar="NAME",
        help=f"the model: {', '.join(MODELS)} (default: mlp, 1024-4096-1024, batch 256)",
    )
    parser.add_argument(
        "--size",
        default="default",
        metavar="SIZE",
        help=f"model size: {', '.join(SIZES)} (default: default; tiny is for tests)",
    )
    parser.add_argument(
        "--policy",
        action="append",
        metavar="SPEC",
        help=f"a policy to time (repeatable; default: {', '.join(DEFAULT_POLICIES)})",
    )
    parser.add_argument(
        "--steps", default="20", metavar="N", help="timed steps per configuration, at least 2 (default: 20)"
    )
    parser.add_argument(
        "--warmup",
        default="3",
        metavar="N",
        help="warm-up steps per configuration, at least 1; the first is reported as the "
        "first call, compilation included (default: 3)",
    )
    parser.add_argument(
        "--budget",
        default="10",
        metavar="SECONDS",
        help="time budget per configuration: a slower one is capped to fewer steps, or "
        "skipped with a note when fewer than 2 fit (default: 10)",
    )
    parser.add_argument(
        "--skip-slower-than",
        default="20",
        metavar="X",
        help="skip a compute dtype that mpx.advice knows to be more than X times slower "
        "than float32 on this device, when a quick matmul probe agrees; 0 never skips "
        "(default: 20)",
    )
    parser.add_argument("--device", default="cpu", metavar="DEVICE", help="cpu or cuda (default: cpu)")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("mpx-bench"),
        help="folder for bench.json, bench.md and bench.png (default: mpx-bench)",
    )
    parser.add_argument(
        "--timeout",
        default="1800",
        metavar="SECONDS",
        help="wall-clock limit per backend process (default: 1800)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch: also time each step under torch.compile (inductor): fp32, native and mpx compiled, "
        "with compiles, graphs and graph breaks per configuration",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress display")  # fmt: skip
    parser.add_argument(
        "--memory",
        action="store_true",
        help="instead of timing: bytes per parameter (weights, grads, compensation/master, optimizer state) per "
        "policy after one AdamW step of the mlp, counted from the tensors (torch, jax; default policies: "
        "float32, mixed_bfloat16, bf16_kahan, bf16_sr, mixed_bfloat16_8bit_adam); writes memory.json/.md",
    )


def _usage(prog: str, message: str) -> int:
    print(f"{prog}: {message}", file=sys.stderr)
    return 2


def _number(value: str, name: str, kind: type, low: float) -> float | int:
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"{name}: expected {'an integer' if kind is int else 'a number'}, got {value!r}"
        ) from None
    if not number >= low or number != number:
        raise ValueError(f"{name}: must be at least {low:g}, got {value}")
    return number


def run_bench(args: argparse.Namespace) -> int:
    """Run ``mpx bench``; returns 0, 1 when a backend's worker failed, 2 for bad usage."""
    from mpx_bench import bench, report

    prog = "mpx bench"
    try:
        names = backend_names(args.backend, BACKENDS)
    except ValueError as err:
        return _usage(prog, str(err))
    if args.model not in MODELS:
        return _usage(prog, f"unknown model {args.model!r}; available: {', '.join(MODELS)}")
    if args.size not in SIZES:
        return _usage(prog, f"unknown size {args.size!r}; available: {', '.join(SIZES)}")
    try:
        steps = _number(args.steps, "--steps", int, 2)
        warmup = _number(args.warmup, "--warmup", int, 1)
        budget = _number(args.budget, "--budget", float, 0.001)
        skip = _number(args.skip_slower_than, "--skip-slower-than", float, 0)
        timeout = _number(args.timeout, "--timeout", float, 1)
        policies = [
            str(mpx.get_policy(p).name or mpx.get_policy(p)) for p in (args.policy or DEFAULT_POLICIES)
        ]
    except (ValueError, mpx.MPXError) as err:
        return _usage(prog, str(err).splitlines()[0])
    if args.device.split(":")[0] not in ("cpu", "cuda", "gpu"):
        return _usage(prog, f"--device: expected cpu or cuda, got {args.device!r}")
    from mpx_tools.workers import unwritable

    why = unwritable(args.out)  # before the run, not after it
    if why:
        return _usage(prog, f"--out: {why}")
    if getattr(args, "memory", False):
        from mpx_bench import memory

        chosen = policies if args.policy else list(memory.DEFAULT_POLICIES)
        rows, status = memory.run(names, chosen, args.size, args.out)
        print(memory.table(rows))
        print(f"reports: {args.out / 'memory.json'}, {args.out / 'memory.md'}")
        return status
    data = bench.run(names, model=args.model, size=args.size, policies=policies, steps=steps, warmup=warmup,
                     budget_s=budget, device=args.device, skip_slower_than=skip, timeout_s=timeout,
                     quiet=args.quiet, command=["mpx", "bench", *sys.argv[2:]] if sys.argv[1:2] == ["bench"]
                     else None, compile=getattr(args, "compile", False))  # fmt: skip
    paths = report.write_all(data, args.out)
    print(report.terminal(data))
    print("reports: " + ", ".join(str(p) for p in paths.values()))
    failed = [b for b, m in data["backends"].items() if m["status"] == "failed"]
    return 1 if failed else 0


def add_doctor_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mpx doctor``."""
    parser.description = (
        "Show the installed frameworks and versions, the devices, the hardware's precision support, and a "
        "short matmul probe per framework and dtype that flags slow policies; recommend a policy per backend."
    )
    parser.add_argument(
        "--backend",
        action="append",
        metavar="NAME",
        help=f"a backend to check (repeatable): {', '.join(BACKENDS)}; default: every installed one",
    )
    parser.add_argument(
        "--probe-seconds",
        default="1",
        metavar="SECONDS",
        help="time budget of each framework's probe, all dtypes together (default: 1; 0: no probe)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")  # fmt: skip


def run_doctor(args: argparse.Namespace) -> int:
    """Run ``mpx doctor``; returns 0, or 2 for bad usage."""
    from mpx_bench import doctor

    prog = "mpx doctor"
    try:
        names = backend_names(args.backend, BACKENDS)
    except ValueError as err:
        return _usage(prog, str(err))
    try:
        seconds = _number(args.probe_seconds, "--probe-seconds", float, 0)
    except ValueError as err:
        return _usage(prog, str(err))
    data = doctor.run(names, probe_s=seconds)
    if args.json:
        import json

        print(json.dumps(data, indent=1, default=str))
    else:
        print(doctor.text(data))
    return 0


#: ``mpx bench`` and ``mpx doctor`` (``mpx.commands`` entry points, tools/pyproject.toml).
BENCH = Command("time training steps natively and under mpx", add_bench_arguments, run_bench)
DOCTOR = Command(
    "show frameworks, devices and precision support; recommend a policy", add_doctor_arguments, run_doctor
)
