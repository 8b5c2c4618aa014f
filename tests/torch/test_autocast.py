"""mpx_torch.autocast: every canonical op returns the dtype mpx.result_dtype names."""

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mpx
import mpx_torch
from mpx_torch._ops import FUNCTIONS

HALF = {"float16": torch.float16, "bfloat16": torch.bfloat16}
NAMES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
}


def _cases():
    """op -> {call form: f(dtype, device) -> output tensor}."""

    def x(dt, dev, *shape):
        g = torch.Generator().manual_seed(0)
        return torch.randn(*(shape or (4, 8)), generator=g).to(dev, dt)

    tgt = lambda dev: torch.tensor([1, 0, 3, 2], device=dev)  # noqa: E731
    return {
        "matmul": {
            "@": lambda d, v: x(d, v) @ x(d, v, 8, 3),
            "torch.matmul": lambda d, v: torch.matmul(x(d, v), x(d, v, 8, 3)),
            "torch.mm": lambda d, v: torch.mm(x(d, v), x(d, v, 8, 3)),
        },
        "linear": {"F.linear": lambda d, v: F.linear(x(d, v), x(d, v, 3, 8), x(d, v, 3))},
        "conv": {
            "F.conv2d": lambda d, v: F.conv2d(x(d, v, 1, 2, 5, 5), x(d, v, 3, 2, 3, 3)),
            "F.conv1d": lambda d, v: F.conv1d(x(d, v, 1, 2, 5), x(d, v, 3, 2, 3)),
        },
        "conv_transpose": {
            "F.conv_transpose2d": lambda d, v: F.conv_transpose2d(x(d, v, 1, 2, 5, 5), x(d, v, 2, 3, 3, 3))
        },
        "bmm": {
            "torch.bmm": lambda d, v: torch.bmm(x(d, v, 2, 4, 8), x(d, v, 2, 8, 3)),
            "Tensor.bmm": lambda d, v: x(d, v, 2, 4, 8).bmm(x(d, v, 2, 8, 3)),
        },
        "einsum": {"torch.einsum": lambda d, v: torch.einsum("ij,jk->ik", x(d, v), x(d, v, 8, 3))},
        "attention": {
            "F.scaled_dot_product_attention": lambda d, v: F.scaled_dot_product_attention(
                x(d, v, 1, 2, 4, 8), x(d, v, 1, 2, 4, 8), x(d, v, 1, 2, 4, 8)
            )
        },
        "softmax": {
            "torch.softmax": lambda d, v: torch.softmax(x(d, v), -1),
            "F.softmax": lambda d, v: F.softmax(x(d, v), dim=-1),
            "Tensor.softmax": lambda d, v: x(d, v).softmax(-1),
            "nn.Softmax": lambda d, v: nn.Softmax(-1)(x(d, v)),
        },
        "log_softmax": {
            "F.log_softmax": lambda d, v: F.log_softmax(x(d, v), -1),
            "Tensor.log_softmax": lambda d, v: x(d, v).log_softmax(-1),
            "torch.log_softmax": lambda d, v: torch.log_softmax(x(d, v), -1),
        },
        "layer_norm": {
            "F.layer_norm": lambda d, v: F.layer_norm(x(d, v), (8,)),
            "nn.LayerNorm": lambda d, v: nn.LayerNorm(8).to(v, d)(x(d, v)),
        },
        "batch_norm": {
            "F.batch_norm": lambda d, v: F.batch_norm(
                x(d, v), torch.zeros(8, device=v), torch.ones(8, device=v), training=True
            ),
            "nn.BatchNorm1d": lambda d, v: nn.BatchNorm1d(8).to(v)(x(d, v)),
        },
        "group_norm": {
            "F.group_norm": lambda d, v: F.group_norm(x(d, v, 2, 4, 3), 2),
            "nn.GroupNorm": lambda d, v: nn.GroupNorm(2, 4).to(v, d)(x(d, v, 2, 4, 3)),
        },
        "rms_norm": {
            "F.rms_norm": lambda d, v: F.rms_norm(x(d, v), (8,)),
            "nn.RMSNorm": lambda d, v: nn.RMSNorm(8).to(v, d)(x(d, v)),
        },
        "cross_entropy": {
            "F.cross_entropy": lambda d, v: F.cross_entropy(x(d, v), tgt(v)),
            "nn.CrossEntropyLoss": lambda d, v: nn.CrossEntropyLoss()(x(d, v), tgt(v)),
        },
        "nll_loss": {"F.nll_loss": lambda d, v: F.nll_loss(x(d, v), tgt(v))},
        "mse_loss": {"F.mse_loss": lambda d, v: F.mse_loss(x(d, v), x(d, v))},
        "bce_with_logits": {
            "F.binary_cross_entropy_with_logits": lambda d, v: F.binary_cross_entropy_with_logits(
                x(d, v), torch.rand(4, 8, device=v).to(d)
            )
        },
        "exp": {"torch.exp": lambda d, v: torch.exp(x(d, v)), "Tensor.exp": lambda d, v: x(d, v).exp()},
        "log": {
            "torch.log": lambda d, v: torch.log(x(d, v).abs()),
            "Tensor.log1p": lambda d, v: x(d, v).abs().log1p(),
        },
        "pow": {
            "**": lambda d, v: x(d, v) ** 2,
            "rpow": lambda d, v: 2 ** x(d, v),
            "torch.pow": lambda d, v: torch.pow(x(d, v), 3),
        },
        "sum": {
            "Tensor.sum": lambda d, v: x(d, v).sum(),
            "torch.sum": lambda d, v: torch.sum(x(d, v), dim=0),
        },
        "mean": {
            "Tensor.mean": lambda d, v: x(d, v).mean(),
            "torch.mean": lambda d, v: torch.mean(x(d, v), 1),
        },
        "cumsum": {
            "Tensor.cumsum": lambda d, v: x(d, v).cumsum(0),
            "torch.cumsum": lambda d, v: torch.cumsum(x(d, v), 1),
        },
        "prod": {
            "Tensor.prod": lambda d, v: x(d, v).prod(),
            "torch.prod": lambda d, v: torch.prod(x(d, v), 1),
        },
        "logsumexp": {
            "Tensor.logsumexp": lambda d, v: x(d, v).logsumexp(-1),
            "torch.logsumexp": lambda d, v: torch.logsumexp(x(d, v), 0),
        },
        "vector_norm": {
            "torch.linalg.vector_norm": lambda d, v: torch.linalg.vector_norm(x(d, v)),
            "Tensor.norm": lambda d, v: x(d, v).norm(),
        },
        "add": {"+": lambda d, v: x(d, v) + x(d, v), "torch.add": lambda d, v: torch.add(x(d, v), x(d, v))},
        "mul": {"*": lambda d, v: x(d, v) * x(d, v)},
        "cat": {"torch.cat": lambda d, v: torch.cat([x(d, v), x(d, v)])},
        "stack": {"torch.stack": lambda d, v: torch.stack([x(d, v), x(d, v)])},
        "where": {"torch.where": lambda d, v: torch.where(x(d, v) > 0, x(d, v), x(d, v))},
        "relu": {"F.relu": lambda d, v: F.relu(x(d, v)), "Tensor.relu": lambda d, v: x(d, v).relu()},
        "gelu": {"F.gelu": lambda d, v: F.gelu(x(d, v))},
        "max_pool": {
            "F.max_pool2d": lambda d, v: F.max_pool2d(x(d, v, 1, 2, 4, 4), 2),
            "F.max_pool3d": lambda d, v: F.max_pool3d(x(d, v, 1, 2, 4, 4, 4), 2),
        },
        "reshape": {
            "Tensor.reshape": lambda d, v: x(d, v).reshape(-1),
            "Tensor.view": lambda d, v: x(d, v).view(-1),
        },
        "transpose": {
            "Tensor.transpose": lambda d, v: x(d, v).transpose(0, 1),
            "Tensor.t": lambda d, v: x(d, v).t(),
        },
        "dropout": {"F.dropout": lambda d, v: F.dropout(x(d, v), 0.5)},
        "embedding": {"F.embedding": lambda d, v: F.embedding(tgt(v), x(d, v))},
    }


