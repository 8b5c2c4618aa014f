"""model.fit on a real dataset (scikit-learn's digits): mixed precision reaches float32's accuracy."""

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


def _build():
    return keras.Sequential(
        [
            keras.Input((64,)),
            L.Dense(64, activation="relu", name="hidden"),
            L.LayerNormalization(name="norm"),
            L.Dense(10, name="logits"),
            L.Activation("softmax", name="probs"),
        ]
    )


@pytest.fixture(scope="module")
def digits():
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    return train_test_split(x, y.astype("int32"), test_size=0.5, random_state=0, stratify=y)


@pytest.fixture(scope="module")
def accuracies(digits):
    x_train, x_test, y_train, y_test = digits
    keras.utils.set_random_seed(0)
    initial = _build().get_weights()
    results = {}
    for spec in ("float32", "mixed_bfloat16", "mixed_float16"):
        policy = mpx.get_policy(spec)
        with mpx_tf.policy_scope(policy):
            model = _build()
        mpx_tf.apply_policy(model, policy)
        model.set_weights(initial)
        optimizer = mpx_tf.LossScaleOptimizer(
            keras.optimizers.Adam(3e-3), mpx.ScalerConfig.for_policy(policy, growth_interval=20)
        )
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        keras.utils.set_random_seed(1)
        model.fit(x_train, y_train, batch_size=32, epochs=15, verbose=0)
        probs = model.predict(x_test, batch_size=256, verbose=0)
        results[spec] = {
            "accuracy": float(np.mean(probs.argmax(-1) == y_test)),
            "output_dtype": probs.dtype.name,
            "compute": model.get_layer("hidden").compute_dtype,
            "norm": model.get_layer("norm").compute_dtype,
            "state": optimizer.state,
        }
    return results


def test_float32_learns(accuracies):
    assert accuracies["float32"]["accuracy"] > 0.9


@pytest.mark.parametrize("spec", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_matches_float32_accuracy(accuracies, spec):
    got = accuracies[spec]
    assert got["compute"] == mpx.get_policy(spec).compute_dtype and got["norm"] == "float32"
    assert got["output_dtype"] == "float32"
    assert abs(got["accuracy"] - accuracies["float32"]["accuracy"]) <= 0.01, accuracies


def test_loss_scaling_ran_only_for_float16(accuracies):
    fp16 = accuracies["mixed_float16"]["state"]
    assert fp16.steps == 15 * 29 and fp16.scale > 1.0
    bf16 = accuracies["mixed_bfloat16"]["state"]
    assert bf16.scale == 1.0 and bf16.steps == 15 * 29 and bf16.skipped_steps == 0
