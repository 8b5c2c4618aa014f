"""The FP8 reference (mpx.float8): quantization bytes, every scaling rule, the skip rule, state dicts."""

import json
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mpx
from mpx.float8 import (
    CURRENT_AMAX_FLOOR,
    Float8Error,
    Float8Recipe,
    compute_scale,
    float8_init,
    float8_update,
    fp8_dot,
    fp8_max,
    load_state_dict,
    quantize,
    reduce_amaxes,
    scale_inv,
    state_dict,
)

F32_MAX = float(np.finfo(np.float32).max)


def test_formats_and_roles():
    assert (fp8_max("e4m3"), fp8_max("e5m2")) == (448.0, 57344.0)
    hybrid, e4m3 = Float8Recipe(), Float8Recipe(format="e4m3")
    assert [hybrid.format_of(r) for r in ("input", "weight", "grad")] == ["e4m3", "e4m3", "e5m2"]
    assert [e4m3.format_of(r) for r in ("input", "weight", "grad")] == ["e4m3"] * 3
    with pytest.raises(Float8Error, match="role: 'bias' is not allowed; allowed: input, weight, grad"):
        hybrid.format_of("bias")


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"format": "e5m2"}, "format: 'e5m2' is not allowed; allowed: hybrid, e4m3"),
        ({"scaling": "dynamic"}, "scaling: 'dynamic' is not allowed; allowed: delayed, current"),
        ({"amax_compute": "mean"}, "amax_compute: 'mean' is not allowed"),
        ({"amax_history_len": 0}, r"amax_history_len: expected an int in \[1, 2\*\*31 - 1\], got 0"),
        ({"amax_history_len": 16.0}, "amax_history_len: expected an int"),
        ({"margin": -1}, r"margin: expected an int in \[0, 2\*\*31 - 1\]"),
        ({"margin": True}, "margin: expected an int"),
        ({"power_of_two": 1}, "power_of_two: expected a bool"),
    ],
)
def test_recipe_refuses_bad_fields(changes, match):
    with pytest.raises(Float8Error, match=match):
        Float8Recipe(**changes)
    assert issubclass(Float8Error, mpx.MPXError)


def test_recipe_dict_round_trip_and_unknown_key():
    r = Float8Recipe(scaling="current", margin=2, power_of_two=True)
    assert Float8Recipe.from_dict(json.loads(json.dumps(r.to_dict()))) == r
    with pytest.raises(Float8Error, match="recipe: unknown key 'histroy'"):
        Float8Recipe.from_dict({"histroy": 3})


def _direct(x, scale, fmt):
    """The recipe written out with numpy only, independently of quantize's code path."""
    dtype = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}[fmt]
    limit = float(ml_dtypes.finfo(dtype).max)
    out = []
    for v in np.asarray(x, np.float32).ravel():
        with np.errstate(over="ignore", invalid="ignore"):
            p = np.float32(v) * np.float32(scale)
        if not np.isnan(p):
            p = np.float32(min(max(float(p), -limit), limit))
        out.append(np.array(p, np.float32).astype(dtype))
    return np.array(out, dtype=dtype)


def _same_bytes_nan_as_nan(a, b):
    fa, fb = a.astype(np.float32), b.astype(np.float32)
    both_nan = np.isnan(fa) & np.isnan(fb)
    return bool(np.all(both_nan | (a.view(np.uint8) == b.view(np.uint8))))


floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
scales = st.floats(min_value=2.0**-20, max_value=2.0**20, width=32)


@settings(max_examples=300, deadline=None)
@given(st.lists(floats32, min_size=1, max_size=40), scales, st.sampled_from(["e4m3", "e5m2"]))
def test_quantize_matches_the_written_recipe_byte_for_byte(xs, scale, fmt):
    got = quantize(xs, scale, fmt)
    assert got.dtype == {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}[fmt]
    assert _same_bytes_nan_as_nan(got, _direct(xs, scale, fmt))


def test_quantize_clips_overflow_keeps_nan_and_rounds_subnormals():
    q = quantize([1e9, -1e9, np.inf, -np.inf, np.nan, 2.0**-9, 2.0**-10], 1.0, "e4m3").astype(np.float32)
    assert q[:4].tolist() == [448.0, -448.0, 448.0, -448.0]
    assert math.isnan(q[4])
    assert q[5] == 2.0**-9  # e4m3fn's smallest subnormal
    assert q[6] == 0.0  # half of it rounds to even (zero)
    assert quantize([1e9], 1.0, "e5m2").astype(np.float32)[0] == 57344.0


