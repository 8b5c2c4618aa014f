"""The memory keys of a policy (mpx.update_policy): master, update, opt_state; presets; errors; round trips."""

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mpx
from mpx import PolicyError, get_policy
from mpx.policy import MEMORY_PRESETS


@pytest.mark.parametrize(
    ("name", "fields"),
    [
        ("bf16_kahan", ("bfloat16", "bfloat16", "kahan", "float32")),
        ("bf16_sr", ("bfloat16", "bfloat16", "stochastic", "float32")),
        ("mixed_bfloat16_8bit_adam", ("float32", "float32", "plain", "int8:256")),
    ],
)
def test_presets(name, fields):
    p = get_policy(name)
    assert (p.param_dtype, p.master_dtype, p.update, p.opt_state) == fields
    assert p.name == name and p is MEMORY_PRESETS[name]
    assert get_policy(str(p)) == p and get_policy(p.to_dict()) == p
    assert p.to_dict() == json.loads(json.dumps(p.to_dict()))


def test_defaults_leave_every_existing_policy_as_it_was():
    p = get_policy("mixed_bfloat16")
    assert (p.master_dtype, p.update, p.opt_state) == ("float32", "plain", "float32")
    assert set(p.to_dict()) == {"param_dtype", "compute_dtype", "output_dtype", "reduce_dtype", "keep_fp32",
                                "overrides", "fp8"}  # fmt: skip
    assert str(p) == "params=float32,compute=bfloat16,output=float32" and p.name == "mixed_bfloat16"
    assert get_policy("bfloat16").master_dtype == "bfloat16" and get_policy("bfloat16").name == "bfloat16"
    # a preset's name is lost once a memory key changes it
    assert get_policy("bfloat16,opt_state=bf16").name is None


@settings(max_examples=40, deadline=None)
@given(
    params=st.sampled_from(["float32", "bfloat16", "float16"]),
    master=st.sampled_from([None, "float32", "bfloat16", "fp32", "bf16"]),
    update=st.sampled_from(["plain", "kahan", "stochastic"]),
    opt_state=st.sampled_from(["float32", "bfloat16", "bf16", "int8", "int8:32", "int8:4096"]),
    compute=st.sampled_from(["float32", "bfloat16"]),
)
def test_every_valid_combination_round_trips_and_every_invalid_one_names_its_key(
    params, master, update, opt_state, compute
):
    spec = f"params={params},compute={compute},update={update},opt_state={opt_state}"
    if master is not None:
        spec += f",master={master}"
    canon_master = {"fp32": "float32", "bf16": "bfloat16"}.get(master, master) or params
    valid_master = canon_master in (params, "float32")
    valid = valid_master and (update == "plain" or canon_master == "bfloat16")
    if not valid:
        key = "master" if not valid_master else "update"
        with pytest.raises(PolicyError, match=f"^{key}: "):
            get_policy(spec)
        with pytest.raises(PolicyError, match=f"^{key}: "):
            mpx.Policy(params, compute, master_dtype=master, update=update, opt_state=opt_state)
        return
    p = get_policy(spec)
    assert p.master_dtype == canon_master and p.update == update
    assert p.opt_state == {"bf16": "bfloat16", "int8": "int8:256"}.get(opt_state, opt_state)
    assert get_policy(str(p)) == p and get_policy(p.to_dict()) == p and hash(get_policy(str(p))) == hash(p)
    assert dataclasses.replace(p) == p
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.update = "plain"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("mixed_bfloat16,update=kahan", "update: 'kahan' needs master=bfloat16"),
        ("bf16_sr,params=float32", "update: 'stochastic' needs master=bfloat16"),
        ("p=bf16,update=fast", "update: 'fast' is not allowed; allowed: plain, kahan, stochastic"),
        ("p=bf16,opt_state=int8:100", "opt_state: 'int8:100' is not allowed"),
        ("p=bf16,opt_state=int4", "opt_state: 'int4' is not allowed"),
        ("p=bf16,opt_state=float16", "opt_state: 'float16' is not allowed"),
        ("p=bf16,master=f16", "master: 'float16' with params=bfloat16 is not allowed"),
        ("p=f32,master=bf16", "master: 'bfloat16' with params=float32 is not allowed"),
        ("p=f64,master=f32", "master: float32 is narrower than params=float64"),
        ("p=bf16,master=int8", "master: 'int8' is not a floating dtype"),
        ("mixed_bfloat16,@head={opt_state=bf16}", "opt_state is a whole-model key"),
    ],
)
def test_bad_combinations_raise_a_policy_error_naming_the_key(spec, message):
    with pytest.raises(PolicyError, match=message.replace("(", r"\(").replace("+", r"\+")):
        get_policy(spec)


def test_an_override_keeps_the_defaults_and_inherits_none_of_the_memory_keys():
    p = get_policy("bf16_kahan,@head={compute=float32}")
    assert p.update == "kahan" and p.for_module("head").update == "plain"
    assert get_policy(str(p)) == p
    with pytest.raises(PolicyError, match="whole-model keys"):
        get_policy("bfloat16").with_overrides({"head": "bf16_sr"})
