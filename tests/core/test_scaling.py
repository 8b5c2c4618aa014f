import dataclasses
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mpx
from mpx import LossScaler, PolicyError, ScalerConfig, ScalerConfigError, ScalerState, StateDictError

T, F = True, False


def trace(config, flags):
    state = mpx.scaler_init(config)
    out = []
    for finite in flags:
        state = mpx.scaler_update(config, state, finite)
        out.append(state)
    return out


def scales(config, flags):
    return [s.scale for s in trace(config, flags)]


def test_defaults():
    c = ScalerConfig()
    assert (c.kind, c.init_scale, c.growth_factor, c.backoff_factor, c.growth_interval) == (
        "dynamic", 65536.0, 2.0, 0.5, 2000,
    )  # fmt: skip
    assert (c.min_scale, c.max_scale, c.hysteresis, c.skip_nonfinite) == (1.0, 2.0**24, 1, True)
    assert ScalerConfig(kind="static").skip_nonfinite is True
    assert ScalerConfig(kind="none").skip_nonfinite is False
    assert mpx.scaler_init(c) == ScalerState(65536.0, 0, 0, 0, 0)


@pytest.mark.parametrize(
    "spec,kind",
    [("mixed_float16", "dynamic"), ("float16", "dynamic"), ("mixed_bfloat16", "none"), ("float32", "none"), ("c=bf16", "none")],
)  # fmt: skip
def test_for_policy(spec, kind):
    assert ScalerConfig.for_policy(spec).kind == kind
    assert ScalerConfig.for_policy(spec, growth_interval=5).growth_interval == 5


