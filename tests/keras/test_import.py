"""Importing mpx_keras patches nothing and loads no other framework than Keras's backend."""

from __future__ import annotations

import json

import keras
import pytest

BACKEND = keras.config.backend()

SNAPSHOT = r"""
import json, sys, inspect, keras

TF = keras.config.backend() == "tensorflow"

def snapshot():
    found = {}
    names = ["keras.ops", "keras.ops.nn", "keras.ops.numpy", "keras.ops.linalg", "keras.ops.image",
             "keras.losses", "keras.activations"]
    if TF:
        names += ["tensorflow", "tensorflow.math", "tensorflow.nn", "tensorflow.linalg"]
    for module_name in names:
        module = sys.modules.get(module_name) or __import__(module_name, fromlist=["_"])
        for name in dir(module):
            value = getattr(module, name, None)
            if callable(value) and not name.startswith("_") and not isinstance(value, type):
                found[f"{module_name}.{name}"] = value
    found["keras.layers.Layer.__call__"] = keras.layers.Layer.__call__
    found["keras.Operation.__call__"] = keras.Operation.__call__
    for name, value in vars(keras.DTypePolicy).items():
        found[f"keras.DTypePolicy.{name}"] = value
    return found

before = snapshot()
frameworks_before = {m for m in ("tensorflow", "jax", "torch") if m in sys.modules}
import mpx_keras
if TF:
    import mpx_tf
after = snapshot()
changed = sorted(k for k in before if after.get(k) is not before[k])
frameworks_after = {m for m in ("tensorflow", "jax", "torch") if m in sys.modules}
import importlib
A = importlib.import_module("mpx_keras.autocast")
with mpx_keras.autocast("mixed_bfloat16"):
    during = sorted(k for k in before if snapshot().get(k) is not after[k])
after_scope = sorted(k for k in before if snapshot().get(k) is not after[k])
print(json.dumps({"checked": len(before), "changed": changed, "holds": A.holds(),
                  "dispatched": sorted(A.wrapped_functions()), "during": during, "after_scope": after_scope,
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
    assert imported["checked"] > (1000 if BACKEND == "tensorflow" else 300)  # every public function looked at
    # The one install at import: Keras's dtype-policy name parser learns `mpx:` names, so a saved model
    # with them loads (Operation.from_config turns a non-quantized policy back into its name and
    # DTypePolicy.__init__ parses it; see mpx_keras.layer_policy).
    assert imported["changed"] == ["keras.DTypePolicy._parse_name"]


def test_the_op_table_is_installed_only_inside_a_scope(imported):
    assert imported["holds"] == 0
    keras_ops = {n for n in imported["dispatched"] if n.startswith("keras.")}
    assert {"keras.ops.softmax", "keras.ops.matmul", "keras.losses.mean_squared_error"} <= keras_ops
    if BACKEND == "tensorflow":  # mpx_tf adds tf.* (named tf.*; the snapshot reads them as tensorflow.*)
        assert "tf.nn.softmax" in imported["dispatched"]
    else:
        assert keras_ops == set(imported["dispatched"])
    during = {n.replace("tensorflow.", "tf.", 1) for n in imported["during"]}
    assert during == set(imported["dispatched"])  # exactly those, while the scope runs
    assert imported["after_scope"] == []  # and every one put back (`is`)


def test_import_loads_no_other_framework(imported):
    assert imported["new_frameworks"] == []
    if BACKEND != "tensorflow":  # (Keras's torch backend itself may load jax, for its own utilities)
        assert "tensorflow" not in imported["loaded"]


def test_apply_policy_wraps_each_named_layers_call_not_layer_call(python_on):
    code = r"""
import keras, mpx_keras
original = keras.layers.Layer.__call__
model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
mpx_keras.apply_policy(model, "float32")
print(keras.layers.Layer.__call__ is original, "call" in vars(model.layers[0]), "call" in vars(model))
"""
    proc = python_on(code, BACKEND)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "True True True"


def test_the_name_parser_reads_mpx_names_and_hands_every_other_name_to_keras():
    """The one install at import is bounded: only names starting with ``mpx:`` are mpx's."""
    import mpx
    import mpx_keras

    for name, dtypes in (("mixed_float16", ("float16", "float32")), ("bfloat16", ("bfloat16", "bfloat16"))):
        policy = keras.DTypePolicy(name)
        assert (policy.compute_dtype, policy.variable_dtype) == dtypes
    with pytest.raises(ValueError, match="Cannot convert 'float17' to a mixed precision DTypePolicy"):
        keras.DTypePolicy("float17")  # Keras's own error
    with pytest.raises(TypeError, match="'name' must be a string"):
        keras.DTypePolicy(3)
    policy = keras.DTypePolicy("mpx:params=float32,compute=bfloat16,output=float32;autocast=off")
    assert (policy.compute_dtype, policy.variable_dtype) == ("bfloat16", "float32")
    assert type(policy) is mpx_keras.layer_policy.LayerPolicy  # what Keras builds from an mpx: name
    assert type(keras.DTypePolicy("mixed_float16")) is keras.DTypePolicy
    with pytest.raises(mpx.PolicyError, match="'autocast=maybe' is not understood"):
        keras.DTypePolicy("mpx:mixed_float16;autocast=maybe")
