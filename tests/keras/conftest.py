"""Keras 3 tests on the backend ``KERAS_BACKEND`` names (tests/run.py runs them once per backend).

Each suite is its own process: ``keras-tf``, ``keras-jax``, ``keras-torch``.  A backend whose
framework is not installed skips the whole directory.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The slow-policy warning (float16 on CPU) is tested in tests/tf/test_slow_warning.py.
os.environ.setdefault("MPX_NO_SLOW_WARNING", "1")

import pytest

_FRAMEWORK = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}[os.environ["KERAS_BACKEND"]]
if importlib.util.find_spec(_FRAMEWORK) is None:  # pragma: no cover
    pytest.skip(f"{_FRAMEWORK} is not installed", allow_module_level=True)

keras = pytest.importorskip("keras")

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ("tensorflow", "jax", "torch")


@pytest.fixture(autouse=True)
def _float32_global_policy():
    """Every test starts and ends with Keras's default float32 global policy (and mpx's, when loaded).

    Resetting mpx's global policy too gives back the op table's hold a mixed
    ``set_global_policy`` took, so no test leaves the dispatch installed for the next.
    """
    _reset_global_policy()
    yield
    _reset_global_policy()


def _reset_global_policy():
    if "mpx_keras" in sys.modules:
        sys.modules["mpx_keras"].set_global_policy("float32")
    keras.config.set_dtype_policy("float32")


def run_python(code: str, backend: str, *, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python with ``KERAS_BACKEND=backend`` (timeout: only a hang detector)."""
    env = {**os.environ, "KERAS_BACKEND": backend, "MPX_NO_SLOW_WARNING": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="session")
def python_on():
    """:func:`run_python` for tests (a fixture, as test modules import no sibling module)."""
    return run_python
