"""Tests of the JAX backend; skipped as a whole where jax is not installed."""

import os

import pytest

# The slow-policy warning (float16/bfloat16 on XLA:CPU) is tested on its own in test_slow_warning.py.
os.environ.setdefault("MPX_NO_SLOW_WARNING", "1")

pytest.importorskip("jax")
pytest.importorskip("optax")
