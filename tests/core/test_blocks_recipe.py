"""BlockRecipe (#31 item 1): fields, presets, policy spec keys, stateless mpx.float8/1 dicts."""

from __future__ import annotations

import json

import pytest

import mpx
from mpx import float8
from mpx.blocks import PRESETS, BlockRecipe
from mpx.policy import Policy, get_policy


def test_presets_name_the_published_formats() -> None:
    assert PRESETS["mxfp8"].block_of("input") == (1, 32) and PRESETS["mxfp8"].scale == "e8m0"
    assert PRESETS["mxfp8_rceil"].scale_rule == "rceil"
    assert PRESETS["mxfp4"].element == "e2m1"
    nv = PRESETS["nvfp4"]
    assert (nv.element, nv.block_of("weight"), nv.scale) == ("e2m1", (1, 16), "e4m3_f32")
    bw = PRESETS["fp8_blockwise"]
    assert (bw.block_of("input"), bw.block_of("weight"), bw.block_of("grad")) == (
        (1, 128),
        (128, 128),
        (1, 128),
    )
    assert PRESETS["fp8_rowwise"].block_of("grad") == (1, 0) and PRESETS["fp8_rowwise"].scale == "pow2"
    assert all(recipe.name == name and recipe.stateless for name, recipe in PRESETS.items())


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"element": "e3m3"}, "element"),
        ({"grad_element": "fp8"}, "grad_element"),
        ({"weight_block": "32x16"}, "weight_block"),
        ({"input_block": "0x32"}, "input_block"),
        ({"scale": "e8m1"}, "scale"),
        ({"scale_rule": "rceil", "scale": "pow2"}, "scale_rule"),
        ({"scale": "pow2", "element": "e2m1"}, "element"),
        ({"rounding": "up"}, "rounding"),
        ({"hadamard": 1}, "hadamard"),
    ],
)
def test_bad_fields_raise_naming_the_field(fields: dict, named: str) -> None:
    with pytest.raises(mpx.Float8Error, match=named):
        BlockRecipe(**fields)


def test_spec_keys_name_block_presets_and_round_trip() -> None:
    p = get_policy("mixed_bfloat16,fp8=mxfp8")
    assert p.fp8 == PRESETS["mxfp8"]
    q = get_policy("mixed_bfloat16,fp4=nvfp4,@head={fp8=none},@proj={fp8=fp8_blockwise}")
    assert q.fp8 == PRESETS["nvfp4"] and q.for_module("head").fp8 is None
    assert q.for_module("proj").fp8 == PRESETS["fp8_blockwise"]
    assert get_policy(str(q)) == q and Policy.from_dict(json.loads(json.dumps(q.to_dict()))) == q
    # an override naming a per-tensor format replaces the parent's block recipe
    r = get_policy("mixed_bfloat16,fp8=mxfp8,@head={fp8=e4m3}")
    assert r.for_module("head").fp8 == mpx.Float8Recipe(format="e4m3")
    assert (
        get_policy("mixed_bfloat16,fp8=mxfp8,@head={keep_fp32=none}").for_module("head").fp8
        == PRESETS["mxfp8"]
    )


@pytest.mark.parametrize(
    ("spec", "key"),
    [
        ("mixed_bfloat16,fp8=mxfp9", "fp8"),
        ("mixed_bfloat16,fp4=mxfp8", "fp4"),
        ("mixed_bfloat16,fp8=mxfp8,fp8_margin=2", "fp8_margin"),
        ("mixed_bfloat16,fp4=nvfp4,fp8=hybrid", "fp4 and fp8"),
        ("mixed_bfloat16,fp8=mxfp8,@head={fp8_history=4}", "fp8_history"),
    ],
)
def test_bad_spec_values_raise_policy_error_naming_the_key(spec: str, key: str) -> None:
    with pytest.raises(mpx.PolicyError, match=key):
        get_policy(spec)


def test_float8_state_dict_says_stateless_and_round_trips() -> None:
    for recipe in PRESETS.values():
        d = float8.state_dict(recipe, float8.Float8State({}))
        assert d["recipe"]["stateless"] is True and d["tensors"] == {}
        back, state = float8.load_state_dict(json.loads(json.dumps(d)))
        assert back == recipe and state.tensors == {}
    d = float8.state_dict(PRESETS["mxfp8"], float8.Float8State({}))
    with pytest.raises(mpx.StateDictError, match="stateless"):
        float8.load_state_dict(
            {**d, "tensors": {"x.input": {"role": "input", "scale": 1.0, "amax_history": []}}}
        )
    with pytest.raises(mpx.StateDictError, match="stateless"):
        float8.load_state_dict({**d, "recipe": {k: v for k, v in d["recipe"].items() if k != "stateless"}})
    with pytest.raises(mpx.StateDictError, match="element"):
        float8.load_state_dict({**d, "recipe": {**d["recipe"], "element": "e9m9"}})
    with pytest.raises(mpx.StateDictError, match="stateless"):
        float8.state_dict(PRESETS["mxfp8"], float8.float8_init(mpx.Float8Recipe(), {"x": "input"}))
