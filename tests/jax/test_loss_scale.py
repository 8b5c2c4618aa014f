import json
import pickle
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mpx
from mpx_jax import LossScale, all_finite, select_tree
from mpx_jax.loss_scale import INT32_MAX

F32_MAX = float(np.finfo(np.float32).max)


def f32_bits(x):
    return np.asarray(x, np.float32).view(np.int32)


# -- the float64 product rule without float64 --------------------------------------------
normal_f32 = st.integers(0x00800000, 0x7F7FFFFF).map(lambda b: float(np.int32(b).view(np.float32)))
factor = st.one_of(
    st.sampled_from([0.5, 2.0, 0.25, 3.0, 1.5, 0.999, 1.0001, 0.1, 0.9, 1.1, 0.8, 1.333333412806193]),
    st.floats(1.0, 2.0**32, exclude_min=True),
    st.floats(2.0**-32, 1.0, exclude_max=True),
)


def _one_step(a, f):
    """(LossScale's, mpx.scaler_update's) scale after one step of ``a`` by the factor ``f`` (grow or back off)."""
    grow = f > 1.0
    factors = {"growth_factor": f} if grow else {"backoff_factor": f}
    cfg = mpx.ScalerConfig(init_scale=a, growth_interval=1, min_scale=None, max_scale=None, **factors)
    want = mpx.scaler_update(cfg, mpx.scaler_init(cfg), grow).scale
    got = jax.jit(lambda ls, finite: ls.update(finite))(LossScale.create(cfg), jnp.asarray(grow))
    return int(f32_bits(got.loss_scale)), int(f32_bits(want))


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(a=normal_f32, b=factor)
def test_a_step_is_the_float64_product_rule_bit_for_bit(a, b):
    # item 9: float32(float64(scale) * float64(factor)), as torch's kernel, from int32 ops on device
    got, want = _one_step(a, b)
    assert got == want


def test_issue_examples():
    assert _one_step(3.0, 0.9) == (int(f32_bits(2.700000047683716)),) * 2
    # the float64 product 4 + 2**-22 is a float32 tie (rounded to even: 4.0); the exact one is above it
    assert _one_step(3.0, 1.333333412806193) == (int(f32_bits(4.0)),) * 2


# -- traces against mpx.scaler_update -------------------------------------------------------
positive = st.one_of(
    st.sampled_from([1.0, 2.0**16, 2.0**24, 0.5, 1e-3, 1.2e-38, 2.0**-126, F32_MAX, 3e38]),
    st.floats(2.0**-126, F32_MAX, allow_nan=False, allow_infinity=False),
)


@st.composite
def configs(draw):
    kind = draw(st.sampled_from(["dynamic", "dynamic", "static", "none"]))
    values = sorted(draw(st.lists(positive, min_size=3, max_size=3)))
    lo, init, hi = values
    min_scale = draw(st.sampled_from([lo, None]))
    max_scale = draw(st.sampled_from([hi, None]))
    kw = dict(
        kind=kind,
        init_scale=init,
        growth_factor=draw(st.one_of(st.sampled_from([2.0, 1.5, 3.0, 1.0001, 1.1, 1e9]), st.floats(1.0, 2.0**32))),
        backoff_factor=draw(st.one_of(st.sampled_from([0.5, 0.25, 0.9, 1e-3, 0.8]), st.floats(2.0**-32, 1.0))),
        growth_interval=draw(st.integers(1, 4)),
        min_scale=min_scale,
        max_scale=max_scale,
        hysteresis=draw(st.integers(1, 3)),
        skip_nonfinite=draw(st.sampled_from([None, True, False])),
    )
    try:
        return mpx.ScalerConfig(**kw)
    except mpx.ScalerConfigError:
        return mpx.ScalerConfig(kind=kind, growth_interval=kw["growth_interval"], hysteresis=kw["hysteresis"])


def device_trace(config, flags):
    @jax.jit
    def run(ls, flags):
        def step(ls, finite):
            ls = ls.update(finite)
            return ls, ls

        return jax.lax.scan(step, ls, flags)[1]

    out = run(LossScale.create(config), jnp.asarray(flags, bool))
    return jax.device_get(out)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), flags=st.lists(st.booleans(), min_size=1, max_size=40))
