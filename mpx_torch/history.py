"""Scaler history and stuck detection for :class:`mpx_torch.GradScaler`, plus the TensorBoard hook.

History (opt-in, ``GradScaler.record_history()``): each :meth:`GradScaler.update`
copies the state after the step (the scale's float32 bits, ``growth_tracker``,
``consecutive_nonfinite``, the step number) into one row of an int64 ring buffer on the scaler's
device, with tensor ops only (no host sync, nothing a compiled step guards on:
the scaler's methods run eagerly); :meth:`GradScaler.history` reads the buffer
in one transfer and :meth:`mpx.ScalerHistory.from_rows` decodes it (the row layout every backend uses).
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
from mpx.scaling import COUNTER_MAX, ScalerConfig
from mpx.stuck import check_stuck

__all__ = ["HistoryBuffer", "check_stuck_after", "log_history", "loss_finite_flag"]


class HistoryBuffer:
    """A ring buffer of the last ``capacity`` states after each step, on ``device`` (int64, ``capacity x 4``)."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity = self.check(capacity)
        self.rows = torch.zeros((capacity, 4), dtype=torch.int64, device=device)
        self.recorded = 0  # rows written (host int: the scaler's methods run eagerly)

    @staticmethod
    def check(capacity: Any) -> int:
        """``capacity`` validated: an int in [1, 2**31 - 1]."""
        if not isinstance(capacity, int) or isinstance(capacity, bool) or not 1 <= capacity <= COUNTER_MAX:
            raise MPXError(f"capacity: expected an int in [1, 2**31 - 1] (steps kept), got {capacity!r}")
        return capacity

    @torch.no_grad()
    def record(self, tensors: Any) -> None:
        """Copy the state after this step into the next row (device ops only)."""
        row = torch.stack([
            tensors.scale.view(torch.int32).to(torch.int64),
            tensors.growth_tracker.to(torch.int64),
            tensors.consecutive_nonfinite.to(torch.int64),
        ])  # fmt: skip
        self.rows[self.recorded % self.capacity, :3].copy_(row)
        self.rows[self.recorded % self.capacity, 3].fill_(tensors.steps)  # the host step count: no sync
        self.recorded += 1

    def read(self, config: ScalerConfig) -> ScalerHistory:
        """The recorded steps (the last ``capacity``), oldest first, in one device-to-host transfer
        (decoded by :meth:`mpx.ScalerHistory.from_rows`)."""
        return ScalerHistory.from_rows(config, self.rows.cpu().numpy(), self.recorded)


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
