"""Run the test suites, one pytest process per framework, two at a time.

    python tests/run.py [--jobs N] [PYTEST_ARGS...]

Each suite imports at most one framework (the project's rule: never load two
frameworks in one process when one will do).  A suite whose framework is not
installed is reported as skipped; every other suite must collect and pass at
least one test (pytest's exit 5, "no tests collected", counts as a failure).

Suites run ``--jobs`` at a time (default 2: most of a suite's time is one
core compiling or tracing), the longest first; each suite's output is printed
whole when it ends, after a line saying when it started.  The last line is the
total over all suites.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name, framework module that must be importable (None: always), paths[, environment];
# longest first (seconds on a 2-core CI machine), so that the last suite to start is a short one
SUITES: list[tuple[str, str | None, list[str]] | tuple[str, str | None, list[str], dict[str, str]]] = [
    ("jax", "jax", ["mpx_jax", "tests/jax"]),
    ("conformance", None, ["tools/conformance"]),
    # Keras 3 once per backend, each in its own process (mpx_keras's doctests and tests/keras)
    ("keras-jax", "jax", ["mpx_keras", "tests/keras"], {"KERAS_BACKEND": "jax"}),
    ("torch", "torch", ["mpx_torch", "tests/torch"]),
    ("keras-tf", "tensorflow", ["mpx_keras", "tests/keras"], {"KERAS_BACKEND": "tensorflow"}),
    ("keras-torch", "torch", ["mpx_keras", "tests/keras"], {"KERAS_BACKEND": "torch"}),
    ("bench", None, ["tools/mpx_tools", "tools/mpx_bench", "tools/mpx_compare", "tests/bench"]),
    ("tf", "tensorflow", ["mpx_tf", "tests/tf"]),
    ("core", None, ["mpx", "tests/core"]),
]
#: how many of each suite's slowest tests pytest lists (--durations): where CI's time budget goes
SLOWEST = 15
COUNTS = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)")


class Running:
    """One suite's pytest process, its output going to a temporary file until it ends."""

    def __init__(self, name: str, paths: list[str], env: dict[str, str] | None, argv: list[str]) -> None:
        self.name = name
        self.start = time.monotonic()
        self.log = tempfile.TemporaryFile(mode="w+", encoding="utf-8")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", *paths, f"--durations={SLOWEST}", *argv],
            cwd=ROOT,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def finish(self, totals: dict[str, int]) -> int:
        """Print the suite's whole output and its exit line, add its counts to ``totals``, return its exit code."""
        code = self.proc.wait()
        self.log.seek(0)
        last = ""
        for line in self.log:
            sys.stdout.write(line)
            if line.strip():
                last = line
        self.log.close()
        for number, kind in COUNTS.findall(last):
            key = "failed" if kind.startswith(("failed", "error")) else kind
            if key in totals:
                totals[key] += int(number)
        print(f"== {self.name}: exit {code} in {time.monotonic() - self.start:.0f}s", flush=True)
        return code


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        usage=__doc__.splitlines()[2].strip(), add_help=False, allow_abbrev=False
    )
    parser.add_argument("--jobs", type=int, default=2, help="suites run at a time (default 2)")
    args, pytest_args = parser.parse_known_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    totals = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    queue = []
    for name, framework, paths, *extra in SUITES:
        present = [p for p in paths if (ROOT / p).exists()]
        if not any(p.startswith(("tests", "tools/conformance")) for p in present):
            continue
        if framework is not None and importlib.util.find_spec(framework) is None:
            print(f"== {name}: skipped ({framework} is not installed)", flush=True)
            continue
        queue.append((name, present, {**os.environ, **extra[0]} if extra else None))
    began = time.monotonic()
    running: list[Running] = []
    while queue or running:
        while queue and len(running) < args.jobs:
            name, paths, env = queue.pop(0)
            print(
                f"== {name}: pytest {' '.join(paths)} (started at {time.monotonic() - began:.0f}s)",
                flush=True,
            )
            running.append(Running(name, paths, env, pytest_args))
        done = next((r for r in running if r.proc.poll() is not None), None)
        if done is None:
            time.sleep(1)
            continue
        running.remove(done)
        code = done.finish(totals)
        if code != 0:
            failures.append(f"{done.name} (exit {code}{', no tests collected' if code == 5 else ''})")
    if failures:
        print("failed suites: " + ", ".join(failures))
    print(
        f"total: {totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped "
        f"in {time.monotonic() - began:.0f}s"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
