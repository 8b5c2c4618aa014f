"""LossScale.record_history: the kernel ring buffer in the pytree equals the core's reference trace, inside
jit, under donation, in an optax state and across accumulation windows; leaves only while recording."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mpx
import mpx_jax


@settings(max_examples=20, deadline=None)
@given(
    flags=st.lists(st.booleans(), min_size=1, max_size=30),
    interval=st.integers(1, 3),
    hysteresis=st.integers(1, 2),
    capacity=st.integers(1, 40),
)
def test_loss_scale_history_equals_reference(flags, interval, hysteresis, capacity) -> None:
    cfg = mpx.ScalerConfig(init_scale=8.0, growth_interval=interval, hysteresis=hysteresis, max_scale=64.0)
    ls = mpx_jax.LossScale.create(cfg).record_history(capacity=capacity)
    update = jax.jit(lambda s, f: s.update(f))
    for f in flags:
        ls = update(ls, jnp.asarray(f))
    ref = mpx.ScalerHistory.reference(cfg, flags)
    want = mpx.ScalerHistory(
        cfg, *(getattr(ref, k)[-capacity:] for k in ("steps", "scale", "skipped", "growth", "backoff"))
    )
    assert ls.history() == want  # the last `capacity` steps


def test_recording_adds_two_leaves_and_stopping_removes_them() -> None:
    ls = mpx_jax.LossScale.create()
    assert len(jax.tree_util.tree_leaves(ls)) == 5  # not recording: the state's five arrays, as before
    rec = ls.record_history(capacity=3)
    rows, count = jax.tree_util.tree_leaves(rec)[5:]
    assert rows.shape == (3, 4) and rows.dtype == jnp.int32 and count.dtype == jnp.int32
    stopped = rec.update(True).record_history(False)
    assert len(jax.tree_util.tree_leaves(stopped)) == 5 and stopped.state.steps == 1
    with pytest.raises(mpx.MPXError, match="does not record"):
        stopped.history()
    with pytest.raises(mpx.MPXError, match="capacity"):
        ls.record_history(capacity=0)
    assert rec.update(True).record_history().history().steps == []  # starting again clears the record


def test_optax_donated_records_inside_the_compiled_step() -> None:
    cfg = mpx.ScalerConfig(init_scale=4.0, growth_interval=2)
    tx = mpx_jax.with_loss_scaling(optax.adam(1e-2), cfg)
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    state = mpx_jax.set_loss_scale(state, mpx_jax.get_loss_scale(state).record_history(capacity=16))
    traces = []

    def step(p, s, c):
        traces.append(1)
        ls = mpx_jax.get_loss_scale(s)
        g = jax.grad(lambda q: ls.scale(jnp.sum(q["w"] * c)))(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(step, donate_argnums=(0, 1))
    flags = [True, True, False, True, True, True, False]
    skipped = []
    for f in flags:
        params, state = step(params, state, jnp.float32(1.0 if f else jnp.inf))
        skipped.append(mpx_jax.get_loss_scale(state).last_step_skipped())
    assert mpx_jax.get_loss_scale(state).history() == mpx.ScalerHistory.reference(cfg, flags)
    assert [bool(s) for s in skipped] == [not f for f in flags]
    assert len(traces) == 1


def test_accumulation_records_one_row_per_window() -> None:
    cfg = mpx.ScalerConfig(init_scale=4.0, growth_interval=1)
    tx = mpx_jax.with_loss_scaling(optax.sgd(0.1), cfg, accumulate=2)
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    state = mpx_jax.set_loss_scale(state, mpx_jax.get_loss_scale(state).record_history(capacity=8))
    update = jax.jit(tx.update)
    micro = [1.0, 1.0, 1.0, np.inf, 1.0, 1.0]  # windows: finite, non-finite, finite
    for c in micro:
        _, state = update({"w": jnp.full(2, c, jnp.float32)}, state, params)
    assert mpx_jax.get_loss_scale(state).history() == mpx.ScalerHistory.reference(cfg, [True, False, True])


def test_a_saved_and_loaded_scale_keeps_recording() -> None:
    ls = mpx_jax.LossScale.create(mpx.ScalerConfig(growth_interval=1)).record_history().update(True)
    loaded = ls.load_state_dict({**ls.state_dict(), "scale": 8.0}).update(True)
    assert loaded.history().scale == [131072.0, 16.0]
    assert mpx_jax.LossScale.from_state_dict(ls.state_dict()).history_rows is None
