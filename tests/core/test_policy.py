import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mpx
from mpx import Policy, PolicyError, get_policy

F32, F16, BF16, F64 = "float32", "float16", "bfloat16", "float64"
ALL3 = ("normalization", "softmax", "loss")

EXPECTED = {
    # presets
    "float32": (F32, F32, F32),
    "mixed_float16": (F32, F16, F32),
    "mixed_bfloat16": (F32, BF16, F32),
    "float16": (F16, F16, F16),
    "bfloat16": (BF16, BF16, BF16),
    # Lightning
    "32-true": (F32, F32, F32),
    "16-mixed": (F32, F16, F32),
    "bf16-mixed": (F32, BF16, F32),
    "16-true": (F16, F16, F16),
    "bf16-true": (BF16, BF16, BF16),
    # Accelerate
    "no": (F32, F32, F32),
    "fp16": (F32, F16, F32),
    "bf16": (F32, BF16, F32),
    # key grammar and its defaults
    "params=float32,compute=float16,output=float32": (F32, F16, F32),
    "p=f32,c=bf16,o=f32": (F32, BF16, F32),
    " params = fp32 , compute = half , output = float ": (F32, F16, F32),
    "compute=bf16": (F32, BF16, BF16),  # params defaults to float32, output to compute
    "c=f16,o=f32": (F32, F16, F32),
    "params=bf16": (BF16, BF16, BF16),  # compute defaults to params
    "p=f64": (F64, F64, F64),
    "o=f16": (F32, F32, F16),
    "output=f32,compute=f16,params=f16": (F16, F16, F32),  # any key order
}


@pytest.mark.parametrize("spec,dtypes", EXPECTED.items())
def test_spec_dtypes(spec, dtypes):
    p = get_policy(spec)
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == dtypes
    assert p.keep_fp32 == (ALL3 if dtypes[1] in (F16, BF16) else ())
    assert p.overrides == ()


@pytest.mark.parametrize("spec", EXPECTED)
def test_str_is_canonical_and_round_trips(spec):
    p = get_policy(spec)
    text = str(p)
    assert text.startswith("params=") and " " not in text
    assert get_policy(text) == p
    assert str(get_policy(text)) == text
    assert Policy.from_dict(json.loads(json.dumps(p.to_dict()))) == p


def test_mixed_preset_equals_its_key_form_and_direct_construction():
    assert get_policy("mixed_float16") == get_policy("params=float32,compute=float16,output=float32")
    assert get_policy("mixed_float16") == Policy("float32", "float16", "float32")
    assert hash(get_policy("16-mixed")) == hash(Policy("f32", "fp16", "float"))
    assert get_policy("mixed_bfloat16").name == "mixed_bfloat16"
    assert get_policy("c=bf16").name is None


