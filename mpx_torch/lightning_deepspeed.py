"""mpx's Lightning plugins for ``DeepSpeedStrategy``: :class:`MPXDeepSpeedPrecision` (Trainer), :class:`MPXFabricDeepSpeedPrecision` (Fabric).

Lightning's ``DeepSpeedStrategy`` hands the forward, backward, skip and clip to
the DeepSpeed engine; its precision plugin (``DeepSpeedPrecision``) only names
the dtype, which the strategy turns into the ``fp16``/``bf16`` block of its
ds_config.  mpx's plugins are ``DeepSpeedPrecision`` subclasses that put the
policy there instead (:mod:`mpx_torch.deepspeed`):

* the module is prepared under the policy (:func:`mpx_torch.deepspeed.prepare_for_engine`)
  and each step runs under the policy's :class:`mpx_torch.autocast`; inputs and
  outputs are left as given and as the model returns them (Lightning's plugin
  casts inputs to its dtype);
* the ds_config gets the policy's ``fp16``/``bf16`` block, the scaler config,
  ``communication_data_type`` from ``reduce_dtype`` and ``bf16.check_grad_overflow``
  from ``skip_nonfinite`` (:func:`mpx_torch.deepspeed.write_config`).  The Trainer
  plugin writes them into the strategy's config when the strategy sets the
  module up; Fabric gives a precision plugin no way to reach its strategy, so
  there pass ``DeepSpeedStrategy(config=plugin.ds_config(base))`` when the
  scaler config is not DeepSpeed's default.  Both check the engine at the first
  backward and raise :class:`mpx.MPXError` for an engine that runs another
  precision than the policy;
* the engine scales the loss, skips a non-finite step on every rank (its
  overflow flag is all-reduced) and clips the unscaled gradients
  (``gradient_clipping``, from the Trainer's ``gradient_clip_val``);
  ``plugin.scaler`` is the engine's scaler in mpx's terms
  (:class:`mpx_torch.deepspeed.EngineScaler`), and its neutral ``mpx.scaler/1``
  state is saved with the checkpoint (the Trainer under the plugin's class name,
  Fabric when the plugin is in the saved state) and loaded back into the engine.

Lightning 2.6's ``DeepSpeedStrategy.setup_environment`` refuses any accelerator
but CUDA ("The DeepSpeed strategy is only supported on CUDA GPUs"); DeepSpeed's
own CPU accelerator runs its bf16 engine (ZeRO 0-2) on gloo, and mpx's tests
run these plugins there through a subclass that lifts only that check (see
docs/integrations.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Mapping, MutableMapping, Sequence
from typing import Any

import deepspeed
import torch
from lightning.fabric.plugins.precision.deepspeed import DeepSpeedPrecision as FabricDeepSpeedPrecision
from lightning.pytorch.plugins.precision.deepspeed import DeepSpeedPrecision
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch.nn import Module

from mpx import MPXError, OpTable, Policy, PolicySpec, ScalerConfig, get_policy
from mpx import scaling as mpx_scaling
from mpx.deepspeed_config import from_deepspeed_config
from mpx_torch._integrations import lightning_precision
from mpx_torch.autocast import autocast
from mpx_torch.deepspeed import (
    EngineScaler,
    _engine_config,
    ds_config,
    prepare_for_engine,
    scaler_config_for,
    write_config,
)

__all__ = ["MPXDeepSpeedPrecision", "MPXFabricDeepSpeedPrecision"]

_ScalerSpec = ScalerConfig | Mapping[str, Any] | PolicySpec | None


class _MPXDeepSpeed:
    """What both plugins share: the policy, the ds_config keys, the module, the engine's scaler, its state."""

    precision: str

    def _setup(
        self,
        policy: PolicySpec,
        config: _ScalerSpec,
        device_type: str | Sequence[str] | None,
        op_table: OpTable | None,
    ) -> None:
        self.policy: Policy = get_policy(policy)
        # refuses what DeepSpeed cannot run (FP8, half parameters, the scaler) now, not at setup
        ds_config(self.policy, config)
        self._config = config
        #: The :class:`mpx.ScalerConfig` the engine runs (None given: DeepSpeed's defaults for the policy).
        self.scaler_config: ScalerConfig = scaler_config_for(self.policy, config)
        self._device_type = device_type
        self._op_table = op_table
        self._engine: Any = None
        self._checked = False
        self._pending: Mapping[str, Any] | None = None  # a state loaded before the engine was made
        #: The engine's scaler in mpx's terms (raises :class:`mpx.MPXError` before the engine is made).
        self.scaler = EngineScaler(self._current_engine)

    def _current_engine(self) -> Any:
        return self._engine

    def ds_config(self, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """``base`` (copied) with the policy's precision keys (:func:`mpx_torch.deepspeed.ds_config`)."""
        return ds_config(self.policy, self._config, base=base)

    def write_config(self, target: MutableMapping[str, Any]) -> ScalerConfig:
        """Write the policy's precision keys into the ds_config ``target`` in place (:func:`mpx_torch.deepspeed.write_config`)."""
        return write_config(target, self.policy, self._config, owner="DeepSpeedStrategy.config")

    def convert_module(self, module: Module) -> Module:
        """Prepare ``module`` under the policy, in place (the engine then stores its parameters)."""
        return prepare_for_engine(module, self.policy, device_type=self._device_type, op_table=self._op_table)

    def convert_input(self, data: Any) -> Any:
        """Inputs as given: the policy's autocast casts per op (Lightning's plugin casts them to its dtype)."""
        return data

    def _check_engine(self, engine: Any) -> None:
        """At the first backward: the engine runs the policy's compute and reduce dtypes and scaler config;
        a scaler state loaded before the engine was made goes into it now (before the backward scales)."""
        if self._checked:
            return
        self._engine = engine
        if not isinstance(engine, deepspeed.DeepSpeedEngine):
            raise MPXError(
                f"model: {type(self).__name__} runs inside a DeepSpeed engine, got {type(engine).__name__}; use it "
                "with Lightning's DeepSpeedStrategy (mpx_torch.lightning.MPXPrecision for the other strategies)"
            )
        engine_policy, _ = from_deepspeed_config(_engine_config(engine))
        engine_config = self.scaler.config
        ours = (self.policy.compute_dtype, self.policy.reduce_dtype, self.scaler_config.to_dict())
        theirs = (engine_policy.compute_dtype, engine_policy.reduce_dtype, engine_config.to_dict())
        if ours != theirs:
            raise MPXError(
                f"engine: the DeepSpeed engine computes in {theirs[0]}, reduces in {theirs[1]} and runs the scaler "
                f"{theirs[2]}, the policy {self.policy} asks {ours[0]}, {ours[1]} and {ours[2]}; make the strategy "
                "with DeepSpeedStrategy(config=plugin.ds_config(base)) so the policy is in its ds_config"
            )
        self._checked = True
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.scaler.load_state_dict(pending)

    def state_dict(self) -> dict[str, Any]:
        """The engine's scaler state, the neutral ``mpx.scaler/1`` dict (before the engine is made: the
        state loaded for it, else ``{}``)."""
        if self._current_engine() is None:
            return dict(self._pending or {})
        return self.scaler.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Put a neutral ``mpx.scaler/1`` dict into the engine's scaler (before the engine is made: at its
        first backward).

        Raises:
            mpx.StateDictError: an invalid dict, or one saved under another scaler config than the engine's.
        """
        if not state_dict:
            return
        if self._current_engine() is None:
            mpx_scaling.load_state_dict(state_dict)  # invalid dicts are refused now
            self._pending = dict(state_dict)
            return
        self.scaler.load_state_dict(state_dict)


class MPXDeepSpeedPrecision(_MPXDeepSpeed, DeepSpeedPrecision):
    """Lightning's ``DeepSpeedPrecision`` under an mpx policy, for the ``Trainer``'s ``DeepSpeedStrategy``.

    Args:
        policy: an :class:`mpx.Policy` or anything :func:`mpx.get_policy` reads, with float32
            parameters (DeepSpeed's master weights) and no FP8: ``"mixed_bfloat16"``,
            ``"mixed_float16"``, ``"float32"``.
        config: the engine's scaler config (None, the default: DeepSpeed's defaults,
            :func:`mpx_torch.deepspeed.scaler_config_for`); for float16 one DeepSpeed can run
            (start from the preset ``"deepspeed_fp16"``), otherwise kind ``"none"``.
        device_type: passed to :func:`mpx_torch.prepare` and :class:`mpx_torch.autocast`
            (None: every device the inputs may live on).
        op_table: passed to :func:`mpx_torch.prepare` and :class:`mpx_torch.autocast`.

    ``Trainer(strategy=DeepSpeedStrategy(...), plugins=[MPXDeepSpeedPrecision(policy)])``: the
    policy's keys are written into the strategy's ds_config when it sets the module up, over
    the ``fp16``/``bf16`` block Lightning writes from ``precision=`` (the plugin's scaler config
    replaces the strategy's ``loss_scale``/``hysteresis``/... arguments).  ``gradient_clip_val``
    becomes DeepSpeed's ``gradient_clipping`` (by norm, of the unscaled gradients).

    Raises:
        mpx.MPXError: a policy DeepSpeed cannot run (FP8, parameters stored in a half dtype); at
            setup, a strategy that is not a ``DeepSpeedStrategy``.
        mpx.ScalerConfigError: a scaler DeepSpeed cannot run, naming the field.
    """

    def __init__(
        self,
        policy: PolicySpec,
        config: _ScalerSpec = None,
        *,
        device_type: str | Sequence[str] | None = None,
        op_table: OpTable | None = None,
    ) -> None:
        self._setup(policy, config, device_type, op_table)
        DeepSpeedPrecision.__init__(self, lightning_precision(self.policy))  # type: ignore[arg-type]

    def convert_module(self, module: Module) -> Module:
        """Write the policy into the strategy's ds_config, then prepare ``module`` under the policy."""
        trainer = getattr(module, "_trainer", None)
        strategy = getattr(trainer, "strategy", None)
        if not isinstance(strategy, DeepSpeedStrategy):
            raise MPXError(
                f"strategy: {type(self).__name__} runs under Lightning's DeepSpeedStrategy, got "
                f"{type(strategy).__name__}; use mpx_torch.lightning.MPXPrecision for the other strategies"
            )
        if strategy.config is None:
            strategy.config = {}
        self.write_config(strategy.config)
        self._strategy = strategy
        return super().convert_module(module)

    def _current_engine(self) -> Any:
        model = getattr(getattr(self, "_strategy", None), "model", None)
        return model if isinstance(model, deepspeed.DeepSpeedEngine) else None

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """The policy's :class:`mpx_torch.autocast` (around each training, validation, test and predict step)."""
        with autocast(self.policy, self._device_type, op_table=self._op_table):
            yield

    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """The engine's backward (it scales the loss); the first one checks the engine against the policy."""
        self._check_engine(model.trainer.model)
        super().backward(tensor, model, optimizer, *args, **kwargs)


class MPXFabricDeepSpeedPrecision(_MPXDeepSpeed, FabricDeepSpeedPrecision):
    """Lightning's Fabric ``DeepSpeedPrecision`` under an mpx policy (same arguments as :class:`MPXDeepSpeedPrecision`).

    ``Fabric(strategy=DeepSpeedStrategy(config=plugin.ds_config(base)), plugins=[plugin])``.  With
    the scaler config left at None, Lightning's own ``fp16``/``bf16`` block is already DeepSpeed's
    defaults, which the first ``fabric.backward`` checks, so ``config=`` may then be left out.
    ``fabric.clip_gradients`` is the engine's clipping (Lightning refuses it under DeepSpeed: set
    ``gradient_clipping`` in the ds_config).  Put the plugin in the state you save
    (``fabric.save(path, {"model": model, "optimizer": opt, "precision": plugin})``).
    """

    def __init__(
        self,
        policy: PolicySpec,
        config: _ScalerSpec = None,
        *,
        device_type: str | Sequence[str] | None = None,
        op_table: OpTable | None = None,
    ) -> None:
        self._setup(policy, config, device_type, op_table)
        FabricDeepSpeedPrecision.__init__(self, lightning_precision(self.policy))  # type: ignore[arg-type]

    def forward_context(self) -> contextlib.AbstractContextManager:
        """The policy's :class:`mpx_torch.autocast` (around each forward of a ``fabric.setup`` module)."""
        return autocast(self.policy, self._device_type, op_table=self._op_table)

    def convert_output(self, data: Any) -> Any:
        """Outputs as the model returns them (in the policy's ``output_dtype``)."""
        return data

    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        """The engine's backward (it scales the loss); the first one checks the engine against the policy."""
        self._check_engine(model)
        super().backward(tensor, model, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """``engine.step()``, which steps the optimizer (or skips a non-finite step) and counts the steps.

        Fabric means to step the engine but hands over the engine's optimizer (its ``Optimizable`` check
        fails for ``DeepSpeedEngine``), whose ``step`` skips alike but leaves the engine's
        ``global_steps`` and ``skipped_steps`` (what :attr:`scaler` reads) and its scheduler behind.
        """
        engine = self._engine
        if engine is not None and (optimizer is engine or optimizer is engine.optimizer):
            return engine.step(**kwargs)
        return super().optimizer_step(optimizer, **kwargs)