@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_compute_scale_rules(scaling):
    r = Float8Recipe(scaling=scaling)
    assert compute_scale(r, 2.0, "e4m3") == 224.0
    assert compute_scale(Float8Recipe(scaling=scaling, margin=3), 2.0, "e4m3") == 28.0
    assert (
        compute_scale(Float8Recipe(scaling=scaling, power_of_two=True), 3.0, "e4m3") == 128.0
    )  # 149.3 -> 128
    if scaling == "delayed":
        assert compute_scale(r, 1e-40, "e5m2") == F32_MAX  # 57344 / 1e-40 overflows float32: the ceiling
        assert compute_scale(r, 0.0, "e4m3", previous=8.0) == 8.0  # zero keeps the previous scale
        assert compute_scale(r, math.inf, "e4m3", previous=8.0) == 8.0
        assert compute_scale(r, math.nan, "e4m3", previous=8.0) == 8.0
    else:
        assert compute_scale(r, 0.0, "e4m3") == float(np.float32(448.0 / CURRENT_AMAX_FLOOR))
        assert compute_scale(r, 1e-40, "e5m2") == float(np.float32(57344.0 / CURRENT_AMAX_FLOOR))  # the floor
        assert compute_scale(r, math.inf, "e4m3", previous=8.0) == 1.0
        assert compute_scale(r, math.nan, "e4m3", previous=8.0) == 1.0


def test_current_scale_is_torchaos_float64_rule():
    for amax in (0.3, 1.7, 1e-5, 123.456):
        a32 = float(np.float32(amax))
        expected = float(np.float32(448.0 / max(a32, 1e-12)))
        assert compute_scale(Float8Recipe(scaling="current"), a32, "e4m3") == expected


def test_delayed_lag_window_and_most_recent():
    r = Float8Recipe(amax_history_len=3)
    s = float8_init(r, {"x": "input", "g": "grad"})
    assert s.tensors["x"].scale == 1.0 and s.tensors["x"].amax_history == (0.0, 0.0, 0.0)
    scales = []
    for amax in (4.0, 1.0, 2.0, 0.5, 0.25):
        scales.append(s.tensors["x"].scale)  # what this step quantizes with: amaxes of earlier steps only
        s = float8_update(r, s, {"x": amax})
    assert scales == [1.0, 112.0, 112.0, 112.0, 224.0]  # max over the last 3: 4, 4, 4, 2
    assert s.tensors["x"].amax_history == (0.25, 0.5, 2.0)
    assert s.tensors["g"] == float8_init(r, {"g": "grad"}).tensors["g"]  # not in amaxes: unchanged
    m = Float8Recipe(amax_history_len=3, amax_compute="most_recent")
    sm = float8_update(m, float8_update(m, float8_init(m, {"x": "input"}), {"x": 4.0}), {"x": 1.0})
    assert sm.tensors["x"].scale == 448.0


def test_nonfinite_amax_is_not_recorded_and_does_not_freeze_the_window():
    r = Float8Recipe(amax_history_len=4)
    s = float8_update(r, float8_init(r, {"x": "weight"}), {"x": 2.0})
    after_inf = float8_update(r, s, {"x": math.inf})
    assert after_inf == s  # nothing recorded, the scale stays
    assert float8_update(r, after_inf, {"x": 1.0}).tensors["x"].scale == 224.0  # max(1, 2): not frozen by inf


def test_a_skipped_step_commits_nothing():
    r = Float8Recipe(amax_history_len=4)
    s = float8_update(r, float8_init(r, {"x": "input"}), {"x": 3.0})
    assert float8_update(r, s, {"x": 100.0}, skipped=True) is s


def test_unknown_tensor_is_refused():
    r = Float8Recipe()
    with pytest.raises(Float8Error, match="amaxes: unknown tensor 'y'; known: x"):
        float8_update(r, float8_init(r, {"x": "input"}), {"y": 1.0})