CASES = _cases()
PARAMS = [pytest.param(op, form, id=f"{op}-{form}") for op, forms in CASES.items() for form in forms]


def test_every_canonical_op_has_cases_and_functions():
    assert set(CASES) == set(mpx.OP_TABLE) == set(FUNCTIONS)
    assert all(FUNCTIONS[op] for op in FUNCTIONS)


@pytest.mark.parametrize("compute", ["float16", "bfloat16"])
@pytest.mark.parametrize("in_dtype", ["float32", "half"])
@pytest.mark.parametrize(("op", "form"), PARAMS)
def test_op_dtype_under_mpx(op, form, compute, in_dtype, device):
    policy = mpx.get_policy(f"mixed_{compute}")
    dt = HALF[compute] if in_dtype == "half" else torch.float32
    expected = mpx.result_dtype(op, policy, [NAMES[dt]])
    with mpx_torch.autocast(policy, device):
        out = CASES[op][form](dt, device)
    assert NAMES[out.dtype] == expected, (op, form)


def test_native_cpu_autocast_differs_where_documented():
    """What mpx fixes: torch's CPU autocast keeps these FLOAT32 ops in half precision."""
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        native = {
            "softmax": torch.softmax(x, -1).dtype,
            "layer_norm": F.layer_norm(x, (8,)).dtype,
            "exp": x.exp().dtype,
            "sum": x.sum().dtype,
            "mean": x.mean().dtype,
            "pow": (x**2).dtype,
        }
    assert set(native.values()) == {torch.bfloat16}
    with mpx_torch.autocast("mixed_bfloat16", "cpu"):
        assert torch.softmax(x, -1).dtype == torch.float32
        assert F.layer_norm(x, (8,)).dtype == torch.float32


