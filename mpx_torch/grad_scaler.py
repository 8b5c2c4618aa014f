"""``mpx_torch.GradScaler``: ``torch.amp.GradScaler``'s API over the mpx state machine.

The scale and every counter live in tensors on the scaler's device, created
at the first :meth:`GradScaler.scale`; :meth:`GradScaler.update` advances them
with the core's kernel (:func:`mpx.kernels.scale.update`, tensor ops, no host sync),
bit for bit as :func:`mpx.scaler_update`:

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
>>> mpx.LossScaler.from_state_dict(scaler.state_dict()).get_scale()
131072.0
"""

from __future__ import annotations

import dataclasses
import inspect
from collections import abc, defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import torch

import mpx
from mpx import (
    MPXError,
    Policy,
    ScalerConfig,
    ScalerState,
    UnsupportedTypeError,
    load_state_dict,
    scaler_init,
    state_dict,
)
from mpx.kernels.ring import check_capacity
from mpx_torch import _compat
from mpx_torch._compile import eager_under_dynamo, make_eager
from mpx_torch._device_state import DeviceState as _DeviceState
from mpx_torch._optimizer_step import (
    OptimizerStep,
    OptState,
    checked_optimizer,
    step_fused,
    step_grad_scaler_kwarg,
    step_plain,
    unscale_grads,
)
from mpx_torch._process_group import agree_found_inf, check_process_group, group_to_agree
from mpx_torch._scaler_state import as_config, as_neutral, new_scale_value
from mpx_torch.history import HistoryBuffer, check_floor_after, check_stuck_after, loss_finite_flag

__all__ = ["GradScaler", "OptState", "OptimizerStep"]