def test_trace_is_bit_identical_to_reference(config, flags):
    trace = device_trace(config, flags)
    state = mpx.scaler_init(config)
    for i, finite in enumerate(flags):
        state = mpx.scaler_update(config, state, finite)
        assert trace.loss_scale.dtype == np.float32
        assert int(f32_bits(trace.loss_scale[i])) == int(f32_bits(state.scale)), (i, config)
        assert int(trace.growth_tracker[i]) == state.growth_tracker
        assert int(trace.consecutive_nonfinite[i]) == state.consecutive_nonfinite
        assert int(trace.steps[i]) == state.steps
        assert int(trace.skipped_steps[i]) == state.skipped_steps


def test_scale_is_floored_at_the_smallest_normal_without_min_scale():
    # item 5: 166 non-finite steps took the scale to 0.0; it stops at 2**-126 and grows back
    config = mpx.ScalerConfig(min_scale=None, max_scale=None, growth_interval=3, backoff_factor=0.3)
    flags = [False] * 170 + [True] * 9 + [False] * 5
    trace = device_trace(config, flags)
    state = mpx.scaler_init(config)
    for i, finite in enumerate(flags):
        state = mpx.scaler_update(config, state, finite)
        assert int(f32_bits(trace.loss_scale[i])) == int(f32_bits(state.scale)), i
    assert float(trace.loss_scale[169]) == 2.0**-126 == state.scale
    final = LossScale.from_state_dict(json.loads(json.dumps(mpx.state_dict(config, state))))
    assert final.state == state


def test_eager_update_matches_and_accepts_python_and_array_flags():
    config = mpx.ScalerConfig(growth_interval=2, hysteresis=2)
    ls, state = LossScale.create(config), mpx.scaler_init(config)
    for finite in (True, jnp.asarray(True), np.bool_(False), False, True):
        ls = ls.update(finite)
        state = mpx.scaler_update(config, state, bool(finite))
    assert ls.state == state
    with pytest.raises(ValueError, match="scalar"):
        ls.update(jnp.array([True, False]))


# -- pytree behaviour ---------------------------------------------------------------
def test_flatten_unflatten_keeps_every_field_including_small_min_scale():
    config = mpx.ScalerConfig(init_scale=0.5, min_scale=0.125, max_scale=4.0, hysteresis=2, growth_interval=7)
    ls = LossScale.create(config).update(False).update(False)
    leaves, treedef = jax.tree_util.tree_flatten(ls)
    assert len(leaves) == 5
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert back.config == config and back.config.min_scale == 0.125
    assert back.state == ls.state
    # leaves only: every leaf is state, never config
    mapped = jax.tree_util.tree_map(lambda x: x, ls)
    assert mapped.config == config and mapped.state == ls.state
    assert sorted(str(x.dtype) for x in leaves) == ["float32", "int32", "int32", "int32", "int32"]
    # the floor holds after the round trip
    for _ in range(10):
        back = back.update(False)
    assert float(back.loss_scale) == 0.125


def test_jit_argument_and_result_and_pickle_round_trip():
    config = mpx.ScalerConfig(min_scale=2.0**-10, init_scale=1.0)
    ls = LossScale.create(config)
    out = jax.jit(lambda s: s.update(False))(ls)
    assert out.config == config and float(out.loss_scale) == 0.5
    again = pickle.loads(pickle.dumps(out))
    assert again.config == config and again.state == out.state


def test_checkpoint_of_leaves_round_trip(tmp_path):
    config = mpx.ScalerConfig(min_scale=0.25, init_scale=1.0)
    ls = LossScale.create(config).update(False)
    leaves, treedef = jax.tree_util.tree_flatten(ls)
    np.savez(tmp_path / "ckpt.npz", *[np.asarray(x) for x in leaves])
    data = np.load(tmp_path / "ckpt.npz")
    loaded = [jnp.asarray(data[f"arr_{i}"]) for i in range(len(leaves))]
    back = jax.tree_util.tree_unflatten(treedef, loaded)
    assert back.state == ls.state and back.config.min_scale == 0.25


def test_config_change_recompiles_scale_change_does_not():
    traces = []

    @jax.jit
    def f(ls):
        traces.append(1)
        return ls.update(True)

    ls = LossScale.create(mpx.ScalerConfig(growth_interval=1))
    for _ in range(5):
        ls = f(ls)
    assert len(traces) == 1 and float(ls.loss_scale) == 2.0**21
    f(LossScale.create(mpx.ScalerConfig(growth_interval=2)))
    assert len(traces) == 2


