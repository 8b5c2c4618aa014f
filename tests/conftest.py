"""Fixtures every suite shares; this file imports no framework.

It also puts this folder on ``sys.path`` for the one helper module the suites share,
``kernel_parity`` (the kernels' parity checks each backend runs against numpy).
"""

import sys
from pathlib import Path

import pytest

import mpx.advice

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def warnings_on(monkeypatch):
    """Slow-policy warnings switched on (the suites' conftests switch them off) and forgotten before and after."""
    monkeypatch.delenv(mpx.advice.ENV_SWITCH, raising=False)
    mpx.advice.reset_warnings()
    yield
    mpx.advice.reset_warnings()


@pytest.fixture
def loaded_by():
    """``loaded_by(code, packages)``: the modules of ``packages`` (top-level names) loaded after ``code`` ran
    in a fresh Python process, sorted."""
    import json
    import subprocess
    import sys

    def run(code: str, packages: tuple[str, ...]) -> list[str]:
        script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {packages!r})))"
        # the bound only catches a hang: importing the library takes about a second
        out = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=600
        )
        return json.loads(out.stdout.splitlines()[-1])

    return run
