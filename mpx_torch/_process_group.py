"""One decision across replicas: the process group a :class:`mpx_torch.GradScaler` (and
:func:`mpx_torch.float8.commit_float8`) agrees over, and the one all-reduce of the found-inf flag.

A leaf module (torch and the core only), so that the scaler, FP8 and
:mod:`mpx_torch.distributed` all import it and none of them imports another.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from mpx import MPXError
from mpx_torch._compile import eager_under_dynamo

__all__ = ["agree_found_inf", "check_process_group", "group_to_agree"]


# -- one decision across replicas ------------------------------------------------------
def check_process_group(process_group: Any) -> Any:
    """``GradScaler``'s ``process_group`` argument, validated (None or a ``torch.distributed.ProcessGroup``)."""
    if process_group is None:
        return None
    if not dist.is_available():
        raise MPXError(
            "process_group: this torch build has no torch.distributed; pass process_group=None (the default)."
        )
    if not isinstance(process_group, dist.ProcessGroup):
        raise MPXError(
            f"process_group: expected None (the default group once torch.distributed is initialized) or a "
            f"torch.distributed.ProcessGroup (e.g. from dist.new_group), got {type(process_group).__name__}."
        )
    return process_group


def group_to_agree(process_group: Any) -> Any:
    """The group whose ranks must agree on a step, or None when there is nothing to combine.

    None (the default) means the default (world) group when torch.distributed
    is initialized, and nothing otherwise (no distributed call is made).  A
    group of one rank means nothing to combine.

    Raises:
        mpx.MPXError: when this rank is not a member of ``process_group``.
    """
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        process_group = dist.group.WORLD
    size = dist.get_world_size(process_group)
    if size < 0:
        raise MPXError(
            "process_group: this rank is not a member of the GradScaler's process group; give every rank that "
            "steps with this scaler a group it belongs to."
        )
    return process_group if size > 1 else None


@eager_under_dynamo  # a collective: run eagerly from compiled code, as the rest of the scaler
def agree_found_inf(flags: Iterable[torch.Tensor], device: torch.device, group: Any) -> torch.Tensor:
    """One float32 flag on ``device``: 1.0 when any of ``flags`` is non-zero on any rank of ``group``.

    The per-device flags are combined first (their maximum), then one
    ``all_reduce(MAX)`` over ``group``; no host sync.  The maximum (not a sum)
    keeps the flag at 1.0, which torch's fused optimizers require to skip.
    """
    flags = [f.to(device=device, dtype=torch.float32, non_blocking=True) for f in flags]
    if not flags:
        combined = torch.zeros((), dtype=torch.float32, device=device)
    elif len(flags) == 1:
        combined = flags[0].reshape(()).clone()
    else:
        combined = torch.stack([f.reshape(()) for f in flags]).amax()
    dist.all_reduce(combined, op=dist.ReduceOp.MAX, group=group)
    return combined
