"""mpx in the Hugging Face ``Trainer``: ``MPXTrainer``, and ``MPXTrainerMixin`` for other Trainer subclasses.

>>> import torch, transformers
>>> from mpx_torch.transformers import MPXTrainer
>>> config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, bos_token_id=0, eos_token_id=0)
>>> model = transformers.GPT2LMHeadModel(config)
>>> args = transformers.TrainingArguments("/tmp/mpx-doctest", use_cpu=True, report_to="none")
>>> trainer = MPXTrainer(model=model, args=args, policy="mixed_bfloat16")
>>> trainer.scaler is trainer.accelerator.scaler, trainer.policy.compute_dtype
(True, 'bfloat16')

The policy replaces ``fp16=``/``bf16=`` in ``TrainingArguments`` (leave both
False).  The model is prepared with :func:`mpx_torch.prepare` and the
Trainer's Accelerator gets mpx through :func:`mpx_torch.accelerate.attach`,
so: the loss is scaled; ``max_grad_norm`` clips the unscaled gradients and
the logged ``grad_norm`` is the unscaled norm; a non-finite step is skipped
(parameters and optimizer state untouched) and does not advance the LR
scheduler; checkpoints save the scaler state as ``scaler.pt`` (the neutral
``mpx.scaler/1`` dict) and ``resume_from_checkpoint`` restores it (a
``scaler.pt`` written by ``torch.amp.GradScaler`` loads too); every training
log gains ``loss_scale`` (the scale after the last step) and
``skipped_steps`` (the total skipped so far).

Under an FP8 policy (``"mixed_bfloat16,fp8=hybrid,@lm_head={fp8=none}"``...), the
model's ``nn.Linear`` modules the policy names become
:class:`mpx_torch.float8.Float8Linear` and their FP8 state commits after each
optimizer step through the Accelerator (:func:`mpx_torch.accelerate.attach`):
once per gradient-accumulation window, nothing on a skipped step.  The FP8
buffers are persistent, so ``model.safetensors`` in each checkpoint holds them
and ``resume_from_checkpoint`` restores them with the weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformers import Trainer

from mpx import MPXError, OpTable, Policy, PolicySpec, ScalerConfig, get_policy
from mpx_torch._integrations import HalfParametersWarning, require_library, warn_half_parameters
from mpx_torch.accelerate import attach
from mpx_torch.grad_scaler import GradScaler
from mpx_torch.prepare import prepare

__all__ = ["HalfParametersWarning", "MPXTrainer", "MPXTrainerMixin"]

require_library("transformers")


def _check_args(args: Any) -> None:
    requested = [name for name in ("fp16", "bf16") if getattr(args, name, False)]
    if not requested:
        return
    on_cpu = getattr(args, "use_cpu", False) or args.device.type == "cpu"
    silently = (
        " (on a CPU, fp16=True makes no scaler and no autocast: the Trainer would train in float32)"
        if "fp16" in requested and on_cpu
        else ""
    )
    raise MPXError(
        f"TrainingArguments: {requested[0]}=True{silently}; the mpx policy replaces the Trainer's fp16/bf16, "
        "so leave both False and pass the policy to the trainer, e.g. MPXTrainer(..., policy='mixed_float16')"
    )


class MPXTrainerMixin:
    """Adds an mpx policy to a ``transformers.Trainer`` subclass: ``class T(MPXTrainerMixin, SFTTrainer)``.

    Keyword arguments (the others go to the Trainer):
        policy: an :class:`mpx.Policy` or anything :func:`mpx.get_policy`
            reads (``"mixed_float16"``, ``"mixed_bfloat16"``...); required.
        scaler_config: the loss scaler's config (an :class:`mpx.ScalerConfig`,
            its dict, or a policy); None (the default) means
            ``ScalerConfig.for_policy(policy)``: dynamic for float16 compute,
            none (no scaling, no skipping) otherwise.
        device_type, op_table: passed to :func:`mpx_torch.prepare`.

    Attributes: ``policy`` (the :class:`mpx.Policy`) and ``scaler`` (the
    :class:`mpx_torch.GradScaler`, also ``trainer.accelerator.scaler``).

    Raises:
        mpx.MPXError: for ``TrainingArguments(fp16=True)`` or ``bf16=True``
            (``fp16`` on a CPU would otherwise train in float32 without a
            word), a ds_config (``deepspeed=``) that enables ``fp16``/``bf16``
            other than the policy does, and for an XLA setup.

    With ``TrainingArguments(deepspeed=ds_config)`` the DeepSpeed engine
    scales, skips (on every rank) and clips (``max_grad_norm``, on the
    unscaled gradients); mpx writes the policy into the ds_config (leave
    ``fp16``/``bf16`` out of it or ``"auto"``), prepares the model, and
    ``scaler`` reads the engine's scale and state; the engine's checkpoint
    holds its scaler and ``resume_from_checkpoint`` restores it.
        mpx.PolicyError, mpx.ScalerConfigError: for a bad policy or config.

    A model holding float16/bfloat16 parameters under a policy with float32
    master weights (``from_pretrained``'s default ``dtype="auto"`` on a
    half-precision checkpoint) warns with :class:`HalfParametersWarning`
    and is upcast, as the policy asks.
    """

    policy: Policy
    scaler: GradScaler | Any  # an mpx_torch.deepspeed.EngineScaler under DeepSpeed

    def __init__(
        self,
        *args: Any,
        policy: PolicySpec,
        scaler_config: ScalerConfig | Mapping[str, Any] | PolicySpec | None = None,
        device_type: str | Sequence[str] | None = None,
        op_table: OpTable | None = None,
        **kwargs: Any,
    ) -> None:
        # read by create_accelerator_and_postprocess, which the Trainer's __init__ calls
        self.policy = get_policy(policy)
        self._mpx_scaler_config = scaler_config
        self._mpx_prepare = {"device_type": device_type, "op_table": op_table}
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's Accelerator, with mpx attached, and the model prepared under the policy.

        With ``TrainingArguments(deepspeed=...)`` the policy and scaler config are first written into
        the Trainer's ds_config (:func:`mpx_torch.deepspeed.write_config`), which the DeepSpeed
        engine then runs; ``scaler`` is an :class:`mpx_torch.deepspeed.EngineScaler`.
        """
        args = self.args  # type: ignore[attr-defined]
        _check_args(args)
        hf_ds_config = getattr(args, "hf_deepspeed_config", None)
        if hf_ds_config is not None:
            from mpx_torch.deepspeed import write_config

            write_config(
                hf_ds_config.config,
                self.policy,
                self._mpx_scaler_config,
                owner="TrainingArguments(deepspeed=...)",
            )
        super().create_accelerator_and_postprocess()  # type: ignore[misc]
        self.scaler = attach(
            self.accelerator,  # type: ignore[attr-defined]
            self.policy,
            self._mpx_scaler_config,
            **self._mpx_prepare,
        )
        model = self.model  # type: ignore[attr-defined]
        if model is not None and hf_ds_config is not None:
            from mpx_torch.deepspeed import prepare_for_engine

            prepare_for_engine(model, self.policy, **self._mpx_prepare)
        elif model is not None:  # None with model_init: the accelerator prepares the model train() makes
            warn_half_parameters(model, self.policy, stacklevel=5)
            prepare(model, self.policy, **self._mpx_prepare)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's log, plus ``loss_scale`` and ``skipped_steps`` in training logs (one host read)."""
        if "loss" in logs and (self.scaler.is_enabled() or getattr(self.args, "hf_deepspeed_config", None)):
            state = self.scaler.state
            logs["loss_scale"] = state.scale
            logs["skipped_steps"] = state.skipped_steps
        super().log(logs, *args, **kwargs)  # type: ignore[misc]


class MPXTrainer(MPXTrainerMixin, Trainer):
    """``transformers.Trainer`` under an mpx policy: ``MPXTrainer(model=..., args=..., policy="mixed_float16")``.

    See :class:`MPXTrainerMixin` for the extra keyword arguments.
    """
