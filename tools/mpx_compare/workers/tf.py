"""The Keras 3 / TensorFlow side of ``mpx compare``: a custom loop with ``mpx_tf.LossScaleOptimizer``."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import numpy as np
import tensorflow as tf

import mpx
import mpx_tf
from mpx_compare.workers.common import Settings, batches, record, run_all

__all__ = ["build", "compare", "info"]


def info(device: str) -> dict[str, Any]:
    return {"framework": "tf", "versions": {"tensorflow": tf.__version__, "keras": keras.__version__},
            "device": device}  # fmt: skip


def build(model: str, classes: int) -> Callable[[int], keras.Model]:
    """``make_model(seed)`` for a built-in model on ``(n, 8, 8)`` inputs (built under the current policy)."""
    L = keras.layers

    def make(seed: int) -> keras.Model:
        keras.utils.set_random_seed(seed)
        inputs = keras.Input((8, 8))
        if model == "mlp":
            x = L.Dense(128, activation="relu")(L.Flatten()(inputs))
        elif model == "cnn":
            x = L.Conv2D(16, 3, padding="same", activation="relu")(L.Reshape((8, 8, 1))(inputs))
            x = L.GlobalAveragePooling2D()(L.Conv2D(32, 3, strides=2, padding="same", activation="relu")(x))
        else:
            x = L.Dense(32)(inputs)
            h = L.LayerNormalization()(x)
            x = x + L.MultiHeadAttention(2, 16)(h, h)
            x = L.LayerNormalization()(x + L.Dense(32)(L.Dense(64, activation="gelu")(L.LayerNormalization()(x))))
            x = L.GlobalAveragePooling1D()(x)
        return keras.Model(inputs, L.Dense(classes)(x))

    return make


def _train(make_model: Callable[[int], keras.Model], data: Sequence[np.ndarray], policy: str, seed: int,
           settings: Settings) -> dict[str, Any]:  # fmt: skip
    t0 = time.perf_counter()
    p = mpx.get_policy(policy)
    with mpx_tf.policy_scope(p):
        model = make_model(seed)
    model = mpx_tf.apply_policy(model, p)
    opt = mpx_tf.LossScaleOptimizer(keras.optimizers.Adam(settings.lr), p)  # the policy's scaler config
    opt.record_history()  # a ring-buffer variable, written inside the traced step
    loss_obj = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        with tf.GradientTape() as tape:
            loss = loss_obj(y, tf.cast(model(x, training=True), tf.float32))
            scaled = opt.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
        opt.apply(grads, model.trainable_variables)
        return loss, tf.identity(opt.dynamic_scale.value), finite

    xt, yt, xv, yv = data
    losses, scales, skipped = [], [], 0
    for idx in batches(len(xt), settings, seed):
        loss, scale, finite = step(tf.constant(xt[idx]), tf.constant(yt[idx]))
        losses.append(float(loss))
        scales.append(float(scale))
        skipped += not bool(finite) and opt.config.skip_nonfinite
    logits = tf.cast(model(tf.constant(xv), training=False), tf.float32)
    val_loss = float(loss_obj(yv, logits))
    acc = float(np.mean(np.argmax(logits.numpy(), axis=1) == yv))
    return record("tf", policy, seed, losses, scales, skipped, val_loss, acc, time.perf_counter() - t0,
                  history=opt.history())  # fmt: skip


def compare(make_model: Callable[[int], keras.Model], data: Sequence[np.ndarray], *, policies: Sequence[str],
            seeds: Sequence[int] = (0,), settings: Settings | None = None,
            progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Train a Keras model in float32 and under each policy; one run record per policy and seed.

    ``make_model(seed)`` builds the model (it runs under ``mpx_tf.policy_scope``
    of the run's policy; call ``keras.utils.set_random_seed(seed)`` in it for
    the same initialization); ``data`` is ``(x_train, y_train, x_val, y_val)``
    with integer labels (sparse cross-entropy from logits).  Each run: a
    ``tf.function`` step with ``mpx_tf.LossScaleOptimizer(Adam)`` and
    ``ScalerConfig.for_policy``.
    """
    settings = settings or Settings()
    return run_all(lambda p, s: _train(make_model, data, p, s, settings), list(policies), list(seeds), progress)