def test_grows_on_the_nth_finite_step():
    c = ScalerConfig(init_scale=8.0, growth_interval=3)
    states = trace(c, [T, T, T, F, T, T, T])
    assert [s.scale for s in states] == [8, 8, 16, 8, 8, 8, 16]
    assert [s.growth_tracker for s in states] == [1, 2, 0, 0, 1, 2, 0]
    assert [s.skipped_steps for s in states] == [0, 0, 0, 1, 1, 1, 1]
    assert [s.steps for s in states] == [1, 2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize(
    "hysteresis,flags,expected,consecutive",
    [
        (1, [F, F, T, F], [32, 16, 16, 8], [1, 2, 0, 1]),
        (2, [F, F, F, T, F, T, F, F], [64, 32, 16, 16, 16, 16, 16, 8], [1, 2, 3, 0, 1, 0, 1, 2]),
        (3, [F, F, F, F, T, F, F, F], [64, 64, 32, 16, 16, 16, 16, 8], [1, 2, 3, 4, 0, 1, 2, 3]),
    ],
)
def test_hysteresis(hysteresis, flags, expected, consecutive):
    c = ScalerConfig(init_scale=64.0, growth_interval=100, hysteresis=hysteresis)
    states = trace(c, flags)
    assert [s.scale for s in states] == expected
    assert [s.consecutive_nonfinite for s in states] == consecutive
    assert states[-1].skipped_steps == flags.count(F)


def test_floor_and_no_floor():
    assert scales(ScalerConfig(init_scale=2.0), [F, F, F]) == [1.0, 1.0, 1.0]
    assert scales(ScalerConfig(init_scale=2.0, min_scale=None), [F, F, F]) == [1.0, 0.5, 0.25]
    assert scales(ScalerConfig(init_scale=0.5, min_scale=0.125), [F, F, F]) == [0.25, 0.125, 0.125]


def test_ceiling_and_float32_overflow():
    c = ScalerConfig(init_scale=2.0**23, growth_interval=1)
    assert scales(c, [T, T, T]) == [2.0**24] * 3
    c = ScalerConfig(init_scale=2.0**126, growth_interval=1, max_scale=None)
    assert scales(c, [T, T, T]) == [2.0**127] * 3  # 2**128 is inf in float32: keep the old scale
    c = ScalerConfig(init_scale=3.0, growth_interval=1, max_scale=5.0)
    assert scales(c, [T, T]) == [5.0, 5.0]


def test_static_and_none():
    static = trace(ScalerConfig(kind="static", init_scale=128.0, growth_interval=1), [T, F, T, F, F])
    assert [s.scale for s in static] == [128.0] * 5
    assert [s.growth_tracker for s in static] == [0] * 5
    assert static[-1].skipped_steps == 3 and static[-1].consecutive_nonfinite == 2
    none = trace(ScalerConfig(kind="none"), [T, F, F])
    assert [s.scale for s in none] == [1.0] * 3 and none[-1].skipped_steps == 0
    skipping = trace(ScalerConfig(kind="none", skip_nonfinite=True), [T, F, F])
    assert skipping[-1].skipped_steps == 2


def test_dynamic_without_skipping_still_backs_off():
    states = trace(ScalerConfig(init_scale=8.0, skip_nonfinite=False), [F, F])
    assert [s.scale for s in states] == [4.0, 2.0] and states[-1].skipped_steps == 0


def test_products_follow_torch_float64_rule():
    # init 1 + 2**-23; times 1.5 is 1.5 + 1.5 ulp(1.5): a tie, rounded to even, 1.5 + 2 ulp.
    c = ScalerConfig(init_scale=1.0 + 2.0**-23, growth_factor=1.5, growth_interval=1)
    assert scales(c, [T]) == [1.5 + 2.0**-22]
    # The factor acts as its float64 value (issue #13 item 9: torch gives 2.700000047683716).
    c = ScalerConfig(init_scale=3.0, backoff_factor=0.9, min_scale=None)
    assert scales(c, [F]) == [2.700000047683716]
    assert float(np.float32(3.0 * float(np.float32(0.9)))) == 2.6999998092651367  # the old rule
    # Double rounding, as float64 then float32: 3 * f is exactly 4 + 2**-22 + 2**-53 (just above a
    # float32 tie, so one rounding gives 4 + 2**-21), but the float64 product is the tie, which
    # rounds to even: 4.0.
    f = 1.333333412806193
    c = ScalerConfig(init_scale=3.0, growth_factor=f, growth_interval=1, max_scale=None)
    assert scales(c, [T]) == [4.0]
    # Every scale is a float32 value.
    c = ScalerConfig(init_scale=1.0, growth_factor=1.5, growth_interval=1, max_scale=None)
    for s in scales(c, [T] * 60):
        assert float(np.float32(s)) == s


def test_init_scale_is_rounded_to_float32():
    assert mpx.scaler_init(ScalerConfig(init_scale=0.1, min_scale=None)).scale == float(np.float32(0.1))


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"kind": "adaptive"}, "kind"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"growth_factor": 0.5}, "growth_factor"),
        ({"growth_factor": 3.5e38}, "growth_factor"),  # issue #13 item 4
        ({"growth_factor": 2.0**32 + 2**11}, "growth_factor"),
        ({"backoff_factor": 2.0**-33}, "backoff_factor"),
        ({"growth_interval": 2**70}, "growth_interval"),
        ({"growth_interval": 2**31}, "growth_interval"),
        ({"hysteresis": 2**31}, "hysteresis"),
        ({"init_scale": 10**400}, "init_scale"),  # issue #13 item 3
        ({"init_scale": 10**5000}, "init_scale"),  # its repr raises ValueError
        ({"max_scale": 10**400}, "max_scale"),
        ({"min_scale": -(10**400)}, "min_scale"),
        ({"growth_factor": 10**400}, "growth_factor"),
        ({"backoff_factor": np.array([0.5])}, "backoff_factor"),
        ({"min_scale": 2.0**-127, "init_scale": 1.0}, "min_scale"),  # below the smallest normal
        ({"init_scale": 2.0**-130, "min_scale": None}, "init_scale"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"backoff_factor": -0.5}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"growth_interval": 2.0}, "growth_interval"),
        ({"growth_interval": True}, "growth_interval"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"min_scale": 4.0, "max_scale": 2.0, "init_scale": 3.0}, "min_scale"),
        ({"init_scale": 0.5}, "init_scale"),
        ({"init_scale": 2.0**25}, "init_scale"),
        ({"init_scale": math.inf}, "init_scale"),
        ({"init_scale": math.nan}, "init_scale"),
        ({"init_scale": 0.0, "min_scale": None}, "init_scale"),
        ({"init_scale": "65536"}, "init_scale"),
        ({"max_scale": math.inf}, "max_scale"),
        ({"min_scale": -1.0}, "min_scale"),
        ({"min_scale": 0.0}, "min_scale"),
        ({"skip_nonfinite": "yes"}, "skip_nonfinite"),
        ({"init_scale": 1e39, "max_scale": None}, "init_scale"),
    ],
)
def test_invalid_configs(kwargs, field):
    with pytest.raises(ScalerConfigError, match=f"^{field}: "):
        ScalerConfig(**kwargs)


