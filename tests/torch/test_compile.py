"""``torch.compile`` of prepared models, ``mpx_torch.autocast`` regions and ``GradScaler`` steps (issue 14).

Graphs are counted with a counting backend and ``torch._dynamo.utils.counters``
(cross-checked with ``torch._dynamo.explain``); dtypes are read from the
captured FX graphs (dynamo's and the ATen graph AOTAutograd traces).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

import mpx
import mpx_torch

BF16, F32 = torch.bfloat16, torch.float32


class Block(nn.Module):
    """A small pre-norm transformer block: LayerNorm, attention with softmax, MLP."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, -1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax(q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5, -1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 4)
    )


MODELS = {
    "mlp": (_mlp, (8, 16)),
    "block": (Block, (2, 8, 32)),
    "cnn": (_cnn, (4, 3, 8, 8)),
}


class Counting:
    """A dynamo backend that keeps every graph it is given and runs it as traced."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs.append(gm)
        return gm.forward


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _model(name: str, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    make, shape = MODELS[name]
    torch.manual_seed(seed)
    return make(), torch.randn(*shape)


def _breaks() -> int:
    return sum(counters["graph_break"].values())


# -- item 1: prepared models and autocast regions ----------------------------------------------------
@pytest.mark.parametrize("name", list(MODELS))
def test_prepared_model_compiles_to_native_graph_count(name):
    native, x = _model(name)
    prepared = mpx_torch.prepare(copy.deepcopy(native), "mixed_bfloat16")
    prepared.train(False), native.train(False)

    def native_forward(x):
        with torch.autocast("cpu", dtype=BF16):
            return native(x)

    expected = prepared(x)
    counts = {}
    for label, fn in (("native", native_forward), ("mpx", prepared)):
        torch._dynamo.reset()
        counters.clear()
        backend = Counting()
        compiled = torch.compile(fn, backend=backend, fullgraph=True)
        outs = [compiled(x) for _ in range(3)]
        counts[label] = (len(backend.graphs), _breaks(), counters["stats"]["unique_graphs"])
        if label == "mpx":
            for out in outs:
                assert out.dtype == F32
                assert torch.equal(out, expected)  # the traced ops run as eager mpx's
    assert counts["mpx"] == counts["native"] == (1, 0, 1)
    # explain agrees (it under-reports breaks in some cases, so the counters above are the check)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(prepared)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)


def test_softmax_and_loss_modules_and_path_overrides_compile_fullgraph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4), nn.LogSoftmax(-1))
    # a path override (model[2] computes in float32) as well as the norm and softmax categories
    mpx_torch.prepare(model, "params=float32,compute=bfloat16,output=float32,@2={compute=float32}")
    loss_fn = mpx_torch.prepare(nn.NLLLoss(), "mixed_bfloat16")
    x, t = torch.randn(6, 8), torch.randint(0, 4, (6,))

    def f(x, t):
        out = model(x)
        return out, loss_fn(out, t)

    backend = Counting()
    got = torch.compile(f, backend=backend, fullgraph=True)(x, t)
    want = f(x, t)
    assert (len(backend.graphs), _breaks()) == (1, 0)
    assert [g.dtype for g in got] == [F32, F32]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    linears = [n for n in backend.graphs[0].graph.nodes if getattr(n.target, "__name__", "") == "linear"]
    assert [n.meta["example_value"].dtype for n in linears] == [BF16, F32]  # model[2] is overridden


def _op_of(node: torch.fx.Node) -> str | None:
    name = getattr(node.target, "__name__", node.target)
    return {
        "linear": "linear", "matmul": "matmul", "conv2d": "conv", "softmax": "softmax",
        "layer_norm": "layer_norm", "batch_norm": "batch_norm", "gelu": "gelu", "relu": "relu",
    }.get(name)  # fmt: skip


def _tensor_inputs(node: torch.fx.Node) -> list[torch.Tensor]:
    vals = [a.meta.get("example_value") for a in node.all_input_nodes]
    return [v for v in vals if isinstance(v, torch.Tensor) and v.is_floating_point()]


@pytest.mark.parametrize("name", list(MODELS))
def test_dtypes_inside_the_captured_graph_follow_the_op_table(name):
    model, x = _model(name)
    policy = mpx.get_policy("mixed_bfloat16")
    mpx_torch.prepare(model, policy)
    backend = Counting()
    torch.compile(model, backend=backend, fullgraph=True)(x)
    (graph,) = backend.graphs
    seen = set()
    for node in graph.graph.nodes:
        op = _op_of(node)
        if op is None:
            continue
        seen.add(op)
        out = node.meta["example_value"]
        # norms, softmax: their module's float32 region (category override) or the FLOAT32 op class
        cls = mpx.OP_TABLE.classify(op, policy)
        if cls is mpx.OpClass.FLOAT32:
            assert out.dtype == F32, (node, out.dtype)
            assert all(t.dtype == F32 for t in _tensor_inputs(node)), node
        elif cls is mpx.OpClass.LOWER:
            assert out.dtype == BF16, (node, out.dtype)
        else:  # PASSTHROUGH: the input's dtype
            assert out.dtype == _tensor_inputs(node)[0].dtype, node
    assert {"linear"} <= seen
    assert {"softmax", "layer_norm", "matmul"} <= seen if name == "block" else True
    assert {"conv", "batch_norm"} <= seen if name == "cnn" else True


def test_aten_graph_dtypes_of_a_prepared_block():
    """The ATen graph AOTAutograd captures: the matmuls in bfloat16, softmax and layer norm in float32."""
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[torch.fx.GraphModule] = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model, x = _model("block")
    mpx_torch.prepare(model, "mixed_bfloat16")
    out = torch.compile(model, backend=aot_autograd(fw_compiler=keep), fullgraph=True)(x)
    assert torch.allclose(out, model(x), rtol=0, atol=0)
    found: dict[str, set[torch.dtype]] = {}
    for node in graphs[0].graph.nodes:
        if node.op != "call_function":
            continue
        name = str(node.target).split(".")[1] if str(node.target).startswith("aten.") else None
        if name in ("mm", "addmm", "bmm", "_softmax", "native_layer_norm"):
            first = next(a for a in node.args if isinstance(a, torch.fx.Node) and a.meta["val"].dim() > 1)
            found.setdefault(name, set()).add(first.meta["val"].dtype)
    assert found["_softmax"] == {F32}
    assert found["native_layer_norm"] == {F32}
    assert found["bmm"] == {BF16}
    assert found.get("mm", set()) | found.get("addmm", set()) == {BF16}


@pytest.mark.parametrize("device_type", [None, "cpu"])
def test_autocast_region_inside_a_compiled_function(device_type):
    torch.manual_seed(0)
    x, w = torch.randn(4, 8), torch.randn(8, 8)

    def f(x, w):
        with mpx_torch.autocast("mixed_bfloat16", device_type):
            y = (x @ w).softmax(-1)
            return y, y @ w, (x @ w).sum()

    def native(x, w):
        with torch.autocast("cpu", dtype=BF16):
            y = (x @ w).softmax(-1)
            return y, y @ w, (x @ w).sum()

    counts = []
    for fn in (native, f):
        torch._dynamo.reset()
        counters.clear()
        backend = Counting()
        out = torch.compile(fn, backend=backend, fullgraph=True)(x, w)
        counts.append((len(backend.graphs), _breaks()))
    assert counts[0] == counts[1] == (1, 0)
    assert [t.dtype for t in out] == [F32, BF16, F32]
    for a, b in zip(out, f(x, w), strict=True):
        assert torch.equal(a, b)
    ops = {
        getattr(n.target, "__name__", n.target): n.meta.get("example_value")
        for n in backend.graphs[0].graph.nodes
    }
    assert ops["softmax"].dtype == F32 and ops["sum"].dtype == F32


def test_decorated_function_inside_compiled_code():
    @mpx_torch.autocast("mixed_bfloat16", "cpu")
    def g(x, w):
        return (x @ w).softmax(-1), x @ w

    torch.manual_seed(0)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    backend = Counting()
    out = torch.compile(lambda x, w: g(x, w), backend=backend, fullgraph=True)(x, w)
    assert len(backend.graphs) == 1
    assert [t.dtype for t in out] == [F32, BF16]
    for a, b in zip(out, g(x, w), strict=True):
        assert torch.equal(a, b)


def test_float32_region_nested_in_a_compiled_bf16_region():
    torch.manual_seed(0)
    x, w = torch.randn(4, 8), torch.randn(8, 8)

    def f(x, w):
        with mpx_torch.autocast("mixed_bfloat16", "cpu"):
            a = x @ w
            with mpx_torch.autocast("float32", "cpu"):
                b = a @ w  # half input computed in float32
            return a, b, x @ w

    out = torch.compile(f, backend=Counting(), fullgraph=True)(x, w)
    assert [t.dtype for t in out] == [BF16, F32, BF16]
    for a, b in zip(out, f(x, w), strict=True):
        assert torch.equal(a, b)


def test_prepared_model_compiles_with_inductor():
    model, x = _model("block")
    mpx_torch.prepare(model, "mixed_bfloat16")
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    out = compiled(x)
    assert out.dtype == F32
    torch.testing.assert_close(out, model(x), rtol=2e-2, atol=2e-2)  # inductor fuses: not bit for bit


# -- item 2: GradScaler in a compiled train step ---------------------------------------------------
def _train(kind: str, steps: int = 50) -> dict:
    model, x = _model("mlp", seed=1)
    target = torch.randn(8, 4)
    if kind == "mpx":
        mpx_torch.prepare(model, "mixed_bfloat16")
        scaler = mpx_torch.GradScaler(mpx.ScalerConfig(growth_interval=3, min_scale=None, max_scale=None))
        region = contextlib.nullcontext  # the prepared model runs under its policy
    else:
        scaler = torch.amp.GradScaler("cpu", growth_interval=3)
        region = lambda: torch.autocast("cpu", dtype=BF16)  # noqa: E731
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(x, bad):
        opt.zero_grad()
        with region():
            loss = F.mse_loss(model(x).float(), target)
        scaler.scale(loss * bad).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    backend = Counting()
    compiled = torch.compile(step, backend=backend)
    one, inf = torch.tensor(1.0), torch.tensor(float("inf"))
    scales, frames_after_warmup = [], None
    for i in range(steps):
        compiled(x, inf if i % 7 == 3 else one)  # growth every 3 finite steps, backoff and skip on inf
        scales.append(scaler.get_scale())
        if i == 1:
            frames_after_warmup = counters["frames"]["total"]
    return {
        "scales": scales,
        "graphs": len(backend.graphs),  # every graph the backend compiled, warm-up included
        "breaks": _breaks(),
        "frames": counters["frames"]["total"],
        "frames_after_warmup": frames_after_warmup,
        "params": [p.detach().clone() for p in model.parameters()],
        "scaler": scaler,
    }


def test_compiled_train_step_with_grad_scaler_matches_native_counts():
    native = _train("native")
    torch._dynamo.reset()
    counters.clear()
    ours = _train("mpx")
    assert ours["scales"] == native["scales"]  # growth, backoff, skips: the same trace
    assert len(set(ours["scales"])) > 2
    assert ours["frames"] == ours["frames_after_warmup"]  # 48 steps, scale changes: nothing compiled
    assert ours["graphs"] == native["graphs"] == 2  # the step's and the optimizer's (compiled in both)
    assert ours["breaks"] <= native["breaks"]
    assert native["frames"] == native["frames_after_warmup"]


def test_compiled_step_equals_eager_step_and_state_dict():
    compiled = _train("mpx", steps=20)
    torch._dynamo.reset()
    model, x = _model("mlp", seed=1)
    target = torch.randn(8, 4)
    mpx_torch.prepare(model, "mixed_bfloat16")
    scaler = mpx_torch.GradScaler(mpx.ScalerConfig(growth_interval=3, min_scale=None, max_scale=None))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    one, inf = torch.tensor(1.0), torch.tensor(float("inf"))
    for i in range(20):
        opt.zero_grad()
        loss = F.mse_loss(model(x).float(), target)
        scaler.scale(loss * (inf if i % 7 == 3 else one)).backward()
        scaler.step(opt)
        scaler.update()
    assert compiled["scaler"].state_dict() == scaler.state_dict()
    for a, b in zip(compiled["params"], model.parameters(), strict=True):
        assert torch.equal(a, b)


# -- item 3: mpx bench --compile (the torch worker's configurations) -------------------------------
def test_bench_worker_adds_compiled_configurations():
    from mpx_bench.workers import torch as worker

    plain = worker.configs("mlp", "tiny", ["mixed_bfloat16", "mixed_float16"], "cpu", {})
    compiled = worker.configs("mlp", "tiny", ["mixed_bfloat16", "mixed_float16"], "cpu", {}, compile=True)
    added = [c.id for c in compiled[len(plain) :]]
    assert [c.id for c in compiled[: len(plain)]] == [c.id for c in plain]
    assert added == [
        "fp32-compiled",
        "mixed_bfloat16/native-compiled",
        "mixed_bfloat16/mpx-compiled",
        "mixed_float16/native-compiled",
        "mixed_float16/mpx-compiled",
    ]
    runner = compiled[-1].make()  # built, not run: compiled float16 with mpx's scaler
    assert runner.compiled is not None and isinstance(runner.scaler, mpx_torch.GradScaler)
    assert plain[-1].make().compiled is None
