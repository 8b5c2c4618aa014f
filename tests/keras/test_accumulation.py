"""Gradient accumulation under mpx_keras.LossScaleOptimizer on this process's Keras backend (inner
``gradient_accumulation_steps=k``): one scale per window, one scaler move per window, a window with a
non-finite micro-batch skipped whole (weights and inner variables bit-identical), the core's reference."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import mpx
import mpx_keras

BACKEND = keras.config.backend()
CONFIG = mpx.ScalerConfig(init_scale=8.0, growth_interval=1)
#: Per micro-batch of 8 rows: whether its gradients are finite (an inf input makes them non-finite).
FLAGS = [True, True, True, False, False, True, True, True, False, True, True, True]
K = 2
ROWS = 8


def data(flags):
    x = np.random.RandomState(2).rand(ROWS * len(flags), 4).astype("float32")
    for i, finite in enumerate(flags):
        if not finite:
            x[ROWS * i, 0] = np.inf
    return x, x[:, :3] * 0.5


def setup(inner, config=CONFIG):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    opt = mpx_keras.LossScaleOptimizer(inner, config)
    return model, opt


def host(variables):
    return [keras.ops.convert_to_numpy(v.value).copy() for v in variables]


def as_bytes(values):
    return [(v.dtype.str, v.tobytes()) for v in values]


class Snapshots(keras.callbacks.Callback):
    """The scale each micro-batch used, and the model's and inner optimizer's variables before and after it."""

    def __init__(self, opt):
        super().__init__()
        self.opt, self.rows = opt, []

    def on_train_batch_begin(self, batch, logs=None):
        inner = self.opt.inner_optimizer
        self.rows.append(
            {
                "used": self.opt.get_scale(),
                "before": as_bytes(host(self.model.variables) + host(inner.variables)),
            }
        )

    def on_train_batch_end(self, batch, logs=None):
        inner = self.opt.inner_optimizer
        self.rows[-1]["after"] = as_bytes(host(self.model.variables) + host(inner.variables))


@pytest.mark.parametrize("jit_compile", [False, True], ids=["no-jit", "jit_compile"])
def test_fit_follows_the_reference_and_skips_bad_windows_whole(jit_compile):
    model, opt = setup(keras.optimizers.Adam(0.01, gradient_accumulation_steps=K))
    opt.record_history()
    model.compile(optimizer=opt, loss="mse", jit_compile=jit_compile)
    opt.build(model.trainable_variables)
    snapshots = Snapshots(opt)
    x, y = data(FLAGS)
    model.fit(x, y, batch_size=ROWS, shuffle=False, verbose=0, callbacks=[snapshots])
    expected = mpx.accumulation_trace(CONFIG, FLAGS, K)

    history = opt.history()
    assert history.scale == [w["scale"] for w in expected]  # one transition per window, the reference's
    assert history.skipped == [not w["applied"] for w in expected]
    assert opt.state.steps == len(expected)
    assert opt.state.skipped_steps == sum(not w["applied"] for w in expected)
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == sum(w["applied"] for w in expected)
    scale_before = [CONFIG.first_scale] + [w["scale"] for w in expected]
    for i, row in enumerate(snapshots.rows):
        window = i // K
        assert row["used"] == scale_before[window], i  # constant inside a window
        if i % K == K - 1 and not expected[window]["applied"]:
            # weights, moments, accumulators and _iterations as before the window
            assert row["after"] == snapshots.rows[i - K + 1]["before"], i
    assert all(np.isfinite(v).all() for v in host(model.variables))


def test_applied_windows_equal_the_inner_optimizers_own_accumulation():
    """All finite: the update is plain Keras accumulation's, bit for bit (the scale is a power of two)."""
    flags = [True] * 6
    model_a, opt_a = setup(keras.optimizers.Adam(0.01, gradient_accumulation_steps=K))
    model_a.compile(optimizer=opt_a, loss="mse")
    keras.utils.set_random_seed(0)
    model_b = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model_b.compile(optimizer=keras.optimizers.Adam(0.01, gradient_accumulation_steps=K), loss="mse")
    x, y = data(flags)
    for m in (model_a, model_b):
        m.fit(x, y, batch_size=ROWS, shuffle=False, verbose=0)
    assert as_bytes(host(model_a.variables)) == as_bytes(host(model_b.variables))
    assert opt_a.state.steps == len(flags) // K


def test_a_custom_loop_follows_the_reference():
    """apply() called by the user's own step (eagerly on torch and jax; traced on TensorFlow by fit only)."""
    model, opt = setup(keras.optimizers.SGD(0.01, gradient_accumulation_steps=K))
    opt.build(model.trainable_variables)
    opt.record_history()
    model.compile(optimizer=opt, loss="mse")
    x, y = data(FLAGS)
    for i in range(len(FLAGS)):
        model.train_on_batch(x[ROWS * i : ROWS * (i + 1)], y[ROWS * i : ROWS * (i + 1)])
    expected = mpx.accumulation_trace(CONFIG, FLAGS, K)
    assert opt.history().scale == [w["scale"] for w in expected]
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == sum(w["applied"] for w in expected)


def test_the_window_refuses_what_it_cannot_honour_when_made():
    with pytest.raises(mpx.MPXError, match="use_ema.*mpx_keras.LossScaleOptimizer's accumulation window"):
        mpx_keras.LossScaleOptimizer(keras.optimizers.Adam(0.01, gradient_accumulation_steps=K, use_ema=True))
