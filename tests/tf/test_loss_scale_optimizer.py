"""mpx_tf.LossScaleOptimizer: the mpx state machine, skip semantics, tracing, state and checkpoints."""

from __future__ import annotations

import json
import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mpx
import mpx_tf

L = keras.layers


def bits(values):
    """Every variable's bytes, for bit-identity checks."""
    return [np.asarray(v.numpy()).tobytes() for v in values]


def reference_trace(config, flags):
    state = mpx.scaler_init(config)
    trace = []
    for finite in flags:
        state = mpx.scaler_update(config, state, finite)
        trace.append(state)
    return trace


def _same_state(got: mpx.ScalerState, want: mpx.ScalerState) -> bool:
    return got == want and np.float32(got.scale).tobytes() == np.float32(want.scale).tobytes()


# -- the state machine, bit for bit -----------------------------------------------------
SCALES = [2.0**-126, 1.5e-38, 1e-37, 0.75, 1.0, 3.0, 2.0**16, 1e30, 2.0**127, 3.4e38]  # scales >= 2**-126
FACTORS_UP = [1.0000001, 1.1, 1.5, 2.0, 3.0, 1e9, 2.0**32]  # factors in (1, 2**32]
FACTORS_DOWN = [2.0**-32, 1e-7, 0.1, 0.5, 0.9, 0.9999999]  # and in [2**-32, 1)


@st.composite
def configs(draw):
    kind = draw(st.sampled_from(["dynamic", "dynamic", "static", "none"]))
    fields = dict(
        kind=kind,
        init_scale=draw(st.sampled_from(SCALES)),
        growth_factor=draw(st.sampled_from(FACTORS_UP)),
        backoff_factor=draw(st.sampled_from(FACTORS_DOWN)),
        growth_interval=draw(st.integers(1, 4)),
        min_scale=draw(st.sampled_from([None, 2.0**-126, 1.2e-38, 0.5, 1.0])),
        max_scale=draw(st.sampled_from([None, 1.0, 2.0**24, 1e38, 3.4e38])),
        hysteresis=draw(st.integers(1, 3)),
        skip_nonfinite=draw(st.sampled_from([None, True, False])),
    )
    lo, hi = fields["min_scale"], fields["max_scale"]
    init = fields["init_scale"]
    if lo is not None and hi is not None and lo > hi:
        fields["min_scale"] = hi
        lo = hi
    if lo is not None and init < lo:
        fields["init_scale"] = lo
    if hi is not None and fields["init_scale"] > hi:
        fields["init_scale"] = hi
    return mpx.ScalerConfig(**fields)


def _make_step(opt, var):
    """A traced step applying one injected gradient: 0 = finite, 1 = inf, 2 = nan."""

    @tf.function
    def step(kind):
        base = tf.constant([0.5, -1.5, 2.0], tf.float32)  # finite, whatever the scale
        bad = tf.gather(tf.constant([0.0, math.inf, math.nan], tf.float32), kind)
        grad = base + tf.constant([0.0, 0.0, 1.0]) * bad
        opt.apply([grad], [var])

    return step


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), events=st.lists(st.sampled_from([0, 0, 0, 1, 2]), min_size=1, max_size=24))
def test_trace_matches_scaler_update(config, events):
    var = keras.Variable(np.array([1.0, 2.0, 3.0], np.float32), name="w")
    inner = keras.optimizers.SGD(0.01)
    opt = mpx_tf.LossScaleOptimizer(inner, config)
    step = _make_step(opt, var)
    want = reference_trace(config, [e == 0 for e in events])
    for i, (event, expected) in enumerate(zip(events, want, strict=True)):
        before_var, before_inner = bits([var]), bits(inner.variables)
        step(tf.constant(event))
        assert _same_state(opt.state, expected), (i, opt.state, expected)
        skipped = expected.skipped_steps != (want[i - 1].skipped_steps if i else 0)
        if skipped:
            assert bits([var]) == before_var and bits(inner.variables) == before_inner
        else:
            assert int(inner.iterations.numpy()) == expected.steps - expected.skipped_steps
    assert step.experimental_get_tracing_count() == 1


