"""The one scaler surface (#22): every check of mpx.testing.SURFACE_CHECKS against mpx_torch.GradScaler.

Each step is a real optimizer step on a tiny model; a non-finite step has an inf in one gradient, and
a skipped step must leave the parameters bit-identical.
"""

import pytest
import torch
from torch import nn

import mpx
import mpx_torch
from mpx.testing import SURFACE_CHECKS


class TorchAdapter:
    def __init__(self):
        torch.manual_seed(0)
        self.model = nn.Linear(3, 2)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.x = torch.randn(4, 3)

    def make(self, config):
        return mpx_torch.GradScaler(config)

    def step(self, scaler, finite):
        self.opt.zero_grad()
        scaler.scale(self.model(self.x).square().mean()).backward()
        if not finite:
            self.model.weight.grad[0, 1] = float("inf")
        before = [p.detach().clone() for p in self.model.parameters()]
        try:
            scaler.step(self.opt)
            scaler.update()
        finally:
            after = list(self.model.parameters())
            if not finite and scaler.config.skip_nonfinite:
                assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
            elif scaler.is_enabled():
                assert not all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        return scaler

    def multiply(self, scaler, value):
        out = scaler.scale(torch.tensor(value, dtype=torch.float32))
        assert out.dtype == torch.float32
        return out.item()

    def load(self, scaler, data):
        assert scaler.load_state_dict(data) is None  # in place
        return scaler

    def history(self, config, flags):
        scaler = mpx_torch.GradScaler(config)
        scaler.record_history()
        for finite in flags:
            self.step(scaler, finite)
        return scaler.history()


@pytest.mark.parametrize("check", SURFACE_CHECKS.values(), ids=list(SURFACE_CHECKS))
def test_grad_scaler_meets_the_surface(check):
    check(TorchAdapter())


def test_a_check_fails_for_a_scaler_that_differs():
    class NeverOverflows(TorchAdapter):
        def step(self, scaler, finite):
            return super().step(scaler, True)

    with pytest.raises(AssertionError):
        SURFACE_CHECKS["trace"](NeverOverflows())


def test_state_counters_are_read_through_state():
    adapter = TorchAdapter()
    scaler = adapter.make(mpx.ScalerConfig(growth_interval=3))
    for finite in (True, False, False, True):
        adapter.step(scaler, finite)
    assert scaler.state == mpx.ScalerState(
        scale=2.0**14, growth_tracker=1, consecutive_nonfinite=0, steps=4, skipped_steps=2
    )


@pytest.mark.parametrize(
    "call",
    [
        lambda s, opt: s.scale("loss"),
        lambda s, opt: s.scale([torch.ones(()), 3.0]),
        lambda s, opt: s.unscale_(object()),
        lambda s, opt: s.step({"params": []}),
        lambda s, opt: s.unscale_(nn.Linear(2, 2)),
    ],
    ids=["scale-str", "scale-list-with-float", "unscale-object", "step-dict", "unscale-module"],
)
def test_wrong_types_raise_unsupported_type_error(call):
    scaler = mpx_torch.GradScaler()
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler.scale(w.sum()).backward()
    with pytest.raises(
        mpx.UnsupportedTypeError, match=r"expected a torch\.(Tensor|optim\.Optimizer)"
    ) as info:
        call(scaler, opt)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)  # torch raised ValueError
    scaler.step(opt)  # nothing was recorded for the bad call: the real step still runs
    scaler.update()
    assert w.tolist() == [pytest.approx(0.9)] * 2


def test_device_first_is_refused_with_its_own_sentence():
    with pytest.raises(mpx.PolicyError, match=r"'cuda' is a device.*GradScaler\(device='cuda'\)"):
        mpx_torch.GradScaler("cuda")