def test_policy_is_frozen_and_hashable():
    p = get_policy("mixed_float16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.compute_dtype = "float32"  # type: ignore[misc]
    assert {p: 1}[get_policy("fp16")] == 1


def test_repr():
    assert repr(get_policy("bf16-mixed")) == '<Policy "mixed_bfloat16">'
    assert repr(get_policy("c=f16")) == '<Policy "params=float32,compute=float16,output=float16">'


def test_get_policy_passes_policies_through():
    p = get_policy("mixed_float16")
    assert get_policy(p) is p
    assert get_policy(p.to_dict()) == p


BAD = {
    "": "empty",
    "   ": "empty",
    "mixed": "unknown policy name 'mixed'",
    "FP16": "unknown policy name 'FP16'",
    "keep_fp32=none,mixed_float16": "is not KEY=VALUE",
    "params=float32,,compute=float16": "segment 2 is empty",
    ",compute=float16": "segment 1 is empty",
    "compute=float16,": "segment 2 is empty",
    "p=f32,params=f16": "key 'params' repeats 'p'",
    "compute=f16,compute=f16": "key 'compute' repeats 'compute'",
    "compute=int8": "compute: 'int8' is not a floating dtype",
    "params=int32": "params: 'int32' is not a floating dtype",
    "output=bool": "output: 'bool' is not a floating dtype",
    "compute=float8_e4m3fn": "compute: 'float8_e4m3fn' is not allowed here",
    "compute=": "key 'compute' has no value",
    "=float16": "has no key",
    "compute==float16": "stray '='",
    "compute=float16=float32": "stray '='",
    "precision=16": "unknown key 'precision'",
    "c=f16;o=f32": "stray '='",
    "c=f16;": "'f16;' is not a floating dtype",
    "keep_fp32=none": "names no dtype",
    "c=f16,keep_fp32=": "key 'keep_fp32' has no value",
    "c=f16,keep_fp32=norms": "unknown category 'norms'",
    "c=f16,keep_fp32=loss+loss": "category 'loss' is named twice",
    "c=f16,keep_fp32=loss++softmax": "has an empty name",
    "c=f16,keep_fp32=none+loss": "unknown category 'none'",
    "c=f16,@enc.norm=float32": "must read @SELECTOR={SPEC}",
    "c=f16,@={c=f32}": "selector: expected",
    "c=f16,@category:norm={c=f32}": "unknown category 'norm'",
    "c=f16,@a b={c=f32}": "is not a module-path glob",
    "c=f16,@x={c=f32,@y={c=f16}}": "cannot have overrides",
    "c=f16,@x={c=f32": "unmatched '{'",
    "c=f16}": "unmatched '}'",
}


@pytest.mark.parametrize("spec,message", BAD.items())
def test_bad_specs_raise_policy_error(spec, message):
    with pytest.raises(PolicyError, match=message):
        get_policy(spec)


@pytest.mark.parametrize("bad", [None, 16, 1.5, ["float16"], b"mixed_float16"])
def test_bad_spec_types(bad):
    with pytest.raises(PolicyError, match="policy: expected an mpx.Policy, a spec string or a dict"):
        get_policy(bad)


@pytest.mark.parametrize(
    "data,message",
    [
        ({"param_dtype": F32, "compute_dtype": F16}, "missing key 'output_dtype'"),
        ({"param_dtype": F32, "compute_dtype": F16, "output_dtype": F32, "x": 1}, "unknown key 'x'"),
        ({"param_dtype": F32, "compute_dtype": "int8", "output_dtype": F32}, "compute: 'int8'"),
        ({"param_dtype": F32, "compute_dtype": F16, "output_dtype": F32, "keep_fp32": "loss"}, "keep_fp32"),
        ({"param_dtype": F32, "compute_dtype": F16, "output_dtype": F32, "overrides": [{"selector": "x"}]}, "override"),
    ],
)  # fmt: skip
def test_bad_dicts(data, message):
    with pytest.raises(PolicyError, match=message):
        get_policy(data)


def test_error_messages_say_what_is_allowed():
    with pytest.raises(PolicyError) as info:
        get_policy("mixd_float16")
    text = str(info.value)
    for name in ("float32", "mixed_float16", "mixed_bfloat16", "16-mixed", "bf16-true", "params=DTYPE"):
        assert name in text


# -- keep_fp32 and overrides ---------------------------------------------------------


@pytest.mark.parametrize("spec", ["mixed_float16", "mixed_bfloat16", "float16", "bfloat16", "c=f16"])
@pytest.mark.parametrize("category", ALL3)
def test_half_policies_keep_sensitive_categories_in_float32(spec, category):
    p = get_policy(spec)
    sub = p.for_module("encoder.0.norm", category)
    assert sub.compute_dtype == F32 and sub.output_dtype == F32
    assert sub.param_dtype == p.param_dtype  # pure half policies keep half parameters
    assert p.for_module("encoder.0.linear") is p


def test_float32_policies_keep_nothing():
    assert get_policy("float32").keep_fp32 == ()
    assert get_policy("float32").for_module("norm", "normalization") == get_policy("float32")


@pytest.mark.parametrize(
    "spec,keep",
    [
        ("c=f16,keep_fp32=none", ()),
        ("c=f16,keep_fp32=loss", ("loss",)),
        ("c=f16,keep_fp32=loss+normalization", ("normalization", "loss")),
        ("c=f16,keep_fp32=softmax+loss+normalization", ALL3),
        ("keep_fp32=loss,c=f32", ("loss",)),
    ],
)
def test_keep_fp32_key(spec, keep):
    p = get_policy(spec)
    assert p.keep_fp32 == keep
    assert get_policy(str(p)) == p
    for category in ALL3:
        expected = F32 if category in keep else p.compute_dtype
        assert p.for_module("m", category).compute_dtype == expected


def test_keep_fp32_written_only_when_not_default():
    assert "keep_fp32" not in str(get_policy("c=f16,keep_fp32=normalization+softmax+loss"))
    assert str(get_policy("c=f16,keep_fp32=none")).endswith(",keep_fp32=none")
    assert str(get_policy("c=f32,keep_fp32=loss")).endswith(",keep_fp32=loss")
    assert get_policy("c=f16,keep_fp32=none") != get_policy("mixed_float16")


def test_overrides_last_match_wins_and_round_trip():
    p = get_policy("mixed_bfloat16").with_overrides(
        [("encoder.*", "float32"), ("encoder.*.norm", "c=f16"), ("category:loss", "p=f32,c=bf16,o=f32")]
    )
    assert p.for_module("encoder.1.attn").compute_dtype == F32
    assert p.for_module("encoder.1.norm").compute_dtype == F16  # later rule wins
    assert p.for_module("encoder.1.norm", "normalization").compute_dtype == F16  # overrides beat keep_fp32
    assert p.for_module("head", "loss").compute_dtype == BF16
    assert p.for_module("head", "softmax").compute_dtype == F32
    assert p.for_module("decoder.0").compute_dtype == BF16
    assert get_policy(str(p)) == p
    assert Policy.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    assert str(p) == (
        "params=float32,compute=bfloat16,output=float32"
        ",@encoder.*={params=float32,compute=float32,output=float32}"
        ",@encoder.*.norm={params=float32,compute=float16,output=float16}"
        ",@category:loss={params=float32,compute=bfloat16,output=float32}"
    )


def test_with_overrides_accepts_mapping_and_override_objects():
    base = get_policy("mixed_float16")
    a = base.with_overrides({"head": "float32"})
    b = base.with_overrides([mpx.Override("head", get_policy("float32"))])
    assert a == b and a != base and base.overrides == ()


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda p: p.for_module("x", "norm"), "category: unknown category 'norm'"),
        (lambda p: p.for_module(3), "path: expected"),
        (lambda p: p.with_overrides({"": "float32"}), "selector"),
        (lambda p: p.with_overrides({"x": "int8"}), "int8"),
        (lambda p: p.with_overrides({"x": get_policy("float32").with_overrides({"y": "c=f16"})}), "cannot have overrides"),
        (lambda p: Policy(F32, F16, F32, keep_fp32="loss"), "keep_fp32: expected a sequence"),
        (lambda p: Policy(F32, F16, F32, overrides="x"), "overrides: expected"),
    ],
)  # fmt: skip
def test_bad_rules(call, message):
    with pytest.raises(PolicyError, match=message):
        call(get_policy("mixed_float16"))


