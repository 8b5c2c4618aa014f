"""mpx_tf.LossScaleOptimizer's history equals the core's reference trace; the Keras callback."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import mpx
import mpx_tf


def _run(cfg: mpx.ScalerConfig, flags: list[bool], capacity: int = 65536, traced: bool = True):
    w = keras.Variable([1.0, 1.0], name="w")
    opt = mpx_tf.LossScaleOptimizer(keras.optimizers.SGD(0.1), cfg)
    opt.build([w])
    opt.record_history(capacity=capacity)

    def step(c):
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(tf.reduce_sum(w * c))
        opt.apply(tape.gradient(scaled, [w]), [w])

    fn = tf.function(step) if traced else step
    for finite in flags:
        fn(tf.constant(1.0 if finite else float("inf")))
    return opt


@pytest.mark.parametrize("traced", [True, False])
def test_history_equals_reference(traced: bool) -> None:
    rng = np.random.default_rng(0)
    for interval, hysteresis in [(1, 1), (2, 1), (3, 2)]:
        cfg = mpx.ScalerConfig(
            init_scale=8.0, growth_interval=interval, hysteresis=hysteresis, max_scale=64.0
        )
        flags = [bool(x) for x in rng.random(30) < 0.7]
        assert _run(cfg, flags, traced=traced).history() == mpx.ScalerHistory.reference(cfg, flags)


def test_ring_buffer_and_errors() -> None:
    cfg = mpx.ScalerConfig(init_scale=4.0, growth_interval=1)
    flags = [True, False, True, True, False]
    h = _run(cfg, flags, capacity=2).history()
    full = mpx.ScalerHistory.reference(cfg, flags)
    assert h.steps == [4, 5] and h.scale == full.scale[-2:] and h.backoff == full.backoff[-2:]
    opt = mpx_tf.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(mpx.MPXError, match="record_history"):
        opt.history()
    with pytest.raises(mpx.MPXError, match="capacity"):
        opt.record_history(capacity=0)
    names = [v.name for v in opt.variables]
    opt.record_history()
    assert [v.name for v in opt.variables] == names  # the buffer is not saved with the optimizer


def test_keras_callback_tensorboard_and_history(tmp_path) -> None:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    cfg = mpx.ScalerConfig(init_scale=8.0, growth_interval=2)
    model.compile(optimizer=mpx_tf.LossScaleOptimizer(keras.optimizers.SGD(0.01), cfg), loss="mse")
    x = np.ones((8, 3), np.float32)
    y = np.ones((8, 1), np.float32)
    y[4:] = np.inf  # the second batch of each epoch has an inf loss: a skip and a backoff
    cb = mpx_tf.ScalerHistoryCallback(tmp_path)
    fit = model.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0, callbacks=[cb])
    flags = [True, False] * 3
    ref = mpx.ScalerHistory.reference(cfg, flags)
    assert cb.history == ref
    assert fit.history["loss_scale"] == [ref.scale[1], ref.scale[3], ref.scale[5]]
    assert fit.history["skipped_steps"] == [1, 1, 1]
    events = [f for f in tmp_path.iterdir()]
    assert events
    got: dict[str, list[tuple[int, float]]] = {}
    for f in events:
        for e in tf.compat.v1.train.summary_iterator(str(f)):
            for v in e.summary.value:
                got.setdefault(v.tag, []).append((e.step, float(tf.make_ndarray(v.tensor))))
    assert got["loss_scaler/scale"] == [(i + 1, s) for i, s in enumerate(ref.scale)]
    assert got["loss_scaler/backoff"] == [(i + 1, float(b)) for i, b in enumerate(ref.backoff)]