def test_scale_is_floored_at_the_smallest_normal():
    """TF's kernels flush float32 subnormals; the scale stops at 2**-126 (issue #13 item 5) and grows back."""
    config = mpx.ScalerConfig(init_scale=2.0**-120, backoff_factor=0.3, min_scale=None, growth_interval=1)
    var = keras.Variable(np.zeros(3, np.float32))
    opt = mpx_tf.LossScaleOptimizer(keras.optimizers.SGD(0.1), config)
    step = _make_step(opt, var)
    events = [1] * 25 + [0] * 3
    want = reference_trace(config, [e == 0 for e in events])
    for i, (event, expected) in enumerate(zip(events, want, strict=True)):
        step(tf.constant(event))
        assert _same_state(opt.state, expected)
        if i == 24:
            assert opt.get_scale() == 2.0**-126
    assert opt.get_scale() == 2.0**-123


# -- a real model in a custom loop ------------------------------------------------------
def _model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), L.Dense(8, activation="relu"), L.Dense(3)])


def test_custom_loop_skips_leave_model_and_adam_bit_identical():
    model = _model()
    inner = keras.optimizers.Adam(1e-2)
    config = mpx.ScalerConfig(growth_interval=2, init_scale=2.0**10)
    opt = mpx_tf.LossScaleOptimizer(inner, config)
    x = tf.random.normal((16, 5), seed=1)
    y = tf.random.normal((16, 3), seed=2)
    opt.build(model.trainable_variables)  # else tf.function traces twice to create Adam's variables
    traces = []

    @tf.function
    def train_step(x, y, poison):
        traces.append(1)  # runs once per trace
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
            scaled = opt.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        grads = [grads[0] + poison, *grads[1:]]
        opt.apply(grads, model.trainable_variables)
        return loss

    events = [0, 0, 1, 0, 2, 2, 0, 0, 0, 1, 0, 0]
    flags = [e == 0 for e in events]
    want = reference_trace(config, flags)
    poison = {0: 0.0, 1: math.inf, 2: math.nan}
    scales = set()
    for event, expected in zip(events, want, strict=True):
        before = bits(model.variables), bits(inner.variables)
        train_step(x, y, tf.constant(poison[event]))
        assert _same_state(opt.state, expected)
        after = bits(model.variables), bits(inner.variables)
        if event:
            assert after == before  # weights, iterations and both Adam moments untouched
        else:
            assert after[0] != before[0] and after[1] != before[1]
        scales.add(opt.get_scale())
    assert len(scales) > 2  # grew and backed off ...
    assert len(traces) == 1 == train_step.experimental_get_tracing_count()  # ... without a retrace
    assert int(inner.iterations.numpy()) == want[-1].steps - want[-1].skipped_steps
    assert opt.iterations is inner.iterations


def test_apply_gradients_and_eager_use():
    model = _model()
    opt = mpx_tf.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    x, y = np.ones((4, 5), np.float32), np.zeros((4, 3), np.float32)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
        scaled = opt.scale_loss(loss)
    assert float(scaled) == float(loss) * 2.0**16 == float(opt.scale(loss))  # scale: mpx's name for it
    grads = tape.gradient(scaled, model.trainable_variables)
    iterations = opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    assert int(iterations) == 1 and opt.state.steps == 1
    bad = [g * math.inf for g in grads]
    before = bits(model.variables)
    opt.apply(bad)  # variables known from the first call
    assert bits(model.variables) == before and opt.get_scale() == 2.0**15 and opt.state.skipped_steps == 1


def test_scale_loss_keeps_a_half_loss_from_overflowing():
    opt = mpx_tf.LossScaleOptimizer(keras.optimizers.SGD())
    scaled = opt.scale_loss(tf.constant(2.0, tf.float16))
    assert scaled.dtype == tf.float32 and float(scaled) == 2.0**17


