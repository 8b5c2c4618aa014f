"""mpx_torch.watch and mpx_torch.underflow_stats on real torch models.

An overflow is injected in one named layer, in the forward pass or only in the backward pass, and the
report must name that layer; the statistics must match the numpy reference in mpx.diagnostics exactly.
"""

import logging
from collections import OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import mpx
import mpx_torch
from mpx.diagnostics import DiagnosticsError, underflow_reference


def _model(boom_weight: float) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(embed=nn.Linear(4, 8), act=nn.ReLU(), boom=nn.Linear(8, 8),
                                      head=nn.Linear(8, 1)))  # fmt: skip
    with torch.no_grad():
        model.boom.weight.fill_(boom_weight)
    return model


def _step(model, x, watch=None, scale=2.0**16):
    scaler = mpx_torch.GradScaler(mpx.ScalerConfig(init_scale=scale))
    with mpx_torch.autocast("mixed_float16", device_type="cpu"):
        loss = model(x).float().mean()
    scaler.scale(loss).backward()
    return scaler


def test_forward_overflow_is_named():
    model = _model(1e4)  # boom's float16 output is about 8 * 1e4 * 10 * O(1): inf
    x = torch.full((2, 4), 10.0)
    with mpx_torch.watch(model) as w:
        _step(model, x)
        report = w.report()
    assert not report.finite
    assert report.first.kind == "forward"
    assert report.origin == "boom"
    assert report.first.dtype == "float16"
    assert report.first.inf > 0 and report.first.max_abs == float("inf")
    assert {s.name for s in report.sites if s.kind == "forward"} >= {"boom", "head"}
    assert not w._handles  # removed on exit


def test_backward_overflow_is_named():
    # boom's forward stays finite (small inputs), but its input gradient, g @ W with W = 1e3 and g
    # carrying the 2**10 loss scale, overflows float16 in the backward pass only (head's gradients stay finite)
    model = _model(1e3)
    with torch.no_grad():
        model.embed.weight.fill_(1e-4)
        model.embed.bias.fill_(1e-4)
        model.head.weight.fill_(1.0)
    x = torch.ones(2, 4)
    with mpx_torch.watch(model, scaler=2.0**10) as w:
        _step(model, x, scale=2.0**10)
        report = w.report()
    assert [s for s in report.sites if s.kind == "forward"] == []
    assert report.first.kind == "backward"
    assert report.origin == "boom"
    assert report.scale == 2.0**10
    assert {s.name for s in report.gradient_sites} == {"embed.weight", "embed.bias"}
    assert np.isfinite(model.boom.weight.grad.numpy()).all()


def test_finite_step_and_result_unchanged(caplog):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    plain = _model(0.1)
    _step(plain, x, scale=2.0**10)
    watched = _model(0.1)
    with caplog.at_level(logging.INFO, logger="mpx.diagnostics"), mpx_torch.watch(watched) as w:
        _step(watched, x, scale=2.0**10)
    report = w.report()
    assert report.finite and report.origin is None
    assert report.checked == 5 + 6  # 5 modules (the Sequential included) + 6 parameters
    for (n, a), (_, b) in zip(plain.named_parameters(), watched.named_parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), n
    lines = [r for r in caplog.records if r.name == "mpx.diagnostics"]
    assert len(lines) == 1 and "all finite" in lines[0].getMessage()


def test_no_hooks_outside_watch():
    model = _model(0.1)
    with mpx_torch.watch(model):
        pass
    assert all(not m._forward_hooks and not m._backward_hooks for m in model.modules())


def test_watch_rejects_non_module():
    with pytest.raises(mpx.UnsupportedTypeError, match=r"model: expected a torch\.nn\.Module, got str\."):
        mpx_torch.watch("not a model")


@settings(max_examples=30, deadline=None)
@given(
    exps=st.lists(st.floats(-40, 10), min_size=1, max_size=64),
    zeros=st.integers(0, 5),
    scale_exp=st.integers(0, 24),
    compute=st.sampled_from(["float16", "bfloat16"]),
    scaled=st.booleans(),
)
def test_underflow_matches_numpy(exps, zeros, scale_exp, compute, scaled):
    rng = np.random.default_rng(len(exps))
    g = (np.sign(rng.standard_normal(len(exps))) * 2.0 ** np.array(exps)).astype(np.float32)
    g[:zeros] = 0
    other = np.array([1e-8, 3e-5, 7.0], np.float32)
    scale = 2.0**scale_exp
    got = mpx_torch.underflow_stats({"a": torch.from_numpy(g), "b": torch.from_numpy(other)}, scale,
                                    compute_dtype=compute, scaled=scaled, log=False)  # fmt: skip
    want = underflow_reference({"a": g, "b": other}, scale=scale, compute_dtype=compute, scaled=scaled)
    assert got == type(got)(**{**want.__dict__, "backend": "torch"})


def test_underflow_constructed_gradient_from_module():
    model = nn.Linear(4, 2, bias=False)
    # scaled gradients: 0, float16-subnormal 1e-6, a value that rounds to 0 in float16 (1e-8), normal 1.0
    model.weight.grad = torch.tensor(  # already scaled (the default)
        [[0.0, 1e-6, 1e-8, 1.0], [2.0, 4.0, 1e-5, 2e-8]])
    report = mpx_torch.underflow_stats(model, 1024.0, log=False)
    (layer,) = report.layers
    assert layer.name == "weight" and layer.size == 8
    assert layer.zero_fraction == 3 / 8  # 0, 1e-8, 2e-8 (below half the smallest subnormal, 2.98e-8)
    assert layer.subnormal_fraction == 2 / 8  # 1e-6, 1e-5
    assert layer.lost_fraction == 2 / 8
    assert layer.headroom_log2 == pytest.approx(np.log2(65504 / 4.0))
    assert report.advice is not None and "too low" in report.advice


def test_underflow_advice_too_high_and_scaler_input():
    scaler = mpx_torch.GradScaler(mpx.ScalerConfig(init_scale=2.0**15))
    grads = {"w": torch.full((4,), 3.0 * 2**15)}  # scaled grads ~98k: past float16's max
    report = mpx_torch.underflow_stats(grads, scaler, log=False)
    assert report.scale == 2.0**15 and report.headroom_log2 < 0
    assert "too high" in report.advice
    with pytest.raises(DiagnosticsError, match="scale"):
        mpx_torch.underflow_stats(grads, 0.0)


def test_forward_overflow_in_a_prepared_model_with_module_paths():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Sequential(OrderedDict(proj=nn.Linear(4, 8), norm=nn.LayerNorm(8)))
            self.boom = nn.Linear(8, 8)
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            return self.head(self.boom(self.encoder(x)))

    torch.manual_seed(0)
    model = mpx_torch.prepare(Net(), "mixed_float16")
    with torch.no_grad():
        # the LayerNorm's output is O(1) with zero mean: random weights of 3e4 overflow float16
        model.boom.weight.copy_(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)) * 3e4)
    scaler = mpx_torch.GradScaler("mixed_float16")
    with mpx_torch.watch(model, scaler=scaler) as w:
        scaler.scale(model(torch.randn(2, 4)).float().mean()).backward()
    report = w.report()
    assert report.origin == "boom" and report.first.kind == "forward" and report.first.dtype == "float16"
    assert report.scale == 2.0**16
    assert [s.name for s in report.sites if s.kind == "forward"][:2] == ["boom", "head"]
