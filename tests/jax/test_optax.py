import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpx
from mpx_jax import LossScale, LossScalingState, get_loss_scale, with_loss_scaling


def init_params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"w": jax.random.normal(k1, (4, 3)), "b": jnp.zeros(3), "v": jax.random.normal(k2, (3,))}


X = jnp.asarray(np.random.default_rng(0).standard_normal((8, 4)), jnp.float32)


def loss_fn(p, x, poison, dtype=jnp.float32):
    h = jnp.tanh(x.astype(dtype) @ p["w"].astype(dtype) + p["b"].astype(dtype))
    out = (h @ p["v"].astype(dtype)).astype(jnp.float32)
    return jnp.mean(out**2) * poison


def make_step(tx, counter=None, dtype=jnp.float32):
    @jax.jit
    def step(params, opt_state, poison):
        if counter is not None:
            counter.append(1)
        ls = get_loss_scale(opt_state)
        grads = jax.grad(lambda p: ls.scale(loss_fn(p, X, poison, dtype)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def tree_norm(t):
    return jnp.sqrt(sum(jnp.sum(x.astype(jnp.float32) ** 2) for x in jax.tree_util.tree_leaves(t)))


def close(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-6, atol=1e-9)


def bits_equal(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype
        and np.array_equal(
            np.atleast_1d(np.asarray(x)).view(np.uint8), np.atleast_1d(np.asarray(y)).view(np.uint8)
        )
        for x, y in zip(la, lb, strict=True)
    )


@pytest.mark.parametrize("poison", [float("inf"), float("nan")])
def test_skipped_step_leaves_params_and_moments_bit_identical(poison):
    tx = with_loss_scaling(optax.adamw(1e-2), mpx.ScalerConfig(growth_interval=2))
    params = init_params()
    state = tx.init(params)
    assert isinstance(state, LossScalingState)
    step = make_step(tx)
    params, state = step(params, state, 1.0)
    before_p, before_inner = params, state.inner_state
    params2, state2 = step(params, state, poison)
    assert bits_equal(params2, before_p)
    assert bits_equal(state2.inner_state, before_inner)  # mu, nu and count untouched
    ls = get_loss_scale(state2)
    assert float(ls.loss_scale) == 2.0**15 and int(ls.skipped_steps) == 1 and int(ls.steps) == 2
    params3, state3 = step(params2, state2, 1.0)
    assert not bits_equal(params3, params2)
    assert int(state3.inner_state[0].count) == 2


@pytest.mark.parametrize("accumulate", [1, 2])
def test_skipped_step_keeps_a_negative_zero_parameter_bit_identical(accumulate):
    # the skipped update is -0.0: p + (-0.0) is p for every p, where +0.0 would turn -0.0 into +0.0;
    # with accumulate=2 the first micro-step's update is -0.0 as well
    tx = with_loss_scaling(optax.adamw(1e-2), accumulate=accumulate)
    params = {**init_params(), "b": jnp.array([-0.0, 0.0, -1.5], jnp.float32)}
    params["w"] = params["w"].at[0, 0].set(-0.0)
    state = tx.init(params)
    step = make_step(tx)
    for poison in (float("inf"), float("nan")):
        new_params, new_state = step(params, state, poison)
        assert bits_equal(new_params, params)
        assert np.signbit(np.asarray(new_params["b"][0])) and np.signbit(np.asarray(new_params["w"][0, 0]))
        assert bits_equal(new_state.inner_state, state.inner_state)


def test_nothing_leaks_from_a_skipped_step():
    # the inner update runs on the infs/NaNs of a skipped step; its NaN updates and moments must not
    # reach later steps: with a static scale the run with poisoned steps equals the run without, bit for bit
    tx = with_loss_scaling(
        optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2)),
        mpx.ScalerConfig(kind="static", init_scale=2.0**8),
    )
    step = make_step(tx)
    p_a, s_a = init_params(), tx.init(init_params())
    for poison in (1.0, float("inf"), 1.0, float("nan"), float("-inf"), 1.0):
        p_a, s_a = step(p_a, s_a, jnp.float32(poison))
        assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree_util.tree_leaves((p_a, s_a.inner_state)))
    p_b, s_b = init_params(), tx.init(init_params())
    for _ in range(3):
        p_b, s_b = step(p_b, s_b, jnp.float32(1.0))
    assert bits_equal(p_a, p_b) and bits_equal(s_a.inner_state, s_b.inner_state)
    assert int(get_loss_scale(s_a).skipped_steps) == 3