def test_unscaled_gradients_match_the_inner_optimizer_exactly():
    """A power-of-two scale is exact: training with scaling equals training without, bit for bit."""
    x, y = np.random.RandomState(0).rand(8, 5).astype("float32"), np.zeros((8, 3), "float32")
    results = []
    for wrap in (False, True):
        model = _model()
        inner = keras.optimizers.Adam(1e-2)
        opt = mpx_tf.LossScaleOptimizer(inner) if wrap else inner
        for _ in range(3):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x) - y))
                if wrap:
                    loss = opt.scale_loss(loss)
            opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        results.append(bits(model.variables) + bits(inner.variables))
    assert results[0] == results[1]


def test_none_config_is_a_pass_through():
    model = _model()
    config = mpx.ScalerConfig.for_policy("mixed_bfloat16")
    assert config.kind == "none"
    opt = mpx_tf.LossScaleOptimizer(keras.optimizers.SGD(0.1), config)
    loss = tf.constant(3.0)
    assert opt.scale_loss(loss) is loss
    grads = [tf.ones_like(v) for v in model.trainable_variables]
    grads[0] = grads[0] * math.inf
    opt.apply(grads, model.trainable_variables)  # applied: none never skips by default
    assert not np.isfinite(model.trainable_variables[0].numpy()).all()
    assert opt.state == mpx.ScalerState(1.0, 0, 1, 1, 0)


# -- model.fit -------------------------------------------------------------------------
def _data(n=64):
    rng = np.random.RandomState(0)
    x = rng.rand(n, 5).astype("float32")
    return x, (x @ rng.rand(5, 3)).astype("float32")


@pytest.mark.parametrize("jit_compile", [False, True])
def test_fit_uses_the_scale_under_a_float32_policy(jit_compile):
    """Keras's auto_scale_loss does nothing under float32; Keras's train step still calls scale_loss.

    With a power-of-two scale the result is bit-identical to the inner optimizer
    alone, which holds only if fit scaled the loss (else every update would be
    divided by 2**16).
    """
    x, y = _data()
    weights = []
    for wrap in (False, True):
        model = _model()
        inner = keras.optimizers.Adam(1e-2)
        opt = mpx_tf.LossScaleOptimizer(inner) if wrap else inner
        model.compile(optimizer=opt, loss="mse", jit_compile=jit_compile)
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        assert model.optimizer is opt
        weights.append(bits(model.variables))
    assert weights[0] == weights[1]
    assert opt.state == mpx.ScalerState(2.0**16, 8, 0, 8, 0)


def test_fit_skips_and_backs_off_from_an_overflowing_scale():
    x, y = _data()
    y = y * 100.0  # an mse far above 2: times 2**127 it overflows float32
    model = _model()
    config = mpx.ScalerConfig(init_scale=2.0**127, max_scale=None, backoff_factor=2.0**-10)
    opt = mpx_tf.LossScaleOptimizer(keras.optimizers.Adam(1e-3), config)
    model.compile(optimizer=opt, loss="mse")
    before = bits(model.variables)
    history = model.fit(x, y, batch_size=64, epochs=1, verbose=0)
    assert bits(model.variables) == before  # loss * 2**127 overflows: the step was skipped
    assert opt.state == mpx.ScalerState(2.0**117, 0, 1, 1, 1)
    assert np.isfinite(history.history["loss"][0])  # the logged loss is the unscaled one
    model.fit(x, y, batch_size=64, epochs=1, verbose=0)
    assert opt.state.skipped_steps == 1 and int(opt.iterations.numpy()) == 1


def test_compile_under_mixed_float16_does_not_wrap_again():
    with mpx_tf.policy_scope("mixed_float16"):
        model = _model()
    mpx_tf.apply_policy(model, "mixed_float16")
    opt = mpx_tf.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
    model.compile(optimizer=opt, loss="mse")
    assert model.optimizer is opt
    x, y = _data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert opt.state.steps == 4
    # Keras's own wrapper, for comparison, starts at 2**15
    plain = _model()
    with mpx_tf.policy_scope("mixed_float16"):
        native = keras.Sequential([keras.Input((5,)), L.Dense(3)])
    native.compile(optimizer="adam", loss="mse")
    assert isinstance(native.optimizer, keras.optimizers.LossScaleOptimizer)
    assert not isinstance(native.optimizer, mpx_tf.LossScaleOptimizer)
    assert native.optimizer.initial_scale == 2.0**15
    del plain