# -- properties ----------------------------------------------------------------------

DTYPE_TOKENS = st.sampled_from(
    ["float32", "f32", "fp32", "float16", "half", "fp16", "bfloat16", "bf16", "f64", "double"]
)
KEY_NAMES = {
    "params": ["p", "params"],
    "compute": ["c", "compute"],
    "output": ["o", "output"],
    "reduce": ["r", "reduce"],
}
SPACE = st.sampled_from(["", " ", "  "])


@st.composite
def key_specs(draw):
    keys = draw(st.lists(st.sampled_from(list(KEY_NAMES)), min_size=1, max_size=4, unique=True))
    parts = []
    chosen = {}
    for key in keys:
        value = draw(DTYPE_TOKENS)
        chosen[key] = mpx.canonical_dtype(value)
        parts.append(f"{draw(st.sampled_from(KEY_NAMES[key]))}{draw(SPACE)}={draw(SPACE)}{value}")
    if draw(st.booleans()):
        cats = draw(st.lists(st.sampled_from(ALL3), max_size=3, unique=True))
        parts.append("keep_fp32=" + ("+".join(cats) or "none"))
        chosen["keep"] = tuple(c for c in ALL3 if c in cats)
    return (draw(SPACE) + ",").join(parts), chosen


@settings(max_examples=300, deadline=None)
@given(key_specs())
def test_key_grammar_property(case):
    spec, chosen = case
    p = get_policy(spec)
    params = chosen.get("params", F32)
    compute = chosen.get("compute", params)
    output = chosen.get("output", compute)
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (params, compute, output)
    assert p.reduce_dtype == chosen.get("reduce", params)
    assert Policy.from_dict(p.to_dict()) == p
    if "keep" in chosen:
        assert p.keep_fp32 == chosen["keep"]
    assert get_policy(str(p)) == p and str(get_policy(str(p))) == str(p)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="pcoarmsetu=,{}@ 1632bfxl_+:.*", max_size=40))
