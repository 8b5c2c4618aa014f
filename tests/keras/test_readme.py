"""The README's Keras-on-JAX quickstart runs as written (a fresh process; it selects the jax backend itself)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import keras
import pytest

ROOT = Path(__file__).resolve().parents[2]
NAME = "keras-jax"
BLOCK = re.compile(r"```python\n(# readme-example: " + NAME + r"\n.*?)```", re.S)


@pytest.mark.skipif(keras.config.backend() != "jax", reason="runs once, in the keras-jax suite")
@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax is not installed")
def test_keras_jax_quickstart_runs(python_on):
    [code] = BLOCK.findall((ROOT / "README.md").read_text())
    proc = python_on(f"import sys; sys.path.insert(0, {str(ROOT)!r})\n" + code, "jax")
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = proc.stdout.strip().splitlines()[-1]
    assert (
        line
        == "jax [8192.0] ScalerState(scale=8192.0, growth_tracker=1, consecutive_nonfinite=0, steps=4, skipped_steps=3, nonfinite_since_growth=0)"
    )
