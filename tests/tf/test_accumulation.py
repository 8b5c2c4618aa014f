"""Gradient accumulation (inner ``gradient_accumulation_steps``): one scaler move per window, bad windows skipped whole."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import mpx
import mpx_tf

CONFIG = mpx.ScalerConfig(init_scale=8.0, growth_interval=1)
FLAGS = [True, True, True, False, False, True, True, True, False, True, True, True]
K = 2


def _setup(optimizer_factory):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    opt = optimizer_factory()
    opt.build(model.trainable_variables)
    return model, opt


def _inner(opt):
    return getattr(opt, "inner_optimizer", opt)


def _bytes(variables):
    return [np.asarray(v.numpy()).tobytes() for v in variables]


def _run(opt, model, flags, compiled):
    """One micro-batch per flag; returns per micro-batch (scale used for the loss, state bytes before/after)."""
    x = tf.constant(np.random.RandomState(0).rand(8, 4), tf.float32)
    y = tf.constant(np.random.RandomState(1).rand(8, 3), tf.float32)

    def step(poison):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y)) * poison  # poison inf: every gradient non-finite
            scaled = opt.scale_loss(loss)
        opt.apply(tape.gradient(scaled, model.trainable_variables), model.trainable_variables)

    fn = tf.function(step) if compiled else step
    rows = []
    for finite in flags:
        used = float(opt.dynamic_scale.numpy()) if hasattr(opt, "dynamic_scale") else 1.0
        before = _bytes(model.variables) + _bytes(_inner(opt).variables)
        fn(tf.constant(1.0 if finite else math.inf))
        rows.append(
            {"used": used, "before": before, "after": _bytes(model.variables) + _bytes(_inner(opt).variables)}
        )
    return rows, (fn.experimental_get_tracing_count() if compiled else None)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf.function"])
def test_trace_is_the_reference_and_bad_windows_are_skipped_whole(compiled):
    model, opt = _setup(
        lambda: mpx_tf.LossScaleOptimizer(keras.optimizers.Adam(0.01, gradient_accumulation_steps=K), CONFIG)
    )
    opt.record_history()
    rows, traces = _run(opt, model, FLAGS, compiled)
    expected = mpx.accumulation_trace(CONFIG, FLAGS, K)

    history = opt.history()
    assert history.scale == [w["scale"] for w in expected]  # one transition per window, exactly the reference
    assert history.skipped == [not w["applied"] for w in expected]
    state = opt.state
    assert state.steps == len(expected) and state.skipped_steps == sum(not w["applied"] for w in expected)
    assert int(opt.iterations.numpy()) == sum(w["applied"] for w in expected)  # applied optimizer steps

    scale_before = [CONFIG.first_scale] + [w["scale"] for w in expected]
    for i, row in enumerate(rows):
        window = i // K
        assert row["used"] == scale_before[window], i  # constant inside a window
        if i % K == K - 1 and not expected[window]["applied"]:
            start = rows[i - K + 1]["before"]
            assert row["after"] == start, (
                i
            )  # params, moments, accumulators and _iterations as before the window
    if compiled:
        assert traces == 1
    assert all(np.isfinite(v.numpy()).all() for v in model.variables)


def test_applied_windows_match_plain_keras_accumulation():
    """An all-finite run updates exactly as the inner optimizer alone would (the scale is a power of two)."""
    flags = [True] * 6
    model_a, opt_a = _setup(
        lambda: mpx_tf.LossScaleOptimizer(keras.optimizers.Adam(0.01, gradient_accumulation_steps=K), CONFIG)
    )
    _run(opt_a, model_a, flags, compiled=True)
    model_b, opt_b = _setup(lambda: keras.optimizers.Adam(0.01, gradient_accumulation_steps=K))
    opt_b.scale_loss = lambda loss: loss
    _run(opt_b, model_b, flags, compiled=True)
    assert _bytes(model_a.variables) == _bytes(model_b.variables)


def test_model_fit_follows_the_reference():
    model, opt = _setup(
        lambda: mpx_tf.LossScaleOptimizer(keras.optimizers.SGD(0.01, gradient_accumulation_steps=K), CONFIG)
    )
    model.compile(optimizer=opt, loss="mse")
    opt.record_history()
    x = np.random.RandomState(2).rand(8 * len(FLAGS), 4).astype("float32")
    for i, finite in enumerate(FLAGS):  # batch i (of 8 rows) is non-finite where the flag says so
        if not finite:
            x[8 * i, 0] = np.inf
    model.fit(x, x[:, :3] * 0.5, batch_size=8, epochs=1, shuffle=False, verbose=0)
    expected = mpx.accumulation_trace(CONFIG, FLAGS, K)
    assert opt.history().scale == [w["scale"] for w in expected]
    assert opt.history().skipped == [not w["applied"] for w in expected]
    assert int(opt.iterations.numpy()) == sum(w["applied"] for w in expected)
    assert all(np.isfinite(v.numpy()).all() for v in model.variables)


def test_native_keras_lso_drops_the_micro_batch_and_moves_per_micro_batch():
    """Keras's own LossScaleOptimizer, recorded: the scale moves per micro-batch, a bad micro-batch is dropped."""
    model, opt = _setup(
        lambda: keras.optimizers.LossScaleOptimizer(
            keras.optimizers.Adam(0.01, gradient_accumulation_steps=K),
            initial_scale=8.0,
            dynamic_growth_steps=1,
        )
    )
    rows, _ = _run(opt, model, FLAGS, compiled=True)
    used = [row["used"] for row in rows]
    # x2 after each finite micro-batch, /2 after each non-finite one (growth every finite step)
    native, scale = [], 8.0
    for finite in FLAGS:
        native.append(scale)
        scale = scale * 2 if finite else scale / 2
    assert used == native
    assert int(_inner(opt)._iterations.numpy()) == sum(
        FLAGS
    )  # the bad micro-batches never reached the inner one
    reference = [CONFIG.first_scale] + [w["scale"] for w in mpx.accumulation_trace(CONFIG, FLAGS, K)]
    assert used != [reference[i // K] for i in range(len(FLAGS))]  # not the one semantics


def test_reduce_dtype_argument_is_checked_and_saved():
    opt = mpx_tf.LossScaleOptimizer(keras.optimizers.SGD(0.1), reduce_dtype="bf16")
    assert opt.get_config()["reduce_dtype"] == "bfloat16"
    again = mpx_tf.LossScaleOptimizer.from_config(opt.get_config())
    assert again.get_config()["reduce_dtype"] == "bfloat16"
    policy = mpx.get_policy("params=float32,compute=bfloat16,output=float32,reduce=bfloat16")
    assert mpx_tf.LossScaleOptimizer(keras.optimizers.SGD(0.1), reduce_dtype=policy).get_config()[
        "reduce_dtype"
    ] == ("bfloat16")
    with pytest.raises(mpx.MPXError, match="reduce_dtype"):
        mpx_tf.LossScaleOptimizer(keras.optimizers.SGD(0.1), reduce_dtype="float8_e4m3fn")
    with pytest.raises(mpx.MPXError, match="reduce_dtype"):
        mpx_tf.LossScaleOptimizer(keras.optimizers.SGD(0.1), reduce_dtype="int8")


def test_accumulation_refuses_what_the_window_cannot_honour():
    with pytest.raises(mpx.MPXError, match="use_ema: mpx_tf.LossScaleOptimizer's accumulation window"):
        mpx_tf.LossScaleOptimizer(
            keras.optimizers.Adam(0.01, gradient_accumulation_steps=K, use_ema=True), CONFIG
        )
