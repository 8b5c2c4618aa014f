"""mpx_jax.optim.policy_optimizer: the core's reference trace (the one torch's PolicyOptimizer gives), eagerly and
under jit; inside with_loss_scaling a skipped step leaves everything bit-identical; bytes per parameter."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optim_parity
import pytest
from hypothesis import given, settings

import mpx
import mpx_jax
from mpx_jax.optim import PolicyOptimizerState, policy_optimizer


def _bits(x):
    return np.asarray(jnp.asarray(x, jnp.float32)).view(np.int32)


def _run_trace(case, step_fn=None):
    tx = policy_optimizer(
        optax.sgd(case["lr"], momentum=case.get("momentum") or None),
        optim_parity.policy_of(case),
        seed=case["seed"],
    )
    params = {"a": jnp.asarray(case["w0"][0], jnp.bfloat16), "b": jnp.asarray(case["w0"][1], jnp.bfloat16)}
    state = tx.init(params)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step_fn = step if step_fn is None else step_fn(step)
    out = []
    for g in case["grads"]:
        grads = {"a": jnp.asarray(g[0], jnp.bfloat16), "b": jnp.asarray(g[1], jnp.bfloat16)}
        params, state = step_fn(params, state, grads)
        assert params["a"].dtype == jnp.bfloat16
        comp = state.kahan_comp
        out.append((params, comp))
    return out


def _check(case, got):
    for step, ((params, comp), (want_w, want_c)) in enumerate(
        zip(got, optim_parity.reference_trace(case), strict=True)
    ):
        for i, key in enumerate("ab"):
            assert np.array_equal(_bits(params[key]), want_w[i].view(np.int32)), (step, key)
            if case["update"] == "kahan":
                assert np.array_equal(_bits(comp[key]), want_c[i].view(np.int32)), (step, key)


@settings(max_examples=12, deadline=None)
@given(optim_parity.traces())
def test_sgd_trace_is_the_core_reference(case):
    _check(case, _run_trace(case))


@settings(max_examples=4, deadline=None)
@given(optim_parity.traces())
def test_sgd_trace_under_jit_is_the_core_reference(case):
    _check(case, _run_trace(case, jax.jit))


@settings(max_examples=8, deadline=None)
@given(optim_parity.momentum_traces())
def test_momentum_trace_with_stored_state_is_the_core_reference(case):
    """SGD momentum 0.5, the trace stored in float32, bfloat16 or int8 blocks: the bits torch and Keras give."""
    _check(case, _run_trace(case))


@settings(max_examples=3, deadline=None)
@given(optim_parity.momentum_traces())
def test_momentum_trace_under_jit_is_the_core_reference(case):
    _check(case, _run_trace(case, jax.jit))


def _sgd(case, seed=None):
    tx = policy_optimizer(
        optax.sgd(case["lr"], momentum=case["momentum"]),
        optim_parity.policy_of(case),
        seed=case["seed"] if seed is None else seed,
    )

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return tx, step


def _pair(x):
    return {"a": jnp.asarray(x[0], jnp.bfloat16), "b": jnp.asarray(x[1], jnp.bfloat16)}


@settings(max_examples=6, deadline=None)
@given(optim_parity.momentum_traces())
def test_neutral_checkpoint_is_the_reference_and_resumes_from_it(case):
    """After k steps the mpx.optim/1 dict equals the numpy reference's (the one torch and Keras save too); a state
    loaded from the reference's dict continues the reference trace bit for bit."""
    k = (len(case["grads"]) + 1) // 2
    tx, step = _sgd(case)
    params = _pair(case["w0"])
    state = tx.init(params)
    for g in case["grads"][:k]:
        params, state = step(params, state, _pair(g))
    saved = optim_parity.reference_checkpoint(case, k)
    policy = optim_parity.policy_of(case)
    assert optim_parity.equal_checkpoints(
        mpx_jax.optim.neutral_state_dict(state, params, policy, seed=case["seed"]), saved
    )
    trace = optim_parity.reference_trace(case)
    params = _pair(trace[k - 1][0])
    state = mpx_jax.optim.load_neutral_state_dict(tx.init(params), params, saved, policy, seed=case["seed"])
    for t in range(k, len(trace)):
        params, state = step(params, state, _pair(case["grads"][t]))
        for i, key in enumerate("ab"):
            assert np.array_equal(_bits(params[key]), trace[t][0][i].view(np.int32)), (t, key)
            if case["update"] == "kahan":
                assert np.array_equal(_bits(state.kahan_comp[key]), trace[t][1][i].view(np.int32)), (t, key)


