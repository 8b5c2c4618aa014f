import warnings

import torch
from torch import nn

import mpx
import mpx.advice
import mpx_torch


def test_float16_on_cpu_warns_once_pointing_at_the_caller(warnings_on):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mpx_torch.prepare(nn.Linear(2, 2), "mixed_float16")
        with mpx_torch.autocast("mixed_float16", "cpu"):
            pass
    slow = [w for w in caught if issubclass(w.category, mpx.SlowPolicyWarning)]
    assert len(slow) == 1 and slow[0].filename == __file__
    assert "mixed_bfloat16" in str(slow[0].message)


def test_bfloat16_does_not_warn_and_the_switch_silences(warnings_on, monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("error", mpx.SlowPolicyWarning)
        mpx_torch.prepare(nn.Linear(2, 2), "mixed_bfloat16")
        monkeypatch.setenv("MPX_NO_SLOW_WARNING", "1")
        mpx_torch.prepare(nn.Linear(2, 2), "mixed_float16")
        with mpx_torch.autocast("mixed_float16", "cpu"):
            assert torch.ones(2).sum().dtype == torch.float32
