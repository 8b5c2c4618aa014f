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
