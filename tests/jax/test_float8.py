"""mpx_jax.float8 against the core reference (mpx.float8): bytes, scales, state traces, the FP8 GEMM."""

import json
import math
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpx import float8 as core
from mpx.float8 import Float8Recipe
from mpx_jax import float8 as f8

F32_MAX = float(np.finfo(np.float32).max)

_quantize_jit = jax.jit(f8.quantize, static_argnums=2)


def _f32_bits(draw_bits):
    return np.array(draw_bits, dtype=np.uint32).view(np.float32)


finite_or_not = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    st.integers(0, 2**32 - 1).map(lambda b: float(np.uint32(b).view(np.float32))),
    st.floats(min_value=-(2.0**-123), max_value=2.0**-123, width=32),  # float32 subnormals and tiny normals
)
scales = st.one_of(
    st.floats(min_value=2.0**-126, max_value=F32_MAX, width=32),
    st.floats(min_value=2.0**-149, max_value=2.0**-126, width=32),  # subnormal scales
    st.sampled_from([1.0, 224.0, 448.0, F32_MAX, 2.0**-20]),
)


def _same_fp8(a, b, fmt):
    """Equal bytes, NaN compared as NaN (frameworks' NaN bytes differ)."""
    a = np.asarray(a).astype(core.FORMATS[fmt])
    b = np.asarray(b).astype(core.FORMATS[fmt])
    an, bn = np.isnan(a.astype(np.float32)), np.isnan(b.astype(np.float32))
    np.testing.assert_array_equal(an, bn)
    np.testing.assert_array_equal(a.view(np.uint8)[~an], b.view(np.uint8)[~bn])


@settings(max_examples=300, deadline=None)
@given(
    st.lists(finite_or_not, min_size=1, max_size=64),
    scales,
    st.sampled_from(["e4m3", "e5m2"]),
    st.floats(min_value=0.5, max_value=2.0**18, width=32),
)
def test_quantize_bytes_equal_the_reference(values, scale, fmt, spread):
    x = np.asarray(values, np.float32)
    # overflowing values: the same numbers spread past fp8_max
    x = np.concatenate([x, (x * np.float32(spread)).astype(np.float32)]) if np.all(np.isfinite(x)) else x
    # one length (zeros after): every example reuses one compiled quantize per format, jit and eager
    x = np.pad(x, (0, 128 - x.size))
    ref = core.quantize(x, scale, fmt)
    _same_fp8(_quantize_jit(x, np.float32(scale), fmt), ref, fmt)
    _same_fp8(f8.quantize(x, np.float32(scale), fmt), ref, fmt)  # eager
    assert _quantize_jit(x, np.float32(scale), fmt).dtype == f8.DTYPES[fmt]


def test_quantize_bytes_every_e4m3_neighbourhood():
    # every fp8 value, its midpoints to the next and values around them, at two scales
    for fmt in ("e4m3", "e5m2"):
        grid = np.arange(256, dtype=np.uint8).view(core.FORMATS[fmt]).astype(np.float32)
        grid = np.sort(grid[np.isfinite(grid)])
        mids = ((grid[1:].astype(np.float64) + grid[:-1]) / 2).astype(np.float32)
        x = np.concatenate([grid, mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf)])
        for scale in (1.0, 0.5, 2.0**-100, 1e-41):
            xs = (x.astype(np.float64) / scale).astype(np.float32)
            _same_fp8(_quantize_jit(xs, np.float32(scale), fmt), core.quantize(xs, scale, fmt), fmt)


def test_quantize_bfloat16_input_is_upcast_first():
    x = jnp.asarray([1.5, 300.0, -1e4], jnp.bfloat16)
    ref = core.quantize(np.asarray(x).astype(np.float32), 2.0, "e4m3")
    _same_fp8(f8.quantize(x, 2.0, "e4m3"), ref, "e4m3")


def test_quantize_refuses_an_unknown_format():
    with pytest.raises(core.Float8Error, match="fmt: 'e3m4' is not allowed; allowed: e4m3, e5m2"):
        f8.quantize(jnp.ones(2), 1.0, "e3m4")


# -- scales ---------------------------------------------------------------------------------------------


def test_mantissa_quotient_is_correctly_rounded_for_every_mantissa():
    # the one float32 division compute_scale relies on, exhaustively: fp8_max / m for every m in [1, 2)
    m = (np.arange(2**23, dtype=np.uint32) | np.uint32(127 << 23)).view(np.float32)
    for limit in (448.0, 57344.0):
        ref = (limit / m.astype(np.float64)).astype(np.float32)
        got = np.asarray(jax.jit(lambda v, lim=limit: jnp.float32(lim) / v)(m))
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))


