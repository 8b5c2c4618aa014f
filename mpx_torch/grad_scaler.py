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
import warnings
from collections import abc, defaultdict
from collections.abc import Iterable, Mapping
from enum import Enum
from typing import Any

import torch

import mpx
from mpx import (
    MPXError,
    Policy,
    PolicyError,
    ScalerConfig,
    ScalerConfigError,
    ScalerState,
    StateDictError,
    load_state_dict,
    scaler_init,
    state_dict,
)
from mpx.scaling import _finite_float, f32
from mpx_torch import _compat
from mpx_torch._compile import eager_under_dynamo, make_eager
from mpx_torch._device_state import DeviceState as _DeviceState
from mpx_torch._scaler_state import NATIVE_KEYS, as_config, native_to_neutral
from mpx_torch.distributed import agree_found_inf, check_process_group, group_to_agree
from mpx_torch.history import HistoryBuffer, check_stuck, loss_finite_flag

__all__ = ["GradScaler", "OptState"]


class OptState(Enum):
    """Where one optimizer is in the current iteration (as in torch)."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _refresh_per_optimizer_state() -> dict[str, Any]:
    # agreed: found_inf_per_device already holds the flag combined over the process group
    return {"stage": OptState.READY, "found_inf_per_device": {}, "agreed": False}


def _has_fresh_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether some parameter with a gradient has no optimizer state yet (its first step)."""
    state = optimizer.state
    if len(state) >= sum(len(group["params"]) for group in optimizer.param_groups):
        return False  # every parameter has its state: the common case, without a loop over parameters
    return any(
        p.grad is not None and p not in state for group in optimizer.param_groups for p in group["params"]
    )


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
        process_group: the ranks that must take the same decision.  None (the
            default) means the default (world) group once torch.distributed is
            initialized, and nothing (no distributed call) otherwise; a
            ``torch.distributed.ProcessGroup`` means that group.  With more
            than one rank, each optimizer's found-inf flag is combined over
            the group before its step decides to skip (one
            ``all_reduce(MAX)`` of one float32 flag per optimizer per step,
            no host sync), so every rank skips, backs off and grows together
            (as FSDP1's ``ShardedGradScaler`` does; under FSDP2, DTensor's
            found-inf kernel already combines its shards' flags over the mesh).
            A group of one rank (``dist.new_group([rank])``) keeps the
            decision local.

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
        mpx.ScalerConfigError: for a bad config, mpx.PolicyError for a bad spec,
            and mpx.MPXError for a bad ``process_group``.
    """

    def __init__(
        self,
        config: ScalerConfig | Policy | str | Mapping[str, Any] | None = None,
        device: str | torch.device | None = None,
        *,
        enabled: bool = True,
        process_group: Any = None,
    ) -> None:
        self._config = as_config(config)
        self._process_group = check_process_group(process_group)
        make_eager()  # compiled steps call the scaler's methods eagerly (mpx_torch._compile)
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
        self._history: HistoryBuffer | int | None = None  # an int: the capacity, until the device is known
        self._loss_finite: torch.Tensor | None = None  # set by scale() only with max_consecutive_skips

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
    @eager_under_dynamo  # run eagerly by compiled code, as torch's GradScaler
    def scale(self, outputs: torch.Tensor | Iterable[torch.Tensor]) -> Any:
        """Multiply a tensor (or nested lists/tuples/iterables of tensors) by the current scale.

        A pass-through scaler returns ``outputs`` unchanged.
        """
        if self._passthrough():
            return outputs
        if self._config.max_consecutive_skips is not None:  # stuck detection tells a non-finite loss apart
            # every loss scaled since the last update (the micro-batches of an accumulation window)
            flag, seen = loss_finite_flag(outputs), self._loss_finite
            self._loss_finite = flag if seen is None or flag is None else seen & flag
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
        check_unscaled: bool = False,
    ) -> dict[torch.device, torch.Tensor]:
        """Unscale in place, recording non-finite values in ``found_inf`` per device (torch's helper).

        ``check_unscaled``: test the unscaled gradients too (a second pass, no sync), for a scale
        below 1, where dividing a finite gradient by it can overflow.
        """
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
                        to_unscale = _compat.sparse_values(param.grad)
                    else:
                        to_unscale = param.grad
                    grads[to_unscale.device][to_unscale.dtype].append(to_unscale)
            for device, per_dtype in grads.items():
                if device not in per_device_found:
                    per_device_found[device] = found_inf.to(device, non_blocking=True, copy=True)
                    per_device_inv[device] = inv_scale.to(device, non_blocking=True, copy=True)
                for group_grads in per_dtype.values():
                    _compat.foreach_non_finite_check_and_unscale_(
                        group_grads, per_device_found[device], per_device_inv[device]
                    )
                    if check_unscaled:  # times 1: a check only
                        one = torch.ones_like(per_device_inv[device])
                        _compat.foreach_non_finite_check_and_unscale_(
                            group_grads, per_device_found[device], one
                        )
        return per_device_found

    @eager_under_dynamo
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale, in place, and record whether they are finite.

        Optional: :meth:`step` unscales when this was not called.  Call it
        once per optimizer per iteration, after the last backward, e.g. to
        clip gradients.  No host sync.  When the config lets the scale drop
        below 1, the unscaled gradients are tested too (a gradient that
        overflows only once unscaled makes the step non-finite, as in mpx_jax).

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
            optimizer,
            inv_scale,
            found_inf,
            allow_fp16=self._config.kind == "none",
            check_unscaled=self._config.scale_can_drop_below_one,
        )
        optimizer_state["stage"] = OptState.UNSCALED

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        tensors = self._check_initialized("_check_inf_per_device")
        one = torch.ones((), dtype=torch.float32, device=tensors.device)
        found_inf = torch.zeros((), dtype=torch.float32, device=tensors.device)
        found = self._unscale_grads_(optimizer, one, found_inf, allow_fp16=True)
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = found
        return found

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        """The found-inf flags recorded for ``optimizer`` (torch's helper for ``grad_scaler=`` optimizers)."""
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    @eager_under_dynamo(recursive=False)  # the optimizer's step compiles, as under torch's GradScaler
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless :meth:`unscale_` was called) and step ``optimizer`` when the gradients are finite.

        ``*args``/``**kwargs`` go to ``optimizer.step``; returns what it
        returns, or None for a skipped step.  A skipped step leaves parameters
        and optimizer state untouched.  A non-fused optimizer costs one host
        sync (as in torch); fused ones get ``grad_scale`` and ``found_inf``.
        Across ranks (see ``process_group``) the flag is combined over the
        group first, so every rank takes the same decision.  (An optimizer
        with torch's legacy ``grad_scaler=`` step argument decides by itself;
        its flags are combined in :meth:`update`.)

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

        if _compat.step_supports_amp_scaling(optimizer):
            if "grad_scaler" in inspect.signature(optimizer.step).parameters:
                # torch's older protocol: the optimizer gets the scaler and does its own unscaling,
                # checks and skipping (with _check_inf_per_device, _found_inf_per_device, unscale_)
                warnings.warn(
                    "GradScaler is going to stop passing itself as a keyword argument to the passed "
                    "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                    "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.",
                    FutureWarning,
                    stacklevel=2,
                )
                retval = optimizer.step(*args, **{**kwargs, "grad_scaler": self})
                optimizer_state["stage"] = OptState.STEPPED
                return retval
            if optimizer_state["stage"] is OptState.READY:
                if self._config.scale_can_drop_below_one:
                    # the fused kernel would unscale unchecked: unscale (and check) here instead
                    self.unscale_(optimizer)
                else:
                    self._check_inf_per_device(optimizer)
            self._agree(optimizer_state, tensors)
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
        self._agree(optimizer_state, tensors)
        retval = None
        if not self._config.skip_nonfinite or not sum(
            v.item() for v in optimizer_state["found_inf_per_device"].values()
        ):
            retval = optimizer.step(*args, **kwargs)
        optimizer_state["stage"] = OptState.STEPPED
        return retval

    @eager_under_dynamo  # called by step(), whose callees dynamo compiles: nothing here is traced
    def _agree(self, optimizer_state: dict[str, Any], tensors: _DeviceState) -> None:
        """Replace the optimizer's found-inf flags by one combined over the process group (once a step)."""
        if optimizer_state["agreed"]:
            return
        group = group_to_agree(self._process_group)
        if group is not None:
            flags = optimizer_state["found_inf_per_device"].values()
            optimizer_state["found_inf_per_device"] = {
                tensors.device: agree_found_inf(flags, tensors.device, group)
            }
        optimizer_state["agreed"] = True

    @eager_under_dynamo
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
                finite = _finite_float(new_scale)
                value = math.nan if finite is None else f32(finite)
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
            group = None
            if not all(state["agreed"] for state in self._per_optimizer_states.values()):
                group = group_to_agree(self._process_group)  # unscale_() without step(): agree here
            if group is not None:
                combined = agree_found_inf(found_infs, tensors.device, group)
            else:
                combined = found_infs[0] if len(found_infs) == 1 else torch.stack(found_infs).sum()
            tensors.advance(self._config, combined)
            if self._history is not None:
                if not isinstance(self._history, HistoryBuffer):
                    self._history = HistoryBuffer(self._history, tensors.device)
                self._history.record(tensors)
            if self._config.max_consecutive_skips is not None:
                loss_finite, self._loss_finite = self._loss_finite, None
                check_stuck(self._config, tensors, loss_finite)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    # -- history (mpx_torch.history) ------------------------------------------------------
    def record_history(self, enabled: bool = True, *, capacity: int = 65536) -> None:
        """Start (or with False stop) recording the state after each :meth:`update`, on device.

        Keeps the last ``capacity`` steps (default 65536; ``capacity x 3`` int64
        on the device); starting again clears what was recorded.  No host sync.
        """
        if not enabled:
            self._history = None
        else:
            self._history = HistoryBuffer.check(capacity)
            if self._tensors is not None:
                self._history = HistoryBuffer(capacity, self._tensors.device)

    def history(self) -> mpx.ScalerHistory:
        """The recorded steps as an :class:`mpx.ScalerHistory` (one device-to-host transfer).

        Raises:
            mpx.MPXError: when :meth:`record_history` was not called.
        """
        if self._history is None:
            raise MPXError("history: not recording; call scaler.record_history() before training")
        if isinstance(self._history, int):
            return mpx.ScalerHistory(self._config)
        return self._history.read(self._config)

    # -- queries -----------------------------------------------------------------------
    @eager_under_dynamo
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
    @eager_under_dynamo
    def state_dict(self, *, neutral: bool = False) -> dict[str, Any]:
        """The neutral JSON-safe state dict (``mpx.scaler/1``, via :func:`mpx.state_dict`); a host sync.

        ``mpx.LossScaler`` and every mpx backend load it.  Call it after
        :meth:`update`.  As torch's, a scaler made with ``enabled=False``
        returns ``{}``; ``neutral=True`` returns the neutral dict whatever
        ``enabled`` is.
        """
        if not self._enabled and not neutral:
            return {}
        return state_dict(self._config, self.state)

    @eager_under_dynamo
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore config and state from a neutral dict, or from a ``torch.amp.GradScaler`` state dict.

        A neutral dict (``{"format": "mpx.scaler/1", ...}``) is validated by
        :func:`mpx.load_state_dict` and restores the saved config too.  A
        native dict (keys ``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``) keeps torch's semantics: it
        becomes a dynamic config with ``min_scale=None``, ``max_scale=None``,
        ``hysteresis=1`` and ``init_scale`` set to the saved scale (as torch
        does), the scale rounded to float32 (and raised to 2**-126 if below),
        ``steps`` set to the growth tracker and ``skipped_steps`` to 0.  An
        empty dict (what a disabled scaler saves) is a no-op for a scaler made
        with ``enabled=False``, as in torch.  The dict is validated whole
        before anything changes: on error nothing changes.

        Raises:
            mpx.StateDictError: for a malformed dict of either form, or an
                empty one loaded into an enabled scaler.
        """
        if isinstance(state_dict, Mapping) and "format" not in state_dict:
            if len(state_dict) == 0:
                if not self._enabled:
                    return
                raise StateDictError(
                    "state dict: the source state dict is empty, possibly because it was saved from a "
                    "disabled GradScaler; nothing to load"
                )
            if set(state_dict) == NATIVE_KEYS:
                state_dict = native_to_neutral(state_dict)
        config, state = load_state_dict(state_dict)  # every check first: below, nothing can fail
        self._set_config(config, state)

    def __repr__(self) -> str:
        where = "uninitialized" if self._tensors is None else str(self._tensors.device)
        return f"mpx_torch.GradScaler(kind={self._config.kind!r}, {where}, enabled={self.is_enabled()})"
