"""A custom layer written with keras.ops, trained with fit under mixed precision, reaches float32's accuracy."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import mpx
import mpx_tf

sklearn = pytest.importorskip("sklearn")
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

L = keras.layers


@keras.saving.register_keras_serializable("mpx_tests")
class LogSoftmaxHead(L.Layer):
    """Dense + log-softmax by hand, with keras.ops (Keras alone would run the log-softmax in half)."""

    def __init__(self, units: int, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], self.units), initializer="glorot_uniform")
        self.b = self.add_weight(shape=(self.units,), initializer="zeros")

    def call(self, x):
        logits = keras.ops.add(keras.ops.matmul(x, self.w), self.b)
        self.dtypes = (logits.dtype, keras.ops.log_softmax(logits, axis=-1).dtype)
        return keras.ops.log_softmax(logits, axis=-1)

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def _nll(y_true, log_probs):
    picked = keras.ops.take_along_axis(log_probs, keras.ops.cast(y_true, "int32")[:, None], axis=-1)
    return -keras.ops.mean(picked)


@pytest.fixture(scope="module")
def results():
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    x_train, x_test, y_train, y_test = train_test_split(x, y.astype("int32"), test_size=0.5, random_state=0, stratify=y)
    out = {}
    for spec in ("float32", "mixed_bfloat16", "mixed_float16"):
        policy = mpx.get_policy(spec)
        keras.utils.set_random_seed(0)
        with mpx_tf.policy_scope(policy):
            model = keras.Sequential([keras.Input((64,)), L.Dense(64, activation="relu"), LogSoftmaxHead(10, name="head")])
        mpx_tf.apply_policy(model, policy)
        optimizer = mpx_tf.LossScaleOptimizer(
            keras.optimizers.Adam(3e-3), mpx.ScalerConfig.for_policy(policy, growth_interval=20)
        )
        model.compile(optimizer=optimizer, loss=_nll)
        keras.utils.set_random_seed(1)
        model.fit(x_train, y_train, batch_size=32, epochs=12, verbose=0)
        log_probs = model.predict(x_test, batch_size=256, verbose=0)
        out[spec] = {
            "accuracy": float(np.mean(log_probs.argmax(-1) == y_test)),
            "head_dtypes": model.get_layer("head").dtypes,
        }
    return out


@pytest.mark.parametrize("spec", ["mixed_bfloat16", "mixed_float16"])
def test_custom_keras_ops_layer_within_one_point_of_float32(results, spec):
    half = mpx.get_policy(spec).compute_dtype
    assert results[spec]["head_dtypes"] == (half, "float32")  # matmul lowered, log-softmax in float32
    assert results["float32"]["accuracy"] > 0.9
    assert abs(results[spec]["accuracy"] - results["float32"]["accuracy"]) <= 0.01, results
