"""mpx in Hugging Face Accelerate: ``attach(accelerator, policy)``.

>>> import torch
>>> from accelerate import Accelerator
>>> from mpx_torch.accelerate import attach
>>> accelerator = Accelerator(cpu=True)
>>> scaler = attach(accelerator, "mixed_bfloat16")
>>> model = accelerator.prepare(torch.nn.Linear(4, 4))
>>> model(torch.randn(2, 4)).dtype, accelerator.scaler is scaler
(torch.float32, True)

After :func:`attach`, every model passed to ``accelerator.prepare`` is
prepared with :func:`mpx_torch.prepare` (its forward runs under the policy),
``accelerator.backward`` scales the loss, ``accelerator.clip_grad_norm_`` and
``clip_grad_value_`` clip the unscaled gradients, a non-finite step is skipped
(``accelerator.optimizer_step_was_skipped`` is True and a prepared LR
scheduler does not step), and ``save_state``/``load_state`` save and restore
the scale (``scaler.pt``; one written by ``torch.amp.GradScaler`` loads too).

Under an FP8 policy (``fp8=``), ``prepare`` turns the policy's ``nn.Linear``
modules into :class:`mpx_torch.float8.Float8Linear`, and each prepared
optimizer's ``step()`` commits the FP8 state of the prepared models it trains
(:func:`mpx_torch.float8.commit_float8` with the scaler) when the gradients sync: once
per accumulation window, nothing on a skipped step.  The FP8 buffers are in
the model's ``state_dict`` (``save_state`` writes them with the weights).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType
from torch import nn

from mpx import MPXError, OpTable, Policy, PolicySpec, ScalerConfig, UnsupportedTypeError, get_policy
from mpx.update_policy import needs_policy_optimizer
from mpx_torch._compat import step_supports_amp_scaling
from mpx_torch._integrations import (
    HalfParametersWarning,
    commit_models,
    library_internal,
    require_library,
    unscale_once,
    uses_float8,
    warn_half_parameters,
)
from mpx_torch.grad_scaler import GradScaler
from mpx_torch.optim import attach_policy, attached_policy
from mpx_torch.prepare import prepare, prepared_policy

__all__ = ["HalfParametersWarning", "attach"]

require_library("accelerate")

_UNSUPPORTED = (DistributedType.MEGATRON_LM, DistributedType.XLA)


def _prepared(accelerator: Accelerator, what: str) -> list[Any]:
    # Accelerate keeps the models and optimizers it prepared in private lists (no public accessor)
    return list(
        library_internal(
            "accelerate", accelerator, f"_{what}", f"Accelerator._{what}", f"attach() (the prepared {what})"
        )
    )


def _report_fused_skips(accelerated: AcceleratedOptimizer, scaler: GradScaler) -> None:
    """Make ``step_was_skipped`` true for a skipped step of a fused optimizer (one host read per step).

    Accelerate tells a skipped step by whether the scaler called the
    optimizer's ``step``; a fused optimizer (``fused=True`` AdamW, the HF
    Trainer's default ``adamw_torch_fused``) is always called and skips inside
    its kernel, so Accelerate would report every step as taken and step the LR
    scheduler after a skip.  After each synced step, its (private)
    ``_is_overflow`` flag is set from the scaler's state instead.
    """
    step = accelerated.step
    used_for = "step_was_skipped of fused optimizers"
    library_internal("accelerate", accelerated, "_is_overflow", "AcceleratedOptimizer._is_overflow", used_for)

    def checked_step(self: AcceleratedOptimizer, *args: Any, **kwargs: Any) -> Any:
        output = step(*args, **kwargs)
        if self.gradient_state.sync_gradients and scaler.is_enabled() and scaler.config.skip_nonfinite:
            self._is_overflow = scaler.state.consecutive_nonfinite > 0
        return output

    # a bound method, as torch's LR schedulers expect of optimizer.step (they wrap its __func__)
    accelerated.step = types.MethodType(functools.wraps(step.__func__)(checked_step), accelerated)  # type: ignore[method-assign]


def _commit_float8_after_steps(
    accelerator: Accelerator, accelerated: AcceleratedOptimizer, scaler: GradScaler
) -> None:
    """After each synced ``step()`` of ``accelerated``, commit the FP8 state of the prepared models it trains.

    Accelerate's ``step()`` runs the scaler's ``step`` and ``update`` only when the gradients sync (the
    end of an accumulation window) and does nothing in between, so the commit follows it there: the
    FP8 state moves exactly when the optimizer state does (nothing on a skipped step).
    """
    step = accelerated.step
    params = {id(p) for group in accelerated.optimizer.param_groups for p in group["params"]}

    def committing_step(self: AcceleratedOptimizer, *args: Any, **kwargs: Any) -> Any:
        output = step(*args, **kwargs)
        if self.gradient_state.sync_gradients:
            models = _prepared(accelerator, "models")
            commit_models([m for m in models if any(id(p) in params for p in m.parameters())], scaler)
        return output

    accelerated.step = types.MethodType(functools.wraps(step.__func__)(committing_step), accelerated)  # type: ignore[method-assign]


def _check(accelerator: Any) -> None:
    if not isinstance(accelerator, Accelerator):
        raise UnsupportedTypeError(
            f"accelerator: expected an accelerate.Accelerator, got {type(accelerator).__name__}"
        )
    if isinstance(accelerator.scaler, GradScaler):
        raise MPXError("accelerator: mpx is already attached to this Accelerator (attach it once)")
    requested = accelerator.mixed_precision
    # under DeepSpeed, Accelerate reads mixed_precision from the ds_config, where attach() writes the policy
    # (write_config refuses a ds_config that enables another dtype than the policy's)
    if requested != "no" and accelerator.distributed_type != DistributedType.DEEPSPEED:
        where = accelerator.device.type
        silently = (
            f" (on {where!r}, Accelerate's fp16 makes no scaler and no autocast: it would train in float32)"
            if requested == "fp16" and where == "cpu"
            else ""
        )
        raise MPXError(
            f"accelerator: made with mixed_precision={requested!r}{silently}; mpx replaces Accelerate's mixed "
            "precision, so make the Accelerator with mixed_precision='no' (the default) and give the "
            "policy to attach(), e.g. attach(accelerator, 'mixed_float16')"
        )
    if accelerator.distributed_type in _UNSUPPORTED:
        raise MPXError(
            f"accelerator: distributed_type {accelerator.distributed_type.value} runs its own mixed precision "
            "and loss scaling; attach() supports single-process, DDP, FSDP and DeepSpeed setups"
        )
    if _prepared(accelerator, "models") or _prepared(accelerator, "optimizers"):
        raise MPXError(
            "accelerator: attach() must come before accelerator.prepare(...): a model prepared earlier would "
            "run outside the policy, an optimizer prepared earlier would step unscaled and never skip"
        )


def _attach_deepspeed(
    accelerator: Accelerator,
    policy: Policy,
    config: ScalerConfig | Mapping[str, Any] | PolicySpec | None,
    prepare_kwargs: dict[str, Any],
) -> Any:
    """attach() under Accelerate's DeepSpeed plugin: the engine scales, skips and clips; mpx writes the
    policy into the plugin's ds_config, prepares the model, and reads the engine's scaler."""
    from mpx_torch.deepspeed import EngineScaler, prepare_for_engine, write_config

    plugin = accelerator.state.deepspeed_plugin
    write_config(plugin.deepspeed_config, policy, config, owner="DeepSpeedPlugin.deepspeed_config")
    original_prepare = accelerator.prepare

    # Accelerate hands DeepSpeed's models to deepspeed.initialize without prepare_model: prepared here
    @functools.wraps(original_prepare)
    def prepare_all(*args: Any, **kwargs: Any) -> Any:
        for arg in args:
            if isinstance(arg, nn.Module) and prepared_policy(arg) is None:
                prepare_for_engine(arg, policy, **prepare_kwargs)
        return original_prepare(*args, **kwargs)

    accelerator.prepare = prepare_all  # type: ignore[method-assign]
    scaler = EngineScaler(lambda: getattr(accelerator.deepspeed_engine_wrapped, "engine", None))
    accelerator.register_for_checkpointing(scaler)
    return scaler


def attach(
    accelerator: Accelerator,
    policy: PolicySpec,
    config: ScalerConfig | Mapping[str, Any] | PolicySpec | None = None,
    *,
    device_type: str | Sequence[str] | None = None,
    op_table: OpTable | None = None,
) -> GradScaler | Any:
    """Train under ``policy`` with ``accelerator``; returns the :class:`mpx_torch.GradScaler` it uses.

    Call it right after making the Accelerator, before ``accelerator.prepare``.

    Args:
        accelerator: an ``accelerate.Accelerator`` made with
            ``mixed_precision="no"`` (the default): mpx replaces Accelerate's
            own mixed precision.
        policy: an :class:`mpx.Policy` or anything :func:`mpx.get_policy` reads
            (``"mixed_float16"``, ``"mixed_bfloat16"``, ``"fp16"``...).
        config: the loss scaler's config (an :class:`mpx.ScalerConfig`, its
            dict, or a policy); None (the default) means
            ``ScalerConfig.for_policy(policy)``: dynamic for float16 compute,
            none (no scaling, no skipping) otherwise.
        device_type, op_table: passed to :func:`mpx_torch.prepare`.

    What changes, on this Accelerator instance only: ``accelerator.scaler``
    is the mpx scaler; ``accelerator.prepare_model`` first prepares the
    model under the policy (warning with :class:`HalfParametersWarning
    <mpx_torch._integrations.HalfParametersWarning>` when half-precision
    parameters are upcast to float32 master weights); and
    ``accelerator.unscale_gradients`` unscales through the mpx scaler, once
    per optimizer per step, so ``clip_grad_norm_`` (whose returned norm is
    the unscaled one) and ``clip_grad_value_`` see the true gradients; and
    ``accelerator.prepare_optimizer`` makes a fused optimizer's
    ``step_was_skipped`` report the scaler's decision (Accelerate alone reports
    every fused step as taken; this costs one host read per step).

    Under Accelerate's DeepSpeed plugin the engine does the scaling, the
    skipping (on every rank) and the clipping (``gradient_clipping``, on the
    unscaled gradients); ``attach`` writes the policy and the scaler config
    into the plugin's ds_config (:func:`mpx_torch.deepspeed.write_config`:
    the ``fp16``/``bf16`` block, ``communication_data_type``), prepares each
    model under the policy, and returns an
    :class:`mpx_torch.deepspeed.EngineScaler` (the engine's scale and state
    in mpx's terms), registered for checkpointing so ``save_state`` and
    ``load_state`` carry the neutral ``mpx.scaler/1`` dict.  ``config``
    None then means DeepSpeed's defaults
    (:func:`mpx_torch.deepspeed.scaler_config_for`).

    Raises:
        mpx.UnsupportedTypeError: for something other than an Accelerator.
        mpx.MPXError: for an Accelerator with ``mixed_precision`` other than
            ``"no"`` (``"fp16"`` on a CPU would otherwise train in float32
            without a word), a Megatron-LM or XLA setup, one to
            which mpx is already attached, or one that already prepared a model or optimizer.
        mpx.PolicyError, mpx.ScalerConfigError: for a bad policy or config.
    """
    _check(accelerator)
    resolved = get_policy(policy)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return _attach_deepspeed(
            accelerator, resolved, config, {"device_type": device_type, "op_table": op_table}
        )
    scaler = GradScaler(resolved if config is None else config)
    original_prepare_model = accelerator.prepare_model

    @functools.wraps(original_prepare_model)
    def prepare_model(model: Any, *args: Any, **kwargs: Any) -> Any:
        warn_half_parameters(model, resolved, stacklevel=4)
        prepare(model, resolved, device_type=device_type, op_table=op_table)
        return original_prepare_model(model, *args, **kwargs)

    original_prepare_optimizer = accelerator.prepare_optimizer

    @functools.wraps(original_prepare_optimizer)
    def prepare_optimizer(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(optimizer, torch.optim.Optimizer) and needs_policy_optimizer(resolved):
            if attached_policy(optimizer) is None:  # master/update/opt_state keys: the policy optimizer steps
                attach_policy(optimizer, resolved)
        accelerated = original_prepare_optimizer(optimizer, *args, **kwargs)
        if isinstance(accelerated, AcceleratedOptimizer) and step_supports_amp_scaling(accelerated.optimizer):
            _report_fused_skips(accelerated, scaler)
        if isinstance(accelerated, AcceleratedOptimizer) and uses_float8(resolved):
            _commit_float8_after_steps(accelerator, accelerated, scaler)
        return accelerated

    def unscale_gradients(optimizer: Any = None) -> None:
        """Unscale the gradients of ``optimizer`` (or of every prepared one) through the mpx scaler."""
        if optimizer is None:
            optimizers = _prepared(accelerator, "optimizers")
        elif isinstance(optimizer, (tuple, list)):
            optimizers = list(optimizer)
        else:
            optimizers = [optimizer]
        for opt in optimizers:
            while isinstance(opt, AcceleratedOptimizer):
                opt = opt.optimizer
            unscale_once(scaler, opt)

    accelerator.scaler = scaler
    accelerator.prepare_model = prepare_model  # type: ignore[method-assign]
    accelerator.prepare_optimizer = prepare_optimizer  # type: ignore[method-assign]
    accelerator.unscale_gradients = unscale_gradients  # type: ignore[method-assign]
    return scaler
