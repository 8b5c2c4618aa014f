"""The whole repository is ruff-clean, checked by the ruff version pyproject's test extra pins (and no other).

Another ruff has other rules and defaults, so the test fails, naming both versions, instead of running it.
"""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def pinned_ruff() -> str:
    """The version of ``ruff==X`` in pyproject's ``test`` extra (read as text: no tomllib on Python 3.10)."""
    text = (ROOT / "pyproject.toml").read_text()
    extra = re.search(r"^test = \[(.*?)\]", text, re.S | re.M)
    assert extra, "pyproject.toml has no test extra"
    pins = re.findall(r"\"ruff==([\w.]+)\"", extra.group(1))
    assert len(pins) == 1, f"pyproject's test extra must pin ruff exactly once (ruff==X): {extra.group(1)}"
    return pins[0]


def _ruff() -> list[str] | None:
    """This Python's ruff (the test extra installs it), else the one on PATH, else None."""
    if importlib.util.find_spec("ruff") is not None:
        return [sys.executable, "-m", "ruff"]
    path = shutil.which("ruff")
    return [path] if path else None


def test_ruff_clean():
    pinned, ruff = pinned_ruff(), _ruff()
    if ruff is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"ruff is not installed: pip install ruff=={pinned} (pyproject's test extra)")
        pytest.skip(f"ruff is not installed (pip install ruff=={pinned})")
    # the bounds only catch a hang: ruff checks the repository in about a second
    version = subprocess.run([*ruff, "--version"], capture_output=True, text=True, timeout=600)
    found = version.stdout.split()[-1] if version.returncode == 0 and version.stdout.split() else "unknown"
    assert found == pinned, (
        f"{' '.join(ruff)} is ruff {found}, but pyproject's test extra pins ruff=={pinned}; "
        f"its rules differ, so this test runs the pinned one only: pip install ruff=={pinned}"
    )
    out = subprocess.run(
        [*ruff, "check", "--no-cache", str(ROOT)], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout + out.stderr