def test_arbitrary_text_parses_or_raises_policy_error(text):
    try:
        p = get_policy(text)
    except PolicyError as err:
        assert str(err)
    else:
        assert get_policy(str(p)) == p


# -- issue #13 item 6 ------------------------------------------------------------------
def test_deeply_nested_policy_dict_raises_policy_error():
    base = {"param_dtype": "float32", "compute_dtype": "bfloat16", "output_dtype": "float32"}
    spec = dict(base)
    inner = spec
    for _ in range(1000):
        inner["overrides"] = [{"selector": "a", "policy": dict(base)}]
        inner = inner["overrides"][0]["policy"]
    with pytest.raises(mpx.PolicyError, match="^override 'a': an override's policy cannot have overrides"):
        mpx.get_policy(spec)


@pytest.mark.parametrize("bad", [np.array([1, 2]), np.array(["softmax"]), 3, None, b"loss"])
def test_keep_fp32_items_that_are_not_names_raise_policy_error(bad):
    with pytest.raises(mpx.PolicyError, match="^keep_fp32: unknown category"):
        mpx.Policy("float32", "float16", "float32", keep_fp32=[bad])


# -- issue #16: the reduce dtype ------------------------------------------------------------


@pytest.mark.parametrize("spec", ["mixed_float16", "mixed_bfloat16", "bfloat16", "float16", "float32"])
def test_reduce_defaults_to_the_param_dtype_and_is_not_written(spec):
    p = get_policy(spec)
    assert p.reduce_dtype == p.param_dtype
    assert "reduce" not in str(p) and p.name == spec
    assert p.to_dict()["reduce_dtype"] == p.param_dtype


def test_reduce_key_sets_the_all_reduce_dtype_and_round_trips():
    p = get_policy("params=float32,compute=bfloat16,output=float32,reduce=bf16")
    assert p.reduce_dtype == "bfloat16" and p.compute_dtype == "bfloat16"
    assert str(p) == "params=float32,compute=bfloat16,output=float32,reduce=bfloat16"
    assert p.name is None and p != get_policy("mixed_bfloat16")
    assert get_policy(str(p)) == p == Policy.from_dict(p.to_dict())
    assert p == Policy("float32", "bfloat16", "float32", reduce_dtype="bf16")
    assert get_policy("r=f16").reduce_dtype == "float16" and get_policy("r=f16").param_dtype == F32


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("mixed_bfloat16,reduce=bf16", "params=float32,compute=bfloat16,output=float32,reduce=bfloat16"),
        ("16-mixed, r=f16", "params=float32,compute=float16,output=float32,reduce=float16"),
        ("mixed_float16,output=f16", "params=float32,compute=float16,output=float16"),
        ("bf16-true,params=f32", "params=float32,compute=bfloat16,output=bfloat16"),
        ("mixed_float16,keep_fp32=none", "params=float32,compute=float16,output=float32,keep_fp32=none"),
    ],
)
def test_a_preset_then_keys(spec, expected):
    assert str(get_policy(spec)) == expected


def test_reduce_reaches_the_float32_rules():
    p = get_policy("params=float32,compute=float16,output=float32,reduce=float16")
    assert p.for_module("norm", category="normalization").reduce_dtype == "float16"


