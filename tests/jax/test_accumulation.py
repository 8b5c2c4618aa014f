"""with_loss_scaling(tx, config, accumulate=k): mpx's one accumulation semantics (mpx.accumulation)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpx
from mpx_jax import get_loss_scale, with_loss_scaling

CFG = mpx.ScalerConfig(init_scale=2.0**10, growth_interval=2)
X = jnp.asarray(np.random.default_rng(0).standard_normal((8, 4)), jnp.float32)


def init_params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"w": jax.random.normal(k1, (4, 3)), "v": jax.random.normal(k2, (3,))}


def loss_fn(p, i, poison):
    x = jax.lax.dynamic_slice_in_dim(X, i % 4 * 2, 2)  # a different micro-batch per micro-step
    return jnp.mean((jnp.tanh(x @ p["w"]) @ p["v"]) ** 2) * poison


def bits(t):
    return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(t)]


def make_step(tx, traces):
    @jax.jit
    def step(params, state, i, poison):
        traces.append(1)
        ls = get_loss_scale(state)
        grads = jax.grad(lambda p: ls.scale(loss_fn(p, i, poison)))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


FLAGS = {  # micro-batch finite flags: 12 micro-batches, whole windows for k = 1, 2, 3, 4
    "mixed": [True, True, True, True, False, True, True, True, True, True, False, False],
    "first bad": [False] + [True] * 11,
}


def run(tx, flags, k):
    traces, params = [], init_params()
    state = tx.init(params)
    step = make_step(tx, traces)
    windows, seen = [], []
    for i, finite in enumerate(flags):
        if i % k == 0:
            before = (bits(params), bits(state.inner_state), float(get_loss_scale(state).loss_scale))
        seen.append(float(get_loss_scale(state).loss_scale))
        new_params, state = step(params, state, i, 1.0 if finite else float("inf"))
        if i % k < k - 1:  # inside the window: updates -0.0, nothing moves
            assert bits(new_params) == bits(params)
            assert bits(state.inner_state) == before[1]
        params = new_params
        if i % k == k - 1:
            applied = bits(params) != before[0]
            if not applied:  # skipped whole: parameters and inner state bit-identical to before the window
                assert bits(params) == before[0] and bits(state.inner_state) == before[1]
            assert k == 1 or int(state.micro_step) == 0
            assert all(not np.any(np.asarray(a)) for a in jax.tree_util.tree_leaves(state.accumulated))
            windows.append({"applied": applied, "scale": float(get_loss_scale(state).loss_scale)})
            assert seen[-k:] == [before[2]] * k  # the loss scale is constant inside the window
    return windows, params, state, len(traces)


@pytest.mark.parametrize("flags", list(FLAGS))
@pytest.mark.parametrize("k", [2, 3, 4])
def test_accumulate_follows_the_reference_trace(k, flags):
    tx = with_loss_scaling(optax.adam(1e-2), CFG, accumulate=k)
    windows, _, state, compiles = run(tx, FLAGS[flags], k)
    assert windows == mpx.accumulation_trace(CFG, FLAGS[flags], k)
    ls = get_loss_scale(state)
    assert int(ls.steps) == len(FLAGS[flags]) // k  # one transition per optimizer step
    assert compiles == 1  # no retrace per micro-step


def test_accumulate_1_is_the_plain_step():
    tx = with_loss_scaling(optax.adam(1e-2), CFG)
    windows, _, state, _ = run(tx, FLAGS["mixed"], 1)
    assert windows == mpx.accumulation_trace(CFG, FLAGS["mixed"], 1)
    assert state.accumulated is None and state.micro_step is None


def test_applied_window_is_the_inner_step_on_the_mean_gradient():
    k = 3
    tx = with_loss_scaling(optax.adam(1e-2), CFG, accumulate=k)
    _, params, _, _ = run(tx, [True] * 6, k)
    ref_p, adam = init_params(), optax.adam(1e-2)
    ref_s = adam.init(ref_p)
    for w in range(2):
        grads = [jax.grad(lambda p, i=i: loss_fn(p, i, 1.0))(ref_p) for i in range(w * k, w * k + k)]
        mean = jax.tree_util.tree_map(lambda *g: sum(g) / k, *grads)
        u, ref_s = adam.update(mean, ref_s, ref_p)
        ref_p = optax.apply_updates(ref_p, u)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(ref_p), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_float16_gradients_accumulate_in_float32():
    tx = with_loss_scaling(optax.sgd(1.0), mpx.ScalerConfig(kind="static", init_scale=2.0**12), accumulate=2)
    params = {"w": jnp.ones(2, jnp.float16)}
    state = tx.init(params)
    assert state.accumulated["w"].dtype == jnp.float32
    g = {"w": jnp.full(2, 60000.0, jnp.float16)}  # two of them overflow float16, not float32
    _, state = tx.update(g, state, params)
    updates, state = tx.update(g, state, params)
    assert updates["w"].dtype == jnp.float32  # unscaled gradients are float32, as with accumulate=1
    assert np.asarray(updates["w"]).tolist() == [-60000.0 / 2**12] * 2
    assert int(get_loss_scale(state).skipped_steps) == 0


def test_multisteps_outside_is_not_equivalent():
    # optax 0.2.8's MultiSteps resets its accumulator with (1 - emit) * acc: 0 * inf is NaN, so after one
    # non-finite window every later window is skipped and the scale backs off for good
    k, flags = 2, [True, True, True, False] + [True] * 6
    tx = optax.MultiSteps(with_loss_scaling(optax.sgd(0.1), CFG), k)
    params = init_params()
    state = tx.init(params)
    step = make_step(tx, [])
    out = []
    for i, finite in enumerate(flags):
        new, state = step(params, state, i, 1.0 if finite else float("inf"))
        if i % k == k - 1:
            out.append({"applied": bits(new) != bits(params), "scale": float(get_loss_scale(state).loss_scale)})
        params = new
    ref = mpx.accumulation_trace(CFG, flags, k)
    assert out[:2] == ref[:2]
    assert out[2:] == [{"applied": False, "scale": 2.0**10 / 2**i} for i in range(2, 5)] != ref[2:]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_accumulate_must_be_a_positive_int(bad):
    with pytest.raises(mpx.MPXError, match="accumulate: expected an int >= 1"):
        with_loss_scaling(optax.sgd(1.0), accumulate=bad)


def test_state_without_accumulator_is_refused():
    params = {"w": jnp.ones(2)}
    state = with_loss_scaling(optax.sgd(1.0)).init(params)
    with pytest.raises(ValueError, match="state: made without accumulation"):
        with_loss_scaling(optax.sgd(1.0), accumulate=2).update({"w": jnp.ones(2)}, state, params)


def test_stuck_detection_counts_windows():
    cfg = mpx.ScalerConfig(init_scale=4.0, min_scale=1.0, max_consecutive_skips=2, on_stuck="raise")
    tx = with_loss_scaling(optax.sgd(0.1), cfg, accumulate=2)
    params = {"w": jnp.ones(2)}
    state = tx.init(params)

    @jax.jit
    def step(p, s):
        scaled, g = jax.value_and_grad(lambda q: get_loss_scale(s).scale(jnp.sum(q["w"] * jnp.inf)))(p)
        u, s = tx.update(g, s, p, loss=scaled)
        return optax.apply_updates(p, u), s

    for _ in range(3):  # two windows minus one micro-step: one skipped window so far
        params, state = step(params, state)
    jax.block_until_ready(params)
    assert int(get_loss_scale(state).consecutive_nonfinite) == 1
    with pytest.raises(Exception, match="stuck: 2 steps in a row skipped"):
        jax.block_until_ready(step(params, state))