def test_finite_must_be_a_bool():
    c = ScalerConfig()
    with pytest.raises(mpx.MPXError, match="finite: expected a bool"):
        mpx.scaler_update(c, mpx.scaler_init(c), 1)
    assert mpx.scaler_update(c, mpx.scaler_init(c), np.bool_(False)).skipped_steps == 1


def test_config_round_trip():
    c = ScalerConfig(kind="dynamic", init_scale=4.0, min_scale=None, hysteresis=2)
    assert ScalerConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    with pytest.raises(ScalerConfigError, match="unknown key 'scale'"):
        ScalerConfig.from_dict({**c.to_dict(), "scale": 1.0})


# -- LossScaler and state dicts ------------------------------------------------------


def test_loss_scaler():
    s = LossScaler(ScalerConfig(init_scale=4.0, growth_interval=2))
    assert s.get_scale() == 4.0 and s.config.growth_interval == 2
    assert s.update(True) is False
    assert s.update(True) is False and s.get_scale() == 8.0
    assert s.update(False) is True and s.get_scale() == 4.0
    assert s.state == ScalerState(4.0, 0, 1, 3, 1)
    assert LossScaler().config == ScalerConfig()
    assert LossScaler({"kind": "dynamic", "growth_interval": 7}).config == ScalerConfig(growth_interval=7)
    assert LossScaler("mixed_bfloat16").config.kind == "none"
    with pytest.raises(ScalerConfigError, match="config: expected an mpx.ScalerConfig"):
        LossScaler(3.5)  # type: ignore[arg-type]
    assert s.scale(np.float16(2.0)) == 8.0 and s.scale(np.float16(2.0)).dtype == np.float32
    assert s.scale(np.ones(2, np.float64)).dtype == np.float64


def test_state_dict_format_and_json_round_trip():
    s = LossScaler(ScalerConfig(init_scale=4.0, min_scale=None, growth_interval=3))
    for f in (T, F, T):
        s.update(f)
    d = s.state_dict()
    assert d == {
        "format": "mpx.scaler/1",
        "config": s.config.to_dict(),
        "scale": 2.0,
        "growth_tracker": 1,
        "consecutive_nonfinite": 0,
        "steps": 3,
        "skipped_steps": 1,
    }
    restored = LossScaler()
    restored.load_state_dict(json.loads(json.dumps(d)))
    assert restored.config == s.config and restored.state == s.state


def _good():
    s = LossScaler(ScalerConfig(init_scale=8.0, growth_interval=4))
    for f in (T, T, F, T):
        s.update(f)
    return s.state_dict()