def test_dicts_without_reduce_still_load():
    data = get_policy("mixed_float16").to_dict()
    del data["reduce_dtype"]
    assert Policy.from_dict(data) == get_policy("mixed_float16")


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: get_policy("mixed_float16,,r=f16"), "segment 2 is empty"),
        (lambda: get_policy("mixed_float16,bfloat16,r=f16"), "segment 'bfloat16' is not KEY=VALUE"),
        (lambda: get_policy("reduce=bf16,mixed_float16"), "segment 'mixed_float16' is not KEY=VALUE"),
        (lambda: get_policy("p=f32,reduce=int8"), "^reduce: 'int8' is not a floating dtype"),
        (lambda: get_policy("p=f32,r=f16,reduce=bf16"), "key 'reduce' repeats 'r'"),
        (lambda: Policy(reduce_dtype="int32"), "^reduce: "),
    ],
)
def test_bad_reduce(call, message):
    with pytest.raises(PolicyError, match=message):
        call()


def test_reduce_is_keyword_only():
    with pytest.raises(TypeError):
        Policy("float32", "float16", "float32", None, (), "float16")  # type: ignore[misc]


# -- issue #26: FP8 ------------------------------------------------------------------------

from mpx.float8 import Float8Recipe  # noqa: E402

HYBRID = Float8Recipe()


@pytest.mark.parametrize(
    "spec,recipe",
    [
        ("mixed_bfloat16,fp8=hybrid", HYBRID),
        ("mixed_bfloat16, fp8 = e4m3", Float8Recipe(format="e4m3")),
        ("mixed_bfloat16,fp8=none", None),
        ("mixed_bfloat16_fp8", HYBRID),
        ("mixed_bfloat16_fp8_current", Float8Recipe(scaling="current")),
        ("mixed_bfloat16_fp8,fp8=none", None),
        ("mixed_bfloat16_fp8,fp8=e4m3", Float8Recipe(format="e4m3")),
        ("mixed_bfloat16_fp8_current,fp8=e4m3", Float8Recipe(format="e4m3", scaling="current")),
        (
            "p=f32,c=bf16,o=f32,fp8=hybrid,fp8_scaling=delayed,fp8_history=16,fp8_amax=most_recent,"
            "fp8_margin=2,fp8_pow2=true",
            Float8Recipe(amax_history_len=16, amax_compute="most_recent", margin=2, power_of_two=True),
        ),
        ("fp8_margin=1,fp8=hybrid,c=bf16", Float8Recipe(margin=1)),  # any key order
    ],
)
def test_fp8_key_sets_the_recipe(spec, recipe):
    p = get_policy(spec)
    assert p.fp8 == recipe
    assert (p.param_dtype, p.compute_dtype) == ("float32", "bfloat16")
    assert get_policy(str(p)) == p and str(get_policy(str(p))) == str(p)
    assert Policy.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    assert ("fp8" in str(p)) == (recipe is not None)  # written only when set


def test_fp8_str_writes_only_non_default_recipe_keys():
    assert (
        str(get_policy("mixed_bfloat16,fp8=hybrid"))
        == "params=float32,compute=bfloat16,output=float32,fp8=hybrid"
    )
    assert str(get_policy("mixed_bfloat16,fp8=hybrid,fp8_history=1024,fp8_margin=0")).endswith(",fp8=hybrid")
    assert str(get_policy("mixed_bfloat16,fp8=e4m3,fp8_pow2=true,fp8_scaling=current")).endswith(
        ",fp8=e4m3,fp8_scaling=current,fp8_pow2=true"
    )
    assert str(get_policy("mixed_bfloat16,fp8=none")) == str(get_policy("mixed_bfloat16"))


def test_fp8_presets_and_names():
    assert mpx.FP8_PRESETS["mixed_bfloat16_fp8"] == dataclasses.replace(
        get_policy("mixed_bfloat16"), fp8=HYBRID
    )
    for name, policy in mpx.FP8_PRESETS.items():
        assert get_policy(name) is policy and policy.name == name
        assert get_policy(str(policy)).name == name
        assert name not in mpx.PRESETS  # the dtype presets stay the five every backend's conformance runs
    assert get_policy("mixed_bfloat16,fp8=hybrid,fp8_margin=1").name is None
    assert get_policy("mixed_bfloat16,fp8=e4m3").name is None
    assert get_policy("mixed_bfloat16").name == "mixed_bfloat16"  # fp8 None is part of a dtype preset


