"""DeepSpeed's loss-scaler rule as a mode of ScalerConfig, and the ds_config mapping (mpx.deepspeed_config)."""

import copy
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mpx
from mpx.deepspeed_config import from_deepspeed_config, to_deepspeed_config

PRESET = mpx.SCALER_PRESETS["deepspeed_fp16"]


def _mode(**changes):
    return dataclasses.replace(PRESET, **{"init_scale": 2.0**4, "growth_interval": 3, **changes})


def _trace(config, flags):
    s, out = mpx.scaler_init(config), []
    for finite in flags:
        s = mpx.scaler_update(config, s, finite)
        out.append(s)
    return out


def test_preset_is_deepspeeds_defaults():
    assert PRESET == mpx.ScalerConfig(
        init_scale=2.0**16, growth_interval=1000, hysteresis=2, hysteresis_reset="growth", first_growth_delay=1,
        min_scale=1.0, max_scale=None, on_floor="raise",
    )  # fmt: skip
    assert mpx.as_scaler_config("deepspeed_fp16") is PRESET
    assert mpx.as_scaler_config("mixed_float16") == mpx.ScalerConfig()  # policies still read as before


def test_growth_on_the_window_plus_first_step_then_every_window():
    steps = _trace(_mode(), [True] * 10)
    grew = [i + 1 for i, s in enumerate(steps) if s.scale > (steps[i - 1].scale if i else 16.0)]
    assert grew == [4, 7, 10]
    assert [s.growth_tracker for s in steps[:5]] == [1, 2, 3, 1, 2]  # back to the delay after a growth
    default = _trace(dataclasses.replace(_mode(), first_growth_delay=0), [True] * 10)
    assert [i + 1 for i, s in enumerate(default) if s.growth_tracker == 0] == [3, 6, 9]


def test_growth_reset_refills_only_on_growth():
    flags = [False, True, False, True, True, True, False]
    growth = _trace(_mode(), flags)
    assert [s.scale for s in growth] == [16.0, 16.0, 8.0, 8.0, 8.0, 8.0, 4.0]
    assert [s.nonfinite_since_growth for s in growth] == [1, 1, 2, 2, 2, 2, 3]
    finite = _trace(_mode(hysteresis_reset="finite"), flags)
    assert [s.scale for s in finite] == [16.0] * 7  # a finite step between refills the budget
    assert all(s.nonfinite_since_growth == 0 for s in finite)
    grown = _trace(_mode(), [False] + [True] * 4 + [False])
    assert grown[4].scale == 32.0 and grown[4].nonfinite_since_growth == 0 and grown[5].scale == 32.0


def test_floor_raises_on_the_back_off_due_at_min_scale_not_on_reaching_it():
    scaler = mpx.LossScaler(_mode(init_scale=2.0, hysteresis=1))
    scaler.update(False)
    assert scaler.get_scale() == 1.0
    with pytest.raises(mpx.ScalerFloorError, match="step 2 overflowed with the scale at min_scale"):
        scaler.update(False)
    assert scaler.state.steps == 2 and scaler.state.skipped_steps == 2  # raised after the step, as stuck detection
    keep = mpx.LossScaler(_mode(init_scale=2.0, hysteresis=1, on_floor="keep"))
    for _ in range(3):
        keep.update(False)
    assert keep.get_scale() == 1.0


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hysteresis_reset": "always"}, "hysteresis_reset: 'always' is not allowed; allowed: finite, growth"),
        ({"on_floor": True}, "on_floor: True is not allowed; allowed: keep, raise"),
        ({"first_growth_delay": -1}, "first_growth_delay: expected an int in [0, 2**31 - 1 - growth_interval]"),
        ({"first_growth_delay": 2**31 - 3}, "first_growth_delay: expected an int"),
        ({"first_growth_delay": 1.0}, "first_growth_delay: expected an int"),
    ],
)
def test_bad_fields_are_named(changes, message):
    with pytest.raises(mpx.ScalerConfigError, match=message.replace("[", r"\[").replace("*", r"\*")):
        mpx.ScalerConfig(growth_interval=3, **changes)


def test_state_dicts_old_and_new():
    config = _mode()
    s = _trace(config, [True, False, True])[-1]
    saved = mpx.state_dict(config, s)
    assert saved["nonfinite_since_growth"] == 1 and mpx.load_state_dict(saved) == (config, s)
    old = mpx.state_dict(mpx.ScalerConfig(), mpx.scaler_init(mpx.ScalerConfig()))
    assert "nonfinite_since_growth" not in old  # a default config writes what earlier versions wrote
    assert mpx.load_state_dict(old)[1].nonfinite_since_growth == 0
    legacy = {k: v for k, v in saved.items() if k != "nonfinite_since_growth"}  # an mpx.scaler/1 dict of before
    assert mpx.load_state_dict(legacy)[1].nonfinite_since_growth == 0
    with pytest.raises(mpx.StateDictError, match="nonfinite_since_growth: 5 must lie in"):
        mpx.load_state_dict({**saved, "nonfinite_since_growth": 5})
    with pytest.raises(mpx.StateDictError, match="counts only under hysteresis_reset='growth'"):
        mpx.load_state_dict({**old, "nonfinite_since_growth": 1})


# -- ds_config ---------------------------------------------------------------------------------------


