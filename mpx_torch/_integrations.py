"""What the Lightning, Accelerate and HF Transformers integrations share.

Nothing here imports a training library: ``mpx_torch.lightning``,
``mpx_torch.accelerate`` and ``mpx_torch.transformers`` import theirs, check
its version with :func:`require_library` at import, and reach its private
names only through :func:`library_internal` (one
:class:`mpx.FrameworkVersionError` naming a missing one, never a fallback).

>>> import mpx
>>> lightning_precision(mpx.get_policy("mixed_float16")), lightning_precision(mpx.get_policy("bfloat16"))
('16-mixed', 'bf16-true')
"""

from __future__ import annotations

import importlib.metadata
import warnings
from typing import Any

import torch
from torch import nn

from mpx import Policy
from mpx.versions import missing_internal, require_version
from mpx_torch import float8
from mpx_torch.grad_scaler import GradScaler, OptState

__all__ = [
    "HalfParametersWarning",
    "commit_models",
    "library_internal",
    "lightning_precision",
    "require_library",
    "unscale_once",
    "uses_float8",
    "warn_half_parameters",
]

_MISSING = object()


def require_library(library: str) -> str:
    """The installed version of ``library``; raises :class:`mpx.FrameworkVersionError` below mpx's floor."""
    version = importlib.metadata.version(library)
    require_version(library, version)
    return version


def library_internal(library: str, owner: Any, name: str, qualname: str, used_for: str) -> Any:
    """``getattr(owner, name)``, or raise the :class:`mpx.FrameworkVersionError` naming ``qualname``."""
    value = getattr(owner, name, _MISSING)
    if value is _MISSING:
        raise missing_internal(library, importlib.metadata.version(library), qualname, used_for)
    return value


_LIGHTNING_PREFIX = {"float16": "16", "bfloat16": "bf16", "float32": "32", "float64": "64"}


class HalfParametersWarning(UserWarning):
    """Half-precision parameters were upcast to the policy's float32 master weights."""


def lightning_precision(policy: Policy) -> str:
    """Lightning's precision string for ``policy``: ``"16-mixed"``, ``"bf16-mixed"``, ``"bf16-true"``, ...

    ``<compute>-true`` when the parameters are stored in the compute dtype,
    ``<compute>-mixed`` otherwise (Lightning's names for the same setups).
    """
    prefix = _LIGHTNING_PREFIX.get(policy.compute_dtype, policy.compute_dtype)
    return f"{prefix}-{'true' if policy.param_dtype == policy.compute_dtype else 'mixed'}"


def warn_half_parameters(module: nn.Module, policy: Policy, *, stacklevel: int = 3) -> None:
    """Warn when ``module`` holds float16/bfloat16 parameters that ``policy`` stores in float32.

    ``prepare`` upcasts them (the policy's float32 master weights), which
    doubles their memory: typically a checkpoint loaded with transformers'
    default ``dtype="auto"`` in the half dtype it was saved in.
    """
    if policy.param_dtype != "float32":
        return
    half = {torch.float16: 0, torch.bfloat16: 0}
    for param in module.parameters():
        if param.dtype in half:
            half[param.dtype] += param.numel()
    found = ", ".join(f"{n} {str(dtype).removeprefix('torch.')}" for dtype, n in half.items() if n)
    if found:
        warnings.warn(
            f"the model holds half-precision parameters ({found} values), and the policy {policy} keeps "
            "float32 master weights: they are upcast to float32 (twice their memory), as the policy asks. "
            "Load the model in float32 (transformers: from_pretrained(..., dtype=torch.float32)) to keep "
            "this explicit, or choose a policy that stores half parameters (params=float16 or bfloat16).",
            HalfParametersWarning,
            stacklevel=stacklevel,
        )


def unscale_once(scaler: GradScaler, optimizer: Any) -> None:
    """``scaler.unscale_(optimizer)`` unless this optimizer's gradients were unscaled this step.

    Clipping may be asked for twice in one step (Lightning's manual
    optimization clips before ``step()``, which unscales again): the second
    request finds the gradients already unscaled and does nothing.
    """
    if not scaler.is_enabled():
        return
    if scaler.optimizer_stage(optimizer) is OptState.READY:
        scaler.unscale_(optimizer)


def uses_float8(policy: Policy) -> bool:
    """Whether ``policy`` or one of its overrides turns FP8 on (``fp8=``): its integrations then commit."""
    return policy.fp8 is not None or any(rule.policy.fp8 is not None for rule in policy.overrides)


def commit_models(models: Any, scaler: GradScaler | bool) -> None:
    """Commit the FP8 state of ``models`` (a module or an iterable of them) after one optimizer step.

    :func:`mpx_torch.float8.commit_float8` with the scaler after its ``update()``: nothing moves on a step
    the scaler skipped (``False`` for no scaler: every step commits), so the FP8 state moves exactly when
    the optimizer state does (once per optimizer step, so once per gradient-accumulation window;
    replicas all-reduce their amaxes).
    A module without FP8 Linears is left alone.
    """
    for model in [models] if isinstance(models, nn.Module) else models:
        if any(True for _ in float8.float8_layers(model)):
            float8.commit_float8(model, scaler)
