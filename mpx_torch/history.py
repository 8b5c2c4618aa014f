"""Scaler history and stuck detection for :class:`mpx_torch.GradScaler`, plus the TensorBoard hook.

History (opt-in, ``GradScaler.record_history()``): each :meth:`GradScaler.update`
writes the state after the step and the step's events (the scale's float32 bits, the
kernel's event bits, ``consecutive_nonfinite``, ``steps``) into one int32 row of the core's ring buffer
(:mod:`mpx.kernels.ring`, run with the torch table) on the scaler's device, with tensor
ops only (no host sync, nothing a compiled step guards on: the scaler's methods run
eagerly); :meth:`GradScaler.history` reads the buffer and :meth:`mpx.ScalerHistory.from_rows`
decodes it (the row layout every backend uses).
Off (the default) it costs one ``is None`` test per update.

Stuck detection (``ScalerConfig.max_consecutive_skips``): :meth:`GradScaler.scale`
then keeps ``isfinite(loss).all()`` as a device flag, and each update reads the
scale, the consecutive count and that flag (one host sync per update, only with
the option on) and calls :func:`mpx.check_stuck`.
"""

from __future__ import annotations

from typing import Any

import torch

from mpx.errors import MPXError
from mpx.history import ScalerHistory
from mpx.kernels import ring
from mpx.kernels import scale as scale_kernel
from mpx.kernels.ring import ROW_FIELDS, check_capacity
from mpx.kernels.scale import ScaleState
from mpx.scaling import ScalerConfig
from mpx.stuck import check_floor, check_stuck
from mpx_torch._array_ops import ops_for

__all__ = ["HistoryBuffer", "check_floor_after", "check_stuck_after", "log_history", "loss_finite_flag"]


class HistoryBuffer:
    """The last ``capacity`` states after each step, on ``device``: the core's ring buffer
    (:mod:`mpx.kernels.ring`, int32 ``capacity x 4`` rows and a count of rows written, both tensors)."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity = check_capacity(capacity)
        self.ops = ops_for(device)
        self.rows = torch.zeros((capacity, len(ROW_FIELDS)), dtype=torch.int32, device=device)
        self.recorded = torch.zeros((), dtype=torch.int32, device=device)

    @torch.no_grad()
    def record(self, config: ScalerConfig, tracker_before: torch.Tensor, state: ScaleState) -> None:
        """Write the state after this step and the step's events (:func:`mpx.kernels.scale.events`, from the
        growth tracker before it) into the next row (device ops only; the rows in place)."""
        events = scale_kernel.events(self.ops, config, tracker_before, state)
        row = ring.row(self.ops, state.scale, events, state.consecutive_nonfinite, state.steps)
        self.rows, self.recorded = ring.record(self.ops, self.rows, self.recorded, row)

    def read(self, config: ScalerConfig) -> ScalerHistory:
        """The recorded steps (the last ``capacity``), oldest first, decoded by :meth:`mpx.ScalerHistory.from_rows`
        (one read of the count and one of the rows)."""
        return ScalerHistory.from_rows(config, self.rows.cpu().numpy(), int(self.recorded))


def loss_finite_flag(outputs: Any) -> torch.Tensor | None:
    """``isfinite(outputs).all()`` as a device bool (None when ``outputs`` holds no tensor); no sync."""
    if isinstance(outputs, torch.Tensor):
        return torch.isfinite(outputs).all()
    flags = [torch.isfinite(t).all() for t in outputs if isinstance(t, torch.Tensor)] if isinstance(
        outputs, (list, tuple)) else []  # fmt: skip
    return torch.stack(flags).all() if flags else None


def check_stuck_after(config: ScalerConfig, tensors: Any, loss_finite: torch.Tensor | None) -> None:
    """:func:`mpx.check_stuck` after ``GradScaler.update``: one host read of the scale, the count and the flag.

    ``loss_finite``: :func:`loss_finite_flag` of the losses scaled since the last update (None: unknown).
    The warning (``on_stuck="warn"``) points at the line that called ``update()``.
    """
    if loss_finite is None:  # -1: unknown (no loss was scaled, or it held no tensor)
        flag = torch.full((), -1.0, dtype=torch.float64, device=tensors.device)
    else:
        flag = loss_finite.to(device=tensors.device, dtype=torch.float64)
    values = torch.stack([tensors.scale.double(), tensors.consecutive_nonfinite.double(), flag])
    scale, consecutive, finite = values.tolist()
    # stacklevel: past this function, update() and its eager wrapper, to update()'s caller
    check_stuck(config, scale, int(consecutive), int(finite), stacklevel=5)


def check_floor_after(config: ScalerConfig, tensors: Any) -> None:
    """:func:`mpx.check_floor` after ``GradScaler.update`` with ``on_floor="raise"``: one host read of the
    step's floor flag, the step count and the scale (the same read stuck detection makes)."""
    values = torch.stack([torch.as_tensor(tensors.floor_hit, device=tensors.device).double(),
                          tensors.steps.double(), tensors.scale.double()])  # fmt: skip
    hit, steps, scale = values.tolist()
    check_floor(config, hit, int(steps), scale)


def log_history(history: Any, writer: Any, *, prefix: str = "loss_scaler", since: int = 0) -> int:
    """Write ``history``'s steps after step ``since`` to a TensorBoard ``SummaryWriter``; returns the last step.

    ``history``: an :class:`mpx.ScalerHistory`, or a recording ``GradScaler``
    (its :meth:`~mpx_torch.GradScaler.history`, one transfer).  Call it every
    few hundred steps with ``since`` the step it returned last time.

    ``writer``: a ``torch.utils.tensorboard.SummaryWriter`` (anything with its
    ``add_scalar(tag, value, global_step)``), or a log directory (a str or
    path) for which one is made.  Tags: ``{prefix}/scale``, ``{prefix}/skipped``,
    ``{prefix}/growth``, ``{prefix}/backoff`` (0 or 1), at each step number.

    Raises:
        MPXError: for a log directory when the ``tensorboard`` package is not installed.
    """
    if not isinstance(history, ScalerHistory):
        history = history.history()
    if not hasattr(writer, "add_scalar"):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise MPXError(
                "writer: a log directory needs torch.utils.tensorboard, which needs the tensorboard package "
                f"(pip install tensorboard); it failed to import: {e}"
            ) from None
        writer = SummaryWriter(str(writer))
    last = since
    for i, step in enumerate(history.steps):
        if step <= since:
            continue
        writer.add_scalar(f"{prefix}/scale", history.scale[i], step)
        for name in ("skipped", "growth", "backoff"):
            writer.add_scalar(f"{prefix}/{name}", int(getattr(history, name)[i]), step)
        last = step
    if hasattr(writer, "flush"):
        writer.flush()
    return last
