"""mpx_keras.LossScaleOptimizer on this process's Keras backend: fit, a custom train_step, jit_compile,
bit-identical skips, the scale trace against mpx.scaler_update, and what a backend cannot do."""

from __future__ import annotations

import functools

import keras
import numpy as np
import pytest

import mpx
import mpx_keras

BACKEND = keras.config.backend()
CONFIG = mpx.ScalerConfig(init_scale=2.0**10, growth_interval=2, hysteresis=2)
#: Per batch of 4: whether its gradients are finite (an inf input makes them NaN).
FLAGS = [True, True, True, False, False, True, True, True, False, True]


def reference(config, flags):
    return functools.reduce(lambda s, f: mpx.scaler_update(config, s, f), flags, mpx.scaler_init(config))


def data(flags, rows=4):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows * len(flags), 3)).astype("float32")
    for i, finite in enumerate(flags):
        if not finite:
            x[i * rows] = np.inf
    y = rng.normal(size=(rows * len(flags), 1)).astype("float32")
    return x, y


def model(policy="mixed_float16"):
    with mpx_keras.policy_scope(policy):
        m = keras.Sequential(
            [
                keras.Input((3,)),
                keras.layers.Dense(4),
                keras.layers.LayerNormalization(),
                keras.layers.Dense(1),
            ]
        )
    return mpx_keras.apply_policy(m, policy)


def host(variables):
    return [keras.ops.convert_to_numpy(v.value).copy() for v in variables]


def assert_bit_identical(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes()


# -- fit -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("jit_compile", [False, True], ids=["eager-or-graph", "jit_compile"])
def test_fit_follows_the_reference_trace(jit_compile):
    if jit_compile and BACKEND == "torch":
        pytest.skip("torch: jit_compile (torch.compile) is covered by test_fit_with_jit_compile_on_torch")
    m = model()
    opt = mpx_keras.LossScaleOptimizer(keras.optimizers.Adam(1e-3), CONFIG)
    opt.record_history()
    m.compile(optimizer=opt, loss="mse", jit_compile=jit_compile)
    x, y = data(FLAGS)
    h = m.fit(x, y, batch_size=4, shuffle=False, verbose=0, callbacks=[mpx_keras.LossScaleMonitor()])
    assert opt.state == reference(CONFIG, FLAGS)
    assert opt.history() == mpx.ScalerHistory.reference(
        CONFIG, FLAGS
    )  # (tests/keras/test_history.py: no monitor)
    assert h.history["loss_scale"] == [reference(CONFIG, FLAGS).scale]
    assert h.history["skipped_steps"] == [FLAGS.count(False)]
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == FLAGS.count(True)  # skipped steps do not count


@pytest.mark.skipif(BACKEND != "torch", reason="torch only")
def test_fit_with_jit_compile_on_torch():
    m = model("mixed_bfloat16")
    config = mpx.ScalerConfig(init_scale=2.0**10, growth_interval=2)  # a bfloat16 model may still scale
    opt = mpx_keras.LossScaleOptimizer(keras.optimizers.SGD(1e-3), config)
    m.compile(optimizer=opt, loss="mse", jit_compile=True)
    flags = [True, False, True]
    x, y = data(flags)
    m.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    assert opt.state == reference(config, flags)


def test_a_skipped_fit_step_leaves_weights_and_optimizer_variables_bit_identical():
    m = model()
    opt = mpx_keras.LossScaleOptimizer(keras.optimizers.Adam(1e-3), CONFIG)
    m.compile(optimizer=opt, loss="mse")
    x, y = data([True, True])
    m.fit(x, y, batch_size=4, shuffle=False, verbose=0)  # moments and iterations are not zero
    weights, inner = host(m.weights), host(opt.inner_optimizer.variables)
    x, y = data([False])
    m.fit(x, y, batch_size=4, verbose=0)
    assert_bit_identical(host(m.weights), weights)
    assert_bit_identical(host(opt.inner_optimizer.variables), inner)
    assert opt.state == reference(CONFIG, [True, True, False])


def test_a_float16_model_under_a_float32_policy_trains_with_scaling_and_the_monitor_says_so():
    with mpx_keras.policy_scope("mixed_float16"):
        backbone = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="half")])
    inputs = keras.Input((3,))
    outer = keras.Model(inputs, keras.layers.Dense(1, dtype="float32")(backbone(inputs)))
    outer.compile(optimizer=keras.optimizers.SGD(), loss="mse")  # float32 model: Keras adds no scaling
    check = mpx_keras.check_model(outer)
    assert check.loss_scaling is False and not check.ok and any("half" in p for p in check.float16_layers)
    x, y = data([True])
    with pytest.warns(mpx_keras.UnscaledFloat16Warning, match="does no loss scaling"):
        outer.fit(x, y, verbose=0, callbacks=[mpx_keras.LossScaleMonitor()])
    outer.compile(optimizer=mpx_keras.LossScaleOptimizer(keras.optimizers.SGD()), loss="mse")
    assert mpx_keras.check_model(outer).ok


