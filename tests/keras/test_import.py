"""Importing mpx_keras patches nothing and loads no other framework than Keras's backend."""

from __future__ import annotations

import json

import keras
import pytest

BACKEND = keras.config.backend()

SNAPSHOT = r"""
import json, sys, inspect, keras

def snapshot():
    found = {}
    for module_name in ("keras.ops", "keras.ops.nn", "keras.ops.numpy", "keras.ops.linalg", "keras.ops.image",
                        "keras.losses", "keras.activations"):
        module = sys.modules.get(module_name) or __import__(module_name, fromlist=["_"])
        for name, value in vars(module).items():
            if callable(value) and not name.startswith("_"):
                found[f"{module_name}.{name}"] = value
    found["keras.layers.Layer.__call__"] = keras.layers.Layer.__call__
    found["keras.Operation.__call__"] = keras.Operation.__call__
    return found

before = snapshot()
frameworks_before = {m for m in ("tensorflow", "jax", "torch") if m in sys.modules}
import mpx_keras
after = snapshot()
changed = sorted(k for k in before if after.get(k) is not before[k])
frameworks_after = {m for m in ("tensorflow", "jax", "torch") if m in sys.modules}
print(json.dumps({"checked": len(before), "changed": changed,
                  "new_frameworks": sorted(frameworks_after - frameworks_before), "loaded": sorted(frameworks_after)}))
"""


def _run(run_python) -> dict:
    proc = run_python(SNAPSHOT, BACKEND)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def imported(python_on) -> dict:
    return _run(python_on)


def test_import_patches_no_keras_function(imported):
    assert imported["checked"] > 300  # every public keras.ops / keras.losses function was looked at
    assert imported["changed"] == []


def test_import_loads_no_other_framework(imported):
    assert imported["new_frameworks"] == []
    if BACKEND != "tensorflow":  # (Keras's torch backend itself may load jax, for its own utilities)
        assert "tensorflow" not in imported["loaded"]


def test_apply_policy_wraps_layer_call_only_once_an_mpx_name_is_in_use(python_on):
    code = r"""
import keras, mpx_keras
original = keras.layers.Layer.__call__
model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
mpx_keras.apply_policy(model, "float32")
print(keras.layers.Layer.__call__ is original)
"""
    proc = python_on(code, BACKEND)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "False"
