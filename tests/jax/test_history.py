"""mpx_jax.HistoryRecorder equals the core's reference trace; its callback."""

from __future__ import annotations

import jax
import jax.numpy as jnp
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
)
def test_loss_scale_history_equals_reference(flags, interval, hysteresis) -> None:
    cfg = mpx.ScalerConfig(init_scale=8.0, growth_interval=interval, hysteresis=hysteresis, max_scale=64.0)
    ls, rec = mpx_jax.LossScale.create(cfg), mpx_jax.HistoryRecorder()
    update = jax.jit(lambda s, f: s.update(f))
    for f in flags:
        ls = update(ls, jnp.asarray(f))
        rec.record(ls)
    assert rec.history() == mpx.ScalerHistory.reference(cfg, flags)


def test_optax_donated_with_callback() -> None:
    cfg = mpx.ScalerConfig(init_scale=4.0, growth_interval=2)
    tx = mpx_jax.with_loss_scaling(optax.adam(1e-2), cfg)
    params = {"w": jnp.ones(3)}
    state = tx.init(params)

    def step(p, s, c):
        ls = mpx_jax.get_loss_scale(s)
        g = jax.grad(lambda q: ls.scale(jnp.sum(q["w"] * c)))(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(step, donate_argnums=(0, 1))
    chunks = []
    rec = mpx_jax.HistoryRecorder(chunks.append, every=3)
    flags = [True, True, False, True, True, True, False]
    for f in flags:
        params, state = step(params, state, jnp.float32(1.0 if f else jnp.inf))
        rec.record(state)
    ref = mpx.ScalerHistory.reference(cfg, flags)
    assert rec.history() == ref
    assert [c.steps for c in chunks] == [[1, 2, 3], [4, 5, 6]]
    assert chunks[0].extend(chunks[1]).scale == ref.scale[:6]


def test_recorder_errors() -> None:
    with pytest.raises(mpx.MPXError, match="nothing recorded"):
        mpx_jax.HistoryRecorder().history()
    with pytest.raises(mpx.MPXError, match="every"):
        mpx_jax.HistoryRecorder(every=0)
    rec = mpx_jax.HistoryRecorder()
    rec.record(mpx_jax.LossScale.create(mpx.ScalerConfig()))
    with pytest.raises(mpx.MPXError, match="another config"):
        rec.record(mpx_jax.LossScale.create(mpx.ScalerConfig(growth_interval=3)))