# -- a custom train_step ------------------------------------------------------------------------------
class CustomStep(keras.Sequential):
    """A train_step written against the optimizer's public API (scale_loss, then apply)."""

    def train_step(self, batch):
        x, y = batch
        if BACKEND == "tensorflow":
            import tensorflow as tf

            with tf.GradientTape() as tape:
                loss = keras.ops.mean(keras.ops.square(self(x, training=True) - y))
                scaled = self.optimizer.scale_loss(loss)
            grads = tape.gradient(scaled, self.trainable_variables)
            self.optimizer.apply(grads, self.trainable_variables)
            return {"loss": loss}
        if BACKEND == "torch":
            self.zero_grad()
            loss = keras.ops.mean(keras.ops.square(self(x, training=True) - y))
            self.optimizer.scale_loss(loss).backward()
            grads = [v.value.grad for v in self.trainable_variables]
            self.optimizer.apply(grads, self.trainable_variables)
            return {"loss": loss}
        raise AssertionError("jax uses stateless_train_step below")


def _jax_train_step(self, state, batch):
    import jax

    trainable, non_trainable, optimizer_values, metrics = state
    x, y = batch

    def loss_fn(trainable, non_trainable, optimizer_values):
        out, non_trainable = self.stateless_call(trainable, non_trainable, x, training=True)
        loss = keras.ops.mean(keras.ops.square(out - y))
        mapping = list(zip(self.optimizer.variables, optimizer_values, strict=True))
        with keras.StatelessScope(state_mapping=mapping):
            scaled = self.optimizer.scale_loss(loss)
        return scaled, (loss, non_trainable)

    grads, (loss, non_trainable) = jax.grad(loss_fn, has_aux=True)(trainable, non_trainable, optimizer_values)
    trainable, optimizer_values = self.optimizer.stateless_apply(optimizer_values, grads, trainable)
    return {"loss": loss}, (trainable, non_trainable, optimizer_values, metrics)


if BACKEND == "jax":
    CustomStep.train_step = _jax_train_step


def test_a_custom_train_step_follows_the_reference_trace():
    with mpx_keras.policy_scope("mixed_float16"):
        m = CustomStep([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1, dtype="float32")])
    opt = mpx_keras.LossScaleOptimizer(keras.optimizers.SGD(1e-3), CONFIG)
    m.compile(optimizer=opt)
    x, y = data(FLAGS)
    m.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    assert opt.state == reference(CONFIG, FLAGS)


# -- the transition: the core's kernel (tests/keras/test_kernel_parity.py), wired to the variables ----------
def test_counters_saturate_without_wrapping():
    config = mpx.ScalerConfig(kind="static", init_scale=4.0)
    top = mpx.COUNTER_MAX
    opt = mpx_keras.LossScaleOptimizer(keras.optimizers.SGD(0.1), config)
    w = keras.Variable(np.ones(2, np.float32))
    opt.build([w])
    opt.load_state_dict(
        {**opt.state_dict(), "consecutive_nonfinite": top, "steps": top, "skipped_steps": top}
    )
    opt.apply([keras.ops.convert_to_tensor(np.full(2, np.inf, np.float32))], [w])
    assert opt.state == mpx.ScalerState(4.0, 0, top, top, top)
    assert bool(keras.ops.convert_to_numpy(opt.last_step_skipped()))


# -- what a backend cannot do -------------------------------------------------------------------------------
def test_reduce_dtype_names_the_backend():
    with pytest.raises(mpx.MPXError, match=rf"reduce_dtype is not supported on Keras's '{BACKEND}' backend"):
        mpx_keras.LossScaleOptimizer(keras.optimizers.SGD(), reduce_dtype="bfloat16")


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow refuses stateless_apply")
def test_stateless_apply_on_tensorflow_names_the_backend():
    opt = mpx_keras.LossScaleOptimizer(keras.optimizers.SGD())
    with pytest.raises(
        mpx.MPXError, match="stateless_apply is not supported on Keras's 'tensorflow' backend"
    ):
        opt.stateless_apply([], [], [])


@pytest.mark.skipif(BACKEND != "jax", reason="jax only")
def test_apply_inside_jit_names_the_backend_and_stateless_apply_jits():
    import jax

    w = keras.Variable(np.ones(2, np.float32))
    opt = mpx_keras.LossScaleOptimizer(keras.optimizers.SGD(0.5), mpx.ScalerConfig(init_scale=2.0))
    opt.build([w])
    with pytest.raises(mpx.MPXError, match="inside a traced .* on Keras's 'jax' backend"):
        jax.jit(lambda g: opt.apply([g], [w]))(keras.ops.ones(2))

    @jax.jit
    def step(optimizer_values, grads, trainable):
        return opt.stateless_apply(optimizer_values, grads, trainable)

    values = [v.value for v in opt.variables]
    trainable, values = step(values, [keras.ops.ones(2) * 2.0], [w.value])  # unscaled: 1.0
    np.testing.assert_array_equal(np.asarray(trainable[0]), [0.5, 0.5])
    trainable2, values2 = step(values, [keras.ops.ones(2) * np.inf], trainable)
    assert np.asarray(trainable2[0]).tobytes() == np.asarray(trainable[0]).tobytes()
    for v, value in zip(opt.variables, values2, strict=True):
        v.assign(value)
    assert opt.state == reference(opt.config, [True, False])
