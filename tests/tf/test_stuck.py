"""Stuck detection in mpx_tf.LossScaleOptimizer: after exactly N skips in a row, raise or warn, with the cause."""

from __future__ import annotations

import warnings

import keras
import pytest
import tensorflow as tf

import mpx
import mpx_tf


def _setup(**changes):
    cfg = mpx.ScalerConfig(init_scale=4.0, min_scale=1.0, **changes)
    w = keras.Variable([1.0], name="w")
    opt = mpx_tf.LossScaleOptimizer(keras.optimizers.SGD(0.1), cfg)
    opt.build([w])
    return opt, w


def _step(opt, w, kind: str) -> None:
    """kind "ok" (finite), "grad" (finite loss, inf gradients: sqrt(w - w)), "loss" (inf loss)."""
    with tf.GradientTape() as tape:
        if kind == "grad":
            loss = tf.reduce_sum(tf.sqrt(w - tf.stop_gradient(w)))
        else:
            loss = tf.reduce_sum(w * (1.0 if kind == "ok" else float("inf")))
        scaled = opt.scale_loss(loss)
    opt.apply(tape.gradient(scaled, [w]), [w])


@pytest.mark.parametrize("n", [1, 3])
def test_eager_raises_at_n_not_before(n: int) -> None:
    opt, w = _setup(max_consecutive_skips=n)
    if n > 1:
        _step(opt, w, "grad")
        _step(opt, w, "ok")
    for _ in range(n - 1):
        _step(opt, w, "grad")
    assert opt.state.consecutive_nonfinite == n - 1
    with pytest.raises(mpx.ScalerStuckError, match=f"in a row skipped \\(max_consecutive_skips={n}\\)"):
        _step(opt, w, "grad")


def test_eager_message_causes() -> None:
    opt, w = _setup(max_consecutive_skips=3)
    for _ in range(2):
        _step(opt, w, "grad")
    with pytest.raises(
        mpx.ScalerStuckError, match="loss is finite and the gradients overflow at the minimum scale"
    ):
        _step(opt, w, "grad")
    opt, w = _setup(max_consecutive_skips=3)
    for _ in range(2):
        _step(opt, w, "grad")
    with pytest.raises(mpx.ScalerStuckError, match="forward loss itself is non-finite"):
        _step(opt, w, "loss")


def test_traced_raise_and_warn() -> None:
    opt, w = _setup(max_consecutive_skips=2)
    step = tf.function(lambda: _step(opt, w, "grad"))
    step()
    with pytest.raises(tf.errors.InvalidArgumentError, match="ScalerStuckError: loss scaler stuck: 2 steps"):
        step()
    opt, w = _setup(max_consecutive_skips=2, on_stuck="warn")
    step = tf.function(lambda: _step(opt, w, "loss"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        at = []
        for i in range(1, 6):
            before = len([c for c in caught if issubclass(c.category, mpx.ScalerStuckWarning)])
            step()
            if len([c for c in caught if issubclass(c.category, mpx.ScalerStuckWarning)]) > before:
                at.append(i)
    assert at == [2, 4]
    assert any("forward loss itself is non-finite" in str(c.message) for c in caught)
    assert w.numpy().tolist() == [1.0]


def test_off_adds_nothing_and_round_trips() -> None:
    opt, w = _setup()
    assert opt._mpx_extras.loss_flag is None and opt._mpx_extras.history is None
    for _ in range(4):
        _step(opt, w, "loss")
    opt2, _ = _setup(max_consecutive_skips=5, on_stuck="warn")
    sd = opt2.state_dict()
    assert sd["config"]["max_consecutive_skips"] == 5
    opt.load_state_dict(sd)
    assert opt.config == opt2.config and opt._mpx_extras.loss_flag is not None
    cfg = mpx_tf.LossScaleOptimizer.from_config(opt2.get_config()).config
    assert cfg.max_consecutive_skips == 5 and cfg.on_stuck == "warn"
