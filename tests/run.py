"""Run the test suites, one pytest process per framework.

    python tests/run.py [PYTEST_ARGS...]

Each suite imports at most one framework (the project's rule: never load two
frameworks in one process when one will do).  A suite whose framework is not
installed is reported as skipped; every other suite must collect and pass at
least one test (pytest's exit 5, "no tests collected", counts as a failure).
The last line is the total over all suites.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name, framework module that must be importable (None: always), paths[, environment]
SUITES: list[tuple[str, str | None, list[str]] | tuple[str, str | None, list[str], dict[str, str]]] = [
    ("core", None, ["mpx", "tests/core"]),
    ("torch", "torch", ["mpx_torch", "tests/torch"]),
    ("tf", "tensorflow", ["mpx_tf", "tests/tf"]),
    ("jax", "jax", ["mpx_jax", "tests/jax"]),
    # Keras 3 once per backend, each in its own process (mpx_keras's doctests and tests/keras)
    ("keras-tf", "tensorflow", ["mpx_keras", "tests/keras"], {"KERAS_BACKEND": "tensorflow"}),
    ("keras-jax", "jax", ["mpx_keras", "tests/keras"], {"KERAS_BACKEND": "jax"}),
    ("keras-torch", "torch", ["mpx_keras", "tests/keras"], {"KERAS_BACKEND": "torch"}),
    ("bench", None, ["tools/mpx_tools", "tools/mpx_bench", "tools/mpx_compare", "tests/bench"]),
    ("conformance", None, ["tools/conformance"]),
]
#: how many of each suite's slowest tests pytest lists (--durations): where CI's time budget goes
SLOWEST = 15
COUNTS = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)")


def main(argv: list[str]) -> int:
    totals = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    for name, framework, paths, *extra in SUITES:
        env = {**os.environ, **extra[0]} if extra else None
        present = [p for p in paths if (ROOT / p).exists()]
        if not any(p.startswith(("tests", "tools/conformance")) for p in present):
            continue
        if framework is not None and importlib.util.find_spec(framework) is None:
            print(f"== {name}: skipped ({framework} is not installed)", flush=True)
            continue
        print(f"== {name}: pytest {' '.join(present)}", flush=True)
        start = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", *present, f"--durations={SLOWEST}", *argv],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        last = ""
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            if line.strip():
                last = line
        code = proc.wait()
        for number, kind in COUNTS.findall(last):
            key = "failed" if kind.startswith(("failed", "error")) else kind
            if key in totals:
                totals[key] += int(number)
        print(f"== {name}: exit {code} in {time.monotonic() - start:.0f}s", flush=True)
        if code != 0:
            failures.append(f"{name} (exit {code}{', no tests collected' if code == 5 else ''})")
    if failures:
        print("failed suites: " + ", ".join(failures))
    print(f"total: {totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
