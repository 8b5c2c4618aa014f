"""History, stuck detection and LossScaleMonitor of mpx_keras.LossScaleOptimizer on this process's Keras
backend, in compiled steps too (fit with and without jit_compile), with no callback."""

from __future__ import annotations

import re
import warnings

import keras
import numpy as np
import pytest

import mpx
import mpx_keras

BACKEND = keras.config.backend()
CONFIG = mpx.ScalerConfig(init_scale=2.0**10, growth_interval=2, hysteresis=2)
FLAGS = [True, True, True, False, False, True, True, True, False, True]
JIT = pytest.mark.parametrize("jit_compile", [False, True], ids=["no-jit", "jit_compile"])


def data(flags, rows=4):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows * len(flags), 3)).astype("float32")
    for i, finite in enumerate(flags):
        if not finite:
            x[i * rows] = np.inf
    return x, rng.normal(size=(rows * len(flags), 1)).astype("float32")


def model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])


def fitted(config, flags, jit_compile, *, capacity=65536, callbacks=()):
    m = model()
    opt = mpx_keras.LossScaleOptimizer(keras.optimizers.SGD(1e-3), config)
    opt.record_history(capacity=capacity)
    m.compile(optimizer=opt, loss="mse", jit_compile=jit_compile)
    x, y = data(flags)
    fit = m.fit(x, y, batch_size=4, shuffle=False, verbose=0, callbacks=list(callbacks))
    return m, opt, fit


# -- history ------------------------------------------------------------------------------------------------
@JIT
def test_history_of_a_compiled_fit_is_the_reference_without_a_callback(jit_compile):
    _, opt, _ = fitted(CONFIG, FLAGS, jit_compile)
    assert opt.history() == mpx.ScalerHistory.reference(CONFIG, FLAGS)
    assert opt.history().steps == list(range(1, len(FLAGS) + 1))
    assert opt.get_scale() == opt.history().scale[-1]


def test_the_ring_buffer_keeps_the_last_capacity_steps_and_errors_are_named():
    _, opt, _ = fitted(CONFIG, FLAGS, False, capacity=3)
    full = mpx.ScalerHistory.reference(CONFIG, FLAGS)
    h = opt.history()
    assert h.steps == full.steps[-3:] and h.scale == full.scale[-3:] and h.skipped == full.skipped[-3:]
    fresh = mpx_keras.LossScaleOptimizer(keras.optimizers.SGD())
    with pytest.raises(mpx.MPXError, match="not recording; call optimizer.record_history"):
        fresh.history()
    for bad in (0, -1, 1.5, True):
        with pytest.raises(mpx.MPXError, match="capacity: expected an int"):
            fresh.record_history(capacity=bad)


def test_the_history_buffer_is_never_saved(tmp_path):
    m, opt, _ = fitted(CONFIG, FLAGS[:3], False)
    path = tmp_path / "m.keras"
    m.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.optimizer.state == opt.state
    assert not loaded.optimizer.recording_history
    names = {v.path for v in loaded.optimizer.variables}
    assert not any("mpx_history" in n for n in names)
    m.optimizer.record_history(False)
    assert [v.path for v in m.optimizer.variables] == [v.path for v in loaded.optimizer.variables]


# -- stuck detection ----------------------------------------------------------------------------------------
STUCK = mpx.ScalerConfig(init_scale=4.0, min_scale=1.0, max_consecutive_skips=2, on_stuck="warn")


def host_point(jit_compile):
    """XLA on TensorFlow cannot call the host inside a step: there the monitor checks after each batch."""
    return [mpx_keras.LossScaleMonitor()] if jit_compile and BACKEND == "tensorflow" else []


@JIT
def test_stuck_warns_inside_a_compiled_fit_at_every_nth_skip(jit_compile):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fitted(
            STUCK, [True, False, False, False, False, True], jit_compile, callbacks=host_point(jit_compile)
        )
    stuck = [c for c in caught if issubclass(c.category, mpx.ScalerStuckWarning)]
    assert len(stuck) == 2, [str(c.message) for c in stuck]  # at 2 and 4 skips in a row
    assert all("loss scaler stuck: 2 steps" in str(c.message) or "4 steps" in str(c.message) for c in stuck)


@JIT
def test_stuck_raises_inside_a_compiled_fit(jit_compile):
    config = mpx.ScalerConfig(init_scale=4.0, min_scale=1.0, max_consecutive_skips=2)
    with pytest.raises(Exception, match=re.escape("loss scaler stuck: 2 steps")):
        fitted(config, [True, False, False, True], jit_compile, callbacks=host_point(jit_compile))


@pytest.mark.skipif(BACKEND != "tensorflow", reason="XLA on TensorFlow only")
def test_an_xla_step_on_tensorflow_is_checked_by_check_stuck_once_per_step():
    _, opt, _ = fitted(STUCK, [True, False, False], True)  # no monitor: the steps could not check
    with pytest.warns(mpx.ScalerStuckWarning, match="loss scaler stuck: 2 steps"):
        opt.check_stuck()
    with warnings.catch_warnings():
        warnings.simplefilter("error", mpx.ScalerStuckWarning)
        opt.check_stuck()  # the same step again: nothing


def test_stuck_raises_an_mpx_error_in_an_eager_custom_loop():
    config = mpx.ScalerConfig(init_scale=4.0, min_scale=1.0, max_consecutive_skips=2)
    w = keras.Variable(np.ones(2, np.float32))
    opt = mpx_keras.LossScaleOptimizer(keras.optimizers.SGD(0.1), config)
    opt.build([w])
    opt.apply([keras.ops.full((2,), np.inf)], [w])
    with pytest.raises(mpx.ScalerStuckError, match="in a row skipped \\(max_consecutive_skips=2\\)"):
        opt.apply([keras.ops.full((2,), np.inf)], [w])


