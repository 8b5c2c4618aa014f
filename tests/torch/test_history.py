"""mpx_torch.GradScaler's history equals the core's reference trace; the TensorBoard hook."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mpx
import mpx_torch


def _run(cfg: mpx.ScalerConfig, flags: list[bool], capacity: int = 65536) -> mpx_torch.GradScaler:
    scaler = mpx_torch.GradScaler(cfg)
    scaler.record_history(capacity=capacity)
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    for finite in flags:
        opt.zero_grad()
        scaler.scale((w * (1.0 if finite else float("inf"))).sum()).backward()
        scaler.step(opt)
        scaler.update()
    return scaler


@settings(max_examples=25, deadline=None)
@given(
    flags=st.lists(st.booleans(), min_size=0, max_size=40),
    interval=st.integers(1, 4),
    hysteresis=st.integers(1, 3),
)
def test_history_equals_reference(flags: list[bool], interval: int, hysteresis: int) -> None:
    cfg = mpx.ScalerConfig(init_scale=8.0, growth_interval=interval, hysteresis=hysteresis, min_scale=1.0,
                           max_scale=64.0)  # fmt: skip
    assert _run(cfg, flags).history() == mpx.ScalerHistory.reference(cfg, flags)


def test_exact_trace() -> None:
    cfg = mpx.ScalerConfig(init_scale=4.0, growth_interval=2, min_scale=2.0)
    h = _run(cfg, [True, True, False, False, True]).history()
    assert h.steps == [1, 2, 3, 4, 5]
    assert h.scale == [4.0, 8.0, 4.0, 2.0, 2.0]
    assert h.growth == [False, True, False, False, False]
    assert h.backoff == [False, False, True, True, False]
    assert h.skipped == [False, False, True, True, False]


def test_ring_buffer_keeps_the_last_steps() -> None:
    cfg = mpx.ScalerConfig(init_scale=4.0, growth_interval=1, max_scale=2.0**20)
    flags = [True, False, True, True, False, True, True]
    full = mpx.ScalerHistory.reference(cfg, flags)
    h = _run(cfg, flags, capacity=3).history()
    assert h.steps == [5, 6, 7] and h.scale == full.scale[-3:] and h.skipped == full.skipped[-3:]


def test_not_recording_raises_and_bad_capacity() -> None:
    with pytest.raises(mpx.MPXError, match="record_history"):
        mpx_torch.GradScaler().history()
    with pytest.raises(mpx.MPXError, match="capacity"):
        mpx_torch.GradScaler().record_history(capacity=0)
    assert len(mpx_torch.GradScaler().record_history() or _run(mpx.ScalerConfig(), []).history()) == 0


class _Writer:
    """A stand-in for SummaryWriter's add_scalar (the tensorboard package is optional)."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.rows.append((tag, value, step))


def test_log_history_writes_each_step_once() -> None:
    scaler = _run(mpx.ScalerConfig(init_scale=4.0, growth_interval=1), [True, False])
    writer = _Writer()
    last = mpx_torch.log_history(scaler, writer)
    assert last == 2
    assert writer.rows == [
        ("loss_scaler/scale", 8.0, 1), ("loss_scaler/skipped", 0, 1), ("loss_scaler/growth", 1, 1),
        ("loss_scaler/backoff", 0, 1), ("loss_scaler/scale", 4.0, 2), ("loss_scaler/skipped", 1, 2),
        ("loss_scaler/growth", 0, 2), ("loss_scaler/backoff", 1, 2),
    ]  # fmt: skip
    assert mpx_torch.log_history(scaler, writer, since=last) == 2 and len(writer.rows) == 8


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed")
def test_log_dir_without_tensorboard_is_a_clear_error(tmp_path) -> None:
    scaler = _run(mpx.ScalerConfig(), [True])
    with pytest.raises(mpx.MPXError, match="pip install tensorboard"):
        mpx_torch.log_history(scaler, tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="needs tensorboard")
def test_log_dir_writes_an_event_file(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scaler = _run(mpx.ScalerConfig(init_scale=4.0, growth_interval=1), [True, False])
    mpx_torch.log_history(scaler, tmp_path)
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss_scaler/scale")] == [(1, 8.0), (2, 4.0)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="sync debug mode needs CUDA")
@pytest.mark.parametrize("record", [False, True])
def test_no_host_sync_with_detection_off(record: bool) -> None:
    scaler = mpx_torch.GradScaler(mpx.ScalerConfig(growth_interval=2), device="cuda")
    if record:
        scaler.record_history()
    w = torch.nn.Parameter(torch.ones(4, device="cuda"))
    opt = torch.optim.Adam([w], lr=0.1, fused=True)

    def step() -> None:
        opt.zero_grad()
        scaler.scale((w * 2).sum()).backward()
        scaler.step(opt)
        scaler.update()

    step()  # the step that creates the fused optimizer's state syncs once (documented)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    if record:
        assert scaler.history().steps == [1, 2, 3, 4]


def test_steps_are_the_state_step_numbers_across_a_load() -> None:
    cfg = mpx.ScalerConfig(init_scale=4.0, growth_interval=3)
    scaler = _run(cfg, [True, True])
    resumed = mpx.LossScaler(cfg)
    for finite in [True] * 9:
        resumed.update(finite)
    scaler.load_state_dict(resumed.state_dict())
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler.scale(w.sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.history().steps == [1, 2, 10]