@pytest.mark.parametrize("compute", ["float16", "bfloat16"])
def test_promote_takes_widest_of_mixed_inputs(compute, device):
    h = torch.randn(4, 8, dtype=HALF[compute], device=device)
    f = torch.randn(4, 8, device=device)
    other = torch.randn(4, 8, device=device, dtype=torch.bfloat16 if compute == "float16" else torch.float16)
    with mpx_torch.autocast(f"mixed_{compute}", device):
        for a, b in ((h, f), (h, other)):
            expected = mpx.result_dtype("add", f"mixed_{compute}", [NAMES[a.dtype], NAMES[b.dtype]])
            assert NAMES[(a + b).dtype] == expected == "float32"
            assert NAMES[torch.cat([a, b]).dtype] == expected
            assert NAMES[torch.stack([a, b]).dtype] == expected
            assert NAMES[torch.where(a > 0, a, b).dtype] == expected


@pytest.mark.parametrize(("op", "form"), [p for p in PARAMS if p.values[0] in mpx.OP_CATEGORIES])
def test_keep_fp32_none_lowers_the_categories(op, form, device):
    policy = mpx.get_policy("params=float32,compute=bfloat16,output=float32,keep_fp32=none")
    assert mpx.classify(op, policy) is mpx.OpClass.LOWER
    with mpx_torch.autocast(policy, device):
        out = CASES[op][form](torch.float32, device)
    assert NAMES[out.dtype] == mpx.result_dtype(op, policy, ["float32"])


def test_keep_fp32_subset():
    policy = mpx.get_policy("params=float32,compute=bfloat16,keep_fp32=normalization")
    x = torch.randn(4, 8)
    with mpx_torch.autocast(policy, "cpu"):
        assert F.layer_norm(x, (8,)).dtype == torch.float32
        assert torch.softmax(x, -1).dtype == torch.bfloat16
        assert F.cross_entropy(x, torch.tensor([0, 1, 2, 3])).dtype == torch.bfloat16
        assert x.exp().dtype == torch.float32  # no category: always FLOAT32