# -- state dicts ----------------------------------------------------------------------------
def test_state_dict_round_trip_and_neutral_format():
    config = mpx.ScalerConfig(min_scale=0.5, init_scale=8.0, growth_interval=3)
    ls = LossScale.create(config).update(True).update(False).update(True)
    d = json.loads(json.dumps(ls.state_dict()))
    assert d["format"] == "mpx.scaler/1" and d["scale"] == 4.0
    back = LossScale.from_state_dict(d)
    assert back.config == config and back.state == ls.state
    core = mpx.LossScaler.from_state_dict(d)
    assert core.state == ls.state
    assert LossScale.from_state_dict(core.state_dict()).state == core.state


def test_state_dict_errors():
    d = LossScale.create().state_dict()
    with pytest.raises(mpx.StateDictError):
        LossScale.from_state_dict({**d, "scale": -1.0})
    with pytest.raises(mpx.StateDictError):
        LossScale.from_state_dict({**d, "format": "jmp"})
    with pytest.raises(mpx.StateDictError, match=r"^steps: expected an int in \[0, 2\*\*31 - 1\]"):
        LossScale.from_state_dict({**d, "steps": INT32_MAX + 1})
    with pytest.raises(mpx.ScalerConfigError, match="^growth_interval: "):
        LossScale.create(mpx.ScalerConfig(growth_interval=2**31))
    # every config form mpx.as_scaler_config reads (#22); others raise its errors
    assert LossScale.create({"kind": "dynamic", "growth_interval": 5}).config.growth_interval == 5
    assert LossScale.create("mixed_float16").config == mpx.ScalerConfig.for_policy("mixed_float16")
    with pytest.raises(mpx.ScalerConfigError, match="config: expected an mpx.ScalerConfig"):
        LossScale.create(3)
    with pytest.raises(mpx.PolicyError, match="mixed_float17"):
        LossScale.create("mixed_float17")


# -- scale / unscale -------------------------------------------------------------------------
def test_scale_and_unscale_dtypes():
    ls = LossScale.create()
    assert ls.loss_scale.dtype == jnp.float32
    t = {"h": jnp.float16(2.0), "b": jnp.bfloat16(1.0), "f": jnp.float32(3.0), "i": jnp.int32(4)}
    scaled = ls.scale(t)
    assert scaled["h"].dtype == jnp.float32 and float(scaled["h"]) == 2.0 * 65536
    assert scaled["b"].dtype == jnp.float32 and scaled["f"].dtype == jnp.float32
    assert scaled["i"] is t["i"]
    grads = {"h": jnp.full(3, 65504, jnp.float16), "f": jnp.full(2, 2.0**-20, jnp.float32)}
    un = ls.unscale(grads)
    assert un["h"].dtype == jnp.float32 and float(un["h"][0]) == 65504 / 65536
    assert float(un["f"][0]) == 2.0**-36
    none = LossScale.create(mpx.ScalerConfig(kind="none"))
    assert none.unscale({"x": jnp.float16(1.5)})["x"].dtype == jnp.float32


def test_all_finite_and_select_tree():
    assert bool(all_finite({})) and bool(all_finite([jnp.arange(3)]))
    assert not bool(all_finite({"a": jnp.ones(2), "b": [jnp.array([jnp.nan])]}))
    assert not bool(all_finite(jnp.array([jnp.inf], jnp.bfloat16)))
    assert bool(jax.jit(all_finite)({"a": jnp.ones(2, jnp.float16)}))
    a, b = {"x": jnp.ones(2), "k": jnp.int32(1)}, {"x": jnp.zeros(2), "k": jnp.int32(2)}
    out = jax.jit(select_tree)(jnp.asarray(False), a, b)
    assert out["x"].tolist() == [0.0, 0.0] and int(out["k"]) == 2
    with pytest.raises(ValueError, match="structure"):
        select_tree(jnp.asarray(True), a, {"x": jnp.ones(2)})
    with pytest.raises(ValueError, match="leaves differ"):
        select_tree(jnp.asarray(True), {"x": jnp.ones(2)}, {"x": jnp.ones(2, jnp.bfloat16)})
    with pytest.raises(ValueError, match="boolean scalar"):
        select_tree(jnp.ones(2, bool), a, b)