# -- state dicts, configs, checkpoints ----------------------------------------------------
def _trained(config=None, events=(0, 1, 0, 0, 2)):
    var = keras.Variable(np.ones(3, np.float32))
    opt = mpx_tf.LossScaleOptimizer(keras.optimizers.Adam(0.1), config or mpx.ScalerConfig(growth_interval=2))
    step = _make_step(opt, var)
    for event in events:
        step(tf.constant(event))
    return opt, var


def test_state_dict_round_trip_and_interchange():
    opt, _ = _trained()
    sd = opt.state_dict()
    assert sd["format"] == "mpx.scaler/1" and sd["scale"] == opt.get_scale()
    assert json.loads(json.dumps(sd)) == sd
    scaler = mpx.LossScaler.from_state_dict(sd)  # the core's scaler reads it ...
    assert scaler.state == opt.state and scaler.config == opt.config
    for finite in (True, True, False):
        scaler.update(finite)
    fresh = mpx_tf.LossScaleOptimizer(keras.optimizers.Adam())
    fresh.load_state_dict(scaler.state_dict())  # ... and writes what this one loads, config included
    assert fresh.state == scaler.state and fresh.config == scaler.config
    assert fresh.state_dict() == scaler.state_dict()


def test_load_state_dict_rejects_bad_dicts_and_changes_nothing():
    opt, _ = _trained()
    before = opt.state_dict()
    for bad in (
        {**before, "format": "torch"},
        {**before, "scale": -1.0},
        {**before, "scale": 0.1},  # not a float32 value
        {**before, "growth_tracker": 99},
        {k: v for k, v in before.items() if k != "steps"},
        "nope",
    ):
        with pytest.raises(mpx.StateDictError):
            opt.load_state_dict(bad)
        assert opt.state_dict() == before


def test_loaded_config_drives_the_next_steps():
    opt, var = _trained()
    target = mpx.ScalerConfig(kind="static", init_scale=8.0)
    sd = mpx.state_dict(target, mpx.ScalerState(8.0, 0, 0, 3, 1))
    opt.load_state_dict(sd)
    step = _make_step(opt, var)  # traced after the load
    step(tf.constant(1))
    assert opt.state == mpx.ScalerState(8.0, 0, 1, 4, 2)


def test_smallest_scale_survives_state_dict():
    config = mpx.ScalerConfig(init_scale=2.0**-126, min_scale=None)
    opt = mpx_tf.LossScaleOptimizer(keras.optimizers.SGD(), config)
    assert opt.get_scale() == 2.0**-126
    again = mpx_tf.LossScaleOptimizer(keras.optimizers.SGD())
    again.load_state_dict(opt.state_dict())
    assert again.state == opt.state


@pytest.mark.parametrize(
    "config, error",
    [
        ({"kind": "bogus"}, mpx.ScalerConfigError),
        ({"kind": "dynamic", "growth_factor": 1.0}, mpx.ScalerConfigError),
        ({"kind": "dynamic", "init_scale": 2.0**30}, mpx.ScalerConfigError),  # above max_scale
        ({"kind": "dynamic", "unknown": 1}, mpx.ScalerConfigError),
        ({"growth_factor": 2.0}, mpx.PolicyError),  # a dict without "kind" is read as a policy dict
        ("dynamic", mpx.PolicyError),  # a string is a policy spec
        (2.0, mpx.ScalerConfigError),
    ],
)
def test_bad_configs_raise_mpx_errors(config, error):
    with pytest.raises(error):
        mpx_tf.LossScaleOptimizer(keras.optimizers.SGD(), config)


