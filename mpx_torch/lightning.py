"""mpx as a Lightning precision plugin: ``MPXPrecision`` (``Trainer``) and ``MPXFabricPrecision`` (``Fabric``).

>>> import lightning as L
>>> from mpx_torch.lightning import MPXPrecision
>>> trainer = L.Trainer(plugins=[MPXPrecision("mixed_float16")], accelerator="cpu", logger=False)
>>> trainer.precision, trainer.precision_plugin.scaler.get_scale()
('16-mixed', 65536.0)

The plugin converts the module with :func:`mpx_torch.prepare`, runs every
step under :class:`mpx_torch.autocast`, scales the loss with an
:class:`mpx_torch.GradScaler`, unscales before clipping and skips
non-finite steps (parameters and optimizer state untouched).  Its scaler
state is saved in the checkpoint under ``"MPXPrecision"`` (the neutral
``mpx.scaler/1`` dict); a checkpoint written with Lightning's own
``MixedPrecision("16-mixed")`` loads too, with its scale.

Under an FP8 policy (``"mixed_bfloat16,fp8=hybrid"``, ``"mixed_bfloat16_fp8"``...),
:func:`mpx_torch.prepare` turns the policy's ``nn.Linear`` modules into
:class:`mpx_torch.float8.Float8Linear` and the plugin commits their FP8 state
after each optimizer step (:func:`mpx_torch.float8.commit_float8` with its scaler):
once per accumulation window, nothing on a step the scaler skipped.  The FP8
buffers are in the module's ``state_dict``, so checkpoints carry them.

Two classes because Lightning has two plugin protocols: the ``Trainer``
calls ``optimizer_step(optimizer, model, closure)`` and runs the closure
inside it, ``Fabric`` calls ``optimizer_step(optimizer)`` after the user's
own backward (Lightning itself has a ``MixedPrecision`` in each package).
This module imports the unified ``lightning`` package (``lightning.pytorch``,
``lightning.fabric``), not the standalone ``pytorch_lightning``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning_utilities.core.apply_func import apply_to_collection
from torch.nn import Module
from torch.optim import LBFGS, Optimizer

from mpx import MPXError, OpTable, Policy, PolicySpec, ScalerConfig, get_policy
from mpx.update_policy import needs_policy_optimizer
from mpx_torch._compat import step_supports_amp_scaling
from mpx_torch._integrations import (
    HalfParametersWarning,
    commit_models,
    library_internal,
    lightning_precision,
    require_library,
    unscale_once,
    uses_float8,
    warn_half_parameters,
)
from mpx_torch.autocast import autocast, to_torch_dtype
from mpx_torch.grad_scaler import GradScaler
from mpx_torch.optim import attach_policy, attached_policy
from mpx_torch.prepare import prepare

__all__ = ["HalfParametersWarning", "MPXFabricPrecision", "MPXPrecision"]

require_library("lightning")

# where Lightning's own MixedPrecision saved its torch.amp.GradScaler state (current, and before 2.0)
_NATIVE_CHECKPOINT_KEYS = ("MixedPrecision", "native_amp_scaling_state")


def _default_device() -> str:
    """Lightning's ``MixedPrecision.device`` when none is named: CUDA when available, else the default device's type."""
    return "cuda" if torch.cuda.is_available() else torch.get_default_device().type


def _cast_floating(data: Any, dtype: torch.dtype) -> Any:
    """``data`` with each floating tensor (in lists, tuples, dicts, nested) cast to ``dtype``."""
    return apply_to_collection(
        data, torch.Tensor, lambda t: t.to(dtype) if torch.is_floating_point(t) and t.dtype != dtype else t
    )


def _handles_unscaling(optimizer: Any) -> bool:
    # a fused optimizer unscales inside its step: unscaled here only to clip
    return step_supports_amp_scaling(optimizer)


class _MPXPlugin:
    """What both plugins share: the policy, the scaler, module conversion, the forward context, state."""

    precision: str
    scaler: GradScaler | None

    def _setup(
        self,
        policy: PolicySpec,
        config: ScalerConfig | Mapping[str, Any] | PolicySpec | None,
        device_type: str | Sequence[str] | None,
        op_table: OpTable | None,
        device: str | torch.device | None = None,
        scaler: GradScaler | None = None,
    ) -> None:
        self.policy: Policy = get_policy(policy)
        self.precision = lightning_precision(self.policy)
        if device is not None:
            if device_type is not None:
                raise MPXError(
                    "device: pass either device= (Lightning's name, one device) or device_type= "
                    f"(mpx's, one or more device types), not both; got device={device!r} and "
                    f"device_type={device_type!r}"
                )
            try:
                device_type = torch.device(device).type
            except (RuntimeError, TypeError):
                raise MPXError(
                    f"device: {device!r} is not a torch device; use 'cpu', 'cuda', 'cuda:0', ... or None"
                ) from None
        #: The autocast device, as Lightning's ``MixedPrecision.device``: the one given, else CUDA when it
        #: is available, else the default device's type (autocast itself enters every device type then).
        self.device: str = str(device) if device is not None else _default_device()
        self.scaler: GradScaler | None = self._make_scaler(config, scaler)
        self._device_type = device_type
        self._op_table = op_table
        self._float8 = uses_float8(self.policy)
        # the modules convert_module prepared: their FP8 state commits after each optimizer step
        self._modules: list[Module] = []

    def _make_scaler(
        self, config: ScalerConfig | Mapping[str, Any] | PolicySpec | None, scaler: GradScaler | None
    ) -> GradScaler | None:
        """The plugin's scaler: ``scaler`` as given, else one from ``config`` (None: the policy's own);
        None when no loss scaling is used (kind ``none``), as Lightning's ``bf16-mixed`` has none."""
        if scaler is None:
            built = GradScaler(self.policy if config is None else config)
            return built if built.config.kind != "none" else None
        if config is not None:
            raise MPXError(
                "scaler: pass either scaler= (a ready mpx_torch.GradScaler) or config= (its settings), not both"
            )
        if not isinstance(scaler, GradScaler):
            raise MPXError(
                f"scaler: expected an mpx_torch.GradScaler (torch's GradScaler API with mpx's state machine), "
                f"got {type(scaler).__name__}; pass torch.amp.GradScaler settings as "
                "config=mpx.ScalerConfig(init_scale=..., growth_interval=..., ...) instead"
            )
        if not self.policy.lowers_precision or self.policy.compute_dtype != "float16":
            if scaler.config.kind != "none":
                raise MPXError(
                    f"scaler: precision={self.precision!r} does not use a loss scaler (only float16 compute "
                    f"does), found {type(scaler).__name__} of kind {scaler.config.kind!r}; leave scaler=None, "
                    "or pass config= to scale this policy's loss anyway"
                )
            return None
        return scaler if scaler.config.kind != "none" else None

    def autocast_context_manager(self) -> autocast:
        """The policy's :class:`mpx_torch.autocast` for :attr:`device` with torch's autocast cache off,
        as Lightning's ``MixedPrecision.autocast_context_manager()`` (for your own regions)."""
        return autocast(
            self.policy, self._device_type or self.device, op_table=self._op_table, cache_enabled=False
        )

    def convert_module(self, module: Module) -> Module:
        """Prepare ``module`` under the policy, in place (warns when half parameters are upcast)."""
        warn_half_parameters(module, self.policy, stacklevel=4)
        prepared = prepare(module, self.policy, device_type=self._device_type, op_table=self._op_table)
        if self._float8 and not any(m is prepared for m in self._modules):
            self._modules.append(prepared)
        return prepared

    def _commit_float8(self, optimizer: Any) -> None:
        """After an optimizer step (and the scaler's update): commit the FP8 state of the prepared modules
        that ``optimizer`` trains; nothing moves on a step the scaler skipped."""
        if not self._float8:
            return
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        trained = [m for m in self._modules if any(id(p) in params for p in m.parameters())]
        commit_models(trained, self.scaler if self.scaler is not None else False)

    def _attach_policy(self, optimizers: Sequence[Any], *, late: bool = False) -> None:
        """A policy naming master/update/opt_state keys steps each optimizer through
        :func:`mpx_torch.optim.attach_policy` (``late``: at its first step, refused once it has state)."""
        if not needs_policy_optimizer(self.policy):
            return
        for optimizer in optimizers:
            if not isinstance(optimizer, Optimizer) or attached_policy(optimizer) is not None:
                continue
            if late and optimizer.state:
                raise MPXError(
                    f"optimizer: policy {str(self.policy)!r} steps it through mpx_torch.optim.attach_policy, but it "
                    "already holds state loaded or stepped without the policy; call "
                    "mpx_torch.optim.attach_policy(optimizer, policy) before fabric.setup and before loading"
                )
            attach_policy(optimizer, self.policy)

    def forward_context(self) -> contextlib.AbstractContextManager:
        """The policy's :class:`mpx_torch.autocast` (around each training, validation, test and predict step)."""
        return autocast(self.policy, self._device_type, op_table=self._op_table)

    def state_dict(self) -> dict[str, Any]:
        """The scaler's neutral ``mpx.scaler/1`` state dict; ``{}`` without a scaler (as Lightning's)."""
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a neutral dict, or a ``torch.amp.GradScaler`` one (see :meth:`mpx_torch.GradScaler.load_state_dict`);
        without a scaler, nothing (a bfloat16 run ignores a float16 run's scale, as Lightning's ``bf16-mixed``)."""
        if self.scaler is not None:
            self.scaler.load_state_dict(state_dict)

    def _step_with_scaler(self, optimizer: Any, **kwargs: Any) -> Any:
        if isinstance(optimizer, LBFGS):
            raise MPXError(
                "optimizer: LBFGS re-evaluates its closure inside step(), which loss scaling cannot skip; "
                "use another optimizer or a policy without loss scaling (e.g. 'mixed_bfloat16')"
            )
        scaler = self.scaler
        if scaler is None:  # (callers check first)
            raise MPXError("optimizer_step: this plugin has no loss scaler to step with")
        output = scaler.step(optimizer, **kwargs)
        scaler.update()
        self._commit_float8(optimizer)
        return output


class MPXPrecision(_MPXPlugin, Precision):
    """A Lightning ``Trainer`` precision plugin that trains under an mpx policy.

    Args:
        policy: an :class:`mpx.Policy` or anything :func:`mpx.get_policy`
            reads (``"mixed_float16"``, ``"mixed_bfloat16"``, ``"16-mixed"``...).
        config: the loss scaler's config (an :class:`mpx.ScalerConfig`, its
            dict, or a policy); None (the default) means
            ``ScalerConfig.for_policy(policy)``: dynamic for float16 compute,
            none (no scaling, no skipping) otherwise.
        device_type: passed to :func:`mpx_torch.prepare` and
            :class:`mpx_torch.autocast` (None: every device the inputs may live on).
        op_table: passed to :func:`mpx_torch.prepare` and :class:`mpx_torch.autocast`.

    Use ``Trainer(plugins=[MPXPrecision(policy)])`` without ``precision=``.
    ``trainer.precision`` reads as Lightning's string for the policy
    (``"16-mixed"``, ``"bf16-mixed"``, ``"bf16-true"``, ``"32-true"``...);
    ``trainer.scaler`` is the :class:`mpx_torch.GradScaler`.
    ``gradient_clip_val`` clips the unscaled gradients; in manual
    optimization, ``self.clip_gradients(opt, ...)`` before ``opt.step()``
    unscales first too.

    Raises:
        mpx.PolicyError: for a bad policy; mpx.ScalerConfigError for a bad config.
    """

    def __init__(
        self,
        policy: PolicySpec,
        config: ScalerConfig | Mapping[str, Any] | PolicySpec | None = None,
        *,
        device: str | torch.device | None = None,
        scaler: GradScaler | None = None,
        device_type: str | Sequence[str] | None = None,
        op_table: OpTable | None = None,
    ) -> None:
        self._setup(policy, config, device_type, op_table, device, scaler)

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:  # type: ignore[override]
        """The policy's :class:`mpx_torch.autocast` (around each training, validation, test and predict step)."""
        with autocast(self.policy, self._device_type, op_table=self._op_table):
            yield

    def pre_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:  # type: ignore[override]
        """Scale the loss (the ``on_before_backward`` hooks see the scaled loss, as with ``MixedPrecision``)."""
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    def connect(self, model: Module, optimizers: list[Any], lr_schedulers: list[Any]) -> Any:
        """Lightning's hook after ``configure_optimizers``: attach the policy optimizer (before any checkpoint
        is restored into the optimizers)."""
        self._attach_policy(optimizers)
        return super().connect(model, optimizers, lr_schedulers)

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Run the closure, unscale, clip (``on_before_optimizer_step``), step when finite, update the scaler."""
        if self.scaler is None or not self.scaler.is_enabled():
            stepped: list[bool] = []

            def run_closure() -> Any:
                result = closure()
                # automatic optimization whose training_step returned None: nothing to step or commit
                stepped.append(result is not None or not model.automatic_optimization)
                return result

            output = super().optimizer_step(optimizer, model=model, closure=run_closure, **kwargs)
            if all(stepped):
                self._commit_float8(optimizer)
            return output
        closure_result = closure()
        # automatic optimization whose training_step returned None: no backward, nothing to step
        skip = closure_result is None and model.automatic_optimization
        # unscaled before on_before_optimizer_step and clipping; a fused optimizer unscales in its step
        clipping = bool(model.trainer.gradient_clip_val)
        if not skip and (clipping or not _handles_unscaling(optimizer)):
            unscale_once(self.scaler, optimizer)
        # Lightning's shared step tail: on_before_optimizer_step hooks, then configure_gradient_clipping
        after_closure = library_internal(
            "lightning", self, "_after_closure", "Precision._after_closure", "MPXPrecision.optimizer_step"
        )
        after_closure(model, optimizer)
        if skip:
            return closure_result
        return self._step_with_scaler(optimizer, **kwargs)

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip the unscaled gradients (unscaling first when this step has not yet).

        Unlike Lightning's ``MixedPrecision``, fused optimizers clip too: the
        gradients are unscaled here and their fused step is told so.
        """
        if clip_val > 0 and self.scaler is not None:
            unscale_once(self.scaler, optimizer)
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Read the scale from a checkpoint written with Lightning's ``MixedPrecision`` (torch's scaler dict).

        Lightning loads this plugin's own entry (``"MPXPrecision"``) after
        this hook; a checkpoint without it but with ``MixedPrecision``'s
        entry loads that one (see :meth:`mpx_torch.GradScaler.load_state_dict`),
        unless this plugin's scaler is of kind ``none`` (a bfloat16 policy).
        """
        if type(self).__qualname__ in checkpoint or self.scaler is None:
            return  # a policy without loss scaling ignores a float16 scale, as Lightning's bf16-mixed does
        for key in _NATIVE_CHECKPOINT_KEYS:
            if checkpoint.get(key):
                self.load_state_dict(checkpoint[key])
                return


class MPXFabricPrecision(_MPXPlugin, FabricPrecision):
    """The ``Fabric`` plugin: ``Fabric(plugins=[MPXFabricPrecision(policy)])``.

    Same arguments as :class:`MPXPrecision`.  ``fabric.setup`` prepares the
    module, its forward runs under the policy, ``fabric.backward`` scales the
    loss, ``fabric.clip_gradients`` unscales first, ``optimizer.step()`` skips
    non-finite steps and updates the scaler.  Fabric saves no plugin state by
    itself: put the plugin in the state you save
    (``fabric.save(path, {"model": model, "optimizer": opt, "precision": plugin})``).
    """

    def __init__(
        self,
        policy: PolicySpec,
        config: ScalerConfig | Mapping[str, Any] | PolicySpec | None = None,
        *,
        device: str | torch.device | None = None,
        scaler: GradScaler | None = None,
        device_type: str | Sequence[str] | None = None,
        op_table: OpTable | None = None,
    ) -> None:
        self._setup(policy, config, device_type, op_table, device, scaler)

    def backward(self, tensor: torch.Tensor, model: Module | None, *args: Any, **kwargs: Any) -> None:
        """Backward of the scaled loss."""
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        super().backward(tensor, model, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Step when the gradients are finite (unscaling first unless clipping did), update the scaler."""
        self._attach_policy([optimizer], late=True)
        if self.scaler is None or not self.scaler.is_enabled():
            output = super().optimizer_step(optimizer, **kwargs)
            self._commit_float8(optimizer)
            return output
        return self._step_with_scaler(optimizer, **kwargs)

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Unscale before ``fabric.clip_gradients`` (once per step; fused optimizers too)."""
        if self.scaler is not None:
            unscale_once(self.scaler, optimizer)

    def convert_input(self, data: Any) -> Any:
        """Cast the floating tensors of ``data`` (the inputs of a ``fabric.setup`` module's forward) to the
        policy's compute dtype, as Lightning's ``MixedPrecision`` casts them to its autocast dtype;
        float64 tensors too, integer and bool tensors never."""
        return _cast_floating(data, to_torch_dtype(self.policy.compute_dtype))

    def convert_output(self, data: Any) -> Any:
        """Cast the floating tensors of a forward's output to the policy's output dtype (Lightning: the
        default dtype, float32)."""
        return _cast_floating(data, to_torch_dtype(self.policy.output_dtype))
