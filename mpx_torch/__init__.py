"""mpx for PyTorch: ``autocast``, ``prepare`` and ``GradScaler`` over ``torch.amp``.

>>> import torch, mpx_torch
>>> model = mpx_torch.prepare(torch.nn.Linear(8, 2), "mixed_float16")
>>> scaler = mpx_torch.GradScaler("mixed_float16")
>>> scaler.config.kind
'dynamic'

Integrations, each imported on its own (importing mpx_torch imports none of these libraries):
``mpx_torch.lightning`` (``MPXPrecision`` for Lightning's Trainer, ``MPXFabricPrecision`` for Fabric),
``mpx_torch.lightning_fsdp`` (their forms for ``ModelParallelStrategy`` (FSDP2) and ``FSDPStrategy`` (FSDP1)),
``mpx_torch.lightning_deepspeed`` (their forms for ``DeepSpeedStrategy``), ``mpx_torch.deepspeed`` (the engine),
``mpx_torch.accelerate`` (``attach(accelerator, policy)``),
``mpx_torch.transformers`` (``MPXTrainer`` / ``MPXTrainerMixin`` for the HF Trainer).
"""

from mpx_torch import (
    _compat,  # noqa: F401  (first: the torch version check)
    float8,  # FP8 GEMMs: mpx_torch.float8.convert / commit_float8
)
from mpx_torch.autocast import autocast, to_torch_dtype
from mpx_torch.diagnostics import underflow_stats, watch
from mpx_torch.distributed import fsdp_mixed_precision, fully_shard, register_comm_hook
from mpx_torch.grad_scaler import GradScaler
from mpx_torch.history import log_history
from mpx_torch.prepare import module_category, prepare, prepared_policy

__all__ = [
    "GradScaler",
    "autocast",
    "float8",
    "fsdp_mixed_precision",
    "fully_shard",
    "log_history",
    "module_category",
    "prepare",
    "prepared_policy",
    "register_comm_hook",
    "to_torch_dtype",
    "underflow_stats",
    "watch",
]