def test_policy_specs_give_the_policy_scaler():
    assert mpx_tf.LossScaleOptimizer(keras.optimizers.SGD(), "mixed_float16").config == mpx.ScalerConfig()
    none = mpx_tf.LossScaleOptimizer(keras.optimizers.SGD(), mpx.get_policy("mixed_bfloat16").to_dict())
    assert none.config.kind == "none" and none.get_scale() == 1.0
    # Keras's own arguments still apply over a policy's dynamic config
    keras_args = mpx_tf.LossScaleOptimizer(keras.optimizers.SGD(), "mixed_float16", initial_scale=2.0**15)
    assert keras_args.config == mpx.ScalerConfig(init_scale=2.0**15)


def test_bad_inner_optimizers_raise_mpx_errors():
    with pytest.raises(mpx.UnsupportedTypeError, match="keras.optimizers.Optimizer"):
        mpx_tf.LossScaleOptimizer("adam")
    with pytest.raises(mpx.UnsupportedTypeError, match="already a LossScaleOptimizer"):
        mpx_tf.LossScaleOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))
    with pytest.raises(
        mpx.MPXError, match="unknown arguments 'init_scale'"
    ):  # Keras's initial_scale is accepted
        mpx_tf.LossScaleOptimizer(keras.optimizers.SGD(), init_scale=2.0)
    with pytest.raises(ValueError, match="needs a built optimizer"):
        mpx_tf.LossScaleOptimizer(keras.optimizers.SGD()).apply([tf.ones(2)])
    with pytest.raises(ValueError, match="stateless_apply"):
        mpx_tf.LossScaleOptimizer(keras.optimizers.SGD()).stateless_apply([], [], [])


def test_get_config_from_config():
    config = mpx.ScalerConfig(growth_interval=7, hysteresis=2, min_scale=None, init_scale=2.0**8)
    opt = mpx_tf.LossScaleOptimizer(keras.optimizers.Adam(0.25), config, name="lso")
    cfg = opt.get_config()
    assert cfg["config"] == config.to_dict() and cfg["name"] == "lso"
    again = mpx_tf.LossScaleOptimizer.from_config(cfg)
    assert again.config == config and again.get_scale() == 2.0**8
    assert isinstance(again.inner_optimizer, keras.optimizers.Adam)
    assert float(again.learning_rate.numpy()) == 0.25
    generic = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(generic) is mpx_tf.LossScaleOptimizer and generic.config == config
    bad = {**cfg, "config": {**config.to_dict(), "backoff_factor": 2.0}}
    with pytest.raises(mpx.ScalerConfigError):
        mpx_tf.LossScaleOptimizer.from_config(bad)


def test_model_save_keeps_the_scaler_state(tmp_path):
    x, y = _data()
    model = _model()
    opt = mpx_tf.LossScaleOptimizer(keras.optimizers.Adam(1e-2), mpx.ScalerConfig(growth_interval=3))
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    opt.load_state_dict({**opt.state_dict(), "scale": 2.0**20, "skipped_steps": 2})  # a distinctive state
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    lopt = loaded.optimizer
    assert type(lopt) is mpx_tf.LossScaleOptimizer
    assert lopt.config == opt.config and lopt.state == opt.state
    assert bits(lopt.inner_optimizer.variables) == bits(opt.inner_optimizer.variables)
    loaded.fit(x, y, batch_size=8, epochs=1, verbose=0)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert lopt.state == opt.state and bits(loaded.variables) == bits(model.variables)


def test_tf_train_checkpoint_keeps_the_scaler_state(tmp_path):
    opt, var = _trained()
    checkpoint = tf.train.Checkpoint(optimizer=opt, var=var.value)
    path = checkpoint.save(tmp_path / "ckpt")
    var2 = keras.Variable(np.zeros(3, np.float32))
    opt2 = mpx_tf.LossScaleOptimizer(keras.optimizers.Adam(0.1), opt.config)
    opt2.build([var2])
    tf.train.Checkpoint(optimizer=opt2, var=var2.value).restore(path).assert_consumed()
    assert opt2.state == opt.state
    assert bits(opt2.inner_optimizer.variables) == bits(opt.inner_optimizer.variables)