class GradScaler(torch.amp.GradScaler):
    """A drop-in for ``torch.amp.GradScaler`` (a subclass of it) that runs the mpx loss-scaling state machine.

    ``isinstance(scaler, torch.amp.GradScaler)`` holds, so torch's optimizer
    protocols and the libraries that accept a user's scaler take it.  Every
    public method of torch's class is overridden, and so are the private
    helpers torch's own code calls (``_unscale_grads_``,
    ``_check_inf_per_device``, ``_found_inf_per_device``, ``_get_scale_async``,
    ``_get_growth_tracker``); ``_scale`` and ``_growth_tracker`` are read-only
    views of the mpx device state.  Torch's ``__init__`` is not called (it
    takes the device first and would set those two names); its other private
    attributes (``_init_scale``, ``_growth_factor``...) do not exist here: the
    configuration is :attr:`config`.

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
        # torch.amp.GradScaler.__init__ is not called: it takes the device first, disables a "cuda" scaler
        # on a machine without CUDA, and sets the attributes that are properties here (_scale,
        # _growth_tracker); every method it would set up is overridden (see the class docs)
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
        self._per_optimizer_states: defaultdict[int, OptimizerStep] = defaultdict(OptimizerStep)
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
            if isinstance(val, abc.Iterable) and not isinstance(val, (str, bytes)):
                mapped = map(apply, val)
                return type(val)(mapped) if isinstance(val, (list, tuple)) else mapped
            raise UnsupportedTypeError(
                f"outputs: expected a torch.Tensor or an iterable of Tensors, got {type(val).__name__}."
            )

        return apply(outputs)

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        """torch's helper (same signature): unscale in place, returning the non-finite flags per device."""
        return unscale_grads(checked_optimizer(optimizer), inv_scale, found_inf, allow_fp16=allow_fp16)

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
            mpx.UnsupportedTypeError: for an ``optimizer`` that is not a torch optimizer.
        """
        if self._passthrough():
            return
        tensors = self._check_initialized("unscale_")
        record = self._per_optimizer_states[id(checked_optimizer(optimizer))]
        if record.stage is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if record.stage is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        # as torch: the reciprocal in float64, then float32
        inv_scale = tensors.scale.double().reciprocal().float()
        found_inf = torch.zeros((), dtype=torch.float32, device=tensors.device)
        record.found_inf_per_device = unscale_grads(
            optimizer,
            inv_scale,
            found_inf,
            allow_fp16=self._config.kind == "none",
            check_unscaled=self._config.scale_can_drop_below_one,
        )
        record.stage = OptState.UNSCALED

    def optimizer_stage(self, optimizer: torch.optim.Optimizer) -> OptState:
        """Where ``optimizer`` is in this iteration: ``READY``, ``UNSCALED`` (by :meth:`unscale_`) or ``STEPPED``."""
        record = self._per_optimizer_states.get(id(optimizer))
        return OptState.READY if record is None else record.stage

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        """torch's helper: check the gradients (without unscaling) and record the flags for ``optimizer``."""
        tensors = self._check_initialized("_check_inf_per_device")
        one = torch.ones((), dtype=torch.float32, device=tensors.device)
        found_inf = torch.zeros((), dtype=torch.float32, device=tensors.device)
        found = unscale_grads(checked_optimizer(optimizer), one, found_inf, allow_fp16=True)
        self._per_optimizer_states[id(optimizer)].found_inf_per_device = found
        return found

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        """The found-inf flags recorded for ``optimizer`` (torch's helper for ``grad_scaler=`` optimizers)."""
        return self._per_optimizer_states[id(optimizer)].found_inf_per_device

    @eager_under_dynamo(recursive=False)  # the optimizer's step compiles, as under torch's GradScaler
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless :meth:`unscale_` was called) and step ``optimizer`` when the gradients are finite.

        ``*args``/``**kwargs`` go to ``optimizer.step``; returns what it
        returns, or None for a skipped step.  A skipped step leaves parameters
        and optimizer state untouched.  Torch's three protocols
        (:mod:`mpx_torch._optimizer_step`): an ordinary optimizer costs one
        host sync (as in torch); a fused one (``_step_supports_amp_scaling``)
        gets ``grad_scale`` and ``found_inf``; one whose ``step`` takes
        ``grad_scaler=`` gets the scaler and decides by itself (its flags are
        combined in :meth:`update`).  Across ranks (see ``process_group``) the
        flag is combined over the group first, so every rank takes the same
        decision.

        Raises:
            RuntimeError: for a ``closure`` argument, or when called twice since the last :meth:`update`.
            mpx.UnsupportedTypeError: for an ``optimizer`` that is not a torch optimizer.
        """
        if self._passthrough():
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        tensors = self._check_initialized("step")
        record = self._per_optimizer_states[id(checked_optimizer(optimizer))]
        if record.stage is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        protocol = step_plain
        if _compat.step_supports_amp_scaling(optimizer):
            takes_scaler = "grad_scaler" in inspect.signature(optimizer.step).parameters
            protocol = step_grad_scaler_kwarg if takes_scaler else step_fused
        return protocol(self, optimizer, record, tensors, args, kwargs)

    @eager_under_dynamo  # called by step(), whose callees dynamo compiles: nothing here is traced
    def _agree(self, record: OptimizerStep, tensors: _DeviceState) -> None:
        """Replace the optimizer's found-inf flags by one combined over the process group (once a step)."""
        if record.agreed:
            return
        group = group_to_agree(self._process_group)
        if group is not None:
            flags = record.found_inf_per_device.values()
            record.found_inf_per_device = {tensors.device: agree_found_inf(flags, tensors.device, group)}
        record.agreed = True

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
                tensors.scale.fill_(new_scale_value(self._config, new_scale))
        else:
            found_infs = [
                found_inf.to(device=tensors.device, non_blocking=True)
                for record in self._per_optimizer_states.values()
                for found_inf in record.found_inf_per_device.values()
            ]
            if not found_infs:
                raise AssertionError("No inf checks were recorded prior to update.")
            group = None
            if not all(record.agreed for record in self._per_optimizer_states.values()):
                group = group_to_agree(self._process_group)  # unscale_() without step(): agree here
            if group is not None:
                combined = agree_found_inf(found_infs, tensors.device, group)
            else:
                combined = found_infs[0] if len(found_infs) == 1 else torch.stack(found_infs).sum()
            tensors.advance(combined, keep_tracker=self._history is not None)
            if self._history is not None:
                if not isinstance(self._history, HistoryBuffer):
                    self._history = HistoryBuffer(self._history, tensors.device)
                self._history.record(self._config, tensors.tracker_before, tensors.tensors())
            if self._config.max_consecutive_skips is not None:
                loss_finite, self._loss_finite = self._loss_finite, None
                check_stuck_after(self._config, tensors, loss_finite)
            if self._config.on_floor == "raise":
                self._per_optimizer_states = defaultdict(OptimizerStep)  # the step is over, raised or not
                check_floor_after(self._config, tensors)
        self._per_optimizer_states = defaultdict(OptimizerStep)

    # -- history (mpx_torch.history) ------------------------------------------------------
    def record_history(self, enabled: bool = True, *, capacity: int = 65536) -> None:
        """Start (or with False stop) recording the state after each :meth:`update`, on device.

        Keeps the last ``capacity`` steps (default 65536; ``capacity x 4`` int32
        on the device, :mod:`mpx.kernels.ring`); starting again clears what was recorded.  No host sync.

        Raises:
            mpx.MPXError: for a ``capacity`` that is not an int in [1, 2**31 - 1].
        """
        if not enabled:
            self._history = None
        else:
            self._history = check_capacity(capacity)
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

    def last_step_skipped(self) -> torch.Tensor | None:
        """Whether the last :meth:`update` skipped its step, as a bool tensor on the scaler's device (no host
        sync); None before the first :meth:`scale`.  Always False for a scaler that does not skip."""
        if self._tensors is None:
            return None
        if self._passthrough() or not self._config.skip_nonfinite:
            return torch.zeros((), dtype=torch.bool, device=self._tensors.scale.device)
        return self._tensors.consecutive_nonfinite > 0

    @property
    def updates(self) -> int:
        """How many times :meth:`update` advanced the state, counted on the host from the loaded state's
        ``steps`` (``state.steps`` without a host read)."""
        return self._host.steps if self._tensors is None else self._tensors.updates

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
        if isinstance(state_dict, Mapping) and len(state_dict) == 0 and not self._enabled:
            return  # what a disabled scaler saves, into a disabled scaler: as torch
        config, state = load_state_dict(as_neutral(state_dict))  # every check first: below, nothing can fail
        self._set_config(config, state)

    # -- torch.amp.GradScaler's private surface, read from the mpx state ---------------------------
    @property
    def _scale(self) -> torch.Tensor | None:
        """torch's name for the scale tensor (float32, on the scaler's device; None before the first scale)."""
        return None if self._tensors is None else self._tensors.scale

    @property
    def _growth_tracker(self) -> torch.Tensor | None:
        """torch's name for the growth-tracker tensor (int32; None before the first scale)."""
        return None if self._tensors is None else self._tensors.growth_tracker

    def _get_scale_async(self) -> torch.Tensor | None:
        """The scale tensor without a host sync (torch's helper; None before the first scale)."""
        return self._scale

    def _get_growth_tracker(self) -> int:
        """The growth tracker as an int (a host sync; 0 for a pass-through scaler, as torch)."""
        return self.state.growth_tracker if self.is_enabled() else 0

    def __getstate__(self) -> dict[str, Any]:
        """Pickle (and deepcopy) the state, not the device tensors: they are made again at the next scale().

        Raises:
            AssertionError: between a step and its update (as torch).
        """
        if self._per_optimizer_states:
            raise AssertionError(
                "A GradScaler instance may only be pickled at the beginning "
                "of an iteration, or at the end after scaler.update()."
            )
        state = self.__dict__.copy()
        state["_host"], state["_tensors"] = self.state, None
        state["_per_optimizer_states"] = None  # made again, empty, by __setstate__
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._per_optimizer_states = defaultdict(OptimizerStep)

    def __repr__(self) -> str:
        where = "uninitialized" if self._tensors is None else str(self._tensors.device)
        return f"mpx_torch.GradScaler(kind={self._config.kind!r}, {where}, enabled={self.is_enabled()})"
