"""Gradient accumulation with mpx_torch.GradScaler follows mpx.accumulation_trace exactly.

torch's natural loop: ``scaler.scale(loss / k).backward()`` for each of the k
micro-batches of a window, then one ``step``/``update`` and ``zero_grad``.  The
scale is constant inside a window, the scaler moves once per optimizer step, a
window holding a non-finite micro-batch is skipped whole (parameters and
optimizer state bit-identical).
"""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import mpx
import mpx_torch

CONFIG = mpx.ScalerConfig(init_scale=2.0**8, growth_interval=2, hysteresis=1)


def _same_bits(a, b):
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(
            a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
        )
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_bits(x, y) for x, y in zip(a, b, strict=True))
    return a == b


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=0.01, fused=True),
}


def accumulate(flags, k, *, optimizer="sgd", config=CONFIG, clip=False, bad=float("inf")):
    """Train over ``flags`` (one per micro-batch; False: that micro-batch's loss is ``bad``), windows of ``k``."""
    torch.manual_seed(0)
    model = mpx_torch.prepare(
        nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 1)), "mixed_bfloat16"
    )
    opt = OPTIMIZERS[optimizer](model.parameters())
    scaler = mpx_torch.GradScaler(config)
    gen = torch.Generator().manual_seed(1)
    windows = []
    for start in range(0, len(flags), k):
        before = ([p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict()))
        scales_inside = []
        for finite in flags[start : start + k]:
            x = torch.randn(16, 4, generator=gen)
            loss = model(x).float().pow(2).mean() / k
            scales_inside.append(scaler.get_scale())
            scaler.scale(loss if finite else loss * bad).backward()
        if clip:
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        after = ([p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict()))
        windows.append(
            {
                "applied": not _same_bits(before[0], after[0]),
                "unchanged": _same_bits(before, after),  # parameters and optimizer state
                "scale": scaler.get_scale(),
                "scales_inside": scales_inside,
            }
        )
    return windows, scaler


def _check(flags, k, **kwargs):
    got, scaler = accumulate(flags, k, **kwargs)
    expected = mpx.accumulation_trace(kwargs.get("config", CONFIG), flags, k)
    assert [{"applied": w["applied"], "scale": w["scale"]} for w in got] == expected
    previous = kwargs.get("config", CONFIG).init_scale
    for window, want in zip(got, expected, strict=True):
        assert window["scales_inside"] == [previous] * k  # the scale is constant inside a window
        assert window["unchanged"] == (not want["applied"])  # a skipped window changed nothing at all
        previous = want["scale"]
    assert scaler.state.steps == len(flags) // k  # one transition per optimizer step
    return got


FLAGS = [True] * 5 + [False] + [True] * 7 + [False, False] + [True] * 9  # 24 micro-batches


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_natural_loop_follows_the_reference(k, optimizer):
    got = _check(FLAGS, k, optimizer=optimizer)
    assert any(w["applied"] for w in got) and not all(w["applied"] for w in got)
    assert len({w["scale"] for w in got}) > 1  # growth and backoff both happen


def test_one_bad_micro_batch_skips_the_whole_window_nan_too():
    got = _check([True, True, False, True, True, True, True, True], 4, bad=float("nan"))
    assert [w["applied"] for w in got] == [False, True]


def test_unscale_and_clip_at_the_window_end():
    _check(FLAGS, 3, clip=True)


def test_scaler_moves_once_per_optimizer_step_not_per_micro_batch():
    """With growth_interval=2, 8 finite micro-batches in windows of 4 grow the scale once, not 4 times."""
    got = _check([True] * 8, 4)
    assert [w["scale"] for w in got] == [CONFIG.init_scale, CONFIG.init_scale * 2]


def test_stuck_detection_sees_a_non_finite_loss_in_any_micro_batch():
    """The loss flag covers every micro-batch of the window (not only the last one)."""
    config = mpx.ScalerConfig(init_scale=2.0**8, max_consecutive_skips=1)
    with pytest.raises(mpx.ScalerStuckError, match="the forward loss itself is non-finite"):
        accumulate([False, True, True], 3, config=config)


@settings(max_examples=25, deadline=None)
@given(k=st.integers(1, 4), data=st.data())
def test_any_flag_sequence(k, data):
    windows = data.draw(st.integers(1, 5))
    flags = data.draw(st.lists(st.booleans(), min_size=k * windows, max_size=k * windows))
    _check(flags, k)