def test_float16_overflow_is_skipped_and_scale_backs_off_until_finite():
    # a float16 model: 2**24 makes its backward pass overflow; the scaler finds a working scale
    tx = with_loss_scaling(optax.sgd(0.1), mpx.ScalerConfig(init_scale=2.0**24))
    params = init_params()
    state = tx.init(params)
    step = make_step(tx, dtype=jnp.float16)
    first = params
    while int(get_loss_scale(state).skipped_steps) == int(get_loss_scale(state).steps) < 30:
        params, state = step(params, state, 1.0)
        if int(get_loss_scale(state).skipped_steps) == int(get_loss_scale(state).steps):
            assert bits_equal(params, first)
    ls = get_loss_scale(state)
    assert 0 < int(ls.skipped_steps) < int(ls.steps)
    assert float(ls.loss_scale) == 2.0 ** (24 - int(ls.skipped_steps))
    assert not bits_equal(params, first)


def test_finite_steps_equal_unscaled_training():
    base = optax.adam(1e-2)
    tx = with_loss_scaling(base, mpx.ScalerConfig(init_scale=2.0**10, growth_interval=1))
    p_ref, s_ref = init_params(), base.init(init_params())
    p, s = init_params(), tx.init(init_params())
    step = make_step(tx)
    for _ in range(4):
        g = jax.grad(lambda q: loss_fn(q, X, 1.0))(p_ref)
        u, s_ref = base.update(g, s_ref, p_ref)
        p_ref = optax.apply_updates(p_ref, u)
        p, s = step(p, s, 1.0)
    # power-of-two scales: scaling is exact; only XLA's fusion may reorder sums
    close(p, p_ref)
    assert float(get_loss_scale(s).loss_scale) == 2.0**14


def test_one_compile_across_scale_changes_and_no_host_transfer():
    counter = []
    tx = with_loss_scaling(optax.adamw(1e-3), mpx.ScalerConfig(growth_interval=1))
    params = init_params()
    state = tx.init(params)
    step = make_step(tx, counter)
    poisons = [jnp.float32(p) for p in (1.0, 1.0, np.inf, 1.0, np.nan, np.nan, 1.0)]
    params, state = step(params, state, poisons[0])  # compile
    scales = []
    with jax.transfer_guard("disallow"):
        for poison in poisons[1:]:
            params, state = step(params, state, poison)
            scales.append(get_loss_scale(state).loss_scale)
    assert len(counter) == 1
    assert [float(s) for s in scales] == [2.0**18, 2.0**17, 2.0**18, 2.0**17, 2.0**16, 2.0**17]
    assert int(get_loss_scale(state).skipped_steps) == 3


def test_chain_clips_unscaled_gradients():
    clip = 0.05
    inner = optax.chain(optax.clip_by_global_norm(clip), optax.sgd(1.0))
    tx = with_loss_scaling(inner, mpx.ScalerConfig(init_scale=2.0**12))
    params = init_params()
    state = tx.init(params)
    grads = jax.grad(lambda p: loss_fn(p, X, 1.0))(params)
    scaled = jax.tree_util.tree_map(lambda g: g * 2.0**12, grads)
    updates, _ = tx.update(scaled, state, params)
    norm = tree_norm(updates)
    assert float(tree_norm(grads)) > clip
    np.testing.assert_allclose(float(norm), clip, rtol=1e-5)
    ref, _ = inner.update(grads, inner.init(params), params)
    close(updates, ref)


def test_multisteps_as_the_inner_optimizer_is_refused():
    # it would check and move the scale per micro-batch, not per optimizer step (mpx.accumulation)
    with pytest.raises(mpx.MPXError, match=r"tx: .*MultiSteps.*accumulate=k"):
        with_loss_scaling(optax.MultiSteps(optax.adam(1e-2), 2))


