"""The device half of :class:`mpx_torch.GradScaler`: the scale and the counters as tensors, advanced by the
core's kernel (:func:`mpx.kernels.scale.update`) with the torch table: tensor ops, no host sync.

The kernel's products are torch's own rule, ``float32(float64(scale) * float64(factor))`` (the table
has float64), so a scaler configured as torch's (``min_scale=None, max_scale=None``) moves bit for bit
as ``torch.amp.GradScaler``.
"""

from __future__ import annotations

from typing import Any

import torch

from mpx import ScalerConfig, ScalerState
from mpx.kernels import scale as kernel
from mpx_torch._array_ops import TorchOps, ops_for

__all__ = ["DeviceState"]


class DeviceState:
    """The scale (float32) and the five counters (int32) of :class:`mpx.ScalerState` as tensors on one device.

    :meth:`advance` runs one step of the kernel and writes the results into these tensors in place
    (code holding ``scaler._scale`` sees the new scale, as with torch's GradScaler).  ``updates``
    counts the calls of :meth:`advance` on the host (from the loaded state's ``steps``), so a caller
    can tell that a step happened without reading the device.
    """

    def __init__(self, config: ScalerConfig, state: ScalerState, device: torch.device) -> None:
        self.device = torch.device(device)
        self.ops: TorchOps = ops_for(self.device)
        self.config = config
        self.scale = self._full(state.scale, torch.float32)
        self.growth_tracker = self._full(state.growth_tracker, torch.int32)
        self.consecutive_nonfinite = self._full(state.consecutive_nonfinite, torch.int32)
        self.steps = self._full(state.steps, torch.int32)
        self.skipped_steps = self._full(state.skipped_steps, torch.int32)
        self.nonfinite_since_growth = self._full(state.nonfinite_since_growth, torch.int32)
        #: :func:`mpx.kernels.scale.floor_hit` of the last step (a bool tensor), kept with ``on_floor="raise"``
        self.floor_hit: Any = False
        self.tracker_before: Any = None  # advance(keep_tracker=True): the growth tracker before the step
        self.updates = state.steps

    def _full(self, value: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((), value, dtype=dtype, device=self.device)

    def tensors(self) -> kernel.ScaleState:
        """The state as the kernel's :class:`~mpx.kernels.scale.ScaleState` of these tensors."""
        return kernel.ScaleState(
            self.scale, self.growth_tracker, self.consecutive_nonfinite, self.steps, self.skipped_steps,
            self.nonfinite_since_growth,
        )

    def set_config(self, config: ScalerConfig) -> None:
        self.config = config

    def fill(self, state: ScalerState) -> None:
        """Write a host state into the tensors (in place)."""
        for tensor, value in zip(self.tensors(), (state.scale, *_counters(state)), strict=True):
            tensor.fill_(value)
        self.updates = state.steps

    def read(self) -> ScalerState:
        """The state on the host: one device-to-host transfer."""
        if self.ops.float64:  # every field is exact in float64: one stacked read
            scale, *counters = torch.stack([t.to(torch.float64) for t in self.tensors()]).tolist()
        else:
            scale = self.scale.item()
            counters = torch.stack(self.tensors()[1:]).tolist()
        return ScalerState(float(scale), *(int(c) for c in counters))

    @torch.no_grad()
    def advance(self, found_inf: torch.Tensor, keep_tracker: bool = False) -> None:
        """One step of :func:`mpx.scaler_update` for a step whose combined flag is ``found_inf``
        (a float32 scalar; nonzero: not finite, as torch's kernel reads it).  No host sync.
        ``keep_tracker``: keep the growth tracker before the step in ``tracker_before`` (what the
        step's history events are computed from)."""
        if found_inf.dim():
            found_inf = found_inf.reshape(())
        before = self.tensors()
        if keep_tracker:
            self.tracker_before = before.growth_tracker.clone()
        after = kernel.update(self.ops, self.config, before, torch.eq(found_inf, 0))
        if self.config.on_floor == "raise":  # before the in-place copies overwrite the old scale
            self.floor_hit = kernel.floor_hit(self.ops, self.config, before.scale.clone(), after)
        for old, new in zip(before, after, strict=True):
            if new is not old:
                old.copy_(new)
        self.updates += 1


def _counters(state: ScalerState) -> tuple[int, int, int, int, int]:
    return (
        state.growth_tracker, state.consecutive_nonfinite, state.steps, state.skipped_steps,
        state.nonfinite_since_growth,
    )  # fmt: skip
