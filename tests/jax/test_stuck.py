"""Stuck detection in mpx_jax (LossScale.update and with_loss_scaling): after exactly N skips, raise or warn."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import mpx
import mpx_jax


def _setup(**changes):
    cfg = mpx.ScalerConfig(init_scale=4.0, min_scale=1.0, **changes)
    tx = mpx_jax.with_loss_scaling(optax.sgd(0.1), cfg)
    params = {"w": jnp.ones(2)}

    def loss_fn(p, kind):  # kind 0: finite; 1: finite loss, inf gradients (sqrt(w - w)); 2: inf loss
        return jax.lax.switch(kind, [
            lambda q: jnp.sum(q["w"]),
            lambda q: jnp.sum(jnp.sqrt(q["w"] - jax.lax.stop_gradient(q["w"]))),
            lambda q: jnp.sum(q["w"] * jnp.inf),
        ], p)  # fmt: skip

    @jax.jit
    def step(p, s, kind):
        ls = mpx_jax.get_loss_scale(s)
        scaled, g = jax.value_and_grad(lambda q: ls.scale(loss_fn(q, kind)))(p)
        u, s = tx.update(g, s, p, loss=scaled)
        return optax.apply_updates(p, u), s

    return step, params, tx.init(params)


def _run(step, p, s, kinds):
    for k in kinds:
        p, s = step(p, s, jnp.int32(k))
        jax.block_until_ready(s)
    jax.effects_barrier()
    return p, s


@pytest.mark.parametrize("n", [1, 3])
def test_jit_raises_at_n_not_before(n: int) -> None:
    step, p, s = _setup(max_consecutive_skips=n)
    p, s = _run(step, p, s, [1, 0][: 2 if n > 1 else 0] + [1] * (n - 1))
    assert int(mpx_jax.get_loss_scale(s).consecutive_nonfinite) == n - 1
    with pytest.raises(jax.errors.JaxRuntimeError, match="ScalerStuckError: loss scaler stuck"):
        _run(step, p, s, [1])


def test_messages_and_eager_raise() -> None:
    step, p, s = _setup(max_consecutive_skips=3, on_stuck="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(step, p, s, [1, 1, 1])
        _run(step, p, s, [1, 1, 2])
    texts = [str(c.message) for c in caught if issubclass(c.category, mpx.ScalerStuckWarning)]
    assert len(texts) == 2
    assert "loss is finite and the gradients overflow at the minimum scale (1)" in texts[0]
    assert "forward loss itself is non-finite" in texts[1]
    # the one host-side check (mpx.check_stuck) words it: the same text the core gives for that state
    cfg = mpx.ScalerConfig(init_scale=4.0, min_scale=1.0, max_consecutive_skips=3, on_stuck="warn")
    for text, loss_finite in zip(texts, (True, False), strict=True):
        with pytest.warns(mpx.ScalerStuckWarning) as core:
            mpx.check_stuck(cfg, 1.0, 3, loss_finite)
        assert text == str(core[0].message)
    ls = mpx_jax.LossScale.create(mpx.ScalerConfig(max_consecutive_skips=2))
    ls = ls.update(False)
    with pytest.raises(mpx.ScalerStuckError, match="not given to the scaler|pass the loss"):
        ls.update(False, loss_finite=None)  # eager: the ScalerStuckError itself


def test_warn_at_n_and_2n_params_untouched() -> None:
    step, p, s = _setup(max_consecutive_skips=2, on_stuck="warn")
    at = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(1, 6):
            before = len(caught)
            p, s = _run(step, p, s, [2])
            if len(caught) > before:
                at.append(i)
    assert at == [2, 4]
    assert p["w"].tolist() == [1.0, 1.0]


def test_off_adds_nothing_to_the_jaxpr() -> None:
    ls = mpx_jax.LossScale.create(mpx.ScalerConfig())
    on = mpx_jax.LossScale.create(mpx.ScalerConfig(max_consecutive_skips=2))
    off_text = str(jax.make_jaxpr(lambda s, f: s.update(f, loss_finite=f))(ls, True))
    on_text = str(jax.make_jaxpr(lambda s, f: s.update(f, loss_finite=f))(on, True))
    assert "debug_callback" not in off_text and "debug_callback" in on_text


def test_state_dict_round_trip_and_old_dicts() -> None:
    ls = mpx_jax.LossScale.create(mpx.ScalerConfig(max_consecutive_skips=4, on_stuck="warn"))
    sd = ls.state_dict()
    assert mpx_jax.LossScale.from_state_dict(sd).config == ls.config
    old = {
        **sd,
        "config": {k: v for k, v in sd["config"].items() if k not in ("max_consecutive_skips", "on_stuck")},
    }
    assert mpx_jax.LossScale.from_state_dict(old).config.max_consecutive_skips is None
