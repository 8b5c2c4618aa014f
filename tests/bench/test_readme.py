"""The slow-policy example of docs/performance.md runs as written, in a fresh process."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAME = "slow-policy-warning"


def _block() -> str:
    pattern = re.compile(r"```python\n(# readme-example: " + re.escape(NAME) + r"\n.*?)```", re.S)
    for path in (ROOT / "docs" / "performance.md", ROOT / "README.md"):
        if path.exists():
            found = pattern.search(path.read_text(encoding="utf-8"))
            if found:
                return found.group(1)
    raise AssertionError(f"no '# readme-example: {NAME}' block in docs/performance.md or README.md")


def test_readme_example_runs():
    env = {"PATH": "", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", _block()], capture_output=True, text=True, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "MPX_NO_SLOW_WARNING" in out.stdout
