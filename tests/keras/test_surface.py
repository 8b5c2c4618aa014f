"""The scaler surface every backend shares (mpx.testing) holds for mpx_keras.LossScaleOptimizer.

Each step is a real Keras step on this process's backend: a loss through ``scale``, its gradient
(TensorFlow's tape, torch's autograd, ``jax.grad``), ``apply`` with the scaled gradients.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import mpx
import mpx_keras
from mpx.testing import SURFACE_CHECKS

BACKEND = keras.config.backend()


def scaled_grads(opt, w, factor):
    """The gradient of ``opt.scale(sum(w * factor))`` with respect to ``w`` (a list of one tensor)."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            scaled = opt.scale(keras.ops.sum(w * factor))
        return tape.gradient(scaled, [w])
    if BACKEND == "torch":
        import torch

        value = w.value
        value.grad = None
        scaled = opt.scale(keras.ops.sum(value * factor))
        return [torch.autograd.grad(scaled, [value])[0]]
    import jax

    def f(value):
        with keras.StatelessScope(state_mapping=[(w, value)]):
            return opt.scale(keras.ops.sum(value * factor))

    return [jax.grad(f)(w.value)]


class KerasAdapter:
    """mpx.testing's ScalerAdapter for a Keras LossScaleOptimizer class (tests/tf/test_surface.py reuses it
    with mpx_tf's)."""

    optimizer_class = mpx_keras.LossScaleOptimizer

    def __init__(self):
        self.variables = {}  # id(optimizer) -> the variable it trains

    def make(self, config):
        opt = self.optimizer_class(keras.optimizers.SGD(0.1), config)
        w = self.variables[id(opt)] = keras.Variable(np.ones(3, np.float32), name="w")
        opt.build([w])
        return opt

    def step(self, scaler, finite):
        w = self.variables[id(scaler)]
        scaler.apply(scaled_grads(scaler, w, 1.0 if finite else float("inf")), [w])
        return scaler

    def multiply(self, scaler, value):
        return float(keras.ops.convert_to_numpy(scaler.scale(keras.ops.convert_to_tensor(value, "float32"))))

    def load(self, scaler, data):
        assert scaler.load_state_dict(data) is None  # a mutable scaler loads in place
        return scaler

    def history(self, config, flags):
        scaler = self.make(config)
        scaler.record_history()
        for finite in flags:
            self.step(scaler, finite)
        return scaler.history()


@pytest.mark.parametrize("check", SURFACE_CHECKS.values(), ids=list(SURFACE_CHECKS))
def test_loss_scale_optimizer_meets_the_surface(check):
    check(KerasAdapter())


def test_scale_and_scale_loss_are_the_same_product():
    opt = mpx_keras.LossScaleOptimizer(keras.optimizers.SGD(), mpx.ScalerConfig(init_scale=8.0))
    loss = keras.ops.convert_to_tensor(1.5, "float16")
    a, b = opt.scale(loss), opt.scale_loss(loss)
    assert keras.backend.standardize_dtype(a.dtype) == keras.backend.standardize_dtype(b.dtype) == "float32"
    assert float(keras.ops.convert_to_numpy(a)) == float(keras.ops.convert_to_numpy(b)) == 12.0
    assert opt.get_scale() == 8.0 and type(opt.get_scale()) is float


def test_wrong_types_raise_unsupported_type_error():
    with pytest.raises(
        mpx.UnsupportedTypeError, match="inner_optimizer: expected a keras.optimizers.Optimizer"
    ):
        mpx_keras.LossScaleOptimizer("adam")
    with pytest.raises(mpx.UnsupportedTypeError, match="already a LossScaleOptimizer"):
        mpx_keras.LossScaleOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))
    with pytest.raises(mpx.UnsupportedTypeError, match="model: expected a Keras model or layer"):
        mpx_keras.apply_policy(object(), "mixed_bfloat16")
    with pytest.raises(mpx.UnsupportedTypeError, match="model: expected a Keras model or layer"):
        mpx_keras.check_model("model")