# -- issue #13 -------------------------------------------------------------------------
def test_overflow_only_after_unscaling_skips_the_step():
    # item 1: a finite scaled gradient that overflows when divided by a scale below 1
    config = mpx.ScalerConfig(init_scale=0.25, min_scale=0.25)
    var = keras.Variable(np.ones(2, np.float32))
    inner = keras.optimizers.Adam(0.1)
    opt = mpx_tf.LossScaleOptimizer(inner, config)
    opt.build([var])
    before = bits([var]), bits(inner.variables)
    opt.apply([tf.constant([1e38, 1.0], tf.float32)], [var])
    assert (bits([var]), bits(inner.variables)) == before
    assert _same_state(opt.state, reference_trace(config, [False])[0]) and opt.state.skipped_steps == 1


_HISTORY = st.lists(st.booleans(), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.floats(2.0**-126, 3.4e38).map(lambda x: float(np.float32(x))).filter(lambda x: x >= 2.0**-126),
    st.one_of(st.floats(1.0, 2.0**32, exclude_min=True), st.sampled_from([1.1, 1.333333412806193, 3.0])),
    st.one_of(st.floats(2.0**-32, 1.0, exclude_max=True), st.sampled_from([0.9, 0.8, 0.3])),
    st.integers(1, 3),
    st.sampled_from([None, 2.0**-126, 0.5]),
    _HISTORY,
)
def test_device_scale_matches_core_for_random_factor_histories(init, gf, bf, interval, lo, flags):
    # item 9: the float64 product of torch's kernel, bit for bit, on TF's device ops
    lo = None if lo is not None and init < lo else lo
    config = mpx.ScalerConfig(
        init_scale=init, growth_factor=gf, backoff_factor=bf, growth_interval=interval,
        min_scale=lo, max_scale=None,
    )  # fmt: skip
    opt = mpx_tf.LossScaleOptimizer(keras.optimizers.SGD(0.1), config)
    for finite, expected in zip(flags, reference_trace(config, flags), strict=True):
        opt._transition(tf.constant(finite))
        assert _same_state(opt.state, expected), (opt.state, expected)


def test_issue_example_and_double_rounding_case():
    for config, flags, want in (
        (mpx.ScalerConfig(init_scale=3.0, backoff_factor=0.9, min_scale=None), [False], 2.700000047683716),
        (mpx.ScalerConfig(init_scale=3.0, growth_factor=1.333333412806193, growth_interval=1), [True], 4.0),
    ):
        opt = mpx_tf.LossScaleOptimizer(keras.optimizers.SGD(0.1), config)
        for finite in flags:
            opt._transition(tf.constant(finite))
        assert opt.get_scale() == want


def _snapshot(opt):
    return opt.state, opt.config


@pytest.mark.parametrize(
    "tamper",
    [
        lambda d: d.update(steps=2**64),  # item 2
        lambda d: d.update(scale=10**400),  # item 3
        lambda d: d["config"].update(growth_interval=2**70),  # item 4
        lambda d: d["config"].update(growth_factor=3.5e38),
        lambda d: d.update(growth_tracker=1, consecutive_nonfinite=1, steps=4, skipped_steps=1),  # item 6
        lambda d: d.update(growth_tracker=2, steps=1),
        lambda d: d.update(consecutive_nonfinite=2, skipped_steps=1, steps=4),
        lambda d: d.update(scale=0.125),  # a valid config (min_scale 1) with a state off its bounds
    ],
)
def test_rejected_loads_change_nothing(tamper):
    data = mpx.LossScaler(mpx.ScalerConfig(init_scale=8.0, growth_interval=5)).state_dict()
    data["config"]["hysteresis"] = 3
    tamper(data)
    opt = mpx_tf.LossScaleOptimizer(keras.optimizers.SGD(), mpx.ScalerConfig(init_scale=4.0))
    before = _snapshot(opt)
    with pytest.raises(mpx.StateDictError):
        opt.load_state_dict(data)
    assert _snapshot(opt) == before