# -- overwrite-with-gradient variables (FP8 scales) ----------------------------------------------------------
def test_overwrite_with_gradient_variables_are_not_unscaled_and_not_touched_by_a_skip():
    w = keras.Variable(np.ones(2, np.float32), name="w")
    amax = keras.Variable(np.zeros(2, np.float32), name="amax")
    amax.overwrite_with_gradient = True
    opt = mpx_keras.LossScaleOptimizer(keras.optimizers.SGD(0.5), mpx.ScalerConfig(init_scale=4.0))
    opt.build([w, amax])
    opt.apply([keras.ops.full((2,), 4.0), keras.ops.full((2,), 3.0)], [w, amax])
    assert keras.ops.convert_to_numpy(amax).tolist() == [3.0, 3.0]  # the raw gradient, not 3 / 4
    assert keras.ops.convert_to_numpy(w).tolist() == [0.5, 0.5]  # 1 - 0.5 * 4 / 4
    opt.apply([keras.ops.full((2,), np.inf), keras.ops.full((2,), 7.0)], [w, amax])
    assert keras.ops.convert_to_numpy(amax).tolist() == [3.0, 3.0]  # a skipped step leaves it alone
    assert keras.ops.convert_to_numpy(w).tolist() == [0.5, 0.5]
    assert opt.state.skipped_steps == 1


# -- LossScaleMonitor ---------------------------------------------------------------------------------------
class _Logs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batches = []

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append((logs["loss_scale"], logs["skipped_steps"]))


@JIT
def test_the_monitor_writes_scale_and_skipped_steps_into_each_batchs_logs(jit_compile):
    logs = _Logs()
    _, _, fit = fitted(CONFIG, FLAGS, jit_compile, callbacks=[mpx_keras.LossScaleMonitor(), logs])
    ref = mpx.ScalerHistory.reference(CONFIG, FLAGS)
    assert logs.batches == [(ref.scale[i], sum(ref.skipped[: i + 1])) for i in range(len(FLAGS))]
    assert fit.history["loss_scale"] == [ref.scale[-1]]


def test_check_model_and_the_monitor_on_a_float16_model_without_scaling():
    with mpx_keras.policy_scope("mixed_float16"):
        layers = [keras.layers.Dense(4, name="half"), keras.layers.Dense(1)]
    m = keras.Sequential([keras.Input((3,)), *layers])  # a float32 model: Keras's compile adds no scaling
    m.compile(optimizer=keras.optimizers.SGD(), loss="mse")
    check = mpx_keras.check_model(m)
    assert check.loss_scaling is False and check.float16_layers == ("half", layers[1].name)
    assert "does no loss scaling" in check.message
    x, y = data([True])
    with pytest.warns(mpx_keras.UnscaledFloat16Warning, match="wrap it: mpx_keras.LossScaleOptimizer"):
        m.fit(x, y, verbose=0, callbacks=[mpx_keras.LossScaleMonitor()])
    with warnings.catch_warnings():
        warnings.simplefilter("error", mpx_keras.UnscaledFloat16Warning)
        m.fit(x, y, verbose=0, callbacks=[mpx_keras.LossScaleMonitor(warn=False)])
    m.compile(optimizer=mpx_keras.LossScaleOptimizer(keras.optimizers.SGD(), "mixed_float16"), loss="mse")
    assert mpx_keras.check_model(m).ok and mpx_keras.check_model(m).loss_scaling is True
    m.compile(optimizer=mpx_keras.LossScaleOptimizer(keras.optimizers.SGD(), "mixed_bfloat16"), loss="mse")
    assert mpx_keras.check_model(m).loss_scaling is False  # kind none scales nothing


# -- the floor raise (on_floor="raise", DeepSpeed's mode) ---------------------------------------------------
#: from scale 2, hysteresis 1: the overflow at step 2 halves to min_scale 1, the one at step 3 is due at the floor
FLOOR = mpx.ScalerConfig(**{**mpx.SCALER_PRESETS["deepspeed_fp16"].to_dict(), "init_scale": 2.0, "hysteresis": 1,
                            "growth_interval": 4})  # fmt: skip
FLOOR_FLAGS = [True, False, False, True, True]


@JIT
def test_the_floor_raises_in_a_compiled_fit_naming_the_step(jit_compile):
    """Every backend raises the core's message for step 3; a step XLA compiles on TensorFlow cannot call the
    host, so it marks the step and the monitor raises mpx.ScalerFloorError right after that batch."""
    with pytest.raises(Exception, match=re.escape("step 3 overflowed with the scale at min_scale (1)")) as info:
        fitted(FLOOR, FLOOR_FLAGS, jit_compile, callbacks=host_point(jit_compile))
    if jit_compile and BACKEND == "tensorflow":
        assert isinstance(info.value, mpx.ScalerFloorError)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="XLA on TensorFlow only")
def test_an_xla_step_marks_the_floor_and_check_stuck_raises_it_once():
    _, opt, _ = fitted(FLOOR, FLOOR_FLAGS, True)  # no monitor: the steps go on, skipped and at the floor
    assert opt.state.steps == 5 and opt.get_scale() == 1.0 and opt.history().skipped == [False, True, True, False, False]
    with pytest.raises(mpx.ScalerFloorError, match=re.escape("step 3 overflowed")):
        opt.check_stuck()
    opt.check_stuck()  # raised once: the mark is cleared
