"""The device half of :class:`mpx_torch.GradScaler`: the scale and counters as tensors, and one
step of :func:`mpx.scaler_update` in tensor ops (no host sync), bit for bit as torch's own kernel."""

from __future__ import annotations

from typing import Any

import torch

from mpx import COUNTER_MAX, ScalerConfig, ScalerState
from mpx_torch import _compat

__all__ = ["DeviceState"]


class DeviceState:
    """The scale, the counters and the config's float32 constants, as tensors on one device.

    ``steps`` is counted on the host (every :meth:`GradScaler.update` adds one,
    whatever the gradients), the rest on the device.
    """

    #: use ``torch._amp_update_scale_`` (one kernel, as torch's GradScaler; a torch without it raises
    #: :class:`mpx.FrameworkVersionError`, see :mod:`mpx_torch._compat`): the scale's products are then
    #: torch's own, ``float32(float64(scale) * float64(factor))``, bit for bit.  False: the same
    #: arithmetic in tensor ops (the tests run both and compare them)
    use_torch_kernel = True

    def __init__(self, config: ScalerConfig, state: ScalerState, device: torch.device) -> None:
        self.device = device
        self.scale = self._full(state.scale, torch.float32)
        self.consecutive_nonfinite = self._full(state.consecutive_nonfinite, torch.int64)
        self.skipped_steps = self._full(state.skipped_steps, torch.int64)
        self.zero = self._full(0, torch.int64)
        self.steps = state.steps
        self.growth_tracker = self._full(state.growth_tracker, torch.int32)  # the kernel's tracker is int32
        self.set_config(config)

    def _full(self, value: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((), value, dtype=dtype, device=self.device)

    def set_config(self, config: ScalerConfig) -> None:
        lo, hi = config.bounds  # a validated config: lo >= 2**-126, hi <= float32's max or inf
        # the kernel (and the fallback) take the factors as float64 values, as mpx.scale_product does
        self.factors = (config.growth_factor, config.backoff_factor)
        self.lo, self.hi = self._full(lo, torch.float32), self._full(hi, torch.float32)

    def fill(self, state: ScalerState) -> None:
        self.scale.fill_(state.scale)
        for name in ("growth_tracker", "consecutive_nonfinite", "skipped_steps"):
            getattr(self, name).fill_(getattr(state, name))
        self.steps = state.steps

    def read(self) -> ScalerState:
        tracker, consecutive, skipped = torch.stack(
            [self.growth_tracker.to(torch.int64), self.consecutive_nonfinite, self.skipped_steps]
        ).tolist()
        return ScalerState(float(self.scale.item()), tracker, consecutive, self.steps, skipped)

    @torch.no_grad()
    def advance(self, config: ScalerConfig, found_inf: torch.Tensor) -> None:
        """One step of :func:`mpx.scaler_update` with tensor ops only (``found_inf`` > 0: not finite).

        The counters saturate at 2**31 - 1, as in the reference.
        """
        nonfinite = found_inf > 0
        self.steps = min(self.steps + 1, COUNTER_MAX)
        if config.skip_nonfinite:
            self.skipped_steps.add_(nonfinite).clamp_(max=COUNTER_MAX)
        consecutive = torch.where(
            nonfinite, (self.consecutive_nonfinite + 1).clamp_(max=COUNTER_MAX), self.zero
        )
        if config.kind == "dynamic":
            if config.hysteresis > 1:  # a non-finite step before the hysteresis-th keeps the scale
                keep = nonfinite & (consecutive < config.hysteresis)
                saved = self.scale.clone()
            if self.use_torch_kernel:
                # found_inf: backoff and tracker 0; else the tracker counts and the scale grows (kept if inf)
                _compat.amp_update_scale_(
                    self.scale, self.growth_tracker, found_inf, *self.factors, config.growth_interval
                )
            else:  # the kernel's arithmetic, with float64 products
                tracker = torch.where(nonfinite, 0, self.growth_tracker + 1)
                grow = tracker == config.growth_interval
                grown = (self.scale.double() * self.factors[0]).float()
                grown = torch.where(torch.isfinite(grown), grown, self.scale)
                backed = (self.scale.double() * self.factors[1]).float()
                self.scale.copy_(torch.where(nonfinite, backed, torch.where(grow, grown, self.scale)))
                self.growth_tracker.copy_(torch.where(grow, 0, tracker))
            if config.hysteresis > 1:
                self.scale.copy_(torch.where(keep, saved, self.scale))
            # growth capped at max_scale, backoff floored at min_scale (2**-126 for None): a subnormal
            # (or 0) backoff of the kernel lies below the floor, so its exact value never matters
            torch.clamp(self.scale, self.lo, self.hi, out=self.scale)
        self.consecutive_nonfinite.copy_(consecutive)
