import pytest

import mpx
from mpx import OP_TABLE, OpClass, OpTable

DESIGN = {
    OpClass.LOWER: "matmul linear conv conv_transpose bmm einsum attention",
    OpClass.FLOAT32: "softmax log_softmax layer_norm batch_norm group_norm rms_norm cross_entropy nll_loss "
    "mse_loss bce_with_logits exp log pow sum mean cumsum prod logsumexp vector_norm",
    OpClass.PROMOTE: "add mul cat stack where",
    OpClass.PASSTHROUGH: "relu gelu max_pool reshape transpose dropout embedding",
}
CASES = [(op, cls) for cls, ops in DESIGN.items() for op in ops.split()]


def test_table_is_exactly_the_design_table():
    assert dict(OP_TABLE) == dict(CASES)
    for cls, ops in DESIGN.items():
        assert OP_TABLE.ops(cls) == tuple(ops.split())


@pytest.mark.parametrize("op,cls", CASES)
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16", "float16", "bfloat16"])
@pytest.mark.parametrize("inputs", [["float32"], ["float16"], ["bfloat16"], ["float32", "float16"]])
def test_result_dtype_under_half_policies(op, cls, policy, inputs):
    p = mpx.get_policy(policy)
    expected = {
        OpClass.LOWER: p.compute_dtype,
        OpClass.FLOAT32: "float32",
        OpClass.PROMOTE: "float32" if len(set(inputs)) > 1 else inputs[0],
        OpClass.PASSTHROUGH: inputs[0],
    }[cls]
    assert mpx.classify(op) is cls
    assert mpx.result_dtype(op, policy, inputs) == expected


@pytest.mark.parametrize("op,cls", CASES)
@pytest.mark.parametrize("inputs", [["float16"], ["float32"], ["bfloat16", "float16"]])
def test_float32_policy_is_a_no_op(op, cls, inputs):
    assert mpx.result_dtype(op, "float32", inputs) == mpx.widest_dtype(inputs)


def test_float64_inputs_are_never_narrowed_to_float32():
    assert mpx.result_dtype("softmax", "mixed_float16", ["float64"]) == "float64"
    assert mpx.result_dtype("matmul", "mixed_float16", ["float64"]) == "float16"


@pytest.mark.parametrize(
    "op,keep,expected",
    [
        ("softmax", "none", "bfloat16"),
        ("layer_norm", "softmax", "bfloat16"),
        ("layer_norm", "normalization", "float32"),
        ("mse_loss", "normalization", "bfloat16"),
        ("exp", "none", "float32"),  # no category: always float32
        ("sum", "none", "float32"),
    ],
)
def test_keep_fp32_changes_categorised_ops(op, keep, expected):
    policy = f"c=bf16,o=f32,keep_fp32={keep}"
    assert mpx.result_dtype(op, policy, ["bfloat16"]) == expected
    assert mpx.classify(op, policy) is (OpClass.FLOAT32 if expected == "float32" else OpClass.LOWER)


def test_op_table_copies_with_changes():
    t = OP_TABLE.replace({"softmax": "lower"}, silu=OpClass.PASSTHROUGH)
    assert t["softmax"] is OpClass.LOWER and t["silu"] is OpClass.PASSTHROUGH
    assert OP_TABLE["softmax"] is OpClass.FLOAT32 and "silu" not in OP_TABLE
    assert t.result_dtype("softmax", "mixed_float16", "float32") == "float16"
    assert "relu" not in OP_TABLE.without("relu") and len(OP_TABLE.without("relu")) == len(OP_TABLE) - 1
    assert OpTable(dict(OP_TABLE)) == OP_TABLE and hash(OpTable(dict(OP_TABLE))) == hash(OP_TABLE)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: mpx.classify("softmaxx"), "op: 'softmaxx' is not in the op table; known ops: .*softmax"),
        (lambda: OP_TABLE.replace(gelu="fp32"), "gelu: 'fp32' is not an op class; allowed: lower, float32"),
        (lambda: OpTable({"": "lower"}), "op: expected a non-empty"),
        (lambda: mpx.result_dtype("matmul", "mixed_float16", []), "input_dtypes: at least one"),
        (lambda: mpx.result_dtype("matmul", "mixed_float16", ["int32"]), "input_dtypes: 'int32'"),
        (lambda: mpx.result_dtype("matmul", "mixd", ["float32"]), "unknown policy name"),
        (lambda: OP_TABLE.without("nope"), "'nope' is not in the op table"),
    ],
)
def test_bad_input(call, message):
    with pytest.raises(mpx.MPXError, match=message):
        call()