def test_to_deepspeed_config_defaults_and_blocks():
    ds = to_deepspeed_config("mixed_float16")
    assert ds == {
        "fp16": {
            "enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
            "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1,
        },
        "communication_data_type": "fp32",
    }  # fmt: skip
    assert to_deepspeed_config("mixed_bfloat16") == {"bf16": {"enabled": True}, "communication_data_type": "fp32"}
    assert to_deepspeed_config("float32") == {"communication_data_type": "fp32"}
    reduce16 = mpx.Policy("float32", "bfloat16", "float32", reduce_dtype="bfloat16")
    assert to_deepspeed_config(reduce16)["communication_data_type"] == "bf16"
    static = to_deepspeed_config("mixed_float16", mpx.ScalerConfig(kind="static", init_scale=128.0))
    assert static["fp16"] == {"enabled": True, "loss_scale": 128.0}


def test_base_is_merged_and_not_mutated():
    base = {"train_batch_size": 8, "zero_optimization": {"stage": 2}, "fp16": {"enabled": True, "auto_cast": True}}
    before = copy.deepcopy(base)
    ds = to_deepspeed_config("mixed_bfloat16", base=base)
    assert base == before
    assert ds["train_batch_size"] == 8 and ds["zero_optimization"] == {"stage": 2}
    assert ds["fp16"] == {"enabled": False, "auto_cast": True} and ds["bf16"] == {"enabled": True}
    ds = to_deepspeed_config("mixed_float16", _mode(), base=base)
    assert ds["fp16"]["auto_cast"] is True and ds["fp16"]["loss_scale_window"] == 3
    assert ds["zero_optimization"] is not base["zero_optimization"]


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (dataclasses.replace(PRESET, growth_factor=4.0), "growth_factor"),
        (dataclasses.replace(PRESET, backoff_factor=0.25), "backoff_factor"),
        (dataclasses.replace(PRESET, max_scale=2.0**24), "max_scale"),
        (dataclasses.replace(PRESET, first_growth_delay=0), "first_growth_delay"),
        (dataclasses.replace(PRESET, on_floor="keep"), "on_floor"),
        (dataclasses.replace(PRESET, max_consecutive_skips=10), "max_consecutive_skips"),
        (dataclasses.replace(PRESET, init_scale=3.0), "init_scale"),
        (dataclasses.replace(PRESET, min_scale=0.5), "min_scale"),
        (dataclasses.replace(PRESET, min_scale=None), "min_scale"),
        (mpx.ScalerConfig(kind="none"), "kind"),
    ],
)
def test_refuses_what_deepspeed_cannot_express(config, field):
    with pytest.raises(mpx.ScalerConfigError, match=f"^{field}: "):
        to_deepspeed_config("mixed_float16", config)


def test_refuses_a_scaler_for_bf16_and_bad_inputs():
    with pytest.raises(mpx.ScalerConfigError, match="^kind: a bfloat16 policy runs DeepSpeed without loss scaling"):
        to_deepspeed_config("mixed_bfloat16", PRESET)
    with pytest.raises(mpx.PolicyError, match="fp16 and bf16 are both enabled"):
        from_deepspeed_config({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    with pytest.raises(mpx.PolicyError, match="communication_data_type: expected fp32, fp16 or bf16"):
        from_deepspeed_config({"communication_data_type": "fp8"})
    with pytest.raises(mpx.ScalerConfigError, match="fp16.loss_scale_window: growth_interval"):
        from_deepspeed_config({"fp16": {"enabled": True, "loss_scale_window": 0}})
    with pytest.raises(mpx.ScalerConfigError, match="fp16.consecutive_hysteresis: expected true or false"):
        from_deepspeed_config({"fp16": {"enabled": True, "consecutive_hysteresis": "no"}})


@settings(max_examples=60, deadline=None)
@given(
    power=st.integers(-4, 30),
    window=st.integers(1, 5000),
    hysteresis=st.integers(1, 5),
    consecutive=st.booleans(),
    min_loss_scale=st.integers(1, 4),
    comm=st.sampled_from([None, "fp32", "fp16", "bf16"]),
)
def test_round_trips_exactly(power, window, hysteresis, consecutive, min_loss_scale, comm):
    block = {
        "enabled": True, "loss_scale": 0, "initial_scale_power": max(power, min_loss_scale.bit_length()),
        "loss_scale_window": window, "hysteresis": hysteresis, "consecutive_hysteresis": consecutive,
        "min_loss_scale": min_loss_scale,
    }  # fmt: skip
    ds = {"fp16": block, **({} if comm is None else {"communication_data_type": comm})}
    policy, config = from_deepspeed_config(ds)
    assert config.init_scale == 2.0 ** block["initial_scale_power"] and config.growth_interval == window
    assert config.hysteresis_reset == ("finite" if consecutive else "growth")
    back = to_deepspeed_config(policy, config)
    assert back["fp16"] == block and back["communication_data_type"] == (comm or "fp32")
    assert from_deepspeed_config(back) == (policy, config)
    for name in ("mixed_bfloat16", "float32"):
        ds = to_deepspeed_config(name)
        assert from_deepspeed_config(ds) == (mpx.get_policy(name), mpx.ScalerConfig(kind="none"))
    static, cfg = from_deepspeed_config({"fp16": {"enabled": True, "loss_scale": 2.0**power}})
    assert cfg.kind == "static" and cfg.init_scale == 2.0**power
    assert from_deepspeed_config(to_deepspeed_config(static, cfg)) == (static, cfg)