@pytest.mark.parametrize(
    "policy", ["bf16_kahan,opt_state=int8:32", "bf16_sr,opt_state=bf16", "mixed_bfloat16_8bit_adam"]
)
def test_neutral_checkpoint_of_adamw_round_trips_and_resumes(policy):
    tx = policy_optimizer(optax.adamw(1e-2), policy, seed=9)
    dtype = jnp.float32 if policy.startswith("mixed") else jnp.bfloat16
    key = jax.random.PRNGKey(0)
    params = {"w": jax.random.normal(key, (4, 40)).astype(dtype), "b": jnp.zeros(40, dtype)}
    grad = jax.tree_util.tree_map(lambda p: (p * 0.5 + 0.25).astype(dtype), params)

    @jax.jit
    def step(params, state):
        updates, state = tx.update(grad, state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    for _ in range(2):
        params, state = step(params, state)
    saved = mpx_jax.optim.neutral_state_dict(state, params, policy, seed=9)
    resumed = mpx_jax.optim.load_neutral_state_dict(tx.init(params), params, saved, policy, seed=9)
    assert optim_parity.equal_checkpoints(
        mpx_jax.optim.neutral_state_dict(resumed, params, policy, seed=9), saved
    )
    a, state = step(params, state)
    b, resumed = step(params, resumed)
    assert _tree_bits(a) == _tree_bits(b) and _tree_bits(state) == _tree_bits(resumed)
    with pytest.raises(mpx.StateDictError, match="seed: the checkpoint's is 9"):
        mpx_jax.optim.load_neutral_state_dict(tx.init(params), params, saved, policy, seed=0)
    with pytest.raises(mpx.StateDictError, match="policy"):
        mpx_jax.optim.load_neutral_state_dict(tx.init(params), params, saved, "bf16_sr", seed=9)


def _tree_bits(tree):
    return [
        np.asarray(x).tobytes() + str(np.asarray(x).dtype).encode() for x in jax.tree_util.tree_leaves(tree)
    ]


@pytest.mark.parametrize(
    "policy", ["bf16_kahan", "bf16_sr", "bfloat16,master=float32,opt_state=bf16", "bf16_sr,opt_state=int8:32"]
)
def test_a_skipped_step_under_with_loss_scaling_leaves_everything_bit_identical(policy):
    tx = mpx_jax.with_loss_scaling(
        policy_optimizer(optax.adamw(1e-2), policy, seed=4), mpx.ScalerConfig(init_scale=2.0**8)
    )
    key = jax.random.PRNGKey(0)
    params = {"w": jax.random.normal(key, (4, 8)).astype(jnp.bfloat16), "b": jnp.zeros(8, jnp.bfloat16)}
    state = tx.init(params)

    @jax.jit
    def step(params, state, scale_by):
        grads = jax.tree_util.tree_map(
            lambda p: (jnp.cos(p.astype(jnp.float32)) * scale_by).astype(p.dtype), params
        )
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(2):
        params, state = step(params, state, 256.0)
    inner = state.inner_state
    assert isinstance(inner, PolicyOptimizerState) and int(inner.step) == 2
    before = _tree_bits((params, inner))
    params, state = step(params, state, jnp.inf)
    assert int(state.inner_state.step) == 2
    assert _tree_bits((params, state.inner_state)) == before
    params, state = step(params, state, 256.0)  # and the next finite step moves on
    assert int(state.inner_state.step) == 3 and _tree_bits((params, state.inner_state)) != before


# bytes per parameter of Adam (weights + gradients + compensation or master + moments), from the arrays
BYTES = {"mixed_bfloat16": 16, "bf16_kahan": 14, "bf16_sr": 12, "bf16_kahan,opt_state=bf16": 10,
         "bf16_sr,opt_state=bf16": 8, "bfloat16,master=float32": 16,
         "mixed_bfloat16_8bit_adam": 10.03125, "bf16_kahan,opt_state=int8": 8.03125}  # fmt: skip


@pytest.mark.parametrize(("policy", "expected"), BYTES.items())
def test_bytes_per_parameter_from_the_state_arrays(policy, expected):
    dtype = jnp.dtype(mpx.get_policy(policy).param_dtype)
    params = {"w": jnp.ones((16, 32), dtype)}  # 512: two whole blocks of 256
    tx = policy_optimizer(optax.adam(1e-3), policy)
    state = tx.init(params)
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    _, state = tx.update(grads, state, params)
    n = sum(p.size for p in jax.tree_util.tree_leaves(params))
    arrays = jax.tree_util.tree_leaves((params, grads, state.inner_state, state.kahan_comp, state.master))
    total = sum(a.nbytes for a in arrays if a.ndim)  # the scalars (Adam's count, the step) are per tensor
    assert total / n == expected


def test_errors_name_the_key():
    tx = policy_optimizer(optax.sgd(0.1), mpx.Policy("bfloat16", update="stochastic"))
    with pytest.raises(mpx.PolicyError, match="^update: stochastic writes bfloat16 master weights"):
        tx.init({"w": jnp.ones(2)})
    state = tx.init({"w": jnp.ones(2, jnp.bfloat16)})
    with pytest.raises(mpx.PolicyError, match="^params: policy_optimizer needs the parameters"):
        tx.update({"w": jnp.ones(2, jnp.bfloat16)}, state)
    with pytest.raises(mpx.UnsupportedTypeError, match="^tx: expected an optax GradientTransformation"):
        policy_optimizer(lambda g: g, "bf16_sr")


def test_int8_state_is_the_core_quantization_of_the_float32_moments():
    """One Adam step: the stored codes and absmaxes are the numpy kernel's of the moments optax.adam computes in
    float32, and the next step starts from their dequantized values."""
    from mpx.kernels import NUMPY_OPS
    from mpx.kernels import blockwise as kb

    params = {"w": jax.random.normal(jax.random.PRNGKey(0), (300,))}
    grads = {"w": jax.random.normal(jax.random.PRNGKey(1), (300,))}
    tx = policy_optimizer(optax.adam(1e-2), "mixed_bfloat16_8bit_adam")
    ref = optax.adam(1e-2)
    state, ref_state = tx.init(params), ref.init(params)
    u, state = tx.update(grads, state, params)
    ru, ref_state = ref.update(grads, ref_state, params)
    assert np.array_equal(np.asarray(u["w"]), np.asarray(ru["w"]))
    adam, ref_adam = state.inner_state[0], ref_state[0]
    moments = {}
    for key in ("mu", "nu"):
        stored = getattr(adam, key)["w"]
        q, absmax = kb.quantize(NUMPY_OPS, np.asarray(getattr(ref_adam, key)["w"]), 256)
        assert stored.q.dtype == jnp.int8 and stored.q.shape == (2, 256) and stored.shape == (300,)
        assert np.array_equal(np.asarray(stored.q), q)
        assert np.array_equal(np.asarray(stored.absmax).view(np.int32), absmax.view(np.int32))
        moments[key] = {"w": jnp.asarray(kb.dequantize(NUMPY_OPS, q, absmax, 300))}
    ref_state = (ref_adam._replace(**moments), *ref_state[1:])
    u, state = tx.update(grads, state, params)
    ru, ref_state = ref.update(grads, ref_state, params)
    assert np.array_equal(np.asarray(u["w"]), np.asarray(ru["w"]))
