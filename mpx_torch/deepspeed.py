"""mpx inside a DeepSpeed engine: the policy in the ``ds_config``, the engine's scaler in mpx's terms.

>>> from mpx_torch.deepspeed import ds_config
>>> config = ds_config("mixed_bfloat16", base={"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}})
>>> config["bf16"], config["communication_data_type"]
({'enabled': True, 'check_grad_overflow': True}, 'fp32')

DeepSpeed brings its own mixed precision: its ``fp16`` engine scales the loss with its
``DynamicLossScaler`` and its ``bf16`` engine keeps float32 master weights in the ZeRO
optimizer; both skip a step whose gradients are not finite (the flag is all-reduced with MAX,
so every rank skips) and clip the unscaled gradients (``gradient_clipping``).  mpx never brings
an engine of its own, so here it:

* writes the policy and the scaler config into the ``ds_config`` (:func:`ds_config`, over
  :func:`mpx.deepspeed_config.to_deepspeed_config`): the ``fp16``/``bf16`` block, the dynamic
  scaler's fields, ``communication_data_type`` from the policy's reduce dtype, and
  ``bf16.check_grad_overflow`` from ``ScalerConfig.skip_nonfinite``;
* prepares the model under the policy (:func:`initialize`, as ``deepspeed.initialize``): the
  engine stores the parameters in its dtype, the policy's overrides (norms, softmax and losses in
  float32 by default) and its output dtype still hold in the forward;
* reads the engine's scaler as mpx state (:class:`EngineScaler`: the scale, the mpx
  ``ScalerState``, the neutral ``mpx.scaler/1`` state dict, loaded back into an engine), and
  saves it with the engine's checkpoint (:func:`save_checkpoint`, :func:`load_checkpoint`).

DeepSpeed's dynamic scaler is a mode of mpx's state machine (``ScalerConfig`` with
``hysteresis_reset``, ``first_growth_delay`` and ``on_floor``; the preset ``deepspeed_fp16``), so
its state maps onto mpx's exactly, up to two counters DeepSpeed does not keep (see
:meth:`EngineScaler.state`).  DeepSpeed's fp16 engine refuses a CPU ("Type fp16 is not supported
on your device"): there only the bf16 engine runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import deepspeed
from torch import nn

from mpx import (
    FrameworkVersionError,
    MPXError,
    OpTable,
    Policy,
    PolicySpec,
    ScalerConfig,
    ScalerState,
    StateDictError,
    as_scaler_config,
    get_policy,
)
from mpx import scaling as _scaling
from mpx.deepspeed_config import from_deepspeed_config, to_deepspeed_config
from mpx.versions import parse_version
from mpx_torch._integrations import library_internal, uses_float8, warn_half_parameters
from mpx_torch.prepare import prepare

__all__ = [
    "CHECKPOINT_KEY",
    "DEEPSPEED_FLOOR",
    "EngineScaler",
    "ds_config",
    "initialize",
    "load_checkpoint",
    "load_into_loss_scaler",
    "prepare_for_engine",
    "save_checkpoint",
    "scaler_config_for",
    "state_from_loss_scaler",
    "write_config",
]

#: The deepspeed this module is tested with (its CPU accelerator runs the bf16 engine on gloo).
DEEPSPEED_FLOOR = "0.19.8"
if parse_version(deepspeed.__version__) < parse_version(DEEPSPEED_FLOOR):
    raise FrameworkVersionError(
        f"deepspeed {deepspeed.__version__} is older than mpx_torch.deepspeed supports (deepspeed >= "
        f"{DEEPSPEED_FLOOR}, the version its tests run); upgrade deepspeed"
    )

#: The key of the neutral scaler state in the ``client_state`` of an engine checkpoint.
CHECKPOINT_KEY = "mpx.scaler"


def scaler_config_for(
    policy: PolicySpec, config: ScalerConfig | Mapping[str, Any] | PolicySpec | None = None
) -> ScalerConfig:
    """The scaler config a DeepSpeed engine runs for ``policy`` and ``config`` (None: DeepSpeed's defaults).

    None means DeepSpeed's own defaults: the preset ``deepspeed_fp16`` for float16 compute, and for
    the others kind ``"none"`` with ``skip_nonfinite=True`` (DeepSpeed's bf16 engine checks the
    gradients and skips a non-finite step, ``bf16.check_grad_overflow`` true).  Anything else is
    read by :func:`mpx.as_scaler_config`.
    """
    resolved = get_policy(policy)
    if config is not None:
        return as_scaler_config(config)
    if resolved.compute_dtype == "float16":
        return as_scaler_config("deepspeed_fp16")
    return ScalerConfig(kind="none", skip_nonfinite=True)


def _check_policy(policy: Policy) -> None:
    if uses_float8(policy):
        raise MPXError(
            f"policy: {policy} turns FP8 on (fp8=), which mpx does not run inside a DeepSpeed engine (the ZeRO "
            "optimizer owns the step that commits the FP8 state); use the policy without fp8="
        )
    if policy.param_dtype != "float32":
        raise MPXError(
            f"policy: params={policy.param_dtype}; DeepSpeed keeps float32 master weights in its optimizer and "
            f"stores the module's parameters in the compute dtype, so a DeepSpeed policy has params=float32 "
            f"(e.g. 'mixed_bfloat16' or 'mixed_float16')"
        )


def ds_config(
    policy: PolicySpec,
    config: ScalerConfig | Mapping[str, Any] | PolicySpec | None = None,
    *,
    base: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``ds_config`` that trains under ``policy``: ``base`` (copied) with the precision keys written over it.

    Args:
        policy: an :class:`mpx.Policy` or anything :func:`mpx.get_policy` reads; its compute dtype
            picks the ``fp16`` or ``bf16`` block, its reduce dtype is ``communication_data_type``.
        config: the scaler config (see :func:`scaler_config_for`; None: DeepSpeed's defaults).
            For float16 it must be one DeepSpeed can run (start from the preset ``deepspeed_fp16``);
            otherwise kind ``"none"``, whose ``skip_nonfinite`` becomes ``bf16.check_grad_overflow``.
        base: the rest of the ds_config (batch sizes, ``zero_optimization``, ``optimizer``, ``gradient_clipping``...).

    Raises:
        mpx.MPXError: an FP8 policy, or parameters stored other than in float32 (DeepSpeed's master weights).
        mpx.ScalerConfigError: a scaler DeepSpeed cannot run, naming the field.
        mpx.PolicyError: a compute or reduce dtype DeepSpeed has no name for.
    """
    resolved = get_policy(policy)
    _check_policy(resolved)
    cfg = scaler_config_for(resolved, config)
    out = to_deepspeed_config(resolved, cfg, base=base)
    if resolved.compute_dtype == "bfloat16":
        out["bf16"]["check_grad_overflow"] = bool(cfg.skip_nonfinite)
    return out


def write_config(
    target: MutableMapping[str, Any],
    policy: PolicySpec,
    config: ScalerConfig | Mapping[str, Any] | PolicySpec | None = None,
    *,
    owner: str = "ds_config",
) -> ScalerConfig:
    """Write :func:`ds_config`'s precision keys into ``target`` in place; returns the scaler config written.

    For a ds_config a library holds and will pass to ``deepspeed.initialize`` itself (Accelerate's
    ``DeepSpeedPlugin.deepspeed_config``, the HF Trainer's ``hf_deepspeed_config.config``): the same dict
    object, so every reference to it sees the policy.

    Raises:
        mpx.MPXError: ``target`` already enables ``fp16`` or ``bf16`` other than the policy's compute
            dtype asks (one of the two requests would be dropped without a word); and what
            :func:`ds_config` raises.
    """
    resolved = get_policy(policy)
    written = ds_config(resolved, config, base=target)
    for name in ("fp16", "bf16"):
        block = target.get(name)
        asked = isinstance(block, Mapping) and str(block.get("enabled", False)).lower() == "true"
        if asked and not written[name]["enabled"]:
            raise MPXError(
                f"{owner}: {name}.enabled is true, and the policy {resolved} computes in {resolved.compute_dtype}; "
                f"the mpx policy is the mixed precision, so leave {name}.enabled false or 'auto' in the ds_config"
            )
    target.clear()
    target.update(written)
    return scaler_config_for(resolved, config)


def prepare_for_engine(
    model: nn.Module,
    policy: PolicySpec,
    *,
    device_type: str | Sequence[str] | None = None,
    op_table: OpTable | None = None,
) -> nn.Module:
    """:func:`mpx_torch.prepare` for a model a DeepSpeed engine will own (in place; returns it).

    The engine then stores the parameters in its compute dtype (the float32 masters live in its
    optimizer); the policy's forward, overrides and output dtype hold as prepared.

    Raises:
        mpx.MPXError: as :func:`ds_config` for a policy DeepSpeed cannot run.
    """
    resolved = get_policy(policy)
    _check_policy(resolved)
    warn_half_parameters(model, resolved, stacklevel=3)
    return prepare(model, resolved, device_type=device_type, op_table=op_table)


def initialize(
    model: nn.Module,
    policy: PolicySpec,
    config: ScalerConfig | Mapping[str, Any] | PolicySpec | None = None,
    *,
    base: Mapping[str, Any] | None = None,
    device_type: str | Sequence[str] | None = None,
    op_table: OpTable | None = None,
    **kwargs: Any,
) -> tuple[Any, ...]:
    """``deepspeed.initialize`` under ``policy``: prepares ``model``, writes :func:`ds_config` (over ``base``).

    ``kwargs`` go to ``deepspeed.initialize`` (``model_parameters``, ``optimizer``, ``lr_scheduler``...;
    not ``config``: pass it as ``base``).  Returns what ``deepspeed.initialize`` returns
    ``(engine, optimizer, dataloader, lr_scheduler)``; ``EngineScaler(engine)`` reads its scaler.

    Raises:
        mpx.MPXError: ``config=`` or ``config_params=`` in ``kwargs`` (the ds_config is ``base``), and
            what :func:`ds_config` raises.
    """
    for name in ("config", "config_params"):
        if name in kwargs:
            raise MPXError(f"{name}: pass the ds_config as base=, mpx writes the precision keys into it")
    written = ds_config(policy, config, base=base)
    prepare_for_engine(model, policy, device_type=device_type, op_table=op_table)
    return tuple(deepspeed.initialize(model=model, config=written, **kwargs))


def _engine_config(engine: Any) -> Mapping[str, Any]:
    config = library_internal(
        "deepspeed", engine, "_config", "DeepSpeedEngine._config", "EngineScaler.config"
    )
    return library_internal(
        "deepspeed", config, "_param_dict", "DeepSpeedConfig._param_dict", "EngineScaler.config"
    )


def _loss_scaler(engine: Any) -> Any:
    optimizer = getattr(engine, "optimizer", None)
    scaler = getattr(optimizer, "loss_scaler", None)
    if scaler is None:
        raise MPXError(
            "engine: its optimizer has no loss_scaler (a float32 engine, or one made without an optimizer); "
            "an EngineScaler reads fp16 and bf16 engines that train"
        )
    return scaler


class EngineScaler:
    """A DeepSpeed engine's loss scaler in mpx's terms: ``get_scale()``, ``state``, ``state_dict()``, ``load_state_dict()``.

    Args:
        engine: a ``deepspeed.DeepSpeedEngine``, or a callable returning it (an engine made later,
            e.g. by ``accelerator.prepare``).

    The engine does the scaling and the skipping; this object holds no state of its own, so it
    reads the engine afresh each time.  ``config`` is what the engine's ds_config says
    (:func:`mpx.deepspeed_config.from_deepspeed_config`, with ``bf16.check_grad_overflow`` as
    ``skip_nonfinite``).
    """

    def __init__(self, engine: Any) -> None:
        self._source: Callable[[], Any] = (
            engine if callable(engine) and not isinstance(engine, nn.Module) else (lambda: engine)
        )

    @property
    def engine(self) -> Any:
        """The engine (raises :class:`mpx.MPXError` while there is none yet)."""
        engine = self._source()
        if engine is None:
            raise MPXError("engine: there is no DeepSpeed engine yet (it is made when the model is prepared)")
        return engine

    @property
    def config(self) -> ScalerConfig:
        """The :class:`mpx.ScalerConfig` the engine runs."""
        engine = self.engine
        raw = _engine_config(engine)
        _, config = from_deepspeed_config(raw)
        if config.kind == "none":
            bf16 = raw.get("bf16") or {}
            checked = (
                library_internal(
                    "deepspeed",
                    engine._config,
                    "bfloat16_config",
                    "DeepSpeedConfig.bfloat16_config",
                    "EngineScaler.config",
                ).check_grad_overflow
                if bf16.get("enabled")
                else False
            )
            config = dataclasses.replace(config, skip_nonfinite=bool(checked))
        return config

    def is_enabled(self) -> bool:
        """Whether the engine scales the loss (an fp16 engine)."""
        return self.config.kind != "none"

    def get_scale(self) -> float:
        """The current loss scale as a Python float (1.0 for a bf16 engine)."""
        return float(_loss_scaler(self.engine).cur_scale)

    def scale(self, loss: Any) -> Any:
        """``loss`` times the current scale (``engine.backward`` scales by itself; this is for reading)."""
        return loss * self.get_scale()

    @property
    def state(self) -> ScalerState:
        """The engine's scaler state as an :class:`mpx.ScalerState`.

        DeepSpeed keeps the scale, its iteration count, the iteration of the last overflow and its
        hysteresis counter; the engine counts the skipped steps.  ``growth_tracker`` and
        ``nonfinite_since_growth`` follow from those exactly.  ``consecutive_nonfinite`` is exact
        when the last step was finite (0) and otherwise the smallest count the scaler's state allows
        (DeepSpeed does not count overflows in a row): it only feeds stuck detection.
        """
        return _state_from_engine(self.engine, self.config)

    def state_dict(self) -> dict[str, Any]:
        """The neutral ``mpx.scaler/1`` dict (config and state), as every mpx scaler saves."""
        return _scaling.state_dict(self.config, self.state)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Put a neutral ``mpx.scaler/1`` dict's state into the engine's scaler (its config must be the engine's).

        Raises:
            mpx.StateDictError: an invalid dict, or one saved under another scaler config.
        """
        config, state = _scaling.load_state_dict(state_dict)
        mine = self.config
        if config.to_dict() != mine.to_dict():
            raise StateDictError(
                f"config: the state dict was saved under {config.to_dict()}, this engine runs {mine.to_dict()}; "
                "make the engine with the same ds_config (mpx_torch.deepspeed.ds_config)"
            )
        _state_into_engine(self.engine, config, state)


def _state_from_engine(engine: Any, config: ScalerConfig) -> ScalerState:
    return state_from_loss_scaler(
        _loss_scaler(engine),
        config,
        skipped_steps=int(engine.skipped_steps),
        steps=int(engine.global_steps),
        last_overflowed=bool(getattr(engine.optimizer, "overflow", False)),
    )


def _state_into_engine(engine: Any, config: ScalerConfig, state: ScalerState) -> None:
    engine.skipped_steps = state.skipped_steps
    load_into_loss_scaler(_loss_scaler(engine), config, state)


def state_from_loss_scaler(
    loss_scaler: Any,
    config: ScalerConfig,
    *,
    skipped_steps: int,
    steps: int = 0,
    last_overflowed: bool = False,
) -> ScalerState:
    """The :class:`mpx.ScalerState` of a DeepSpeed loss scaler (``DynamicLossScaler`` or the static ``LossScaler``).

    Args:
        loss_scaler: DeepSpeed's scaler object (``engine.optimizer.loss_scaler``).
        config: the :class:`mpx.ScalerConfig` it runs (for a dynamic one, DeepSpeed's mode:
            ``from_deepspeed_config`` of its ds_config).
        skipped_steps: the steps skipped so far (DeepSpeed's engine counts them, ``engine.skipped_steps``).
        steps, last_overflowed: for a static scaler (which counts nothing): the steps taken
            (``engine.global_steps``) and whether the last one overflowed.  A dynamic scaler counts
            its own steps (``cur_iter``) and overflows (``last_overflow_iter``).

    ``growth_tracker`` and ``nonfinite_since_growth`` follow exactly from DeepSpeed's
    ``cur_iter``, ``last_overflow_iter`` and ``cur_hysteresis``; ``consecutive_nonfinite`` is exact
    (0) after a finite step and otherwise the smallest count the state allows: DeepSpeed does not
    count overflows in a row, and the count only feeds mpx's stuck detection.
    """
    if config.kind != "dynamic":
        consecutive = min(int(last_overflowed), skipped_steps)
        return ScalerState(
            scale=float(loss_scaler.cur_scale),
            consecutive_nonfinite=consecutive,
            steps=steps,
            skipped_steps=skipped_steps,
        )
    steps = int(loss_scaler.cur_iter)
    finite_since = (
        steps - int(loss_scaler.last_overflow_iter) - 1
    )  # finite steps since the last overflow (or start)
    tracker = 0 if finite_since == 0 else (finite_since - 1) % config.growth_interval + 1
    last_overflowed = finite_since == 0 and steps > 0
    used = config.hysteresis - int(loss_scaler.cur_hysteresis)  # overflows the hysteresis budget absorbed
    consecutive = (
        max(used, 1) if last_overflowed and config.hysteresis_reset == "finite" else int(last_overflowed)
    )
    consecutive = min(consecutive, skipped_steps)
    since = min(max(used, consecutive), steps) if config.hysteresis_reset == "growth" else 0
    return ScalerState(
        scale=float(loss_scaler.cur_scale),
        growth_tracker=tracker,
        consecutive_nonfinite=consecutive,
        steps=steps,
        skipped_steps=skipped_steps,
        nonfinite_since_growth=since,
    )


def load_into_loss_scaler(loss_scaler: Any, config: ScalerConfig, state: ScalerState) -> None:
    """Set a DeepSpeed ``DynamicLossScaler`` to ``state`` (its config ``config``): the inverse of
    :func:`state_from_loss_scaler`, so both continue alike.  A static scaler holds no state: nothing to set."""
    if config.kind != "dynamic":
        return
    count = (
        state.nonfinite_since_growth if config.hysteresis_reset == "growth" else state.consecutive_nonfinite
    )
    loss_scaler.cur_scale = float(state.scale)
    loss_scaler.cur_iter = state.steps
    loss_scaler.last_overflow_iter = state.steps - 1 - state.growth_tracker
    loss_scaler.cur_hysteresis = max(config.hysteresis - count, 1)


def save_checkpoint(
    engine: Any, save_dir: str, tag: Any = None, client_state: Mapping[str, Any] | None = None, **kwargs: Any
) -> Any:
    """``engine.save_checkpoint`` with the neutral scaler state in its ``client_state`` under :data:`CHECKPOINT_KEY`."""
    state = {**(client_state or {}), CHECKPOINT_KEY: EngineScaler(engine).state_dict()}
    return engine.save_checkpoint(save_dir, tag=tag, client_state=state, **kwargs)


def load_checkpoint(engine: Any, load_dir: str, tag: Any = None, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """``engine.load_checkpoint``, then the neutral scaler state from its ``client_state`` (when it has one).

    Returns ``(load_path, client_state)`` as the engine does.  DeepSpeed restores its own scaler
    from its checkpoint too; the neutral dict is also what resumes a scale saved elsewhere
    (``mpx_torch.GradScaler``, JAX, Keras) under the same config.

    Raises:
        mpx.MPXError: when the engine found no checkpoint in ``load_dir``.
        mpx.StateDictError: a neutral dict saved under another scaler config.
    """
    path, client_state = engine.load_checkpoint(load_dir, tag=tag, **kwargs)
    if path is None:
        raise MPXError(f"load_dir: DeepSpeed found no checkpoint in {load_dir!r} (tag {tag!r})")
    client_state = dict(client_state or {})
    saved = client_state.get(CHECKPOINT_KEY)
    if saved is not None:
        EngineScaler(engine).load_state_dict(saved)
    return path, client_state
