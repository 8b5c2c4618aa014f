"""mpx_keras._compat: the one gate to Keras internals, and the one error when one changes.

Each mutation test takes one internal away (as a Keras release that renamed it would) and checks that
mpx_keras raises mpx.FrameworkVersionError naming it; what a backend cannot do names the backend instead.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import keras
import numpy as np
import pytest

import mpx
import mpx_keras
from mpx_keras import _compat

BACKEND = keras.config.backend()
MODULES = sorted(p for p in Path(mpx_keras.__file__).parent.glob("*.py") if p.name != "_compat.py")
PRIVATE = {*_compat.OPTIMIZER_METHODS, *_compat.OPTIMIZER_STATE, "_flatten_layers", "_keras_history",
           "_keras_mask", "_parse_name", "_dtype_policy", "_layers"}  # fmt: skip


@pytest.mark.parametrize("path", MODULES, ids=[p.name for p in MODULES])
def test_internals_are_reached_only_through_compat(path):
    text = path.read_text()
    assert not re.search(
        r"keras\.src|tf\.__internal__|tensorflow\.core|from tensorflow\.python|jax\._src", text
    )
    used = sorted(name for name in PRIVATE if re.search(rf"\.{name}\b", text))
    assert not used, f"{path.name} reads {used} directly; go through mpx_keras._compat"


@pytest.mark.parametrize("path", MODULES, ids=[p.name for p in MODULES])
def test_no_module_imports_tensorflow_at_the_top(path):
    top = [line for line in path.read_text().splitlines() if line.startswith(("import ", "from "))]
    assert not [line for line in top if re.search(r"\b(tensorflow|jax|torch)\b", line)], top


def test_the_keras_version_is_checked_at_import(monkeypatch):
    monkeypatch.setattr(keras, "__version__", "3.3.0")
    with pytest.raises(mpx.FrameworkVersionError, match=r"keras 3\.3\.0 is older than mpx supports"):
        importlib.reload(_compat)
    monkeypatch.undo()
    importlib.reload(_compat)


def test_a_missing_keras_module_internal(monkeypatch):
    api_export = importlib.import_module("keras.src.api_export")
    monkeypatch.delattr(api_export, "REGISTERED_NAMES_TO_OBJS")
    with pytest.raises(
        mpx.FrameworkVersionError, match=r"has no keras\.src\.api_export\.REGISTERED_NAMES_TO_OBJS"
    ):
        importlib.reload(_compat)
    monkeypatch.undo()
    importlib.reload(_compat)


def test_a_missing_optimizer_method_fails_at_construction(monkeypatch):
    name = "_overwrite_variable_with_gradient"
    for owner in [c for c in type(keras.optimizers.SGD()).__mro__ if name in vars(c)]:
        monkeypatch.delattr(owner, name)
    with pytest.raises(
        mpx.FrameworkVersionError, match=rf"has no keras\.optimizers\.Optimizer\.{name}, which mpx"
    ):
        mpx_keras.LossScaleOptimizer(keras.optimizers.SGD(0.1))


def test_a_tensorflow_only_optimizer_method_is_not_required():
    """_all_reduce_sum_gradients exists only on TensorFlow's optimizer: never blame the Keras version for it."""
    opt = mpx_keras.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    w = keras.Variable(np.ones(2, np.float32))
    opt.apply([keras.ops.ones(2)], [w])
    assert opt.state.steps == 1


def test_the_dtype_policy_parser_and_layer_internals(monkeypatch):
    monkeypatch.delattr(keras.DTypePolicy, "_parse_name")
    with pytest.raises(
        mpx.FrameworkVersionError, match=r"DTypePolicy\._parse_name, which mpx uses for reading mpx:"
    ):
        _compat.dtype_policy_parse_name()
    monkeypatch.undo()
    monkeypatch.delattr(keras.layers.Layer, "_flatten_layers")
    with pytest.raises(mpx.FrameworkVersionError, match=r"_flatten_layers, which mpx uses for walking"):
        mpx_keras.apply_policy(keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)]), "mixed_bfloat16")


@pytest.mark.skipif(BACKEND != "tensorflow", reason="XLA's host-call limit is TensorFlow's")
def test_the_xla_context_test_is_an_internal(monkeypatch):
    control_flow_util = importlib.import_module("tensorflow.python.ops.control_flow_util")
    assert _compat.in_xla_context() is False
    monkeypatch.delattr(control_flow_util, "GraphOrParentsInXlaContext")
    with pytest.raises(
        mpx.FrameworkVersionError, match=r"GraphOrParentsInXlaContext, which mpx uses for the stuck"
    ):
        _compat.in_xla_context()


def test_the_accumulation_window_internals_fail_at_construction(monkeypatch):
    name = "_get_variable_index"
    for owner in [c for c in type(keras.optimizers.SGD()).__mro__ if name in vars(c)]:
        monkeypatch.delattr(owner, name)
    with pytest.raises(
        mpx.FrameworkVersionError, match=rf"Optimizer\.{name}, which mpx uses for the accumulation"
    ):
        mpx_keras.LossScaleOptimizer(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2))
