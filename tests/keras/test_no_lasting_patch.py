"""mpx_keras changes no Keras class (#30): after apply_policy, a fit and a load_model,
``keras.layers.Layer.__call__`` is Keras's own; the one install (Keras's parser of dtype-policy names learning
``mpx:`` names, and mpx's classes registered with Keras's serialization) is undone by ``mpx_keras.uninstall()``
and done again by ``mpx_keras.install()``.  Each check runs in a fresh Python on this suite's backend, so the
functions compared are those Keras had before mpx_keras was imported."""

from __future__ import annotations

import json

import keras

BACKEND = keras.config.backend()

SCRIPT = r"""
import json, sys, tempfile, os
import numpy as np, keras
keras_call, keras_parse = keras.layers.Layer.__call__, keras.DTypePolicy._parse_name
keras_objects = dict(keras.saving.get_custom_objects())
import mpx, mpx_keras
from mpx_keras.layer_policy import LayerPolicy
out = {"parse_installed": keras.DTypePolicy._parse_name is not keras_parse}
with mpx_keras.policy_scope("mixed_float16"):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="d"),
                              keras.layers.LayerNormalization(name="ln"), keras.layers.Dense(2, name="out")])
mpx_keras.apply_policy(model, "mixed_float16")
out["after_apply"] = keras.layers.Layer.__call__ is keras_call
model.compile(optimizer=mpx_keras.LossScaleOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
model.fit(x, np.ones((4, 2), np.float32), verbose=0)
out["after_fit"] = keras.layers.Layer.__call__ is keras_call
path = os.path.join(tempfile.mkdtemp(), "m.keras")
model.save(path)
loaded = keras.models.load_model(path)
y = loaded(x)
out["after_load"] = keras.layers.Layer.__call__ is keras_call
out["loaded"] = [type(l.dtype_policy).__name__ for l in loaded.layers]
out["loaded_out"] = keras.backend.standardize_dtype(y.dtype)
out["loaded_ln"] = [loaded.get_layer("ln").compute_dtype, loaded.get_layer("ln").autocast]
mpx_keras.uninstall()
out["uninstalled_parse"] = keras.DTypePolicy._parse_name is keras_parse
out["uninstalled_objects"] = sorted(set(keras.saving.get_custom_objects()) ^ set(keras_objects))
try:
    keras.DTypePolicy("mpx:params=float32,compute=float16")
    out["uninstalled_reads_mpx"] = True
except ValueError:
    out["uninstalled_reads_mpx"] = False
try:
    keras.models.load_model(path)
    out["uninstalled_loads"] = True
except Exception:
    out["uninstalled_loads"] = False
out["old_model_runs"] = keras.backend.standardize_dtype(model(x).dtype)
mpx_keras.uninstall()  # idempotent
mpx_keras.install()
out["reinstalled"] = keras.DTypePolicy._parse_name is not keras_parse
out["reinstalled_objects"] = sorted(set(keras.saving.get_custom_objects()) - set(keras_objects))
again = keras.models.load_model(path)
out["reloaded_out"] = keras.backend.standardize_dtype(again(x).dtype)
out["layer_call"] = keras.layers.Layer.__call__ is keras_call
print(json.dumps(out))
"""


def test_layer_call_stays_keras_and_uninstall_takes_back_what_mpx_keras_installed(python_on):
    proc = python_on(SCRIPT, BACKEND)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["parse_installed"]  # the one documented install, at import
    assert out["after_apply"] and out["after_fit"] and out["after_load"] and out["layer_call"]
    # the loaded layers are rebuilt from their mpx: names, and behave as the saved ones
    assert out["loaded"] == ["LayerPolicy"] * 3
    assert out["loaded_out"] == "float32" and out["loaded_ln"] == ["float32", True]
    # uninstall(): Keras's own parser back, mpx's classes out of Keras's serialization registry
    assert out["uninstalled_parse"]
    assert out["uninstalled_objects"] == []
    assert out["uninstalled_reads_mpx"] is False and out["uninstalled_loads"] is False
    assert out["old_model_runs"] == "float32"  # a model already built keeps its per-layer behaviour
    assert out["reinstalled"] and out["reloaded_out"] == "float32"
    assert {"mpx_keras>LayerPolicy", "mpx_keras>LossScaleOptimizer", "mpx_keras>Float8Dense"} <= set(
        out["reinstalled_objects"]
    )