def test_fp8_is_a_keyword_only_field_and_policies_differ_by_it():
    p = Policy("float32", "bfloat16", "float32", fp8=HYBRID)
    assert p == get_policy("mixed_bfloat16_fp8") and hash(p) == hash(get_policy("mixed_bfloat16_fp8"))
    assert p != get_policy("mixed_bfloat16")
    with pytest.raises(TypeError):
        Policy("float32", "bfloat16", "float32", None, (), "float32", HYBRID)  # type: ignore[misc]


def test_fp8_applies_to_lower_gemms_only():
    p = get_policy("mixed_bfloat16_fp8")
    assert [op for op in mpx.OP_TABLE if mpx.OP_TABLE.fp8_applies(op, p)] == ["matmul", "linear", "einsum"]
    assert mpx.FP8_OPS == ("linear", "matmul", "einsum")
    for op in ("conv", "bmm", "attention", "softmax", "layer_norm", "add", "relu"):
        assert not mpx.OP_TABLE.fp8_applies(op, p)
    assert not mpx.OP_TABLE.fp8_applies("linear", get_policy("mixed_bfloat16"))
    table = mpx.OP_TABLE.replace(matmul=mpx.OpClass.FLOAT32)
    assert not table.fp8_applies("matmul", p) and table.fp8_applies("linear", p)
    # the float32 rules of keep_fp32 never carry FP8
    for category in ALL3:
        sub = p.for_module("m", category)
        assert sub.fp8 is None and sub.compute_dtype == F32


def test_an_override_naming_no_dtype_starts_from_its_parent():
    p = get_policy("mixed_bfloat16,fp8=hybrid,fp8_history=16,@head={fp8=none},@embed={fp8_margin=3}")
    head, embed, body = p.for_module("head"), p.for_module("embed"), p.for_module("blocks.0.mlp")
    assert body is p
    assert head == get_policy("mixed_bfloat16") and head.fp8 is None  # the parent without FP8, not float32
    assert embed.fp8 == Float8Recipe(amax_history_len=16, margin=3)  # the parent's recipe, one key changed
    assert (embed.param_dtype, embed.compute_dtype, embed.output_dtype) == (F32, BF16, F32)
    assert get_policy(str(p)) == p and Policy.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    assert str(p).endswith(
        ",@head={params=float32,compute=bfloat16,output=float32}"
        ",@embed={params=float32,compute=bfloat16,output=float32,fp8=hybrid,fp8_history=16,fp8_margin=3}"
    )
    # reduce and keep_fp32 come from the parent too
    q = get_policy(
        "mixed_bfloat16,reduce=bf16,keep_fp32=loss,fp8=e4m3,@first={fp8=none},@last={keep_fp32=none}"
    )
    assert q.for_module("first") == get_policy("mixed_bfloat16,reduce=bf16,keep_fp32=loss")
    assert q.for_module("last") == get_policy("mixed_bfloat16,reduce=bf16,keep_fp32=none,fp8=e4m3")
    # an override that names a dtype is a whole spec, as before: no FP8 unless it says so
    r = get_policy("mixed_bfloat16_fp8,@head={c=f32},@mlp={mixed_bfloat16,fp8=e4m3},@x={r=bf16}")
    assert r.for_module("head") == get_policy("float32")
    assert r.for_module("mlp").fp8 == Float8Recipe(format="e4m3")
    assert r.for_module("x") == get_policy("p=f32,r=bf16")


def test_fp8_only_in_an_override():
    p = get_policy("mixed_bfloat16,@blocks.*.mlp.*={fp8=hybrid}")
    assert p.fp8 is None and p.for_module("blocks.0.mlp.fc1").fp8 == HYBRID
    assert get_policy(str(p)) == p