recipes = st.builds(
    Float8Recipe,
    format=st.sampled_from(["hybrid", "e4m3"]),
    scaling=st.sampled_from(["delayed", "current"]),
    amax_history_len=st.integers(1, 12),
    amax_compute=st.sampled_from(["max", "most_recent"]),
    margin=st.one_of(st.integers(0, 4), st.integers(0, 300), st.just(2**31 - 1)),
    power_of_two=st.booleans(),
)
amax_values = st.one_of(
    st.floats(min_value=0.0, max_value=F32_MAX, width=32),
    st.floats(min_value=0.0, max_value=2.0**-123, width=32),
    st.sampled_from([0.0, -0.0, math.inf, math.nan, -1.0, 1e-12, 9.99999e-13, 1e-45, F32_MAX]),
    st.floats(width=32),
)


@settings(max_examples=60, deadline=None)  # each example compiles its recipe's function: about 0.4 s
@given(recipes, st.lists(amax_values, min_size=1, max_size=32), st.sampled_from(["e4m3", "e5m2"]))
def test_compute_scale_equals_the_reference(recipe, amaxes, fmt):
    a = np.asarray(amaxes, np.float32)
    prev = np.float32(3.5)
    got = np.asarray(jax.jit(lambda v: f8.compute_scale(recipe, v, fmt, prev))(a))
    ref = np.asarray([core.compute_scale(recipe, float(v), fmt, float(prev)) for v in a], np.float32)
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), (got, ref)


def test_compute_scale_at_the_floor_and_the_ceiling():
    # margins that put the exact scale around float32's smallest normal (the floor) and amaxes whose
    # quotient overflows float32 (the ceiling)
    rng = np.random.default_rng(0)
    mant = (rng.integers(0, 2**23, 1000).astype(np.uint32) | np.uint32(127 << 23)).view(np.float32)
    for fmt in ("e4m3", "e5m2"):
        for margin, shift in ((1, 100), (2, 100), (20, 100), (25, 100), (40, 90), (0, -120), (3, -140)):
            recipe = Float8Recipe(margin=margin)
            a = (mant * np.float32(2.0**shift)).astype(np.float32)
            got = np.asarray(f8.compute_scale(recipe, a, fmt))
            ref = np.asarray([core.compute_scale(recipe, float(v), fmt) for v in a], np.float32)
            assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), (fmt, margin)


# -- the state machine ------------------------------------------------------------------------------------

ROLES = {"x": "input", "w": "weight", "g": "grad"}


def _assert_state_equal(jstate, cstate):
    """The same tensors, roles and bits (a state of JAX arrays, or of host values, against the core's)."""
    got = jstate
    assert isinstance(got, core.Float8State) and set(got.tensors) == set(cstate.tensors)
    for name, ts in cstate.tensors.items():
        mine = got.tensors[name]
        assert mine.role == ts.role
        assert np.float32(mine.scale).view(np.uint32) == np.float32(ts.scale).view(np.uint32), name
        assert np.array_equal(
            np.asarray(mine.amax_history, np.float32).view(np.uint32),
            np.asarray(ts.amax_history, np.float32).view(np.uint32),
        ), name


step_amax = st.one_of(
    st.floats(min_value=0.0, max_value=2.0**13, width=32),
    st.sampled_from([0.0, math.inf, math.nan, 1e30, 1e-30, 3e38, 1e-44]),
)


@settings(max_examples=25, deadline=None)  # each example compiles its recipe's update
@given(
    recipes,
    st.lists(
        st.tuples(st.fixed_dictionaries({n: step_amax for n in ROLES}), st.booleans()),
        min_size=1,
        max_size=40,
    ),
)
def test_update_trace_equals_the_reference(recipe, steps):
    cstate = core.float8_init(recipe, ROLES)
    jstate = f8.float8_init(recipe, ROLES)
    update = jax.jit(lambda s, a, k: f8.float8_update(recipe, s, a, skipped=k))
    for amaxes, skipped in steps:
        cstate = core.float8_update(recipe, cstate, amaxes, skipped=skipped)
        jstate = update(jstate, {n: np.float32(v) for n, v in amaxes.items()}, np.bool_(skipped))
        _assert_state_equal(jstate, cstate)