def test_replicas_reduce_amaxes_with_max():
    assert reduce_amaxes([{"x": 1.0, "y": 5.0}, {"x": 3.0, "y": 2.0}]) == {"x": 3.0, "y": 5.0}
    assert math.isnan(reduce_amaxes([{"x": 1.0}, {"x": math.nan}, {"x": 2.0}])["x"])


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_fp8_dot_is_the_quantized_product_within_float32_rounding(m, k, n, seed):
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=(m, k)).astype(np.float32), rng.normal(size=(k, n)).astype(np.float32)
    sa, sb = 448.0 / float(np.abs(a).max()), 448.0 / float(np.abs(b).max())
    got = fp8_dot(a, b, sa, sb)
    qa = quantize(a, sa, "e4m3").astype(np.float64) / sa
    qb = quantize(b, sb, "e4m3").astype(np.float64) / sb
    exact = qa @ qb
    bound = 4 * k * np.finfo(np.float32).eps * (np.abs(qa) @ np.abs(qb)) + 1e-30
    assert got.dtype == np.float32 and np.all(np.abs(got - exact) <= bound)
    assert scale_inv(sa) == float(np.float32(1) / np.float32(sa))


def test_state_dict_round_trip_through_json():
    r = Float8Recipe(amax_history_len=2, margin=1)
    s = float8_update(
        r, float8_init(r, {"fc.input": "input", "fc.grad": "grad"}), {"fc.input": 3.5, "fc.grad": 0.1}
    )
    d = state_dict(r, s)
    assert d["format"] == "mpx.float8/1"
    assert load_state_dict(json.loads(json.dumps(d))) == (r, s)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d.update(format="mpx.scaler/1"), "format: expected 'mpx.float8/1'"),
        (lambda d: d["recipe"].update(scaling="x"), "recipe: scaling: 'x' is not allowed"),
        (
            lambda d: d["tensors"]["x"].update(scale=-2.0),
            r"tensors\['x'\].scale: expected a positive finite float32",
        ),
        (
            lambda d: d["tensors"]["x"].update(scale=0.1),
            r"tensors\['x'\].scale: expected a positive finite float32",
        ),
        (lambda d: d["tensors"]["x"].update(role="bias"), r"tensors\['x'\].role: 'bias' is not allowed"),
        (lambda d: d["tensors"]["x"]["amax_history"].pop(), r"amax_history: expected a list of 2 amaxes"),
        (lambda d: d["tensors"]["x"]["amax_history"].__setitem__(0, math.inf), r"amax_history\[0\]"),
        (lambda d: d["tensors"]["x"].update(extra=1), "expected exactly the keys role, scale, amax_history"),
        (lambda d: d.update(more=1), "unknown key 'more'"),
    ],
)
def test_state_dict_refuses_bad_fields(mutate, match):
    r = Float8Recipe(amax_history_len=2)
    d = state_dict(r, float8_update(r, float8_init(r, {"x": "input"}), {"x": 2.0}))
    mutate(d)
    with pytest.raises(mpx.StateDictError, match=match):
        load_state_dict(d)


@pytest.mark.parametrize("margin", [0, 1, 30, 1023, 1024, 5000, 2**31 - 1])
def test_margin_divides_exactly_and_never_overflows(margin):
    r = Float8Recipe(margin=margin)
    got = compute_scale(r, 3.0, "e4m3")
    exact = (448.0 / 3.0) / 2.0**margin if margin < 1024 else 0.0  # 2.0**1024 overflows a Python float
    # an underflow: the smallest normal
    expected = float(np.float32(exact)) or float(np.finfo(np.float32).tiny)
    assert got == expected


def test_a_subnormal_scale_is_floored_at_the_smallest_normal():
    tiny = float(np.finfo(np.float32).tiny)
    r = Float8Recipe(margin=150)
    assert compute_scale(r, 0.25, "e4m3") == tiny  # 1792 * 2**-150 is a float32 subnormal: 1/it overflows
    assert compute_scale(Float8Recipe(margin=150, power_of_two=True), 0.25, "e4m3") == tiny
    assert math.isfinite(scale_inv(compute_scale(r, 0.25, "e4m3")))
    assert compute_scale(Float8Recipe(margin=120), 0.25, "e4m3") == float(np.float32(1792.0 * 2.0**-120))
