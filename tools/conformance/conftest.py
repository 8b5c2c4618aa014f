"""Fixtures shared by the conformance tests: the one full run of the session."""

from __future__ import annotations

import pytest

from conformance.runner import run, select
from mpx_tools.workers import BACKENDS, is_installed

# The adapters import their frameworks; pytest must not import them all into one process.
collect_ignore = ["adapters"]

#: Keras on JAX and on PyTorch (issue 24) run a selection of the cases in a fixture of their own
#: (test_conformance's ``keras_data``); ``mpx conformance --backend keras-jax`` runs every case.
KERAS_NEW = ("keras-jax", "keras-torch")
#: the columns of the full run
INSTALLED = [b for b in BACKENDS if is_installed(b) and b not in KERAS_NEW]


@pytest.fixture(scope="session")
def full_columns() -> list[str]:
    """The columns of the session's full run (``data``)."""
    return INSTALLED


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    """Every case on every installed column but keras-jax and keras-torch, run once per session through the
    runner (a worker process per backend and mode; this process imports no framework): the report dict,
    with ``out`` the folder its reports were written to (test_conformance's cases, the browser test's page)."""
    if not INSTALLED:
        pytest.skip("no framework is installed")
    out = tmp_path_factory.mktemp("report")
    result = run(INSTALLED, out, quiet=True)
    result["out"] = out
    return result


@pytest.fixture
def group_report(request, tmp_path):
    """``get(backend, only)``: the report of ``backend`` on the cases ``only`` selects, taken from the session's
    full run (``data``) for its columns, else from a run of its own (keras-jax, keras-torch)."""

    def get(backend: str, only: str) -> dict:
        if backend in INSTALLED:
            return select(request.getfixturevalue("data"), backend, only)
        return run([backend], tmp_path / "report", only=only, quiet=True)

    return get
