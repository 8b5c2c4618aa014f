"""``mpx_torch.GradScaler``: ``torch.amp.GradScaler``'s API over the mpx state machine.

The scale and every counter live in tensors on the scaler's device, created
at the first :meth:`GradScaler.scale`; :meth:`GradScaler.update` advances them
with tensor ops only (no host sync), bit for bit as :func:`mpx.scaler_update`:

>>> import torch
>>> import mpx, mpx_torch
>>> scaler = mpx_torch.GradScaler(mpx.ScalerConfig(growth_interval=1))
>>> w = torch.nn.Parameter(torch.ones(2))
>>> opt = torch.optim.SGD([w], lr=0.1)
>>> scaler.scale((w * 3).sum()).backward()
>>> scaler.step(opt)
>>> scaler.update()
>>> scaler.get_scale(), w.tolist()
(131072.0, [0.699999988079071, 0.699999988079071])
>>> mpx.LossScaler.from_state_dict(scaler.state_dict()).scale
131072.0
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections import abc, defaultdict
from collections.abc import Iterable, Mapping
from enum import Enum
from typing import Any

import torch

from mpx import (
    MPXError,
    Policy,
    PolicyError,
    ScalerConfig,
    ScalerConfigError,
    ScalerState,
    StateDictError,
    get_policy,
    load_state_dict,
    scaler_init,
    state_dict,
)

__all__ = ["GradScaler", "OptState"]

_NATIVE_KEYS = frozenset({"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"})
_DEVICE_NAMES = ("cpu", "cuda", "mps", "xpu", "hpu", "mtia", "meta", "xla", "privateuseone")


class OptState(Enum):
    """Where one optimizer is in the current iteration (as in torch)."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _refresh_per_optimizer_state() -> dict[str, Any]:
    return {"stage": OptState.READY, "found_inf_per_device": {}}


def _as_config(config: Any) -> ScalerConfig:
    if config is None:
        return ScalerConfig()
    if isinstance(config, ScalerConfig):
        return config
    if isinstance(config, str) and config.split(":")[0] in _DEVICE_NAMES:
        raise PolicyError(
            f"config: {config!r} is a device, not a scaler config or policy; torch.amp.GradScaler takes the "
            f"device first, mpx_torch.GradScaler takes it second: GradScaler(device={config!r})"
        )
    if isinstance(config, Mapping) and "kind" in config:  # ScalerConfig.to_dict()
        return ScalerConfig.from_dict(config)
    if isinstance(config, (Policy, str, Mapping)):
        return ScalerConfig.for_policy(get_policy(config))
    raise ScalerConfigError(
        f"config: expected an mpx.ScalerConfig, a policy (mpx.Policy or spec string) or None, "
        f"got {type(config).__name__}"
    )


def _native_to_neutral(data: Mapping[str, Any]) -> dict[str, Any]:
    """A ``torch.amp.GradScaler.state_dict()`` as a neutral dict, with torch's semantics."""
    err = StateDictError
    for key in ("scale", "growth_factor", "backoff_factor"):
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise err(f"{key}: expected a finite number in a torch.amp.GradScaler state dict, got {value!r}")
    for key in ("growth_interval", "_growth_tracker"):
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise err(f"{key}: expected an int in a torch.amp.GradScaler state dict, got {value!r}")
    scale = float(torch.tensor(float(data["scale"]), dtype=torch.float32))  # torch's fill_ rounds to float32
    try:
        config = ScalerConfig(
            kind="dynamic",
            init_scale=scale,
            growth_factor=data["growth_factor"],
            backoff_factor=data["backoff_factor"],
            growth_interval=data["growth_interval"],
            min_scale=None,
            max_scale=None,
            hysteresis=1,
        )
    except ScalerConfigError as e:
        raise err(f"config: {e}") from None
    return state_dict(config, ScalerState(scale, growth_tracker=data["_growth_tracker"]))