@pytest.mark.parametrize(
    "spec,recipe",
    [
        ("float32,fp8=hybrid", HYBRID),  # FP8 GEMMs in a float32 model (torchao and TE allow it)
        ("float16,fp8=hybrid", HYBRID),  # half parameters: quantized from float16
        ("bfloat16,fp8=e4m3", Float8Recipe(format="e4m3")),
        ("mixed_float16,fp8=hybrid", HYBRID),
    ],
)
def test_fp8_with_float32_and_pure_half_policies(spec, recipe):
    p = get_policy(spec)
    assert p.fp8 == recipe and mpx.OP_TABLE.fp8_applies("linear", p)
    assert get_policy(str(p)) == p


BAD_FP8 = {
    "mixed_bfloat16,fp8=e5m2": "fp8: 'e5m2' is not allowed; allowed: hybrid, e4m3 or none",
    "mixed_bfloat16,fp8=Hybrid": "fp8: 'Hybrid' is not allowed",
    "mixed_bfloat16,fp8=hybrid,fp8_scaling=dynamic": "fp8_scaling: 'dynamic' is not allowed; allowed: delayed or current",
    "mixed_bfloat16,fp8=hybrid,fp8_history=0": r"fp8_history: '0' is not allowed; allowed: an int in \[1, ",
    "mixed_bfloat16,fp8=hybrid,fp8_history=-1": "fp8_history: '-1' is not allowed",
    "mixed_bfloat16,fp8=hybrid,fp8_history=1.5": "fp8_history: '1.5' is not allowed",
    "mixed_bfloat16,fp8=hybrid,fp8_history=99999999999": "fp8_history: '99999999999' is not allowed",
    "mixed_bfloat16,fp8=hybrid,fp8_margin=x": r"fp8_margin: 'x' is not allowed; allowed: an int in \[0, ",
    "mixed_bfloat16,fp8=hybrid,fp8_amax=mean": "fp8_amax: 'mean' is not allowed; allowed: max or most_recent",
    "mixed_bfloat16,fp8=hybrid,fp8_pow2=1": "fp8_pow2: '1' is not allowed; allowed: true or false",
    "mixed_bfloat16,fp8_margin=1": "fp8_margin sets an FP8 recipe field, but this policy has no FP8",
    "mixed_bfloat16,fp8=none,fp8_history=4": "fp8_history sets an FP8 recipe field, but this policy has no FP8",
    "fp8=hybrid": "names no dtype.*only an override's spec starts from its parent",
    "p=f64,fp8=hybrid": "fp8: FP8 GEMMs need a compute dtype of float32, bfloat16 or float16",
    "mixed_bfloat16,fp8=hybrid,fp8=e4m3": "key 'fp8' repeats 'fp8'",
    "mixed_bfloat16,fp8=hybrid,fp8_lag=2": "unknown key 'fp8_lag'; allowed: .*fp8, fp8_scaling, fp8_history",
    "mixed_bfloat16,@head={fp8=fp16}": "fp8: 'fp16' is not allowed",
    "mixed_bfloat16,@head={fp8_pow2=true}": "fp8_pow2 sets an FP8 recipe field, but this policy has no FP8",
}


@pytest.mark.parametrize("spec,message", BAD_FP8.items())
def test_bad_fp8_specs(spec, message):
    with pytest.raises(PolicyError, match=message):
        get_policy(spec)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: Policy(fp8="hybrid"), "fp8: expected an mpx.Float8Recipe or None, got str"),
        (lambda: Policy(fp8=HYBRID.to_dict()), "fp8: expected an mpx.Float8Recipe or None, got dict"),
        (lambda: Policy("float64", "float64", "float64", fp8=HYBRID), "fp8: FP8 GEMMs need a compute dtype"),
        (lambda: Policy.from_dict({**get_policy("bf16").to_dict(), "fp8": {"format": "e5m2"}}),
         "policy dict: fp8: format: 'e5m2' is not allowed"),
        (lambda: Policy.from_dict({**get_policy("bf16").to_dict(), "fp8": "hybrid"}),
         "policy dict: fp8: recipe: expected a mapping"),
    ],
)  # fmt: skip
def test_bad_fp8_values(call, message):
    with pytest.raises(PolicyError, match=message):
        call()


