"""Activation memory (issue 23, item 6): mpx saves about native autocast's bytes for backward.

Bytes are counted deterministically with saved-tensor hooks (each storage once, parameters excluded;
conformance/models/torch.py), never timed.  Under ``recompute=True`` (the default) a float32 op of half
inputs saves those inputs and recomputes in backward, and a model library's activation whose float32
compute spreads (GPT-2's NewGELU) runs under checkpointing; values and gradients stay bit-identical to
``recompute=False``, where every op keeps what autograd saves for the float32 computation.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mpx_torch

transformers = pytest.importorskip("transformers")
from mpx_tools.models import ACTIVATION_RATIO, models_of  # noqa: E402
from mpx_tools.models import torch as MT  # noqa: E402

BF16, F32 = torch.bfloat16, torch.float32
#: (hidden, sequence) shapes: the tiny default, and a sequence/hidden ratio of real models (GPT-2: 1024/768)
SHAPES = {"tiny": {}, "realistic": {"hidden": 128, "seq": 256, "heads": 4}}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_saved_bytes_at_most_native(name, shape):
    got = MT.activation_bytes(name, **SHAPES[shape])
    assert got["mpx"] <= ACTIVATION_RATIO * got["native"], got
    if shape == "realistic":  # (at the tiny size the half copies of the weights weigh as much as activations)
        assert got["mpx"] < 0.8 * got["float32"], got


def test_without_recompute_gpt2_saves_more_and_the_profile_says_where():
    """What recompute removes: NewGELU's float32 tensors (pow computes in float32 and promotes what follows)."""
    model, batch = MT.build("gpt2")
    plain = mpx_torch.prepare(copy.deepcopy(model), "mixed_bfloat16", recompute=False)
    native = MT.saved_bytes(model, MT.runner(model, "native"), batch)
    assert MT.saved_bytes(plain, lambda **b: plain(**b), batch) > 1.15 * native
    rows = MT.saved_profile(plain, lambda **b: plain(**b), batch)
    f32 = {r["producer"] for r in rows if r["dtype"] == "float32"}
    assert {"tanh", "to"} <= f32  # NewGELU's tanh output and pow's upcast input, in float32
    ours = mpx_torch.prepare(copy.deepcopy(model), "mixed_bfloat16")
    rows = MT.saved_profile(ours, lambda **b: ours(**b), batch)
    assert not {"tanh", "to"} & {r["producer"] for r in rows if r["dtype"] == "float32"}


def _loss_and_grads(model: nn.Module, batch: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = model(**batch)
    out.loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return out.logits.detach(), grads


@pytest.mark.parametrize("name", models_of("torch"))
def test_recompute_is_bit_identical(name):
    model, batch = MT.build(name)
    ours = mpx_torch.prepare(copy.deepcopy(model), "mixed_bfloat16")
    plain = mpx_torch.prepare(copy.deepcopy(model), "mixed_bfloat16", recompute=False)
    for _ in range(2):  # the first call decides which activations recompute; the second uses it
        logits, grads = _loss_and_grads(ours, batch)
        want_logits, want_grads = _loss_and_grads(plain, batch)
        assert torch.equal(logits, want_logits)
        assert len(grads) == len(want_grads) > 0
        assert all(torch.equal(a, b) for a, b in zip(grads, want_grads, strict=True))


def _saved(fn, *inputs):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn(*inputs)
    return out, {(t.dtype, tuple(t.shape)) for t in saved}


@pytest.mark.parametrize(
    "op",
    [
        lambda x, w: torch.softmax(x, -1),
        lambda x, w: F.layer_norm(x, (8,), w, None),
        lambda x, w: x.pow(3),
        lambda x, w: F.log_softmax(x @ w, -1),
        lambda x, w: torch.exp(x).mean(),
    ],
    ids=["softmax", "layer_norm", "pow", "log_softmax_of_matmul", "exp"],
)
def test_float32_ops_save_their_half_inputs(op):
    torch.manual_seed(0)
    x = torch.randn(4, 8, dtype=BF16, requires_grad=True)
    w = torch.randn(8, device="cpu", requires_grad=True) if op.__code__.co_names.count("layer_norm") else None
    w = w if w is not None else torch.randn(8, 8, requires_grad=True)
    results = {}
    for recompute in (True, False):
        with mpx_torch.autocast("mixed_bfloat16", "cpu", recompute=recompute):
            out, saved = _saved(op, x, w)
        assert out.dtype == F32
        out.float().sum().backward()
        results[recompute] = (
            out.detach(),
            x.grad.clone(),
            w.grad.clone() if w.grad is not None else None,
            saved,
        )
        x.grad, w.grad = None, None
    (a, ga, wa, saved), (b, gb, wb, plain_saved) = results[True], results[False]
    assert torch.equal(a, b) and torch.equal(ga, gb) and ga.dtype == BF16
    assert (wa is None and wb is None) or torch.equal(wa, wb)
    assert not any(dtype == F32 and shape == (4, 8) for dtype, shape in saved), saved  # no upcast kept
    assert any(dtype == F32 and shape == (4, 8) for dtype, shape in plain_saved), plain_saved


def test_second_derivatives_through_a_recomputed_op():
    """A gradient penalty (create_graph=True) through softmax and layer_norm of half inputs: the same second
    derivatives with and without recompute, up to the order in which bfloat16 contributions are summed."""
    torch.manual_seed(0)
    x0, w0 = torch.randn(4, 8, dtype=BF16), torch.randn(8)
    got = {}
    for recompute in (True, False):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        with mpx_torch.autocast("mixed_bfloat16", "cpu", recompute=recompute):
            y = torch.softmax(F.layer_norm(x, (8,), w, None), -1)[:, 0].sum()
            (g,) = torch.autograd.grad(y, x, create_graph=True)
            (g.float() ** 2).sum().backward()
        got[recompute] = (x.grad, w.grad)
    assert got[True][0] is not None and got[True][1] is not None
    for a, b in zip(got[True], got[False], strict=True):
        torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-6)  # one bfloat16 rounding apart at most
    assert got[True][1].abs().max() > 0


def test_recomputed_activation_keeps_its_signature_and_pickles():
    import inspect
    import pickle

    model, batch = MT.build("gpt2")
    mpx_torch.prepare(model, "mixed_bfloat16")
    act = model.transformer.h[0].mlp.act
    assert inspect.signature(act.forward) == inspect.signature(type(act)().forward)
    model(**batch).loss.backward()
    assert (
        act.forward.state == "on"
        and model.transformer.h[0].mlp.dropout.forward.__func__ is nn.Dropout.forward
    )
    clone = pickle.loads(pickle.dumps(model))
    with torch.no_grad():
        assert torch.equal(clone(**batch).logits, model(**batch).logits)
    mpx_torch.prepare(model, "mixed_bfloat16", recompute=False)
    assert "forward" not in act.__dict__


def test_bench_worker_reports_gpt2_and_llama():
    from mpx_bench.workers import torch as worker

    got = worker.hf_activations()
    assert set(got) == {"shape", *worker.HF_ACTIVATION_MODELS}
    for name in worker.HF_ACTIVATION_MODELS:
        row = got[name]
        assert row["mpx/native"] == round(row["mpx_bytes"] / row["native_bytes"], 4) <= ACTIVATION_RATIO
        assert row["mpx_bytes"] < row["float32_bytes"]