def test_get_loss_scale_errors():
    with pytest.raises(ValueError, match="no LossScale"):
        get_loss_scale(optax.sgd(1.0).init(init_params()))
    two = (LossScale.create(), LossScale.create())
    with pytest.raises(ValueError, match="2 LossScale"):
        get_loss_scale(two)
    tx = with_loss_scaling(optax.sgd(1.0))
    with pytest.raises(ValueError, match="LossScalingState"):
        tx.update({"w": jnp.ones(1)}, optax.sgd(1.0).init({"w": jnp.ones(1)}))


def test_no_skip_config_applies_every_update():
    tx = with_loss_scaling(optax.sgd(1.0), mpx.ScalerConfig(kind="none"))
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    updates, state = tx.update({"w": jnp.array([jnp.inf, 1.0])}, state, params)
    assert not bool(jnp.isfinite(updates["w"][0])) and float(updates["w"][1]) == -1.0
    assert int(get_loss_scale(state).skipped_steps) == 0
    assert float(get_loss_scale(state).loss_scale) == 1.0


def test_extra_args_are_forwarded():
    inner = optax.contrib.reduce_on_plateau() if hasattr(optax, "contrib") else None
    if inner is None:
        pytest.skip("optax.contrib is missing")
    tx = with_loss_scaling(optax.chain(optax.sgd(1.0), inner))
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    updates, state = tx.update({"w": jnp.ones(2)}, state, params, value=jnp.float32(1.0))
    assert updates["w"].shape == (2,)