def test_long_trace_with_spikes_zeros_infs_and_skips_compiles_once():
    rng = np.random.default_rng(1)
    n = 3000
    base = rng.lognormal(0.0, 1.0, size=(n, 3)).astype(np.float32)
    base[rng.random((n, 3)) < 0.01] *= np.float32(1e4)  # spikes
    base[rng.random((n, 3)) < 0.01] = 0.0
    base[rng.random((n, 3)) < 0.005] = np.inf
    base[rng.random((n, 3)) < 0.005] = np.nan
    skipped = rng.random(n) < 0.05
    for recipe in (
        Float8Recipe(amax_history_len=16),
        Float8Recipe(scaling="current"),
        Float8Recipe(amax_history_len=8, amax_compute="most_recent", margin=1, power_of_two=True),
    ):
        traces = []

        @jax.jit
        def run(state, amaxes, skips, recipe=recipe, traces=traces):
            def body(s, xs):
                a, k = xs
                s = f8.float8_update(recipe, s, {"x": a[0], "w": a[1], "g": a[2]}, skipped=k)
                return s, s.tensors["x"].scale

            traces.append(1)
            return jax.lax.scan(body, state, (amaxes, skips))

        jstate, jscales = run(f8.float8_init(recipe, ROLES), base, skipped)
        cstate = core.float8_init(recipe, ROLES)
        cscales = []
        for t in range(n):
            cstate = core.float8_update(
                recipe, cstate, dict(zip(ROLES, base[t].tolist(), strict=True)), skipped=bool(skipped[t])
            )
            cscales.append(cstate.tensors["x"].scale)
        assert np.array_equal(
            np.asarray(jscales).view(np.uint32), np.asarray(cscales, np.float32).view(np.uint32)
        )
        _assert_state_equal(jstate, cstate)
        assert len(traces) == 1


def test_update_refuses_unknown_tensor():
    r = Float8Recipe(amax_history_len=2)
    with pytest.raises(core.Float8Error, match="amaxes: unknown tensor 'y'; known: x"):
        f8.float8_update(r, f8.float8_init(r, {"x": "input"}), {"y": 1.0})


def test_state_is_a_pytree_jit_carries():
    r = Float8Recipe(amax_history_len=5)
    s = f8.float8_init(r, ROLES)
    leaves, treedef = jax.tree_util.tree_flatten(s)
    assert len(leaves) == 6 and all(leaf.dtype == jnp.float32 for leaf in leaves)
    assert jax.tree_util.tree_unflatten(treedef, leaves).tensors["g"].role == "grad"
    out = jax.jit(lambda s: s)(s)
    assert out.tensors["w"].amax_history.shape == (5,)


