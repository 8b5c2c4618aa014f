"""Tests of the JAX backend; skipped as a whole where jax is not installed."""

import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")
