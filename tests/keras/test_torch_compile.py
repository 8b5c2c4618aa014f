"""torch.compile of a Keras model under mpx on Keras's torch backend (#33): one graph as natively, the same
ops in half and in float32 as the eager mpx model, the same outputs, no recompile on the second call."""

import importlib
import os

import numpy as np
import pytest

if os.environ.get("KERAS_BACKEND") != "torch":
    pytest.skip("torch.compile runs on Keras's torch backend only", allow_module_level=True)

import keras
import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

import mpx_keras

A = importlib.import_module("mpx_keras.autocast")

SPEC = "mixed_bfloat16"
#: aten op (eager) or traced function name (the graph) -> kind; matched by substring
KINDS = {"softmax": "softmax", "layer_norm": "norm", "linear": "matmul", "addmm": "matmul", "matmul": "matmul",
         "mm": "matmul"}  # fmt: skip


def _kind(name: str) -> str | None:
    return next((kind for key, kind in KINDS.items() if key in name), None)


class UserAttention(keras.layers.Layer):
    """User code: ``keras.ops`` calls the op table applies to (softmax in float32 under mpx)."""

    def call(self, x):
        return keras.ops.softmax(keras.ops.matmul(x, keras.ops.transpose(x)))


def _model(mode: str) -> keras.Model:
    def make() -> keras.Model:
        keras.utils.set_random_seed(0)
        return keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(8), keras.layers.LayerNormalization(), UserAttention()]
        )

    if mode == "native":
        keras.config.set_dtype_policy(SPEC)
        try:
            return make()
        finally:
            keras.config.set_dtype_policy("float32")
    with mpx_keras.policy_scope(SPEC):
        model = make()
    mpx_keras.apply_policy(model, SPEC)
    return model


def _eager_ops(model: keras.Model, x: torch.Tensor) -> set[tuple[str, str]]:
    found = set()

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kind = _kind(func.overloadpacket.__name__)
            tensors = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
            if kind and tensors:
                found.add((kind, str(tensors[0].dtype).removeprefix("torch.")))
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Recorder():
        model(x)
    return found


def _graph_ops(graph: torch.fx.GraphModule) -> set[tuple[str, str]]:
    found = set()
    for node in graph.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        kind = _kind(getattr(node.target, "__name__", str(node.target)))
        args = [a.meta.get("example_value") for a in node.args if isinstance(a, torch.fx.Node)]
        tensors = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
        if kind and tensors:
            found.add((kind, str(tensors[0].dtype).removeprefix("torch.")))
    return found


@pytest.fixture
def compiled():
    """``compile(model)``: torch.compile(fullgraph=True) with a backend that keeps each graph dynamo makes."""
    torch._dynamo.reset()
    counters.clear()
    graphs: list[torch.fx.GraphModule] = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    yield lambda model: (torch.compile(model, backend=keep, fullgraph=True), graphs)
    torch._dynamo.reset()
    A.release_compiled()


@pytest.mark.parametrize("mode", ["mpx", "native"])
def test_compiles_in_one_graph_with_the_eager_ops_and_outputs(mode, compiled):
    model = _model(mode)
    x = torch.as_tensor(np.random.default_rng(0).normal(size=(4, 8)).astype("float32"))
    eager = model(x)
    want_ops = _eager_ops(model, x)
    fn, graphs = compiled(model)
    outs = [fn(x), fn(x)]
    assert len(graphs) == 1 and counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"] and not counters["recompiles"]
    assert _graph_ops(graphs[0]) == want_ops
    softmax = "float32" if mode == "mpx" else "bfloat16"  # the user's softmax follows the op table
    assert ("softmax", softmax) in want_ops and ("matmul", "bfloat16") in want_ops
    for out in outs:
        assert out.dtype == eager.dtype and torch.equal(out, eager)
    assert A.holds() == (1 if mode == "mpx" else 0)


def test_the_compiled_hold_is_given_back(compiled):
    model = _model("mpx")
    fn, _ = compiled(model)
    fn(torch.ones((2, 8)))
    assert A.holds() == 1 and keras.ops.softmax is not keras.src.ops.nn.softmax
    assert A.release_compiled() and A.holds() == 0 and not A.release_compiled()
    assert keras.ops.softmax is keras.src.ops.nn.softmax
