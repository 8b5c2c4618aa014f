"""Stuck detection in mpx_torch.GradScaler: after exactly N skips in a row, raise or warn, with the cause."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

import mpx
import mpx_torch


def _step(scaler: mpx_torch.GradScaler, w: torch.nn.Parameter, opt: torch.optim.Optimizer, kind: str) -> None:
    """One iteration: kind "ok" (finite), "grad" (finite loss, inf gradients), "loss" (inf loss)."""
    opt.zero_grad()
    if kind == "grad":  # sqrt(w - w) = 0, its gradient 1 / (2 sqrt(0)) = inf at every scale
        loss = torch.sqrt(w - w.detach()).sum()
    else:
        loss = (w * (1.0 if kind == "ok" else float("inf"))).sum()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def _setup(**changes):
    cfg = mpx.ScalerConfig(init_scale=4.0, min_scale=1.0, **changes)
    scaler = mpx_torch.GradScaler(cfg)
    w = torch.nn.Parameter(torch.ones(1))
    return scaler, w, torch.optim.SGD([w], lr=0.1)


@pytest.mark.parametrize("n", [1, 3, 5])
def test_raises_at_n_not_before(n: int) -> None:
    scaler, w, opt = _setup(max_consecutive_skips=n)
    if n > 1:
        _step(scaler, w, opt, "grad")  # a skip, then a finite step resets the count
        _step(scaler, w, opt, "ok")
    for _ in range(n - 1):
        _step(scaler, w, opt, "grad")
    assert scaler.state.consecutive_nonfinite == n - 1
    with pytest.raises(mpx.ScalerStuckError) as info:
        _step(scaler, w, opt, "grad")
    assert f"{n} step{'s' if n > 1 else ''} in a row skipped (max_consecutive_skips={n})" in str(info.value)
    assert scaler.state.consecutive_nonfinite == n  # the state advanced before the raise


def test_message_tells_nonfinite_loss_from_overflow_at_min_scale() -> None:
    scaler, w, opt = _setup(max_consecutive_skips=3)
    for _ in range(2):
        _step(scaler, w, opt, "grad")
    with pytest.raises(
        mpx.ScalerStuckError, match="finite and the gradients overflow at the minimum scale"
    ) as e:
        _step(scaler, w, opt, "grad")
    assert "scale 1:" in str(e.value) and "no loss scale can help" not in str(e.value)
    scaler, w, opt = _setup(max_consecutive_skips=3)
    for _ in range(2):
        _step(scaler, w, opt, "grad")
    with pytest.raises(
        mpx.ScalerStuckError, match="the forward loss itself is non-finite .* no loss scale can help"
    ):
        _step(scaler, w, opt, "loss")


def test_still_backing_off() -> None:
    scaler, w, opt = _setup(max_consecutive_skips=1)
    with pytest.raises(mpx.ScalerStuckError, match="backs off toward min_scale"):
        _step(scaler, w, opt, "grad")  # 4 -> 2: above min_scale 1


def test_warn_mode_at_n_and_2n() -> None:
    scaler, w, opt = _setup(max_consecutive_skips=2, on_stuck="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        at = []
        for i in range(1, 6):
            before = len(caught)
            _step(scaler, w, opt, "grad")
            if len(caught) > before:
                at.append(i)
    assert at == [2, 4]
    assert all(issubclass(c.category, mpx.ScalerStuckWarning) for c in caught)
    assert w.tolist() == [1.0]  # every step skipped


def test_off_by_default_never_triggers() -> None:
    scaler, w, opt = _setup()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(10):
            _step(scaler, w, opt, "loss")
    assert scaler.state.consecutive_nonfinite == 10
    assert scaler._loss_finite is None  # scale() keeps no loss flag with the option off


def test_state_dict_round_trips_the_fields() -> None:
    scaler, w, opt = _setup(max_consecutive_skips=7, on_stuck="warn")
    _step(scaler, w, opt, "ok")
    sd = scaler.state_dict()
    assert sd["config"]["max_consecutive_skips"] == 7 and sd["config"]["on_stuck"] == "warn"
    other = mpx_torch.GradScaler()
    other.load_state_dict(sd)
    assert other.config == scaler.config
    old = {
        **sd,
        "config": {k: v for k, v in sd["config"].items() if k not in ("max_consecutive_skips", "on_stuck")},
    }
    other.load_state_dict(old)  # a dict written before the fields existed: detection off
    assert other.config.max_consecutive_skips is None and other.config.on_stuck == "raise"


def _two_inf_losses(scaler, w, opt, last_update):
    for i in range(2):
        scaler.scale((w * float("inf")).sum()).backward()
        scaler.step(opt)
        if i == 0:
            scaler.update()
    last_update()


def test_the_core_check_decides_from_one_host_read(monkeypatch):
    """The torch copy of the stuck check is gone: mpx.check_stuck decides."""
    calls = []
    real = mpx_torch.history.check_stuck
    monkeypatch.setattr(mpx_torch.history, "check_stuck", lambda *a, **k: calls.append(a[1:]) or real(*a, **k))
    scaler, w, opt = _setup(max_consecutive_skips=2, on_stuck="warn")
    with pytest.warns(mpx.ScalerStuckWarning):
        _two_inf_losses(scaler, w, opt, scaler.update)
    assert calls == [(2.0, 1, 0), (1.0, 2, 0)]  # scale, consecutive skips, loss finite (0: an inf loss)


def test_the_warning_points_at_the_update_call():
    scaler, w, opt = _setup(max_consecutive_skips=2, on_stuck="warn")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        _two_inf_losses(scaler, w, opt, lambda: scaler.update())
    (warning,) = [w for w in seen if issubclass(w.category, mpx.ScalerStuckWarning)]
    assert (warning.filename, warning.lineno) == (__file__, line)