@pytest.mark.parametrize("spec", ["float32", "params=float64,compute=float64"])
def test_float32_policy_is_a_no_op(spec):
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with mpx_torch.autocast(spec, "cpu") as ctx:
        assert torch.overrides._get_current_function_mode() is None
        assert not torch.is_autocast_enabled("cpu")
        assert torch.softmax(x, -1).dtype == torch.bfloat16
        assert (torch.randn(3, 3) @ torch.randn(3, 3)).dtype == torch.float32
    assert ctx.policy.compute_dtype in ("float32", "float64")


def test_nested_float32_region_turns_autocast_off_and_casts_up():
    x = torch.randn(4, 8)
    w = torch.randn(8, 8, dtype=torch.bfloat16)
    with mpx_torch.autocast("mixed_bfloat16", "cpu"):
        h = x @ torch.randn(8, 8)
        assert h.dtype == torch.bfloat16
        with mpx_torch.autocast("float32", "cpu"):
            assert not torch.is_autocast_enabled("cpu")
            assert (x @ x.T).dtype == torch.float32
            assert F.linear(h, w).dtype == torch.float32  # half inputs computed in float32
            assert h.exp().dtype == torch.float32
        assert torch.is_autocast_enabled("cpu")
        assert (x @ x.T).dtype == torch.bfloat16
        with mpx_torch.autocast("mixed_float16", "cpu"):
            assert (x @ x.T).dtype == torch.float16
        assert (x @ x.T).dtype == torch.bfloat16
    assert torch.overrides._get_current_function_mode() is None
    assert not torch.is_autocast_enabled("cpu")


def test_float32_inside_native_autocast_turns_it_off():
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with mpx_torch.autocast("float32", "cpu"):
            assert (x @ x.T).dtype == torch.float32
        assert (x @ x.T).dtype == torch.bfloat16


def test_decorator_and_reentry():
    ctx = mpx_torch.autocast("mixed_bfloat16", "cpu")

    @ctx
    def f(x, depth):
        assert (x @ x.T).dtype == torch.bfloat16
        return f(x, depth - 1) if depth else torch.softmax(x, -1)

    x = torch.randn(3, 3)
    assert f(x, 3).dtype == torch.float32
    with ctx, ctx:
        assert (x @ x.T).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")
    assert torch.overrides._get_current_function_mode() is None


def test_exit_on_exception_restores_everything():
    with pytest.raises(KeyError), mpx_torch.autocast("mixed_float16", "cpu"):
        raise KeyError("boom")
    assert not torch.is_autocast_enabled("cpu")
    assert torch.overrides._get_current_function_mode() is None


def test_threads_have_their_own_state():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    seen = []
    with mpx_torch.autocast("mixed_bfloat16", "cpu"):
        t = threading.Thread(target=lambda: seen.append(torch.softmax(x, -1).dtype))
        t.start()
        t.join()
        assert torch.softmax(x, -1).dtype == torch.float32
    assert seen == [torch.bfloat16]  # the other thread is not under autocast


def test_explicit_dtype_and_out_are_left_to_torch():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    out = torch.empty(4, 8, dtype=torch.bfloat16)
    with mpx_torch.autocast("mixed_bfloat16", "cpu"):
        assert torch.softmax(x, -1, dtype=torch.float64).dtype == torch.float64
        assert x.sum(dtype=torch.bfloat16).dtype == torch.bfloat16
        assert torch.exp(x, out=out) is out
        assert x.clone().exp_().dtype == torch.bfloat16  # in place: cannot change dtype
        assert torch.softmax(x.double(), -1).dtype == torch.float64  # float64 stays float64


def test_gradients_flow_through_casts_in_input_dtypes():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    with mpx_torch.autocast("mixed_bfloat16", "cpu"):
        h = x @ w
        y = torch.softmax(h, -1)
        loss = (y * y).sum()
    assert (h.dtype, y.dtype, loss.dtype) == (torch.bfloat16, torch.float32, torch.float32)
    loss.backward()
    assert w.grad is not None and w.grad.dtype == torch.float32 and torch.isfinite(w.grad).all()


