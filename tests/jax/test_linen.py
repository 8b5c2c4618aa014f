"""mpx_jax.linen: a TrainState whose skipped steps change nothing, and Flax's DynamicScale read (issue 25, item 2)."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mpx
import mpx_jax

nn = pytest.importorskip("flax.linen")
from flax.training import train_state  # noqa: E402
from flax.training.dynamic_scale import DynamicScale  # noqa: E402

from mpx_jax.flax import policy_apply  # noqa: E402
from mpx_jax.linen import TrainState, from_dynamic_scale  # noqa: E402


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)
        return nn.Dense(2)(nn.relu(x))


class State(TrainState):  # as Flax's ImageNet example adds its batch statistics
    batch_stats: Any


class FlaxState(train_state.TrainState):
    batch_stats: Any


X = jax.random.normal(jax.random.PRNGKey(1), (6, 4))
Y = jax.random.normal(jax.random.PRNGKey(2), (6, 2))


def create(cls):
    variables = Net().init(jax.random.PRNGKey(0), X)
    tx = mpx_jax.with_loss_scaling(optax.adam(1e-2), mpx.ScalerConfig(growth_interval=3))
    apply = policy_apply(Net(), "mixed_float16")
    return cls.create(apply_fn=apply, params=variables["params"], tx=tx, batch_stats=variables["batch_stats"])


def make_step(traces):
    @jax.jit
    def train_step(state, x, poison):
        traces.append(1)
        loss_scale = mpx_jax.get_loss_scale(state.opt_state)

        def loss_fn(params):
            out, updates = state.apply_fn(
                {"params": params, "batch_stats": state.batch_stats}, x, mutable=["batch_stats"]
            )
            return loss_scale.scale(jnp.mean((out - Y) ** 2) * poison), updates

        grads, updates = jax.grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])

    return train_step


def bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]


def test_skipped_step_leaves_step_params_opt_state_and_batch_stats_bit_identical():
    traces = []
    train_step = make_step(traces)
    state = create(State)
    for _ in range(2):
        state = train_step(state, X, jnp.float32(1.0))
    assert int(state.step) == 2
    before = state
    x = X * 3.0  # batch statistics of this batch differ from the running ones
    skipped = train_step(before, x, jnp.float32(jnp.inf))
    assert int(skipped.step) == 2
    for name in ("params", "batch_stats"):
        assert bits(getattr(skipped, name)) == bits(getattr(before, name)), name
    assert bits(skipped.opt_state.inner_state) == bits(before.opt_state.inner_state)
    assert skipped.loss_scale.state.skipped_steps == 1 and skipped.loss_scale.get_scale() == 2.0**15
    applied = train_step(skipped, x, jnp.float32(1.0))
    assert int(applied.step) == 3
    assert bits(applied.batch_stats) != bits(skipped.batch_stats)
    assert bits(applied.params) != bits(skipped.params)
    assert len(traces) == 1  # one compilation: the skip is a select


def test_flax_train_state_counts_the_skip_and_keeps_its_batch_stats():
    state = create(FlaxState)
    skipped = make_step([])(state, X * 3.0, jnp.float32(jnp.inf))
    assert int(skipped.step) == 1  # Flax counts it
    assert bits(skipped.batch_stats) != bits(
        state.batch_stats
    )  # and keeps the overflowing batch's statistics
    assert bits(skipped.params) == bits(state.params)  # with_loss_scaling alone keeps the parameters


def test_create_needs_loss_scaling():
    variables = Net().init(jax.random.PRNGKey(0), X)
    with pytest.raises(mpx.UnsupportedTypeError, match="with_loss_scaling"):
        State.create(apply_fn=Net().apply, params=variables["params"], tx=optax.sgd(0.1), batch_stats={})


# -- Flax's DynamicScale -> mpx ------------------------------------------------------------------------
@jax.jit
def flax_step(ds, c):
    ds, finite, _, _ = ds.value_and_grad(lambda p: p * c)(jnp.float32(1.0))
    return ds, finite


mpx_step = jax.jit(lambda ls, finite: ls.update(finite))


def flax_run(ds, flags):
    scales = []
    for finite in flags:
        ds, ok = flax_step(ds, jnp.float32(1.0 if finite else jnp.inf))
        assert bool(ok) == finite
        scales.append(float(ds.scale))
    return ds, scales


def mpx_run(ls, flags):
    scales = []
    for finite in flags:
        ls = mpx_step(ls, jnp.asarray(finite))
        scales.append(float(ls.loss_scale))
    return scales


FLAGS = st.lists(st.booleans(), max_size=10)


@settings(max_examples=25, deadline=None)
@given(before=FLAGS, after=FLAGS)
def test_flax_cadence_continues_flax_trace_exactly(before, after):
    ds, _ = flax_run(DynamicScale(growth_interval=3), before)
    ls = from_dynamic_scale(ds, flax_cadence=True)
    assert ls.get_scale() == float(ds.scale) and ls.config.growth_interval == 4
    assert mpx_run(ls, after) == flax_run(ds, after)[1]


@settings(max_examples=25, deadline=None)
@given(before=FLAGS, after=FLAGS)
def test_mpx_cadence_follows_the_reference_state_machine(before, after):
    ds, _ = flax_run(DynamicScale(growth_interval=3), before)
    ls = from_dynamic_scale(ds)
    config, state = mpx.load_state_dict(ls.state_dict())
    assert config.growth_interval == 3 and state.scale == float(ds.scale)
    assert state.growth_tracker == min(int(ds.fin_steps), 2)
    expected = []
    for finite in after:
        state = mpx.scaler_update(config, state, finite)
        expected.append(state.scale)
    assert mpx_run(ls, after) == expected


def test_mpx_cadence_grows_one_finite_step_earlier_then_every_interval():
    ds, _ = flax_run(DynamicScale(growth_interval=3), [True])  # fin_steps 1
    flax_scales = flax_run(ds, [True] * 8)[1]
    mpx_scales = mpx_run(from_dynamic_scale(ds), [True] * 8)
    base = 2.0**16
    assert flax_scales == [base, base, base * 2, base * 2, base * 2, base * 2, base * 4, base * 4]
    assert mpx_scales == [base, base * 2, base * 2, base * 2, base * 4, base * 4, base * 4, base * 8]
    full, _ = flax_run(DynamicScale(growth_interval=3), [True] * 3)  # fin_steps 3: grows on the next step
    assert mpx_run(from_dynamic_scale(full), [True]) == flax_run(full, [True])[1] == [base * 2]


def test_dynamic_scale_settings_and_errors():
    ds = DynamicScale(
        growth_factor=4.0, backoff_factor=0.25, growth_interval=10, scale=1024.0, minimum_scale=None
    )
    ls = from_dynamic_scale(ds, max_scale=2.0**24)
    cfg = ls.config
    assert (cfg.growth_factor, cfg.backoff_factor, cfg.growth_interval) == (4.0, 0.25, 10)
    assert (cfg.min_scale, cfg.max_scale, cfg.hysteresis, cfg.skip_nonfinite) == (None, 2.0**24, 1, True)
    assert ls.state == mpx.ScalerState(1024.0, 0, 0, 0, 0)
    assert from_dynamic_scale(DynamicScale()).config.min_scale == float(np.finfo(np.float32).tiny)
    with pytest.raises(mpx.UnsupportedTypeError, match="DynamicScale"):
        from_dynamic_scale(mpx_jax.LossScale.create())
    with pytest.raises(mpx.StateDictError, match="scale"):
        from_dynamic_scale(DynamicScale(scale=1e-40, minimum_scale=None))
    with pytest.raises(mpx.ScalerConfigError, match="growth_factor"):
        from_dynamic_scale(DynamicScale(growth_factor=2.0**40))
    with pytest.raises(mpx.StateDictError, match="outside"):
        from_dynamic_scale(DynamicScale(scale=2.0**30), max_scale=2.0**24)