# -- issue #13 -------------------------------------------------------------------------
def test_every_state_the_core_accepts_loads_and_saturates():
    # item 2: a long torch run (counters up to 2**31 - 1) resumes here; counters saturate as the core's
    m = INT32_MAX
    config = mpx.ScalerConfig(kind="static", init_scale=2.0)
    state = mpx.ScalerState(2.0, 0, m - 1, m - 1, m - 1)
    ls = LossScale.from_state_dict(mpx.state_dict(config, state))
    for _ in range(2):
        ls = jax.jit(lambda ls: ls.update(False))(ls)
        state = mpx.scaler_update(config, state, False)
        assert ls.state == state
    assert state.steps == m


_FIELDS = st.sampled_from(["scale", "growth_tracker", "consecutive_nonfinite", "steps", "skipped_steps"])
_VALUES = st.one_of(
    st.integers(-(2**70), 2**70),
    st.integers(0, 6),
    st.floats(allow_nan=True),
    st.sampled_from([10**400, 2.0**-126, 0.5, 8.0, 2**31 - 1, 2**31]),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(_FIELDS, _VALUES), min_size=1, max_size=3))
def test_state_dict_mutations_load_exactly_when_the_core_accepts(mutations):
    src = mpx.LossScaler(mpx.ScalerConfig(init_scale=8.0, growth_interval=4, min_scale=0.5))
    for finite in (True, False, True):
        src.update(finite)
    data = src.state_dict()
    for key, value in mutations:
        data[key] = value
    try:
        expected = mpx.load_state_dict(data)
    except mpx.StateDictError:
        with pytest.raises(mpx.StateDictError):  # and nothing but a StateDictError
            LossScale.from_state_dict(data)
        return
    ls = LossScale.from_state_dict(data)
    assert (ls.config, ls.state) == expected


@pytest.mark.parametrize(
    "config",
    [
        mpx.ScalerConfig(growth_factor=2.0**32, backoff_factor=2.0**-32, growth_interval=1, min_scale=None,
                         max_scale=None),
        mpx.ScalerConfig(growth_interval=2**31 - 1, hysteresis=2**31 - 1),
        mpx.ScalerConfig(init_scale=F32_MAX, max_scale=None, growth_interval=1),
    ],
)  # fmt: skip
def test_extreme_accepted_configs_run(config):
    # item 4: what the core accepts runs (it raised OverflowError before)
    flags = [True, False, True, True, False, False]
    trace = device_trace(config, flags)
    state = mpx.scaler_init(config)
    for i, finite in enumerate(flags):
        state = mpx.scaler_update(config, state, finite)
        assert int(f32_bits(trace.loss_scale[i])) == int(f32_bits(state.scale)), i


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.floats(2.0**-126, F32_MAX).map(lambda x: float(np.float32(x))).filter(lambda x: x >= 2.0**-126),
    st.one_of(st.floats(1.0, 2.0**32, exclude_min=True), st.sampled_from([1.1, 1.333333412806193])),
    st.one_of(st.floats(2.0**-32, 1.0, exclude_max=True), st.sampled_from([0.9, 0.8])),
    st.lists(st.booleans(), min_size=1, max_size=30),
)
def test_random_factor_histories_match_the_reference(init, gf, bf, flags):
    # item 9: torch's product rule on device, for random (scale, factor) histories
    config = mpx.ScalerConfig(init_scale=init, growth_factor=gf, backoff_factor=bf, growth_interval=1,
                              min_scale=None, max_scale=None)  # fmt: skip
    trace = device_trace(config, flags)
    state = mpx.scaler_init(config)
    for i, finite in enumerate(flags):
        state = mpx.scaler_update(config, state, finite)
        assert int(f32_bits(trace.loss_scale[i])) == int(f32_bits(state.scale)), (i, config)


def test_the_floor_raise_under_jit_names_the_step():
    """on_floor="raise" inside a jitted update: the callback raises in the step (no delay, unlike XLA on
    TensorFlow), re-raised by JAX as a JaxRuntimeError holding the core's message for step 3."""
    cfg = mpx.ScalerConfig(**{**mpx.SCALER_PRESETS["deepspeed_fp16"].to_dict(), "init_scale": 2.0, "hysteresis": 1})
    step = jax.jit(lambda s, f: s.update(f))
    ls = step(step(LossScale.create(cfg), jnp.bool_(True)), jnp.bool_(False))
    assert ls.get_scale() == 1.0
    with pytest.raises(Exception, match=re.escape("step 3 overflowed with the scale at min_scale (1)")):
        jax.block_until_ready(step(ls, jnp.bool_(False)).loss_scale)