@pytest.mark.parametrize("stats_dtype", [torch.float32, torch.bfloat16])
def test_batch_norm_running_stats_are_updated(stats_dtype):
    x = torch.randn(16, 8, dtype=torch.bfloat16) * 3 + 2
    mean = torch.zeros(8, dtype=stats_dtype)
    var = torch.ones(8, dtype=stats_dtype)
    with mpx_torch.autocast("mixed_bfloat16", "cpu"):
        out = F.batch_norm(x, mean, var, training=True, momentum=1.0)
    assert out.dtype == torch.float32
    assert mean.dtype == stats_dtype
    torch.testing.assert_close(mean.float(), x.float().mean(0), atol=0.05, rtol=0.02)
    assert not torch.equal(var, torch.ones(8, dtype=stats_dtype))


def test_custom_op_table_reclassifies():
    table = mpx.OP_TABLE.replace(matmul="float32", gelu="float32", softmax="passthrough", add="lower")
    x = torch.randn(4, 8)
    with mpx_torch.autocast("mixed_bfloat16", "cpu", op_table=table):
        assert (x @ x.T).dtype == torch.float32
        assert F.gelu(x.bfloat16()).dtype == torch.float32
        assert torch.softmax(x, -1).dtype == torch.float32
        assert torch.softmax(x.bfloat16(), -1).dtype == torch.bfloat16
        assert (x + x).dtype == torch.bfloat16
        assert F.linear(x, torch.randn(3, 8)).dtype == torch.bfloat16  # untouched ops as before


def test_errors():
    with pytest.raises(mpx.PolicyError):
        mpx_torch.autocast("mixed_float17")
    with pytest.raises(mpx.MPXError, match="device_type"):
        mpx_torch.autocast("mixed_bfloat16", "gpu0")
    with pytest.raises(mpx.MPXError, match="op_table"):
        mpx_torch.autocast("mixed_bfloat16", "cpu", op_table={"matmul": "lower"})
    with (
        pytest.raises(mpx.MPXError, match="no PyTorch functions"),
        mpx_torch.autocast("mixed_bfloat16", "cpu", op_table=mpx.OP_TABLE.replace(my_op="lower")),
    ):
        pass


def test_default_device_types_include_cpu_and_cuda_when_present():
    ctx = mpx_torch.autocast("mixed_bfloat16")
    assert ctx.device_types[0] == "cpu"
    assert ("cuda" in ctx.device_types) == torch.cuda.is_available()
    with ctx:
        assert torch.is_autocast_enabled("cpu")
        assert torch.softmax(torch.randn(2, 2, dtype=torch.bfloat16), -1).dtype == torch.float32