def test_dicts_without_fp8_still_load_and_fp8_is_always_written():
    data = get_policy("mixed_bfloat16").to_dict()
    assert data["fp8"] is None
    del data["fp8"]
    assert Policy.from_dict(data) == get_policy("mixed_bfloat16")
    d = get_policy("mixed_bfloat16_fp8").to_dict()
    assert d["fp8"] == HYBRID.to_dict()


def test_policy_show_prints_the_recipe(capsys):
    from mpx.cli import main

    assert main(["policy", "show", "mixed_bfloat16,fp8=hybrid,fp8_history=16,@head={fp8=none}"]) == 0
    out = capsys.readouterr().out
    assert (
        "fp8      hybrid (e4m3 inputs and weights, e5m2 gradients); delayed scaling (history 16, amax max), "
        "margin 0, power-of-two scales off; ops: matmul, linear, einsum"
    ) in out
    assert "  linear           lower        bfloat16  (FP8 GEMM)" in out
    assert "  bmm              lower        bfloat16\n" in out
    assert "  head                         -> params=float32,compute=bfloat16,output=float32" in out
    assert main(["policy", "show", "mixed_bfloat16"]) == 0
    assert "fp8      none" in capsys.readouterr().out
    assert main(["policy", "show", "--json", "mixed_bfloat16_fp8_current"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (
        info["fp8"] == Float8Recipe(scaling="current").to_dict()
        and info["name"] == "mixed_bfloat16_fp8_current"
    )
    assert info["fp8_ops"] == ["matmul", "linear", "einsum"]
    assert main(["policy", "list"]) == 0
    assert (
        "mixed_bfloat16_fp8_current params=float32,compute=bfloat16,output=float32,fp8=hybrid,fp8_scaling=current"
        in (capsys.readouterr().out)
    )


FP8_KEY_VALUES = {
    "fp8_scaling": ["delayed", "current"],
    "fp8_history": ["1", "2", "16", "1024", "2147483647"],
    "fp8_amax": ["max", "most_recent"],
    "fp8_margin": ["0", "1", "7", "2147483647"],
    "fp8_pow2": ["true", "false"],
}


@st.composite
def fp8_specs(draw):
    """A key spec with an FP8 recipe (or fp8=none), maybe an override that names no dtype."""
    base, chosen = draw(key_specs())
    fmt = draw(st.sampled_from(["hybrid", "e4m3", "none"]))
    assume_compute = chosen.get("compute", chosen.get("params", F32))
    parts = [base, f"fp8{draw(SPACE)}={draw(SPACE)}{fmt}"]
    fields = {}
    if fmt != "none":
        for key in draw(st.lists(st.sampled_from(list(FP8_KEY_VALUES)), unique=True, max_size=5)):
            value = draw(st.sampled_from(FP8_KEY_VALUES[key]))
            parts.append(f"{key}={value}")
            raw = {"true": True, "false": False}.get(value, value)
            fields[mpx.policy.FP8_KEYS[key]] = int(raw) if key in ("fp8_history", "fp8_margin") else raw
    order = draw(st.permutations(parts))
    override = draw(st.sampled_from(["", "@head={fp8=none}", "@head={fp8=e4m3}", "@x.*={c=f32}"]))
    spec = ",".join(order) + ("," + override if override else "")
    recipe = None if fmt == "none" else Float8Recipe(format=fmt, **fields)
    return spec, recipe, assume_compute, override


@settings(max_examples=300, deadline=None)
@given(fp8_specs())
def test_fp8_round_trip_property(case):
    spec, recipe, compute, override = case
    if compute == F64 and (recipe is not None or override == "@head={fp8=e4m3}"):
        with pytest.raises(PolicyError, match="fp8: FP8 GEMMs need a compute dtype"):
            get_policy(spec)
        return
    p = get_policy(spec)
    assert p.fp8 == recipe
    assert get_policy(str(p)) == p and str(get_policy(str(p))) == str(p)
    assert Policy.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    if override == "@head={fp8=none}":
        assert p.for_module("head") == dataclasses.replace(p, overrides=(), fp8=None)
    elif override == "@head={fp8=e4m3}":
        expected = dataclasses.replace(recipe or HYBRID, format="e4m3")
        assert p.for_module("head") == dataclasses.replace(p, overrides=(), fp8=expected)