TAMPERED = [
    (lambda d: d.update(scale=-1.0), "scale: expected a finite positive"),
    (lambda d: d.update(scale=float("nan")), "scale: expected a finite positive"),
    (lambda d: d.update(scale=float("inf")), "scale: expected a finite positive"),
    (lambda d: d.update(scale="4.0"), "scale: expected a finite positive"),
    (lambda d: d.update(scale=True), "scale: expected a finite positive"),
    (lambda d: d.update(scale=0.1), "scale: 0.1 is not a float32 value"),
    (lambda d: d.update(scale=0.5), r"outside \[min_scale, max_scale\]"),
    (lambda d: d.update(scale=2.0**25), r"outside \[min_scale, max_scale\]"),
    (lambda d: d.update(format="mpx.scaler/2"), "format: expected 'mpx.scaler/1'"),
    (lambda d: d.pop("format"), "format: expected"),
    (lambda d: d.pop("growth_tracker"), "missing key 'growth_tracker'"),
    (lambda d: d.pop("config"), "missing key 'config'"),
    (lambda d: d.update(extra=1), "unknown key 'extra'"),
    (lambda d: d.update(growth_tracker=1.0), "growth_tracker: expected an int"),
    (lambda d: d.update(growth_tracker=-1), "growth_tracker: expected an int"),
    (lambda d: d.update(growth_tracker=4), "growth_tracker: 4 must be below growth_interval 4"),
    (lambda d: d.update(steps="4"), "steps: expected an int"),
    (lambda d: d.update(skipped_steps=True), "skipped_steps: expected an int"),
    (lambda d: d.update(skipped_steps=9), "cannot exceed steps"),
    (lambda d: d["config"].update(growth_factor=0.5), "config: growth_factor"),
    (lambda d: d["config"].update(kind="auto"), "config: kind"),
    (lambda d: d["config"].update(colour="red"), "config: config: unknown key 'colour'"),
    (lambda d: d.update(config="dynamic"), "config: config: expected a mapping"),
    # issue #13 items 2, 3, 6
    (lambda d: d.update(steps=2**64), r"steps: expected an int in \[0, 2\*\*31 - 1\], got an int of 65 bits"),
    (lambda d: d.update(skipped_steps=2**31), r"skipped_steps: expected an int in \[0, 2\*\*31 - 1\]"),
    (lambda d: d.update(scale=10**400), "scale: expected a finite positive number, got an int of 1329 bits"),
    (lambda d: d.update(scale=-(10**5000)), "scale: expected a finite positive"),
    (lambda d: d.update(scale=2.0**-127), "scale: expected|outside|below"),
    (lambda d: d.update(format=np.array(["mpx.scaler/1"])), "format: expected"),
    (lambda d: d["config"].update(init_scale=10**400), "config: init_scale: expected a finite number"),
    (lambda d: d["config"].update(growth_interval=2**70), "config: growth_interval"),
    (lambda d: d.update(growth_tracker=2, steps=1, skipped_steps=1), "growth_tracker: 2 cannot exceed steps 1"),
    (lambda d: d.update(consecutive_nonfinite=1), "both cannot be positive"),
    (
        lambda d: d.update(growth_tracker=0, consecutive_nonfinite=2),
        "consecutive_nonfinite: 2 cannot exceed skipped_steps 1",
    ),
]


@pytest.mark.parametrize("tamper,message", TAMPERED)
def test_tampered_state_dicts_raise_and_leave_the_scaler_unchanged(tamper, message):
    d = _good()
    tamper(d)
    scaler = LossScaler(ScalerConfig(init_scale=2.0))
    before = (scaler.config, scaler.state)
    with pytest.raises(StateDictError, match=message):
        scaler.load_state_dict(d)
    assert (scaler.config, scaler.state) == before


def test_static_and_none_state_dicts_are_checked():
    d = LossScaler(ScalerConfig(kind="static", init_scale=8.0)).state_dict()
    with pytest.raises(StateDictError, match="static scaler's scale is 8.0"):
        mpx.load_state_dict({**d, "scale": 16.0})
    d = LossScaler(ScalerConfig(kind="none")).state_dict()
    with pytest.raises(StateDictError, match="never skips"):
        mpx.load_state_dict({**d, "steps": 2, "skipped_steps": 1})
    with pytest.raises(StateDictError, match="expected a mapping"):
        mpx.load_state_dict([("format", "mpx.scaler/1")])


# -- properties ----------------------------------------------------------------------

POW2 = st.integers(-10, 30).map(lambda e: 2.0**e)


@st.composite
def configs(draw):
    kind = draw(st.sampled_from(["dynamic", "dynamic", "static", "none"]))
    lo = draw(st.one_of(st.none(), st.sampled_from([2.0**-20, 0.5, 1.0, 4.0])))
    hi = draw(st.one_of(st.none(), st.sampled_from([2.0**10, 2.0**24, 2.0**40])))
    init = draw(POW2.filter(lambda v: (lo is None or v >= lo) and (hi is None or v <= hi)))
    return ScalerConfig(
        kind=kind,
        init_scale=init,
        growth_factor=draw(st.sampled_from([2.0, 1.5, 4.0, 1.1])),
        backoff_factor=draw(st.sampled_from([0.5, 0.25, 0.3, 0.9])),
        growth_interval=draw(st.integers(1, 4)),
        min_scale=lo,
        max_scale=hi,
        hysteresis=draw(st.integers(1, 3)),
        skip_nonfinite=draw(st.sampled_from([None, True, False])),
    )


