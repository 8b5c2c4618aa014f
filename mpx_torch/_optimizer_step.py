"""How :meth:`mpx_torch.GradScaler.step` steps one optimizer: its per-iteration record, and torch's three
step protocols as three functions.

* :func:`step_plain`: an ordinary optimizer.  Unscale (unless done), then one host read of the found-inf
  flag decides whether ``optimizer.step()`` runs (as ``torch.amp.GradScaler``).
* :func:`step_fused`: an optimizer marked ``_step_supports_amp_scaling`` whose ``step`` takes no
  ``grad_scaler``: it gets ``grad_scale``/``found_inf`` tensors and unscales and skips by itself, in its
  kernel (``fused=True`` Adam, AdamW, SGD, Adagrad): no host sync.
* :func:`step_grad_scaler_kwarg`: torch's older protocol, an optimizer whose ``step`` takes
  ``grad_scaler=``: it gets the scaler and does everything itself (with ``_check_inf_per_device``,
  ``_found_inf_per_device`` and ``unscale_``).

Each function runs eagerly when a compiled step calls it (its own frame is never compiled, the
optimizer's step it calls is), as the body of torch's ``GradScaler.step`` does.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import torch

from mpx import PolicyError, ScalerConfig, UnsupportedTypeError
from mpx_torch import _compat
from mpx_torch._compile import frame_skipped
from mpx_torch._device_state import DeviceState

__all__ = [
    "OptState",
    "OptimizerStep",
    "Stepping",
    "checked_optimizer",
    "has_fresh_state",
    "step_fused",
    "step_grad_scaler_kwarg",
    "step_plain",
    "unscale_grads",
]


class OptState(Enum):
    """Where one optimizer is in the current iteration (as in torch)."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


_TORCH_KEYS = ("stage", "found_inf_per_device")


@dataclass
class OptimizerStep:
    """One optimizer's record for the current iteration (cleared by :meth:`GradScaler.update`).

    ``stage``: where it is; ``found_inf_per_device``: its gradients' non-finite flag per device
    (float32 tensors, > 0 for non-finite); ``agreed``: the flags were already combined over the
    process group.  ``record["stage"]`` and ``record["found_inf_per_device"]`` read and write the
    same fields, as torch's per-optimizer dicts do, for code written against ``torch.amp.GradScaler``.
    """

    stage: OptState = OptState.READY
    found_inf_per_device: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    agreed: bool = False

    def __getitem__(self, key: str) -> Any:
        if key not in _TORCH_KEYS:
            raise KeyError(key)
        return getattr(self, key)

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in _TORCH_KEYS:
            raise KeyError(key)
        setattr(self, key, value)

    def found_inf(self, device: torch.device) -> torch.Tensor:
        """The flags summed on ``device`` (a float32 scalar, 0 when none was recorded); no sync."""
        flags = [t.to(device, non_blocking=True) for t in self.found_inf_per_device.values()]
        if not flags:
            return torch.zeros((), dtype=torch.float32, device=device)
        return flags[0] if len(flags) == 1 else torch.stack([f.reshape(()) for f in flags]).sum()


class Stepping(Protocol):
    """What the step protocols call on the scaler that steps (an :class:`mpx_torch.GradScaler`; named by
    this protocol so that this module needs no import of the scaler's)."""

    @property
    def config(self) -> ScalerConfig: ...

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None: ...

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]: ...

    def _agree(self, record: OptimizerStep, tensors: DeviceState) -> None: ...


@frame_skipped
def checked_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """``optimizer``, when it is a torch optimizer (``param_groups`` and ``step``, what torch's code reads).

    Raises:
        mpx.UnsupportedTypeError: for anything else.
    """
    if not (
        isinstance(getattr(optimizer, "param_groups", None), list)
        and callable(getattr(optimizer, "step", None))
    ):
        raise UnsupportedTypeError(
            f"optimizer: expected a torch.optim.Optimizer (an object with param_groups and step()), got "
            f"{type(optimizer).__name__}."
        )
    return optimizer


