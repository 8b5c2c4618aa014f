"""The README's Keras examples run as written (each in a fresh process)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NAMES = ["keras-fit", "keras-custom-loop", "keras-quickstart", "keras-distributed"]
#: what an example's output must contain, where it says so
EXPECT = {"keras-quickstart": "['bfloat16', 'float32']", "keras-distributed": "2\n"}
BLOCK = re.compile(r"```python\n(# readme-example: (?P<name>[\w-]+)\n.*?)```", re.S)


def _examples() -> dict[str, str]:
    """Blocks marked `# readme-example: NAME`, from README.md and docs/."""
    found: dict[str, str] = {}
    for source in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        for m in BLOCK.finditer(source.read_text()):
            found.setdefault(m["name"], m.group(1))
    missing = [n for n in NAMES if n not in found]
    if missing:
        raise AssertionError(f"no README.md or docs/ block holds the examples {missing}")
    return found


@pytest.mark.parametrize("name", NAMES)
def test_readme_example_runs(name, tmp_path, run_python):
    code = _examples()[name]
    env = {
        **os.environ,
        "KERAS_BACKEND": "tensorflow",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    # conftest's hang detector (no output and no CPU time for minutes), not a wall-clock limit
    [(code, out, err)] = run_python([[sys.executable, "-c", code]], cwd=tmp_path, env=env)
    assert code == 0, err[-4000:]
    assert out.strip()
    assert EXPECT.get(name, "") in out