PMAP_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np, optax, mpx
    from mpx_jax import with_loss_scaling, get_loss_scale
    assert jax.local_device_count() == 2, jax.devices()
    for axis_name in ("dp", None):  # None: the pmap axis is found where update is traced
        tx = with_loss_scaling(optax.sgd(1.0), mpx.ScalerConfig(growth_interval=1), axis_name=axis_name)
        params = {"w": jnp.ones(2)}
        state = tx.init(params)
        rep = lambda t: jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), t)
        # replica 1's gradient is infinite, replica 0's is finite
        grads = {"w": jnp.array([[1.0, 1.0], [jnp.inf, 1.0]]) * 2.0**16}
        upd, st = jax.pmap(tx.update, axis_name="dp")(grads, rep(state), rep(params))
        scales = [float(s) for s in get_loss_scale(st).loss_scale]
        zeros = [bool(jnp.all(u == 0)) for u in upd["w"]]
        print(axis_name, scales, zeros)
        assert scales == [2.0**15, 2.0**15] and zeros == [True, True], (scales, zeros)
    print("OK")
    """
)


def test_axis_name_makes_replicas_agree():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    # the timeout only catches a hang (a few seconds on a quiet machine), generous for a loaded one
    proc = subprocess.run(
        [sys.executable, "-c", PMAP_SCRIPT], env=env, capture_output=True, text=True, timeout=1800
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout


def _twin():
    # both state leaves come back as one value: each must still keep its own old value on a skip
    def init(params):
        return jnp.zeros([], jnp.int32), jnp.ones([], jnp.int32)

    def update(updates, state, params=None):
        n = state[0] + state[1]
        return jax.tree_util.tree_map(lambda u: u * n.astype(u.dtype), updates), (n, n)

    return optax.GradientTransformation(init, update)


def _jitted(tx):
    # an inner update that is itself a jit: its state is computed inside one call
    return optax.GradientTransformation(tx.init, jax.jit(tx.update))


INNER = {
    "adamw": lambda: optax.adamw(1e-2),
    "clip+adamw": lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2)),
    "lion": lambda: optax.lion(1e-3),
    "nesterov": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
    # MultiSteps' own transformation (a lax.cond and a counter in its state), reached past the MPXError
    "multisteps": lambda: optax.MultiSteps(optax.adam(1e-2), 2).gradient_transformation(),
    "jitted": lambda: _jitted(optax.adamw(1e-2)),
    "twin": _twin,
}


def _grads(params, poison=1.0):
    return jax.grad(lambda p: loss_fn(p, X, poison))(params)


@pytest.mark.parametrize("name", list(INNER))
def test_finite_steps_equal_the_inner_update(name):
    # the state is selected where it is computed and the updates read the selected values: on a
    # finite step those are the inner update's own values.  Compiled, the two programs agree to
    # rounding only (XLA fuses them differently, and contracts multiply-adds differently); the
    # integer state (step counts) is exact
    inner = INNER[name]()
    tx = with_loss_scaling(inner, mpx.ScalerConfig(kind="static", init_scale=2.0**8))
    ref_update, update = jax.jit(inner.update), jax.jit(tx.update)
    params = init_params()
    s_ref, s = inner.init(params), tx.init(params)
    for _ in range(3):
        g = _grads(params)
        u_ref, s_ref = ref_update(g, s_ref, params)
        u, s = update(jax.tree_util.tree_map(lambda x: x * 2.0**8, g), s, params)
        close(u, u_ref)
        close(s.inner_state, s_ref)
        ints = [(a, b) for a, b in zip(*map(jax.tree.leaves, (s.inner_state, s_ref)), strict=True)
                if not jnp.issubdtype(a.dtype, jnp.floating)]  # fmt: skip
        assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in ints)
        params = optax.apply_updates(params, u)


@pytest.mark.parametrize("name", list(INNER))
def test_skipped_steps_keep_every_inner_state(name):
    tx = with_loss_scaling(INNER[name](), mpx.ScalerConfig(growth_interval=3))
    step = make_step(tx)
    params = init_params()
    state = tx.init(params)
    params, state = step(params, state, 1.0)
    for poison in (float("inf"), float("nan"), float("-inf")):
        new_params, new_state = step(params, state, poison)
        assert bits_equal(new_params, params)
        assert bits_equal(new_state.inner_state, state.inner_state)
        state = new_state
        updates, _ = jax.jit(tx.update)(_grads(params, poison), state, params)
        assert all(
            np.all(np.asarray(u) == 0) and np.all(np.signbit(np.asarray(u))) for u in jax.tree.leaves(updates)
        )
    assert int(get_loss_scale(state).skipped_steps) == 3


def test_inner_update_closing_over_traced_values():
    # an optimizer built inside the jitted step, its learning rate a traced argument
    @jax.jit
    def step(params, inner_state, loss_scale, lr, poison):
        tx = with_loss_scaling(optax.adam(lr))
        state = LossScalingState(inner_state, loss_scale)
        g = jax.grad(lambda p: loss_scale.scale(loss_fn(p, X, poison)))(params)
        u, state = tx.update(g, state, params)
        return optax.apply_updates(params, u), state

    params = init_params()
    state = with_loss_scaling(optax.adam(1e-2)).init(params)
    p1, s1 = step(params, state.inner_state, state.loss_scale, jnp.float32(1e-2), 1.0)
    ref_u, ref_s = optax.adam(1e-2).update(_grads(params), state.inner_state, params)
    close(p1, optax.apply_updates(params, ref_u))
    close(s1.inner_state, ref_s)
    p2, s2 = step(p1, s1.inner_state, s1.loss_scale, jnp.float32(1e-2), float("inf"))
    assert bits_equal(p2, p1) and bits_equal(s2.inner_state, s1.inner_state)


@pytest.mark.parametrize(
    "config, skipped",
    [
        (mpx.ScalerConfig(kind="static", init_scale=0.5, min_scale=None), True),  # 3e38 / 0.5 overflows
        (mpx.ScalerConfig(init_scale=0.5, min_scale=0.25), True),
        (mpx.ScalerConfig(kind="static", init_scale=1.0), False),  # a scale >= 1 cannot overflow it
        (mpx.ScalerConfig(), False),
    ],
)
def test_a_gradient_that_overflows_when_unscaled_is_skipped(config, skipped):
    # with a scale >= 1 the scaled gradients are tested as they come (unscaling cannot overflow them);
    # a scale that can drop below 1 has the unscaled ones tested
    tx = with_loss_scaling(optax.sgd(1e-30), config)
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    updates, state = jax.jit(tx.update)({"w": jnp.array([3e38, 1.0], jnp.float32)}, state, params)
    assert int(get_loss_scale(state).skipped_steps) == int(skipped)
    assert bool(jnp.all(updates["w"] == 0)) == skipped
