"""The one scaler surface (#22) on JAX: every mpx.testing check, on LossScale itself, on the loss scale of a
with_loss_scaling optax step, and on that of a Flax ``nnx.Optimizer`` over it (#25: get_loss_scale and
set_loss_scale read and write OptArray state)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import mpx
import mpx_jax
from mpx.testing import SURFACE_CHECKS

_PARAMS = {"w": jnp.array([1.0, -2.0, 0.5], jnp.float32)}


def _grads(finite: bool) -> dict:
    return {"w": jnp.array([0.25, jnp.inf if not finite else 1.0, -3.0], jnp.float32)}


class LossScaleAdapter:
    """The bare LossScale: ``update`` is the step; ``record_history`` returns the recording value."""

    def make(self, config):
        return mpx_jax.LossScale.create(config)

    def step(self, scaler, finite):
        return scaler.update(finite)

    def multiply(self, scaler, value):
        return float(scaler.scale(jnp.float32(value)))

    def load(self, scaler, data):
        return scaler.load_state_dict(data)

    def record(self, scaler):
        return scaler.record_history()

    def history(self, config, flags):
        scaler = self.record(self.make(config))
        for finite in flags:
            scaler = self.step(scaler, finite)
        return scaler.history()


class OptaxAdapter(LossScaleAdapter):
    """The loss scale read with get_loss_scale from a with_loss_scaling(optax.adam) state after each update.

    The adapter remembers which optimizer state each returned LossScale came from."""

    def __init__(self):
        self._held: dict[int, tuple] = {}

    def _keep(self, scaler, holder):
        self._held[id(scaler)] = (scaler, holder)
        return scaler

    def make(self, config):
        tx = mpx_jax.with_loss_scaling(optax.adam(1e-2), config)
        state = tx.init(_PARAMS)
        return self._keep(mpx_jax.get_loss_scale(state), (tx, state))

    def step(self, scaler, finite):
        tx, state = self._held[id(scaler)][1]
        state = mpx_jax.set_loss_scale(state, scaler)  # the same value: the way back is exercised
        _, state = tx.update(_grads(finite), state, _PARAMS)
        return self._keep(mpx_jax.get_loss_scale(state), (tx, state))

    def record(self, scaler):
        # the recording LossScale goes back into the optimizer state at the next step (set_loss_scale)
        return self._keep(scaler.record_history(), self._held[id(scaler)][1])


class NNXAdapter(OptaxAdapter):
    """The loss scale of a Flax nnx.Optimizer(model, with_loss_scaling(optax.adamw(...)), wrt=nnx.Param)."""

    def make(self, config):
        nnx = pytest.importorskip("flax.nnx")
        model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, mpx_jax.with_loss_scaling(optax.adamw(1e-2), config), wrt=nnx.Param)
        return self._keep(mpx_jax.get_loss_scale(opt), (model, opt))

    def step(self, scaler, finite):
        nnx = pytest.importorskip("flax.nnx")
        model, opt = self._held[id(scaler)][1]
        assert mpx_jax.set_loss_scale(opt, scaler) is opt

        grads = nnx.grad(lambda m: scaler.scale(jnp.sum(m(jnp.ones((1, 3))))))(model)
        if not finite:
            grads = jax.tree_util.tree_map(lambda g: g * jnp.inf, grads)
        opt.update(model, grads)
        return self._keep(mpx_jax.get_loss_scale(opt), (model, opt))


ADAPTERS = {"LossScale": LossScaleAdapter, "with_loss_scaling": OptaxAdapter, "nnx.Optimizer": NNXAdapter}


@pytest.mark.parametrize("adapter", ADAPTERS.values(), ids=list(ADAPTERS))
@pytest.mark.parametrize("check", SURFACE_CHECKS.values(), ids=list(SURFACE_CHECKS))
def test_jax_scalers_meet_the_surface(check, adapter):
    check(adapter())


def test_a_check_fails_for_a_scaler_that_differs():
    class Drifting(OptaxAdapter):
        def step(self, scaler, finite):
            return super().step(scaler, True)  # never sees an overflow

    with pytest.raises(AssertionError):
        SURFACE_CHECKS["trace"](Drifting())


def test_load_state_dict_returns_the_loaded_value_and_keeps_self():
    ls = mpx_jax.LossScale.create(mpx.ScalerConfig(growth_interval=2)).update(True)
    saved = ls.state_dict()
    fresh = mpx_jax.LossScale.create()
    loaded = fresh.load_state_dict(saved)
    assert loaded.state == ls.state and loaded.config == ls.config
    assert fresh.state == mpx.scaler_init(mpx.ScalerConfig())  # immutable: unchanged
    assert mpx_jax.LossScale.from_state_dict(saved).state == loaded.state


def test_with_loss_scaling_takes_every_config_form():
    for form in (
        None,
        "mixed_float16",
        {"kind": "static", "init_scale": 8.0},
        mpx.ScalerConfig(hysteresis=2),
    ):
        state = mpx_jax.with_loss_scaling(optax.sgd(0.1), form).init(_PARAMS)
        assert mpx_jax.get_loss_scale(state).config == mpx.as_scaler_config(form)
    with pytest.raises(mpx.PolicyError, match="mixed_float17"):
        mpx_jax.with_loss_scaling(optax.sgd(0.1), "mixed_float17")


def test_wrong_types_raise_unsupported_type_error():
    with pytest.raises(mpx.UnsupportedTypeError, match="tx: with_loss_scaling wraps an optax"):
        mpx_jax.with_loss_scaling(lambda g: g)
    tx = mpx_jax.with_loss_scaling(optax.sgd(0.1))
    with pytest.raises(mpx.UnsupportedTypeError, match="state: expected the LossScalingState"):
        tx.update(_PARAMS, optax.sgd(0.1).init(_PARAMS), _PARAMS)
    with pytest.raises(mpx.UnsupportedTypeError, match="holds no LossScale"):
        mpx_jax.get_loss_scale(optax.adam(0.1).init(_PARAMS))
    with pytest.raises(mpx.UnsupportedTypeError, match="loss_scale: expected an mpx_jax.LossScale"):
        mpx_jax.set_loss_scale(tx.init(_PARAMS), 4.0)
    with pytest.raises(mpx.UnsupportedTypeError, match="finite: expected a boolean scalar"):
        mpx_jax.LossScale.create().update("yes")


def test_set_loss_scale_refuses_another_config_and_changes_nothing():
    tx = mpx_jax.with_loss_scaling(optax.sgd(0.1), mpx.ScalerConfig(growth_interval=2))
    state = tx.init(_PARAMS)
    other = mpx_jax.LossScale.create(mpx.ScalerConfig(growth_interval=2000, init_scale=8.0))
    with pytest.raises(
        mpx.ScalerConfigError, match=r"\(init_scale 65536.0 vs 8.0, growth_interval 2 vs 2000\)"
    ):
        mpx_jax.set_loss_scale(state, other)
    assert mpx_jax.get_loss_scale(state).state == mpx.scaler_init(mpx.ScalerConfig(growth_interval=2))
    bad = mpx_jax.get_loss_scale(state)
    bad = type(bad)(
        jnp.float16(2.0), *(getattr(bad, n) for n in mpx_jax.loss_scale.STATE_FIELDS[1:]), bad.config
    )
    with pytest.raises(mpx.UnsupportedTypeError, match="loss_scale.loss_scale: expected a float32 scalar"):
        mpx_jax.set_loss_scale(state, bad)


def test_nnx_optimizer_under_nnx_jit_reads_and_writes_the_optarray_state():
    """flax 0.12.8: nnx.Optimizer(model, with_loss_scaling(optax.adamw(...)), wrt=nnx.Param), a jitted step."""
    nnx = pytest.importorskip("flax.nnx")
    config = mpx.ScalerConfig(growth_interval=1, init_scale=4.0)
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, mpx_jax.with_loss_scaling(optax.adamw(1e-2), config), wrt=nnx.Param)
    held = opt.opt_state.loss_scale
    assert type(held.loss_scale).__name__ == "OptArray"  # what NNX wraps the leaves in
    for source in (opt, opt.opt_state, held):  # the optimizer, its opt_state, the wrapped LossScale
        ls = source if isinstance(source, mpx_jax.LossScale) else mpx_jax.get_loss_scale(source)
        assert type(mpx_jax.loss_scale.plain_loss_scale(ls).loss_scale) is type(jnp.zeros(()))
        assert ls.get_scale() == 4.0 and ls.state == mpx.scaler_init(config)

    @nnx.jit
    def step(model, opt, poison):
        loss_scale = mpx_jax.get_loss_scale(opt)
        grads = nnx.grad(lambda m: loss_scale.scale(jnp.sum(m(jnp.ones((1, 3))) * poison)))(model)
        opt.update(model, grads)

    assert mpx_jax.set_loss_scale(opt, mpx_jax.get_loss_scale(opt).record_history(capacity=8)) is opt
    assert type(opt.opt_state.loss_scale.history_rows).__name__ == "OptArray"
    before = jax.tree_util.tree_map(jnp.copy, nnx.state(model, nnx.Param))
    step(model, opt, jnp.float32(jnp.inf))  # skipped: params bit-identical
    after = nnx.state(model, nnx.Param)
    assert all(
        bool(jnp.all(a.view(jnp.int32) == b.view(jnp.int32)))
        for a, b in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(after), strict=True)
    )
    step(model, opt, jnp.float32(1.0))
    assert mpx_jax.get_loss_scale(opt).history().scale == [2.0, 4.0]  # recorded inside nnx.jit
    # the way back, in place: the variables take the loaded values and the jitted step goes on from them
    loaded = mpx_jax.get_loss_scale(opt).load_state_dict(
        {**mpx_jax.get_loss_scale(opt).state_dict(), "scale": 64.0}
    )
    assert mpx_jax.set_loss_scale(opt, loaded) is opt
    assert mpx_jax.get_loss_scale(opt).state == loaded.state
    assert "LossScale(kind='dynamic', scale=64.0" in repr(opt.opt_state) and repr(opt)
    step(model, opt, jnp.float32(1.0))
    assert mpx_jax.get_loss_scale(opt).get_scale() == 128.0