def _float32_calls():
    x = torch.randn(4, 8).abs().bfloat16() + 0.5
    p = torch.rand(4, 8).bfloat16()
    img = x.reshape(2, 4, 4)
    z, o = torch.zeros(8), torch.ones(8)
    tgt = torch.tensor([1, 0, 3, 2])
    T, sp = torch.Tensor, torch.special
    return {
        torch.softmax: lambda: torch.softmax(x, -1), T.softmax: lambda: x.softmax(-1),
        F.softmax: lambda: F.softmax(x, -1), sp.softmax: lambda: sp.softmax(x, -1),
        torch.log_softmax: lambda: torch.log_softmax(x, -1), T.log_softmax: lambda: x.log_softmax(-1),
        F.log_softmax: lambda: F.log_softmax(x, -1), sp.log_softmax: lambda: sp.log_softmax(x, -1),
        F.layer_norm: lambda: F.layer_norm(x, (8,)), torch.layer_norm: lambda: torch.layer_norm(x, (8,)),
        F.batch_norm: lambda: F.batch_norm(x, z.clone(), o.clone(), training=True),
        torch.batch_norm: lambda: torch.batch_norm(x, None, None, z.clone(), o.clone(), True, 0.1, 1e-5, False),
        F.group_norm: lambda: F.group_norm(img, 2), torch.group_norm: lambda: torch.group_norm(img, 2),
        F.rms_norm: lambda: F.rms_norm(x, (8,)), torch.rms_norm: lambda: torch.rms_norm(x, (8,)),
        F.cross_entropy: lambda: F.cross_entropy(x, tgt), F.nll_loss: lambda: F.nll_loss(x, tgt),
        F.mse_loss: lambda: F.mse_loss(x, p),
        F.binary_cross_entropy_with_logits: lambda: F.binary_cross_entropy_with_logits(x, p),
        torch.binary_cross_entropy_with_logits: lambda: torch.binary_cross_entropy_with_logits(x, p),
        torch.exp: lambda: torch.exp(x), T.exp: lambda: x.exp(), torch.exp2: lambda: torch.exp2(x),
        T.exp2: lambda: x.exp2(), torch.expm1: lambda: torch.expm1(x), T.expm1: lambda: x.expm1(),
        sp.exp2: lambda: sp.exp2(x), sp.expm1: lambda: sp.expm1(x),
        torch.log: lambda: torch.log(x), T.log: lambda: x.log(), torch.log2: lambda: torch.log2(x),
        T.log2: lambda: x.log2(), torch.log10: lambda: torch.log10(x), T.log10: lambda: x.log10(),
        torch.log1p: lambda: torch.log1p(x), T.log1p: lambda: x.log1p(), sp.log1p: lambda: sp.log1p(x),
        torch.pow: lambda: torch.pow(x, 2), T.pow: lambda: x.pow(2), T.__pow__: lambda: x**2,
        T.__rpow__: lambda: 2**x,
        torch.sum: lambda: torch.sum(x), T.sum: lambda: x.sum(), torch.nansum: lambda: torch.nansum(x),
        T.nansum: lambda: x.nansum(), torch.mean: lambda: torch.mean(x), T.mean: lambda: x.mean(),
        torch.nanmean: lambda: torch.nanmean(x), T.nanmean: lambda: x.nanmean(),
        torch.cumsum: lambda: torch.cumsum(x, 0), T.cumsum: lambda: x.cumsum(0),
        torch.prod: lambda: torch.prod(x), T.prod: lambda: x.prod(),
        torch.logsumexp: lambda: torch.logsumexp(x, 0), T.logsumexp: lambda: x.logsumexp(0),
        sp.logsumexp: lambda: sp.logsumexp(x, 0),
        torch.linalg.vector_norm: lambda: torch.linalg.vector_norm(x), torch.linalg.norm: lambda: torch.linalg.norm(x),
        torch.norm: lambda: torch.norm(x), T.norm: lambda: x.norm(),
    }  # fmt: skip


def test_every_float32_function_is_reached():
    calls = _float32_calls()
    float32_funcs = {f for op in mpx.OP_TABLE.ops("float32") for f, _ in FUNCTIONS[op]}
    assert set(calls) == float32_funcs
    with mpx_torch.autocast("mixed_bfloat16", "cpu"):
        got = {getattr(f, "__qualname__", f): call().dtype for f, call in calls.items()}
    assert set(got.values()) == {torch.float32}, got


def test_recompute_takes_a_bool_and_pickles():
    """``recompute`` (issue 23): a bool; the context pickles with it (its tables are rebuilt)."""
    import pickle

    with pytest.raises(mpx.MPXError, match="recompute: expected True or False"):
        mpx_torch.autocast("mixed_bfloat16", "cpu", recompute="yes")
    ctx = pickle.loads(pickle.dumps(mpx_torch.autocast("mixed_bfloat16", "cpu", recompute=False)))
    assert ctx.recompute is False
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    with ctx:
        y = torch.softmax(x, -1)
    assert y.dtype == torch.float32 and y.grad_fn.name() != "Float32RecomputeBackward"
    with mpx_torch.autocast("mixed_bfloat16", "cpu"):
        z = torch.softmax(x, -1)
    assert torch.equal(y, z) and z.grad_fn.name() == "Float32RecomputeBackward"