@pytest.mark.parametrize(
    "config",
    [
        mpx.ScalerConfig(growth_factor=2.0**32, backoff_factor=2.0**-32, growth_interval=1, min_scale=None,
                         max_scale=None),
        mpx.ScalerConfig(growth_interval=2**31 - 1, hysteresis=2**31 - 1),
    ],
)  # fmt: skip
def test_extreme_accepted_configs_run(config):
    # item 4: what the core accepts, the backend runs
    flags = [True, False, True, True, False]
    opt = mpx_tf.LossScaleOptimizer(keras.optimizers.SGD(), config)
    var = keras.Variable(np.ones(3, np.float32))
    step = _make_step(opt, var)
    for event, expected in zip([0, 1, 0, 0, 2], reference_trace(config, flags), strict=True):
        step(tf.constant(event))
        assert _same_state(opt.state, expected)


def test_counters_saturate_and_the_largest_load():
    m = mpx.COUNTER_MAX
    config = mpx.ScalerConfig(kind="static", init_scale=2.0)
    state = mpx.ScalerState(2.0, 0, m - 1, m - 1, m - 1)
    opt = mpx_tf.LossScaleOptimizer(keras.optimizers.SGD())
    opt.load_state_dict(mpx.state_dict(config, state))
    for _ in range(2):
        opt._transition(tf.constant(False))
        state = mpx.scaler_update(config, state, False)
        assert opt.state == state
    assert state.steps == m


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.floats(2.0**-126, 3.4e38).map(lambda x: float(np.float32(x))).filter(lambda x: x >= 2.0**-126),
    st.one_of(
        st.floats(1.0, 2.0**32, exclude_min=True), st.sampled_from([1.1, 1.0000001, 1.333333412806193])
    ),
    st.one_of(st.floats(2.0**-32, 1.0, exclude_max=True), st.sampled_from([0.9, 0.8, 0.3])),
    st.sampled_from([None, 2.0**-126, 0.5]),
    st.sampled_from([None, 1e38]),
)
def test_both_tables_grow_and_back_off_as_the_core(init, gf, bf, lo, hi):
    """The core's transition with keras.ops' table (what Keras on any backend runs) and with TensorFlow's
    (what mpx_tf's optimizer runs) gives the core's growth and backoff, bit for bit, for factors a float32
    cannot hold too (their float64 product needs the factor made a float64 constant, not a float32)."""
    from mpx.kernels import scale as kernel
    from mpx_keras._array_ops import KERAS_ARRAY_OPS
    from mpx_tf._array_ops import TF_ARRAY_OPS

    lo = None if lo is not None and init < lo else lo
    hi = None if hi is not None and init > hi else hi
    config = mpx.ScalerConfig(
        init_scale=init, growth_factor=gf, backoff_factor=bf, growth_interval=1, min_scale=lo, max_scale=hi
    )
    state = mpx.scaler_init(config)
    for o in (KERAS_ARRAY_OPS, TF_ARRAY_OPS):
        for finite in (True, False):
            got = kernel.update(o, config, kernel.initial(o, config), tf.constant(finite)).scale
            want = mpx.scaler_update(config, state, finite).scale
            assert np.float32(got.numpy()).tobytes() == np.float32(want).tobytes(), (o, finite)


def test_variables_saved_when_the_counters_were_int64_still_load():
    """Files saved before mpx_tf's counters became int32 (mpx_keras's, on every backend) load their values."""
    opt = mpx_tf.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    w = keras.Variable(np.ones(2, np.float32))
    opt.build([w])
    old = {id(opt.dynamic_scale): np.float32(256.0), id(opt.step_counter): np.int64(7),
           id(opt.consecutive_nonfinite): np.int64(1), id(opt.total_steps): np.int64(40),
           id(opt.skipped_steps): np.int64(3)}  # fmt: skip
    opt.load_own_variables({str(i): old.get(id(v), v.numpy()) for i, v in enumerate(opt.variables)})
    assert opt.state == mpx.ScalerState(256.0, 7, 1, 40, 3)
    assert opt.step_counter.dtype == opt.total_steps.dtype == "int32"