def unscale_grads(
    optimizer: torch.optim.Optimizer,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    *,
    allow_fp16: bool,
    check_unscaled: bool = False,
) -> dict[torch.device, torch.Tensor]:
    """Multiply the gradients by ``inv_scale`` in place, recording non-finite values per device.

    ``check_unscaled``: test the unscaled gradients too (a second pass, no sync), for a scale below 1,
    where dividing a finite gradient by it can overflow.

    Raises:
        mpx.PolicyError: for float16 gradients when ``allow_fp16`` is False.
    """
    per_device_inv: dict[torch.device, torch.Tensor] = {}
    per_device_found: dict[torch.device, torch.Tensor] = {}
    grads: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
    with torch.no_grad():
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if not allow_fp16 and param.grad.dtype == torch.float16:
                    raise PolicyError(
                        "Attempting to unscale FP16 gradients.  The parameters are stored in float16 "
                        "(a pure float16 policy such as 'float16' or '16-true'), and loss scaling needs "
                        "float32 master weights: prepare the model with 'mixed_float16' "
                        "(params=float32,compute=float16), or use GradScaler(ScalerConfig(kind='none'))."
                    )
                if param.grad.is_sparse:
                    if param.grad.dtype is torch.float16:
                        param.grad = param.grad.coalesce()
                    to_unscale = _compat.sparse_values(param.grad)
                else:
                    to_unscale = param.grad
                grads[to_unscale.device][to_unscale.dtype].append(to_unscale)
        for device, per_dtype in grads.items():
            per_device_found[device] = found_inf.to(device, non_blocking=True, copy=True)
            per_device_inv[device] = inv_scale.to(device, non_blocking=True, copy=True)
            for group_grads in per_dtype.values():
                _compat.foreach_non_finite_check_and_unscale_(
                    group_grads, per_device_found[device], per_device_inv[device]
                )
                if check_unscaled:  # times 1: a check only
                    one = torch.ones_like(per_device_inv[device])
                    _compat.foreach_non_finite_check_and_unscale_(group_grads, per_device_found[device], one)
    return per_device_found


@frame_skipped
def has_fresh_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether some parameter with a gradient has no optimizer state yet (its first step)."""
    state = optimizer.state
    if len(state) >= sum(len(group["params"]) for group in optimizer.param_groups):
        return False  # every parameter has its state: the common case, without a loop over parameters
    return any(
        p.grad is not None and p not in state for group in optimizer.param_groups for p in group["params"]
    )


@frame_skipped
def step_plain(
    scaler: Stepping,
    optimizer: torch.optim.Optimizer,
    record: OptimizerStep,
    tensors: DeviceState,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Unscale unless done, combine the flag over the group, then one host read decides the step."""
    if record.stage is OptState.READY:
        scaler.unscale_(optimizer)
    if len(record.found_inf_per_device) == 0:
        raise AssertionError("No inf checks were recorded for this optimizer.")
    scaler._agree(record, tensors)
    retval = None
    if not scaler.config.skip_nonfinite or not sum(v.item() for v in record.found_inf_per_device.values()):
        retval = optimizer.step(*args, **kwargs)
    record.stage = OptState.STEPPED
    return retval


@frame_skipped
def step_fused(
    scaler: Stepping,
    optimizer: torch.optim.Optimizer,
    record: OptimizerStep,
    tensors: DeviceState,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Hand the optimizer ``grad_scale`` and ``found_inf``; it unscales and skips in its kernel (no sync).

    The step that creates the optimizer's state syncs once: a fused step would create that state
    even when skipping, so a skipped first step is decided here and leaves the state uncreated.
    """
    config = scaler.config
    given = getattr(optimizer, "grad_scale", None)  # a scale the user set on the optimizer (torch's protocol)
    if record.stage is OptState.READY and config.scale_can_drop_below_one:
        scaler.unscale_(optimizer)  # the fused kernel would unscale unchecked: unscale (and check) here
        grad_scale = torch.ones_like(tensors.scale) if given is None else given  # nothing left to unscale
    elif record.stage is OptState.READY:
        scaler._check_inf_per_device(optimizer)
        grad_scale = tensors.scale if given is None else tensors.scale * given
    else:  # the user called unscale_()
        grad_scale = given
    scaler._agree(record, tensors)
    found_inf = record.found_inf(tensors.device)
    if not config.skip_nonfinite:
        found_inf = torch.zeros_like(found_inf)
    elif has_fresh_state(optimizer) and found_inf.item():
        record.stage = OptState.STEPPED
        return None
    optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        retval = optimizer.step(*args, **kwargs)
    finally:
        del optimizer.grad_scale  # type: ignore[attr-defined]
        del optimizer.found_inf  # type: ignore[attr-defined]
    record.stage = OptState.STEPPED
    return retval


@frame_skipped
def step_grad_scaler_kwarg(
    scaler: Stepping,
    optimizer: torch.optim.Optimizer,
    record: OptimizerStep,
    tensors: DeviceState,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """torch's older protocol: the optimizer gets the scaler and does its own unscaling, checks and skipping.

    Its flags are combined over the process group in :meth:`GradScaler.update`.
    """
    warnings.warn(
        "GradScaler is going to stop passing itself as a keyword argument to the passed "
        "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
        "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.",
        FutureWarning,
        stacklevel=4,  # this function, GradScaler.step, its eager wrapper, the caller
    )
    retval = optimizer.step(*args, **{**kwargs, "grad_scaler": scaler})
    record.stage = OptState.STEPPED
    return retval
