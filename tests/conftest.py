"""Fixtures every suite shares; this file imports no framework."""

import pytest

import mpx.advice


@pytest.fixture
def warnings_on(monkeypatch):
    """Slow-policy warnings switched on (the suites' conftests switch them off) and forgotten before and after."""
    monkeypatch.delenv(mpx.advice.ENV_SWITCH, raising=False)
    mpx.advice.reset_warnings()
    yield
    mpx.advice.reset_warnings()
