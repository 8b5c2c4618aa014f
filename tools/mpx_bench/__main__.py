"""``python -m mpx_bench bench|doctor ...``: the same commands as ``mpx bench`` and ``mpx doctor``."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from mpx_bench.cli import add_bench_arguments, add_doctor_arguments, run_bench, run_doctor


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {message}", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m mpx_bench")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    bench = commands.add_parser("bench", help="time training steps natively and under mpx")
    add_bench_arguments(bench)
    bench.set_defaults(run=run_bench)
    doctor = commands.add_parser("doctor", help="frameworks, devices, precision support, policy advice")
    add_doctor_arguments(doctor)
    doctor.set_defaults(run=run_doctor)
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.error("a command is required: bench, doctor")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
