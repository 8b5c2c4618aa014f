"""mpx_tf._compat: the one gate to Keras and TensorFlow internals, and the one error when one changes.

Each mutation test takes one internal away (as a Keras or TensorFlow release that renamed it would)
and checks that mpx_tf raises mpx.FrameworkVersionError naming it, before anything runs.  Keras's own
internals (mpx_keras._compat, which mpx_tf._compat re-exports) are tested once, in
tests/keras/test_compat.py, which runs on the TensorFlow backend too.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import mpx
import mpx_tf
from mpx_keras import _compat as keras_compat
from mpx_tf import _compat

MODULES = sorted(p for p in Path(mpx_tf.__file__).parent.glob("*.py") if p.name != "_compat.py")
#: Private members of Keras objects mpx_tf reads, all of them reached through _compat only.
PRIVATE = {
    *_compat.OPTIMIZER_METHODS,
    *_compat.OPTIMIZER_STATE,
    "_flatten_layers",
    "_keras_history",
    "_keras_mask",
    "_parse_name",
    "_dtype_policy",
    "_layers",
}


@pytest.mark.parametrize("path", MODULES, ids=[p.name for p in MODULES])
def test_internals_are_reached_only_through_compat(path):
    text = path.read_text()
    assert not re.search(r"keras\.src|tf\.__internal__|tensorflow\.core|from tensorflow\.python", text)
    used = sorted(name for name in PRIVATE if re.search(rf"\.{name}\b", text))
    assert not used, f"{path.name} reads {used} directly; go through mpx_tf._compat"


def test_versions_are_checked_at_import(monkeypatch):
    monkeypatch.setattr(keras, "__version__", "3.3.0")
    with pytest.raises(
        mpx.FrameworkVersionError, match=r"keras 3\.3\.0 is older than mpx supports \(keras >= 3\.15"
    ):
        importlib.reload(keras_compat)
    monkeypatch.undo()
    monkeypatch.setattr(tf, "__version__", "2.16.1")
    with pytest.raises(mpx.FrameworkVersionError, match=r"tensorflow 2\.16\.1 is older"):
        importlib.reload(_compat)
    monkeypatch.undo()
    importlib.reload(_compat)
    assert isinstance(mpx.FrameworkVersionError("x"), ImportError)


def test_the_keras_names_are_re_exported_from_one_list():
    assert _compat.__all__ == [*keras_compat.__all__, "strategy_supports_no_merge_call", "summary_pb2"]
    assert all(hasattr(_compat, name) for name in _compat.__all__)


def test_a_missing_tensorflow_internal(monkeypatch):
    monkeypatch.delattr(tf.__internal__.distribute, "strategy_supports_no_merge_call")
    with pytest.raises(
        mpx.FrameworkVersionError, match=r"tensorflow .* has no .*strategy_supports_no_merge_call"
    ):
        importlib.reload(_compat)
    monkeypatch.undo()
    importlib.reload(_compat)


@pytest.mark.parametrize("name", sorted(_compat.OPTIMIZER_METHODS))
def test_a_missing_optimizer_method_fails_at_construction(monkeypatch, name):
    for owner in [c for c in type(keras.optimizers.SGD()).__mro__ if name in vars(c)]:
        monkeypatch.delattr(owner, name)
    with pytest.raises(
        mpx.FrameworkVersionError, match=rf"has no keras\.optimizers\.Optimizer\.{name}, which mpx uses"
    ):
        mpx_tf.LossScaleOptimizer(keras.optimizers.SGD(0.1))


def test_the_reduce_dtype_hook(monkeypatch):
    for owner in [c for c in type(keras.optimizers.SGD()).__mro__ if "_all_reduce_sum_gradients" in vars(c)]:
        monkeypatch.delattr(owner, "_all_reduce_sum_gradients")
    with pytest.raises(
        mpx.FrameworkVersionError, match=r"_all_reduce_sum_gradients, which mpx uses for reduce_dtype"
    ):
        mpx_tf.set_reduce_dtype(keras.optimizers.SGD(0.1), "bfloat16")


def test_a_missing_optimizer_state_variable(monkeypatch):
    """A Keras whose optimizer keeps its step count elsewhere fails at the first accumulating step."""
    inner = keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)
    opt = mpx_tf.LossScaleOptimizer(inner)
    w = keras.Variable(np.ones(2, np.float32))
    opt.build([w])
    del inner._iterations
    with pytest.raises(
        mpx.FrameworkVersionError, match=r"Optimizer\._iterations, which mpx uses for the accumulation"
    ):
        opt.apply([tf.ones(2)], [w])
