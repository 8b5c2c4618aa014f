"""The scaler surface every backend shares (mpx.testing) holds for mpx_tf.LossScaleOptimizer.

Each step is a real Keras step: a loss through ``scale`` (mpx's name; ``scale_loss`` is Keras's),
gradients from a tape, ``apply`` with the scaled gradients.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import mpx
import mpx_tf
from mpx.testing import SURFACE_CHECKS

_spec = importlib.util.spec_from_file_location(
    "keras_test_surface", Path(__file__).parents[1] / "keras" / "test_surface.py"
)
_keras_surface = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_keras_surface)


class KerasAdapter(_keras_surface.KerasAdapter):
    """tests/keras's adapter (one source), for mpx_tf's LossScaleOptimizer."""

    optimizer_class = mpx_tf.LossScaleOptimizer


@pytest.mark.parametrize("check", SURFACE_CHECKS.values(), ids=list(SURFACE_CHECKS))
def test_loss_scale_optimizer_meets_the_surface(check):
    check(KerasAdapter())


def test_scale_and_scale_loss_are_the_same_product():
    opt = mpx_tf.LossScaleOptimizer(keras.optimizers.SGD(), mpx.ScalerConfig(init_scale=8.0))
    loss = tf.constant(1.5, tf.float16)
    assert opt.scale(loss).dtype == opt.scale_loss(loss).dtype == tf.float32
    assert float(opt.scale(loss)) == float(opt.scale_loss(loss)) == 12.0
    assert opt.get_scale() == 8.0 and type(opt.get_scale()) is float


def test_the_surface_in_a_traced_step():
    """get_scale() and state read what a tf.function step wrote; scale() and last_step_skipped() work inside
    the trace, which a changing scale never retraces."""
    adapter = KerasAdapter()
    opt = adapter.make(mpx.ScalerConfig(init_scale=4.0, growth_interval=1))
    w = adapter.variables[id(opt)]

    @tf.function
    def step(bad):
        with tf.GradientTape() as tape:
            scaled = opt.scale(tf.reduce_sum(w) * bad)
        opt.apply(tape.gradient(scaled, [w]), [w])
        return opt.last_step_skipped()  # a tensor of the step: no host read

    assert not bool(step(tf.constant(1.0)))
    assert not bool(step(tf.constant(1.0)))
    assert opt.get_scale() == 16.0 and opt.state == mpx.ScalerState(16.0, 0, 0, 2, 0)
    assert bool(step(tf.constant(np.inf)))
    assert opt.state == mpx.ScalerState(8.0, 0, 1, 3, 1)
    assert step.experimental_get_tracing_count() == 1


def test_wrong_types_raise_unsupported_type_error():
    with pytest.raises(
        mpx.UnsupportedTypeError, match="inner_optimizer: expected a keras.optimizers.Optimizer"
    ):
        mpx_tf.LossScaleOptimizer("adam")
    with pytest.raises(mpx.UnsupportedTypeError, match="already a LossScaleOptimizer"):
        mpx_tf.LossScaleOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))
    with pytest.raises(mpx.UnsupportedTypeError, match="model: expected a Keras model or layer"):
        mpx_tf.apply_policy(object(), "mixed_bfloat16")
    with pytest.raises(mpx.UnsupportedTypeError, match="model: expected a Keras model or layer"):
        mpx_tf.watch("model")
    with pytest.raises(mpx.UnsupportedTypeError, match="optimizer: expected a keras.optimizers.Optimizer"):
        mpx_tf.set_reduce_dtype("sgd", "bfloat16")
