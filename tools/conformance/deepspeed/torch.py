"""The ``deepspeed`` group in the torch column: natively deepspeed's own scalers, under mpx mpx_torch.GradScaler.

DeepSpeed's scaler asks ``deepspeed.comm`` for the rank on every overflow (to log it), so the native
run first starts a one-process gloo group over an in-process ``torch.distributed.HashStore`` (no port,
no other process) and ``deepspeed.init_distributed`` on it, once per worker.  deepspeed's first
``init_distributed`` on a machine JIT-compiles its CPU shared-memory op into the torch extensions cache
(``TORCH_EXTENSIONS_DIR``, ~2 minutes on 2 cores), later ones load it (~0.3 s).  The group is left up:
the group runs last in the worker.
"""

from __future__ import annotations

import contextlib
import logging
import sys

import torch
from torch import nn

from conformance.adapters._common import flag_gradient
from conformance.deepspeed import NOT_INSTALLED
from mpx_tools.skip import Skip

#: What DeepSpeed raises at the floor (a bare Exception)
FLOOR_MESSAGE = "Current loss scale already at minimum"


def _deepspeed_comm() -> None:
    """deepspeed.comm on a one-process gloo group (module docs); Skip when deepspeed is not installed."""
    try:
        import deepspeed
    except ImportError:
        raise Skip(NOT_INSTALLED) from None
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)  # an OVERFLOW line per overflow otherwise
    if not torch.distributed.is_initialized():
        store = torch.distributed.HashStore()
        torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    with contextlib.redirect_stdout(sys.stderr):  # it prints "... built successfully": stdout is the rows'
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)


def _floor(err: Exception) -> bool:
    return type(err) is Exception and FLOOR_MESSAGE in str(err)


def _dynamic_loss_scaler(ds: dict, flags: list[bool]) -> dict:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    scaler = DynamicLossScaler(ds["init_scale"], ds["scale_window"], ds["min_scale"], ds["delayed_shift"],
                               ds["consecutive_hysteresis"])  # fmt: skip
    scales: list[float] = []
    for i, finite in enumerate(flags, 1):
        try:
            scaler.update_scale(not finite)
        except Exception as err:
            if not _floor(err):
                raise
            return {"scales": scales, "raised_at": i}
        scales.append(float(scaler.cur_scale))
    return {"scales": scales, "raised_at": None}


def _fp16_optimizer(ds: dict, flags: list[bool]) -> dict:
    """FP16_Optimizer over SGD on a float16 parameter: backward of an inf-times loss overflows a step."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer

    p = nn.Parameter(torch.ones(4, dtype=torch.float16))
    opt = FP16_Optimizer(torch.optim.SGD([p], lr=0.1), dynamic_loss_scale=True, initial_dynamic_scale=ds["init_scale"],
                         dynamic_loss_args=dict(ds), verbose=False)  # fmt: skip
    scales: list[float] = []
    for i, finite in enumerate(flags, 1):
        opt.zero_grad()
        opt.backward((p.float() * flag_gradient(finite)).sum())
        try:
            opt.step()
        except Exception as err:
            if not _floor(err):
                raise
            return {"scales": scales, "raised_at": i}
        scales.append(float(opt.loss_scale_config.cur_scale))
    return {"scales": scales, "raised_at": None}


def _mpx(config: dict, flags: list[bool]) -> dict:
    """mpx_torch.GradScaler with the rule's config through real steps (an inf in the gradient overflows)."""
    import mpx
    import mpx_torch

    scaler = mpx_torch.GradScaler(config, device="cpu")
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scales: list[float] = []
    for i, finite in enumerate(flags, 1):
        opt.zero_grad()
        scaler.scale((p * flag_gradient(finite)).sum()).backward()
        scaler.step(opt)
        try:
            scaler.update()
        except mpx.ScalerFloorError:
            return {"scales": scales, "raised_at": i}
        scales.append(float(scaler.get_scale()))
    return {"scales": scales, "raised_at": None}


def run_deepspeed_trace(p: dict, mode: str) -> dict:
    """The scale after each step and the step a floor raise came at (conformance/deepspeed/cases.py)."""
    if mode == "mpx":
        return _mpx(p["config"], p["flags"])
    _deepspeed_comm()
    run = _fp16_optimizer if p["native"] == "FP16_Optimizer" else _dynamic_loss_scaler
    return run(p["ds"], p["flags"])