REPLICA_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from mpx import float8 as core
    from mpx_jax import float8 as f8
    assert jax.device_count() == 2, jax.devices()
    roles = {"x": "input", "w": "weight", "g": "grad"}
    r = core.Float8Recipe(amax_history_len=4)
    per = np.array([[1e-40, 7.0, np.nan, 2.0], [0.0, 2.0, 1.0, 3.0]], np.float32)  # a subnormal amax too
    roles = {**roles, "y": "input"}
    ref = core.float8_update(r, core.float8_init(r, roles), core.reduce_amaxes(
        [dict(zip(roles, row.tolist())) for row in per]))
    want = np.asarray([ref.tensors[n].scale for n in roles], np.float32)

    def step(a):
        red = f8.reduce_amaxes(dict(zip(roles, a[0])), "d")
        s = f8.float8_update(r, f8.float8_init(r, roles), red)
        return jnp.stack([s.tensors[n].scale for n in roles])[None]

    # the replicas' MAX is window_max's (NaN wins, the subnormal kept)
    reduced = jax.pmap(lambda a: f8.reduce_amaxes(a, "d"), axis_name="d")(per)
    folded = np.asarray(f8.window_max(per[0], per[1]))
    assert np.array_equal(np.asarray(reduced)[0].view(np.uint32)[[0, 1, 3]], folded.view(np.uint32)[[0, 1, 3]])
    assert np.isnan(np.asarray(reduced)[:, 2]).all() and np.isnan(folded[2])

    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    out = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(per)
    assert np.array_equal(np.asarray(out), np.stack([want, want])), (out, want)
    out = jax.pmap(lambda a: step(a[None])[0], axis_name="d")(per)
    assert np.array_equal(np.asarray(out), np.stack([want, want])), (out, want)
    print("OK", want.tolist())
    """
)


def test_replicas_reduce_amaxes_with_max_under_shard_map_and_pmap():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    # the timeout only catches a hang
    proc = subprocess.run(
        [sys.executable, "-c", REPLICA_SCRIPT], env=env, capture_output=True, text=True, timeout=1800
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout


# -- state dicts ------------------------------------------------------------------------------------------


def test_state_dict_round_trips_through_the_core_and_json():
    r = Float8Recipe(amax_history_len=3, margin=1)
    s = f8.float8_init(r, ROLES)
    for a in (1.0, 50.0, 0.25):
        s = f8.float8_update(r, s, {"x": a, "w": 2 * a, "g": 3 * a})
    d = core.state_dict(r, s)  # the core reads the JAX arrays
    assert d["format"] == "mpx.float8/1"
    recipe_c, state_c = core.load_state_dict(json.loads(json.dumps(d)))
    assert recipe_c == r
    _assert_state_equal(s, state_c)
    # the loaded host values step on with JAX's table, eagerly and under jit, as the core's do
    want = core.float8_update(r, state_c, {"x": 9.0})
    _assert_state_equal(f8.float8_update(r, state_c, {"x": 9.0}), want)
    _assert_state_equal(jax.jit(lambda st: f8.float8_update(r, st, {"x": 9.0}))(state_c), want)


def test_the_state_types_are_the_cores():
    assert f8.TensorScale is core.TensorScale and f8.Float8State is core.Float8State
    assert not hasattr(f8, "float8_state_dict") and not hasattr(f8, "load_float8_state_dict")


# -- the FP8 GEMM -----------------------------------------------------------------------------------------


def _bound(qa, qb, sa, sb):
    """|error| allowed against the reference: float32 rounding of K-term sums of exact products."""
    k = qa.shape[-1]
    absprod = np.abs(qa.astype(np.float32)) @ np.abs(qb.astype(np.float32))
    return k * 2.0**-23 * absprod * core.scale_inv(sa) * core.scale_inv(sb) * 1.01


@pytest.mark.parametrize(
    "recipe", [Float8Recipe(amax_history_len=4), Float8Recipe(scaling="current"), Float8Recipe(format="e4m3")]
)
def test_fp8_linear_forward_and_backward_match_the_reference(recipe):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(6, 32)).astype(np.float32) * 3
    w = rng.normal(size=(32, 16)).astype(np.float32) * 0.1
    g = rng.normal(size=(6, 16)).astype(np.float32) * 1e-3
    stored = {"input": np.float32(40.0), "weight": np.float32(900.0), "grad": np.float32(2.0**20)}
    if recipe.scaling == "current":
        sx = core.compute_scale(recipe, np.abs(x).max(), "e4m3")
        sw = core.compute_scale(recipe, np.abs(w).max(), "e4m3")
        sg = core.compute_scale(recipe, np.abs(g).max(), recipe.format_of("grad"))
    else:
        sx, sw, sg = (float(stored[k]) for k in ("input", "weight", "grad"))
    sinks = {k: jnp.float32(0.0) for k in core.ROLES}

    def f(x, w, sinks):
        return f8.fp8_linear(x, w, stored, sinks, recipe)

    y, vjp = jax.vjp(jax.jit(f), x, w, sinks)
    dx, dw, amaxes = vjp(jnp.asarray(g))
    fg = recipe.format_of("grad")
    assert y.dtype == jnp.float32
    ref_y = core.fp8_dot(x, w, sx, sw)
    qx, qw = core.quantize(x, sx, "e4m3"), core.quantize(w, sw, "e4m3")
    qg = core.quantize(g, sg, fg)
    assert np.all(np.abs(np.asarray(y) - ref_y) <= _bound(qx, qw, sx, sw))
    ref_dx = core.fp8_dot(g, w.T, sg, sw, fg, "e4m3")
    assert np.all(np.abs(np.asarray(dx) - ref_dx) <= _bound(qg, qw.T, sg, sw))
    ref_dw = core.fp8_dot(x.T, g, sx, sg, "e4m3", fg)
    assert np.all(np.abs(np.asarray(dw) - ref_dw) <= _bound(qx.T, qg, sx, sg))
    assert float(amaxes["input"]) == np.abs(x).max()
    assert float(amaxes["weight"]) == np.abs(w).max()
    assert float(amaxes["grad"]) == np.abs(g).max()
    # the GEMM really runs on float8 operands
    text = jax.jit(f).lower(x, w, sinks).as_text()
    assert "f8E4M3FN" in text


def test_fp8_linear_grad_is_e5m2_under_hybrid():
    recipe = Float8Recipe()
    stored = {k: jnp.float32(1.0) for k in core.ROLES}
    sinks = {k: jnp.float32(0.0) for k in core.ROLES}

    def loss(x, w):
        return jnp.sum(f8.fp8_linear(x, w, stored, sinks, recipe))

    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(jnp.ones((2, 4)), jnp.ones((4, 3))).as_text()
    assert "f8E5M2" in text and "f8E4M3FN" in text


def test_fp8_linear_refuses_missing_roles():
    with pytest.raises(core.Float8Error, match="scales: expected a mapping with exactly the keys"):
        f8.fp8_linear(jnp.ones((2, 2)), jnp.ones((2, 2)), {"input": 1.0}, {}, Float8Recipe())


def test_ml_dtypes_and_jax_agree_on_dtypes():
    assert np.dtype(f8.DTYPES["e4m3"]) == np.dtype(ml_dtypes.float8_e4m3fn)
    assert np.dtype(f8.DTYPES["e5m2"]) == np.dtype(ml_dtypes.float8_e5m2)


def test_fp8_linear_passes_an_overflow_on_to_the_loss_scaler():
    # the clip would turn an inf into +-fp8_max: the GEMM says NaN instead, and the amax is inf
    recipe = Float8Recipe(amax_history_len=2)
    stored = {k: jnp.float32(1.0) for k in core.ROLES}
    sinks = {k: jnp.float32(0.0) for k in core.ROLES}
    x, w = np.ones((2, 4), np.float32), np.ones((4, 3), np.float32)
    f = jax.jit(lambda x, w, s: f8.fp8_linear(x, w, stored, s, recipe))
    y, vjp = jax.vjp(f, x, w, sinks)
    assert np.all(np.isfinite(np.asarray(y)))
    g = np.ones((2, 3), np.float32)
    g[0, 0] = np.inf
    dx, dw, amaxes = vjp(jnp.asarray(g))
    assert np.all(np.isnan(np.asarray(dx))) and np.all(np.isnan(np.asarray(dw)))
    assert float(amaxes["grad"]) == np.inf
    x[1, 1] = -np.inf
    assert np.all(np.isnan(np.asarray(f(x, w, sinks))))


@pytest.mark.parametrize("recipe", [Float8Recipe(), Float8Recipe(format="e4m3", margin=1)])
def test_fp8_dot_general_batched_einsum_matches_the_reference(recipe):
    rng = np.random.default_rng(3)
    a = rng.normal(size=(3, 5, 16)).astype(np.float32)
    b = rng.normal(size=(3, 16, 7)).astype(np.float32) * 4
    g = rng.normal(size=(3, 5, 7)).astype(np.float32) * 1e-2
    dims = (((2,), (1,)), ((0,), (0,)))
    cur = Float8Recipe(**{**recipe.to_dict(), "scaling": "current"})
    sa = core.compute_scale(cur, np.abs(a).max(), "e4m3")
    sb = core.compute_scale(cur, np.abs(b).max(), "e4m3")
    fg = recipe.format_of("grad")
    sg = core.compute_scale(cur, np.abs(g).max(), fg)
    f = jax.jit(lambda a, b: f8.fp8_dot_general(a, b, dims, recipe))
    y, vjp = jax.vjp(f, a, b)
    da, db = vjp(jnp.asarray(g))
    qa, qb, qg = core.quantize(a, sa, "e4m3"), core.quantize(b, sb, "e4m3"), core.quantize(g, sg, fg)
    for i in range(3):
        ref = core.fp8_dot(a[i], b[i], sa, sb)
        assert np.all(np.abs(np.asarray(y[i]) - ref) <= _bound(qa[i], qb[i], sa, sb))
        ref_da = core.fp8_dot(g[i], b[i].T, sg, sb, fg, "e4m3")
        assert np.all(np.abs(np.asarray(da[i]) - ref_da) <= _bound(qg[i], qb[i].T, sg, sb))
        ref_db = core.fp8_dot(a[i].T, g[i], sa, sg, "e4m3", fg)
        assert np.all(np.abs(np.asarray(db[i]) - ref_db) <= _bound(qa[i].T, qg[i], sa, sg))
    assert "f8E4M3FN" in f.lower(a, b).as_text()
    # bfloat16 operands: the result keeps the input's dtype
    out = f8.fp8_dot_general(jnp.asarray(a, jnp.bfloat16), jnp.asarray(b, jnp.bfloat16), dims, recipe)
    assert out.dtype == jnp.bfloat16
