"""The README's PyTorch example runs as written."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARK = "# readme-example: torch"


def _blocks():
    for path in (ROOT / "README.md",):
        if path.exists():
            found = [
                b for b in re.findall(r"```python\n(.*?)```", path.read_text(), re.S) if b.startswith(MARK)
            ]
            if found:
                return path, found
    raise AssertionError(f"no ```python block starting with {MARK!r} in README.md")


def test_readme_example_runs():
    path, blocks = _blocks()
    for code in blocks:
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, f"{path}:\n{out.stdout}\n{out.stderr}"
        assert "accuracy" in out.stdout