def reference(config, flags):
    """The DESIGN pseudo-code written out independently, products in float64 rounded once."""
    f32 = lambda x: float(np.float32(x))  # noqa: E731
    tiny = float(np.finfo(np.float32).smallest_normal)
    scale = config.first_scale
    tracker = consecutive = skipped = 0
    out = []
    for finite in flags:
        skipped += (not finite) and config.skip_nonfinite
        consecutive = 0 if finite else consecutive + 1
        if config.kind == "dynamic":
            if finite:
                tracker += 1
                if tracker == config.growth_interval:
                    grown = f32(scale * config.growth_factor)
                    if math.isfinite(grown):
                        scale = grown if config.max_scale is None else min(grown, f32(config.max_scale))
                    tracker = 0
            else:
                tracker = 0
                if consecutive >= config.hysteresis:
                    shrunk = f32(scale * config.backoff_factor)
                    scale = max(shrunk, tiny if config.min_scale is None else f32(config.min_scale))
        out.append((scale, tracker, consecutive, skipped))
    return out


@settings(max_examples=400, deadline=None)
@given(configs(), st.lists(st.booleans(), max_size=40))
def test_transition_matches_the_pseudo_code(config, flags):
    got = [
        (s.scale, s.growth_tracker, s.consecutive_nonfinite, s.skipped_steps) for s in trace(config, flags)
    ]
    assert got == reference(config, flags)


@settings(max_examples=300, deadline=None)
@given(configs(), st.lists(st.booleans(), max_size=40))
def test_scale_stays_in_bounds_and_skips_count_nonfinite_steps(config, flags):
    lo, hi = config.bounds
    states = trace(config, flags)
    for s in states:
        if config.kind == "dynamic":
            assert lo <= s.scale <= hi
        else:
            assert s.scale == config.first_scale
        assert math.isfinite(s.scale) and s.scale > 0
        assert float(np.float32(s.scale)) == s.scale
    if states:
        expected = flags.count(False) if config.skip_nonfinite else 0
        assert states[-1].skipped_steps == expected and states[-1].steps == len(flags)


@settings(max_examples=200, deadline=None)
@given(configs(), st.lists(st.booleans(), max_size=30), st.lists(st.booleans(), max_size=30))
def test_state_dict_round_trip_mid_sequence_continues_identically(config, first, rest):
    straight = LossScaler(config)
    for f in first + rest:
        straight.update(f)
    a = LossScaler(config)
    for f in first:
        a.update(f)
    b = LossScaler.from_state_dict(json.loads(json.dumps(a.state_dict())))
    for f in rest:
        b.update(f)
    assert b.state == straight.state and b.config == config


# -- issue #13 -------------------------------------------------------------------------
def test_scale_never_reaches_zero_and_round_trips():
    c = ScalerConfig(min_scale=None)
    states = trace(c, [F] * 300)
    assert states[165].scale == mpx.SCALE_FLOOR == 2.0**-126  # 166 skips went to 0.0 before
    assert all(s.scale >= 2.0**-126 for s in states) and states[-1].scale == 2.0**-126
    scaler = LossScaler.from_state_dict(json.loads(json.dumps(LossScaler(c).state_dict())))
    scaler.load_state_dict(mpx.state_dict(c, states[-1]))
    assert scaler.state == states[-1]
    assert scaler.update(True) is False and scaler.get_scale() == 2.0**-126  # and training goes on
    assert c.bounds == (2.0**-126, 2.0**24)


def test_counters_saturate_at_int32_max():
    m = mpx.COUNTER_MAX
    assert m == 2**31 - 1
    c = ScalerConfig(kind="static", init_scale=2.0)
    s = ScalerState(2.0, 0, m - 1, m - 1, m - 1)
    s = mpx.scaler_update(c, s, False)
    assert (s.steps, s.skipped_steps, s.consecutive_nonfinite) == (m, m, m)
    s = mpx.scaler_update(c, s, False)
    assert (s.steps, s.skipped_steps, s.consecutive_nonfinite) == (m, m, m)
    assert mpx.load_state_dict(mpx.state_dict(c, s))[1] == s
    c = ScalerConfig(growth_interval=m, hysteresis=m)  # the largest intervals are accepted
    assert mpx.scaler_update(c, mpx.scaler_init(c), False).scale == c.first_scale


def test_scale_can_drop_below_one():
    assert not ScalerConfig().scale_can_drop_below_one
    assert ScalerConfig(min_scale=None).scale_can_drop_below_one
    assert ScalerConfig(init_scale=0.25, min_scale=0.25).scale_can_drop_below_one
    assert ScalerConfig(kind="static", init_scale=0.5, min_scale=None).scale_can_drop_below_one
    assert not ScalerConfig(kind="none", init_scale=0.5, min_scale=None).scale_can_drop_below_one


