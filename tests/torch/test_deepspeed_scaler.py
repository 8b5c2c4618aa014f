"""DeepSpeed's own ``DynamicLossScaler`` (deepspeed 0.19.8, ``runtime/fp16/loss_scaler.py``) against mpx's
DeepSpeed mode: the same overflow sequences give the same scale, bit for bit, and the raise at the floor
comes at the same step, through mpx_torch.GradScaler's real steps and the core's scaler.

DeepSpeed's scaler logs through ``deepspeed.comm`` on an overflow, so the module runs a one-process gloo
group (deepspeed's first ``init_distributed`` on a machine JIT-compiles its shared-memory op, then loads
it from the torch extensions cache).
"""

import logging
import os
import socket

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import mpx
from mpx_torch import GradScaler

deepspeed = pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install --no-deps deepspeed)")
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler  # noqa: E402

MIN_SCALE_MESSAGE = "Current loss scale already at minimum"


@pytest.fixture(scope="module", autouse=True)
def deepspeed_comm():
    """A one-process gloo group for deepspeed.comm (DeepSpeed's scaler asks it for the rank)."""
    if torch.distributed.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)  # one OVERFLOW line per overflow otherwise
    try:
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
        yield
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _config(power, window, hysteresis, consecutive, min_scale):
    return mpx.ScalerConfig(
        **{
            **mpx.SCALER_PRESETS["deepspeed_fp16"].to_dict(),
            "init_scale": 2.0**power,
            "growth_interval": window,
            "hysteresis": hysteresis,
            "hysteresis_reset": "finite" if consecutive else "growth",
            "min_scale": float(min_scale),
        }
    )


def _deepspeed_trace(power, window, hysteresis, consecutive, min_scale, overflows):
    """DeepSpeed's scale after each step, and the step (0-based) it raised at (None: it did not)."""
    ds = DynamicLossScaler(2.0**power, window, min_scale, hysteresis, consecutive)
    scales = []
    for i, overflow in enumerate(overflows):
        try:
            ds.update_scale(overflow)
        except Exception as e:  # DeepSpeed raises a bare Exception at the floor
            assert MIN_SCALE_MESSAGE in str(e)
            return scales, i
        scales.append(ds.cur_scale)
    return scales, None


def _mpx_trace(scaler, overflows):
    """mpx_torch.GradScaler through real steps: the scale after each, and the step ScalerFloorError came at."""
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scales = []
    for i, overflow in enumerate(overflows):
        scaler.scale((p * 1.0).sum()).backward()
        if overflow:
            p.grad[0] = float("inf")
        scaler.step(opt)
        try:
            scaler.update()
        except mpx.ScalerFloorError as e:
            assert f"step {i + 1} overflowed" in str(e)
            return scales, i
        finally:
            opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales, None


def _same_bits(mpx_scales, ds_scales):
    assert len(mpx_scales) == len(ds_scales)
    for ours, theirs in zip(mpx_scales, ds_scales, strict=True):
        assert ours == theirs and np.float32(ours).tobytes() == np.float32(theirs).tobytes(), (ours, theirs)


overflow_sequences = st.one_of(
    st.lists(st.booleans(), min_size=1, max_size=40),
    st.lists(st.sampled_from([False] * 5 + [True]), min_size=1, max_size=40),  # long clean runs: growth
)


@settings(max_examples=60, deadline=None)
@given(
    power=st.integers(0, 6),
    window=st.integers(1, 4),
    hysteresis=st.integers(1, 3),
    consecutive=st.booleans(),
    min_scale=st.sampled_from([1, 2]),
    overflows=overflow_sequences,
)
def test_grad_scaler_traces_deepspeeds_scaler_bit_for_bit(power, window, hysteresis, consecutive, min_scale,
                                                          overflows):  # fmt: skip
    power = max(power, min_scale - 1)  # DeepSpeed starts at 2**power; mpx refuses an init below min_scale
    config = _config(power, window, hysteresis, consecutive, min_scale)
    want, raised_at = _deepspeed_trace(power, window, hysteresis, consecutive, min_scale, overflows)
    got, floor_at = _mpx_trace(GradScaler(config), overflows)
    _same_bits(got, want)
    assert floor_at == raised_at
    core = mpx.LossScaler(config)  # the core's scaler (the numpy kernel) too
    for overflow, scale in zip(overflows, want, strict=False):
        core.update(not overflow)
        assert core.get_scale() == scale


def test_the_measured_window_4_trace():
    """The issue's measurement: window 4, no overflow: DeepSpeed grows at steps 5 and 9, torch at 4 and 8;
    mpx's DeepSpeed mode at 5 and 9, its default mode (torch's rule) at 4 and 8."""
    overflows = [False] * 9
    ds, _ = _deepspeed_trace(0, 4, 2, False, 1, overflows)
    assert [i + 1 for i in range(1, 9) if ds[i] > ds[i - 1]] == [5, 9]
    got, _ = _mpx_trace(GradScaler(_config(0, 4, 2, False, 1)), overflows)
    assert got == ds
    torch_rule, _ = _mpx_trace(GradScaler(mpx.ScalerConfig(init_scale=1.0, growth_interval=4)), overflows)
    assert [i + 1 for i in range(9) if torch_rule[i] > (torch_rule[i - 1] if i else 1.0)] == [4, 8]


@pytest.mark.parametrize("consecutive", [False, True])
def test_raise_at_the_floor_on_the_same_step(consecutive):
    """Hysteresis 2 from 2**1: DeepSpeed spends its budget, halves to 1, and raises on the next back-off due."""
    overflows = [True, True, False, True, True, True]
    want, raised_at = _deepspeed_trace(1, 3, 2, consecutive, 1, overflows)
    got, floor_at = _mpx_trace(GradScaler(_config(1, 3, 2, consecutive, 1)), overflows)
    assert raised_at is not None and floor_at == raised_at
    _same_bits(got, want)
    # consecutive_hysteresis=false: the clean step does not refill the budget, so the floor comes sooner
    assert raised_at == (3 if not consecutive else 4)


def test_default_deepspeed_config_is_the_preset():
    """ds_config defaults (the fp16 block with only enabled) read back as the preset, and DeepSpeed's own
    config model agrees on each value."""
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config

    policy, config = mpx.from_deepspeed_config({"fp16": {"enabled": True}})
    assert policy.compute_dtype == "float16" and config == mpx.SCALER_PRESETS["deepspeed_fp16"]
    ds = DeepSpeedFP16Config(**mpx.to_deepspeed_config(policy, config)["fp16"]).dynamic_loss_scale_args()
    assert ds == {
        "init_scale": config.init_scale,
        "scale_window": config.growth_interval,
        "delayed_shift": config.hysteresis,
        "consecutive_hysteresis": False,
        "min_scale": config.min_scale,
    }