def _has_fresh_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether some parameter with a gradient has no optimizer state yet (its first step)."""
    state = optimizer.state
    if len(state) >= sum(len(group["params"]) for group in optimizer.param_groups):
        return False  # every parameter has its state: the common case, without a loop over parameters
    return any(
        p.grad is not None and p not in state for group in optimizer.param_groups for p in group["params"]
    )


_INT32_MAX = 2**31 - 1


class _DeviceState:
    """The scale, the counters and the config's float32 constants, as tensors on one device.

    ``steps`` is counted on the host (every :meth:`GradScaler.update` adds one,
    whatever the gradients), the rest on the device.
    """

    #: use ``torch._amp_update_scale_`` (one kernel, as torch's GradScaler) where it is exact:
    #: a dynamic config with hysteresis 1 (bounds are a clamp after it)
    use_torch_kernel = hasattr(torch, "_amp_update_scale_")

    def __init__(self, config: ScalerConfig, state: ScalerState, device: torch.device) -> None:
        self.device = device
        self.scale = self._full(state.scale, torch.float32)
        self.consecutive_nonfinite = self._full(state.consecutive_nonfinite, torch.int64)
        self.skipped_steps = self._full(state.skipped_steps, torch.int64)
        self.zero = self._full(0, torch.int64)
        self.steps = state.steps
        self.growth_tracker = self._full(state.growth_tracker, torch.int64)
        self.set_config(config)

    def _full(self, value: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((), value, dtype=dtype, device=self.device)

    def set_config(self, config: ScalerConfig) -> None:
        lo, hi = config.bounds
        self.growth_factor = self._full(config.growth_factor, torch.float32)
        self.backoff_factor = self._full(config.backoff_factor, torch.float32)
        self.lo, self.hi = self._full(lo, torch.float32), self._full(hi, torch.float32)
        # the kernel takes the factors as doubles: a float32 value times a float32 value is exact in
        # double, so its one rounding to float32 equals the float32 product of mpx.scaler_update
        self.factors = (float(self.growth_factor), float(self.backoff_factor))
        self.bounded = (lo, hi) != (0.0, math.inf)
        self.kernel = (
            self.use_torch_kernel
            and config.kind == "dynamic"
            and config.hysteresis == 1
            and config.growth_interval <= _INT32_MAX
        )
        dtype = torch.int32 if self.kernel else torch.int64  # the kernel's tracker is an int32
        if self.growth_tracker.dtype != dtype:
            self.growth_tracker = self.growth_tracker.to(dtype)

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
        """One step of :func:`mpx.scaler_update` with tensor ops only (``found_inf`` > 0: not finite)."""
        nonfinite = found_inf > 0
        self.steps += 1
        if config.skip_nonfinite:
            self.skipped_steps.add_(nonfinite)
        if self.kernel:
            self.consecutive_nonfinite.add_(1).mul_(nonfinite)
            torch._amp_update_scale_(
                self.scale, self.growth_tracker, found_inf, *self.factors, config.growth_interval
            )
            if self.bounded:  # growth kept below hi, backoff kept above lo
                torch.clamp(self.scale, self.lo, self.hi, out=self.scale)
            return
        consecutive = torch.where(nonfinite, self.consecutive_nonfinite + 1, self.zero)
        if config.kind == "dynamic":
            scale = self.scale
            tracker = torch.where(nonfinite, self.zero, self.growth_tracker + 1)
            grow = tracker == config.growth_interval
            grown = scale * self.growth_factor  # float32 x float32, rounded to float32
            grown = torch.where(torch.isfinite(grown), torch.minimum(grown, self.hi), scale)
            backed = torch.maximum(scale * self.backoff_factor, self.lo)
            back = consecutive >= config.hysteresis  # 0 on finite steps, and hysteresis >= 1
            scale.copy_(torch.where(grow, grown, torch.where(back, backed, scale)))
            self.growth_tracker.copy_(torch.where(grow, self.zero, tracker))
        self.consecutive_nonfinite.copy_(consecutive)


class GradScaler:
    """A drop-in for ``torch.amp.GradScaler`` that runs the mpx loss-scaling state machine.

    Args:
        config: an :class:`mpx.ScalerConfig` (or its ``to_dict()`` form); a
            policy (an :class:`mpx.Policy`, a spec string such as
            ``"mixed_float16"`` or a policy dict), which
            means ``ScalerConfig.for_policy(policy)`` (dynamic for float16
            compute, none otherwise); or None (the default), which means
            ``ScalerConfig()``: init_scale 2**16, growth 2.0 every 2000 finite
            steps, backoff 0.5, the scale kept in [1, 2**24].  (torch's own
            GradScaler has no bounds: ``ScalerConfig(min_scale=None,
            max_scale=None)`` is exactly torch's.)
        device: where the scale and counters live (a device or its name);
            None (the default) means the device of the first tensor passed to
            :meth:`scale`.  Unlike ``torch.amp.GradScaler``, whose first
            argument is the device, the device comes second here.
        enabled: False makes the scaler a pass-through, as in torch.

    A config of kind ``none`` (the default for bfloat16 policies) whose
    ``skip_nonfinite`` is False also makes a pass-through: :meth:`scale`
    returns its input, :meth:`unscale_` and :meth:`update` do nothing,
    :meth:`step` calls ``optimizer.step()``, and the state does not advance.

    Methods follow torch: :meth:`scale`, :meth:`unscale_`, :meth:`step`,
    :meth:`update`, :meth:`get_scale`, :meth:`state_dict`,
    :meth:`load_state_dict`, :meth:`is_enabled`, with torch's misuse errors.
    A step whose gradients are not finite (with ``skip_nonfinite``) leaves
    the parameters and the optimizer state untouched.  Optimizers with
    ``_step_supports_amp_scaling`` (``fused=True`` Adam, AdamW, SGD, Adagrad)
    get ``grad_scale``/``found_inf`` and step without a host sync (except
    for the step that creates their state: it syncs once, so that a skipped
    first step leaves the state uncreated); the others cost one sync in
    :meth:`step`, as in torch.  :meth:`update` never syncs.

    Raises:
        mpx.ScalerConfigError: for a bad config, and mpx.PolicyError for a bad spec.
    """

    def __init__(
        self,
        config: ScalerConfig | Policy | str | Mapping[str, Any] | None = None,
        device: str | torch.device | None = None,
        *,
        enabled: bool = True,
    ) -> None:
        self._config = _as_config(config)
        if device is not None:
            try:
                device = torch.device(device)
            except (RuntimeError, TypeError):
                raise MPXError(f"device: {device!r} is not a torch device") from None
        self._device: torch.device | None = device
        self._enabled = bool(enabled)
        self._host: ScalerState = scaler_init(self._config)
        self._tensors: _DeviceState | None = None
        self._per_optimizer_states: dict[int, dict[str, Any]] = defaultdict(_refresh_per_optimizer_state)

    # -- properties --------------------------------------------------------------------
    @property
    def config(self) -> ScalerConfig:
        """The scaler's configuration (an immutable :class:`mpx.ScalerConfig`)."""
        return self._config

    @property
    def state(self) -> ScalerState:
        """The current :class:`mpx.ScalerState` (reads the device tensors: a host sync)."""
        return self._host if self._tensors is None else self._tensors.read()

    def _passthrough(self) -> bool:
        return not self._enabled or (self._config.kind == "none" and not self._config.skip_nonfinite)

    def is_enabled(self) -> bool:
        """False for a pass-through scaler (``enabled=False``, or kind ``none`` without skipping)."""
        return not self._passthrough()

    def _lazy_init(self, device: torch.device) -> _DeviceState:
        if self._tensors is None:
            self._tensors = _DeviceState(self._config, self._host, self._device or device)
        return self._tensors

    def _check_initialized(self, funcname: str) -> _DeviceState:
        if self._tensors is None:
            raise AssertionError(
                f"Attempted {funcname} but _scale is None.  This may indicate your script did not use "
                "scaler.scale(loss or outputs) earlier in the iteration."
            )
        return self._tensors

    # -- the training-loop API ----------------------------------------------------------
    def scale(self, outputs: torch.Tensor | Iterable[torch.Tensor]) -> Any:
        """Multiply a tensor (or nested lists/tuples/iterables of tensors) by the current scale.

        A pass-through scaler returns ``outputs`` unchanged.
        """
        if self._passthrough():
            return outputs
        if isinstance(outputs, torch.Tensor):
            tensors = self._lazy_init(outputs.device)
            return outputs * tensors.scale.to(device=outputs.device, non_blocking=True)
        per_device: dict[torch.device, torch.Tensor] = {}

        def apply(val: Any) -> Any:
            if isinstance(val, torch.Tensor):
                tensors = self._lazy_init(val.device)
                if val.device not in per_device:
                    per_device[val.device] = tensors.scale.to(device=val.device, non_blocking=True)
                return val * per_device[val.device]
            if isinstance(val, abc.Iterable):
                mapped = map(apply, val)
                return type(val)(mapped) if isinstance(val, (list, tuple)) else mapped
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply(outputs)

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        per_device_inv: dict[torch.device, torch.Tensor] = {}
        per_device_found: dict[torch.device, torch.Tensor] = {}
        grads: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(
            lambda: defaultdict(list)
        )
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
                        to_unscale = param.grad._values()
                    else:
                        to_unscale = param.grad
                    grads[to_unscale.device][to_unscale.dtype].append(to_unscale)
            for device, per_dtype in grads.items():
                if device not in per_device_found:
                    per_device_found[device] = found_inf.to(device, non_blocking=True, copy=True)
                    per_device_inv[device] = inv_scale.to(device, non_blocking=True, copy=True)
                for group_grads in per_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(
                        group_grads, per_device_found[device], per_device_inv[device]
                    )
        return per_device_found

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale, in place, and record whether they are finite.

        Optional: :meth:`step` unscales when this was not called.  Call it
        once per optimizer per iteration, after the last backward, e.g. to
        clip gradients.  No host sync.

        Raises:
            RuntimeError: when called twice since the last :meth:`update`, or after :meth:`step`.
            mpx.PolicyError: for float16 gradients (a pure float16 policy), unless the kind is ``none``.
        """
        if self._passthrough():
            return
        tensors = self._check_initialized("unscale_")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        # as torch: the reciprocal in float64, then float32
        inv_scale = tensors.scale.double().reciprocal().float()
        found_inf = torch.zeros((), dtype=torch.float32, device=tensors.device)
        optimizer_state["found_inf_per_device"] = self._unscale_grads_(
            optimizer, inv_scale, found_inf, allow_fp16=self._config.kind == "none"
        )
        optimizer_state["stage"] = OptState.UNSCALED

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        tensors = self._check_initialized("_check_inf_per_device")
        one = torch.ones((), dtype=torch.float32, device=tensors.device)
        found_inf = torch.zeros((), dtype=torch.float32, device=tensors.device)
        found = self._unscale_grads_(optimizer, one, found_inf, allow_fp16=True)
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = found
        return found

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless :meth:`unscale_` was called) and step ``optimizer`` when the gradients are finite.

        ``*args``/``**kwargs`` go to ``optimizer.step``; returns what it
        returns, or None for a skipped step.  A skipped step leaves parameters
        and optimizer state untouched.  A non-fused optimizer costs one host
        sync (as in torch); fused ones get ``grad_scale`` and ``found_inf``.

        Raises:
            RuntimeError: for a ``closure`` argument, or when called twice since the last :meth:`update`.
        """
        if self._passthrough():
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        tensors = self._check_initialized("step")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            if "grad_scaler" in inspect.signature(optimizer.step).parameters:
                raise RuntimeError(
                    "optimizer.step() takes a grad_scaler argument, the protocol torch is retiring; "
                    "mpx_torch.GradScaler supports the grad_scale/found_inf attributes only."
                )
            if optimizer_state["stage"] is OptState.READY:
                self._check_inf_per_device(optimizer)
            found_inf = sum(
                t.to(tensors.device, non_blocking=True)
                for t in optimizer_state["found_inf_per_device"].values()
            )
            if not isinstance(found_inf, torch.Tensor):
                found_inf = torch.zeros((), dtype=torch.float32, device=tensors.device)
            if not self._config.skip_nonfinite:
                found_inf = torch.zeros_like(found_inf)
            elif _has_fresh_state(optimizer) and found_inf.item():
                # a fused step would create the state of a first step even when skipping it: this
                # step (before any state exists) syncs once, and a skip leaves the state uncreated
                optimizer_state["stage"] = OptState.STEPPED
                return None
            optimizer.grad_scale = (  # type: ignore[attr-defined]
                getattr(optimizer, "grad_scale", None)
                if optimizer_state["stage"] is OptState.UNSCALED
                else tensors.scale * getattr(optimizer, "grad_scale", 1)
            )
            optimizer.found_inf = found_inf  # type: ignore[attr-defined]
            try:
                retval = optimizer.step(*args, **kwargs)
            finally:
                del optimizer.grad_scale  # type: ignore[attr-defined]
                del optimizer.found_inf  # type: ignore[attr-defined]
            optimizer_state["stage"] = OptState.STEPPED
            return retval

        if optimizer_state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if len(optimizer_state["found_inf_per_device"]) == 0:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        retval = None
        if not self._config.skip_nonfinite or not sum(
            v.item() for v in optimizer_state["found_inf_per_device"].values()
        ):
            retval = optimizer.step(*args, **kwargs)
        optimizer_state["stage"] = OptState.STEPPED
        return retval

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Advance the state machine by one step (call once per iteration, after every :meth:`step`).

        The step counts as non-finite when any optimizer's gradients were.
        No host sync.  ``new_scale`` instead sets the scale (a float is
        validated against the config; a tensor is copied unchecked, as
        checking would sync) and leaves the counters as they are.

        Raises:
            AssertionError: when no optimizer was unscaled or stepped since the last update (as torch).
            mpx.ScalerConfigError: for a float ``new_scale`` the config does not allow.
        """
        if self._passthrough():
            return
        tensors = self._check_initialized("update")
        if new_scale is not None:
            if isinstance(new_scale, torch.Tensor):
                if new_scale.numel() != 1 or new_scale.requires_grad:
                    raise ValueError(
                        "new_scale: expected a float or a 1-element tensor with requires_grad=False."
                    )
                tensors.scale.copy_(new_scale.reshape(()))
            else:
                value = float(torch.tensor(float(new_scale), dtype=torch.float32))
                lo, hi = self._config.bounds
                if self._config.kind != "dynamic":
                    raise ScalerConfigError(
                        f"new_scale: a {self._config.kind} scaler's scale cannot be changed"
                    )
                if not (math.isfinite(value) and value > 0 and lo <= value <= hi):
                    raise ScalerConfigError(
                        f"new_scale: {new_scale!r} lies outside [min_scale, max_scale] = [{lo}, {hi}]"
                    )
                tensors.scale.fill_(value)
        else:
            found_infs = [
                found_inf.to(device=tensors.device, non_blocking=True)
                for state in self._per_optimizer_states.values()
                for found_inf in state["found_inf_per_device"].values()
            ]
            if not found_infs:
                raise AssertionError("No inf checks were recorded prior to update.")
            combined = found_infs[0] if len(found_infs) == 1 else torch.stack(found_infs).sum()
            tensors.advance(self._config, combined)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    # -- queries -----------------------------------------------------------------------
    def get_scale(self) -> float:
        """The current scale as a Python float (a host sync); 1.0 for a pass-through scaler."""
        if self._passthrough():
            return 1.0
        return self._host.scale if self._tensors is None else float(self._tensors.scale.item())

    def get_growth_factor(self) -> float:
        """The config's growth factor."""
        return self._config.growth_factor

    def get_backoff_factor(self) -> float:
        """The config's backoff factor."""
        return self._config.backoff_factor

    def get_growth_interval(self) -> int:
        """The config's growth interval."""
        return self._config.growth_interval

    def _set_config(self, config: ScalerConfig, state: ScalerState | None = None) -> None:
        if state is None:
            state = self.state
        self._config = config
        if self._tensors is None:
            self._host = state
        else:
            self._tensors.set_config(config)
            self._tensors.fill(state)

    def set_growth_factor(self, new_factor: float) -> None:
        """Replace the config's growth factor (validated by :class:`mpx.ScalerConfig`)."""
        self._set_config(dataclasses.replace(self._config, growth_factor=new_factor))

    def set_backoff_factor(self, new_factor: float) -> None:
        """Replace the config's backoff factor (validated by :class:`mpx.ScalerConfig`)."""
        self._set_config(dataclasses.replace(self._config, backoff_factor=new_factor))

    def set_growth_interval(self, new_interval: int) -> None:
        """Replace the config's growth interval (validated; a tracker past it restarts at 0)."""
        state = self.state
        if state.growth_tracker >= new_interval:
            state = dataclasses.replace(state, growth_tracker=0)
        self._set_config(dataclasses.replace(self._config, growth_interval=new_interval), state)

    # -- state dicts ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The neutral JSON-safe state dict (``mpx.scaler/1``, via :func:`mpx.state_dict`); a host sync.

        ``mpx.LossScaler`` and every mpx backend load it.  Call it after :meth:`update`.
        """
        return state_dict(self._config, self.state)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore config and state from a neutral dict, or from a ``torch.amp.GradScaler`` state dict.

        A neutral dict (``{"format": "mpx.scaler/1", ...}``) is validated by
        :func:`mpx.load_state_dict` and restores the saved config too.  A
        native dict (keys ``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``) keeps torch's semantics: it
        becomes a dynamic config with ``min_scale=None``, ``max_scale=None``,
        ``hysteresis=1`` and ``init_scale`` set to the saved scale (as torch
        does), the scale rounded to float32 and the step counters at 0.  On
        error nothing changes.

        Raises:
            mpx.StateDictError: for a malformed dict of either form, or an
                empty one (saved from a disabled torch GradScaler).
        """
        if isinstance(state_dict, Mapping) and "format" not in state_dict:
            if len(state_dict) == 0:
                raise StateDictError(
                    "state dict: the source state dict is empty, possibly because it was saved from a "
                    "disabled torch.amp.GradScaler; nothing to load"
                )
            if set(state_dict) == _NATIVE_KEYS:
                state_dict = _native_to_neutral(state_dict)
        config, state = load_state_dict(state_dict)
        self._set_config(config, state)

    def __repr__(self) -> str:
        where = "uninitialized" if self._tensors is None else str(self._tensors.device)
        return f"mpx_torch.GradScaler(kind={self._config.kind!r}, {where}, enabled={self.is_enabled()})"