_MUTATIONS = st.sampled_from(
    ["scale", "growth_tracker", "consecutive_nonfinite", "steps", "skipped_steps", "format"]
)
_VALUES = st.one_of(
    st.integers(-(2**70), 2**70),
    st.integers(0, 12),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([10**400, None, "1", True, [], 2.0**-126, 2.0**-149, 0.5, 8.0, 16.0]),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(_MUTATIONS, _VALUES), min_size=1, max_size=4))
def test_state_dict_mutations_load_or_raise_state_dict_error(mutations):
    d = _good()
    for key, value in mutations:
        d[key] = value
    scaler = LossScaler(ScalerConfig(init_scale=2.0))
    before = (scaler.config, scaler.state)
    try:
        scaler.load_state_dict(d)
    except StateDictError:
        assert (scaler.config, scaler.state) == before
        return
    # accepted: a state the machine can go on from, that round-trips, and that counts sanely
    st_ = scaler.state
    assert scaler.state_dict() == {**d, "scale": float(d["scale"])}
    assert st_.growth_tracker <= st_.steps and st_.skipped_steps <= st_.steps
    assert not (st_.growth_tracker and st_.consecutive_nonfinite)
    scaler.update(False)
    LossScaler.from_state_dict(scaler.state_dict())


@settings(max_examples=300, deadline=None)
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "init_scale": _VALUES,
            "growth_factor": _VALUES,
            "backoff_factor": _VALUES,
            "growth_interval": _VALUES,
            "min_scale": _VALUES,
            "max_scale": _VALUES,
            "hysteresis": _VALUES,
        },
    )
)
def test_configs_either_run_or_raise_scaler_config_error(kwargs):
    try:
        c = ScalerConfig(**kwargs)
    except ScalerConfigError as e:
        names = {f.name for f in dataclasses.fields(ScalerConfig)}
        assert str(e).split(":")[0] in names and " an int of " not in str(e).split(":")[0]
        return
    s = mpx.scaler_init(c)
    for finite in (True, False, True):
        s = mpx.scaler_update(c, s, finite)
    assert c.bounds[0] <= s.scale <= c.bounds[1]
    assert mpx.load_state_dict(json.loads(json.dumps(mpx.state_dict(c, s)))) == (c, s)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, ScalerConfig()),
        (ScalerConfig(growth_interval=3), ScalerConfig(growth_interval=3)),
        ({"kind": "static", "init_scale": 8.0}, ScalerConfig(kind="static", init_scale=8.0)),
        ("mixed_float16", ScalerConfig()),
        ("16-mixed", ScalerConfig()),
        ("mixed_bfloat16", ScalerConfig(kind="none")),
        ({"param_dtype": "float32", "compute_dtype": "float16", "output_dtype": "float32"}, ScalerConfig()),
    ],
)
def test_as_scaler_config_accepts_every_form(value, expected):
    from mpx import as_scaler_config, get_policy

    assert as_scaler_config(value) == expected
    if isinstance(value, str):
        assert as_scaler_config(get_policy(value)) == expected


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (3.5, ScalerConfigError, "config: expected an mpx.ScalerConfig"),
        ([1, 2], ScalerConfigError, "got list"),
        ({"kind": "dynamic", "growth_intervall": 2}, ScalerConfigError, "unknown key 'growth_intervall'"),
        ({"kind": "dynamic", "growth_interval": 0}, ScalerConfigError, "growth_interval"),
        ("mixed_float17", PolicyError, "mixed_float17"),
    ],
)
def test_as_scaler_config_refuses_with_the_field(value, error, match):
    from mpx import as_scaler_config

    with pytest.raises(error, match=match):
        as_scaler_config(value)


@pytest.mark.parametrize("flag", [None, -1, 0, 1, True, False])
def test_check_stuck_is_the_one_host_check(flag):
    from mpx.stuck import check_stuck

    cfg = ScalerConfig(max_consecutive_skips=2, min_scale=1.0)
    check_stuck(cfg, 1.0, 1, flag)  # below N: nothing
    with pytest.raises(mpx.ScalerStuckError, match="2 steps in a row") as info:
        check_stuck(cfg, np.float32(1.0), np.int32(2), flag)
    if flag in (0, False):
        assert "forward loss itself is non-finite" in str(info.value)
    else:
        assert "overflow at the minimum scale" in str(info.value)
