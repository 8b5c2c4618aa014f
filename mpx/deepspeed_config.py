"""A policy and a scaler config written as a DeepSpeed ``ds_config``, and read back from one.

DeepSpeed says its precision in two blocks of its config: ``fp16`` (float16 compute with its
``DynamicLossScaler``, or a static ``loss_scale``) and ``bf16`` (no loss scaling), plus
``communication_data_type`` (the dtype gradients are all-reduced in).  This module maps an
:class:`mpx.Policy` and an :class:`mpx.ScalerConfig` onto those keys and back, exactly, for what
DeepSpeed can express; it refuses the rest (naming the field).  Plain dicts only: DeepSpeed itself
is not imported.

DeepSpeed's dynamic scaler is mpx's ``ScalerConfig`` with ``growth_factor=2``,
``backoff_factor=0.5``, ``first_growth_delay=1``, ``max_scale=None``, ``on_floor="raise"``, an
``init_scale`` of ``2**initial_scale_power``, ``growth_interval=loss_scale_window``,
``hysteresis``, ``hysteresis_reset`` ``"finite"`` for ``consecutive_hysteresis=true`` and
``"growth"`` for false, and ``min_scale=min_loss_scale`` (a positive int there).  Its defaults are
:data:`mpx.SCALER_PRESETS` ``["deepspeed_fp16"]``.

>>> ds = to_deepspeed_config("mixed_float16")
>>> ds["fp16"]["loss_scale_window"], ds["fp16"]["hysteresis"], ds["communication_data_type"]
(1000, 2, 'fp32')
>>> policy, config = from_deepspeed_config(ds)
>>> policy.compute_dtype, config == SCALER_PRESETS["deepspeed_fp16"]
('float16', True)
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from mpx.errors import PolicyError, ScalerConfigError
from mpx.policy import Policy, get_policy
from mpx.scaling import SCALER_PRESETS, ScalerConfig, as_scaler_config

__all__ = ["from_deepspeed_config", "to_deepspeed_config"]

#: mpx dtype names and DeepSpeed's ``communication_data_type`` names.
_COMM = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
#: What every DeepSpeed dynamic scaler has, as ScalerConfig fields.
_FIXED = {
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "first_growth_delay": 1,
    "max_scale": None,
    "on_floor": "raise",
    "skip_nonfinite": True,
    "max_consecutive_skips": None,
}


def _fp16_block(config: ScalerConfig) -> dict[str, Any]:
    """The ``fp16`` block for a ScalerConfig DeepSpeed can express (else ScalerConfigError naming the field)."""
    err = ScalerConfigError
    if config.kind == "none":
        raise err(
            "kind: DeepSpeed's fp16 engine always scales the loss; use kind='static' with init_scale=1.0 "
            "for no scaling, or a bfloat16 policy"
        )
    if config.kind == "static":
        for name in ("skip_nonfinite", "max_consecutive_skips"):
            if getattr(config, name) != _FIXED[name]:
                raise err(f"{name}: DeepSpeed cannot express {getattr(config, name)!r} (it has {_FIXED[name]!r})")
        return {"enabled": True, "loss_scale": config.init_scale}
    for name, value in _FIXED.items():
        if getattr(config, name) != value:
            raise err(
                f"{name}: DeepSpeed's dynamic loss scaler has {name}={value!r}, got {getattr(config, name)!r}; "
                f"start from mpx.SCALER_PRESETS['deepspeed_fp16']"
            )
    mant, exp = math.frexp(config.init_scale)
    if mant != 0.5:
        raise err(f"init_scale: DeepSpeed's is 2**initial_scale_power (an int power), got {config.init_scale!r}")
    lo = config.min_scale
    if lo is None or lo < 1 or lo != int(lo):
        raise err(f"min_scale: DeepSpeed's min_loss_scale is a positive int, got {lo!r}")
    return {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": exp - 1,
        "loss_scale_window": config.growth_interval,
        "hysteresis": config.hysteresis,
        "consecutive_hysteresis": config.hysteresis_reset == "finite",
        "min_loss_scale": int(lo),
    }


def to_deepspeed_config(policy: Any, config: Any = None, *, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``ds_config`` for ``policy`` (anything :func:`mpx.get_policy` reads) and scaler ``config``.

    Args:
        policy: its compute dtype picks the block: float16 writes ``fp16`` (the scaler's fields),
            bfloat16 writes ``bf16``, float32 neither (both disabled where ``base`` has them); its
            reduce dtype is written as ``communication_data_type``.  The other policy fields (FP8,
            ``keep_fp32``, ...) have no DeepSpeed key and are not written.
        config: the scaler (anything :func:`mpx.as_scaler_config` reads); None means
            ``SCALER_PRESETS["deepspeed_fp16"]`` (DeepSpeed's defaults) for float16 and kind ``"none"``
            otherwise.  A bfloat16 or float32 policy takes kind ``"none"`` only.
        base: a user ds_config (batch sizes, ZeRO stage, optimizer...): copied, never mutated; the
            precision keys are written over it (a block's other keys, e.g. ``fp16.auto_cast``, kept).

    Returns:
        a new dict.

    Raises:
        ScalerConfigError: a scaler DeepSpeed cannot express (``growth_factor`` other than 2, a
            ``max_scale``, ``on_floor="keep"``, ...), naming the field.
        PolicyError: a compute or reduce dtype DeepSpeed has no name for, or a ``base`` that is not a mapping.
    """
    pol = get_policy(policy)
    if base is not None and not isinstance(base, Mapping):
        raise PolicyError(f"base: expected a ds_config mapping or None, got {type(base).__name__}")
    out: dict[str, Any] = copy.deepcopy(dict(base)) if base is not None else {}
    compute = pol.compute_dtype
    if compute not in _COMM:
        raise PolicyError(f"compute_dtype: DeepSpeed computes in float32, float16 or bfloat16, got {compute!r}")
    if config is None:
        cfg = SCALER_PRESETS["deepspeed_fp16"] if compute == "float16" else ScalerConfig(kind="none")
    else:
        cfg = as_scaler_config(config)
    blocks: dict[str, dict[str, Any]] = {"fp16": {"enabled": False}, "bf16": {"enabled": False}}
    if compute == "float16":
        blocks["fp16"] = _fp16_block(cfg)
    elif cfg.kind != "none":
        raise ScalerConfigError(
            f"kind: a {compute} policy runs DeepSpeed without loss scaling, so the scaler's kind must be "
            f"'none', got {cfg.kind!r}"
        )
    elif compute == "bfloat16":
        blocks["bf16"] = {"enabled": True}
    for name, block in blocks.items():
        if block["enabled"] or name in out:
            previous = out.get(name)
            merged = dict(previous) if isinstance(previous, Mapping) else {}
            if not block["enabled"]:
                merged = {k: v for k, v in merged.items() if k not in _FP16_SCALER_KEYS}
            out[name] = {**merged, **block}
    reduce = pol.reduce_dtype
    if reduce not in _COMM:
        raise PolicyError(f"reduce_dtype: DeepSpeed communicates in fp32, fp16 or bf16, got {reduce!r}")
    out["communication_data_type"] = _COMM[reduce]
    return out


_FP16_SCALER_KEYS = (
    "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis", "min_loss_scale",
)  # fmt: skip
_FP16_DEFAULTS = {
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "consecutive_hysteresis": False,
    "min_loss_scale": 1,
}


def _enabled(ds: Mapping[str, Any], name: str) -> bool:
    block = ds.get(name)
    if block is None:
        return False
    if not isinstance(block, Mapping):
        raise PolicyError(f"{name}: expected a mapping (a ds_config block), got {type(block).__name__}")
    enabled = block.get("enabled", False)
    if not isinstance(enabled, bool):
        raise PolicyError(f"{name}.enabled: expected true or false, got {enabled!r}")
    return enabled


def from_deepspeed_config(ds_config: Mapping[str, Any]) -> tuple[Policy, ScalerConfig]:
    """The (policy, scaler config) a ``ds_config`` says: the inverse of :func:`to_deepspeed_config`.

    ``fp16`` enabled gives ``mixed_float16`` with DeepSpeed's dynamic scaler (missing keys take
    DeepSpeed's defaults) or, for ``loss_scale`` > 0, a static one; ``bf16`` enabled gives
    ``mixed_bfloat16``; neither gives ``float32``; the last two with kind ``"none"``.
    ``communication_data_type`` (fp32, fp16 or bf16) becomes the policy's ``reduce_dtype``
    (absent: the policy's default, float32).

    Raises:
        PolicyError: both blocks enabled, a block that is not a mapping, an unknown communication dtype.
        ScalerConfigError: an fp16 field out of mpx's ranges, naming it.
    """
    if not isinstance(ds_config, Mapping):
        raise PolicyError(f"ds_config: expected a mapping, got {type(ds_config).__name__}")
    fp16, bf16 = _enabled(ds_config, "fp16"), _enabled(ds_config, "bf16")
    if fp16 and bf16:
        raise PolicyError("ds_config: fp16 and bf16 are both enabled; DeepSpeed accepts one of them")
    changes: dict[str, Any] = {}
    comm = ds_config.get("communication_data_type")
    if comm is not None:
        names = {v: k for k, v in _COMM.items()}
        if not isinstance(comm, str) or comm.lower() not in names:
            raise PolicyError(f"communication_data_type: expected fp32, fp16 or bf16, got {comm!r}")
        changes["reduce_dtype"] = names[comm.lower()]
    name = "mixed_float16" if fp16 else "mixed_bfloat16" if bf16 else "float32"
    policy = get_policy(name)
    if changes:
        policy = dataclasses.replace(policy, **changes)
    if not fp16:
        return policy, ScalerConfig(kind="none")
    block = {**_FP16_DEFAULTS, **ds_config["fp16"]}
    loss_scale = block["loss_scale"]
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)) or not loss_scale >= 0:
        raise ScalerConfigError(f"fp16.loss_scale: expected a number >= 0 (0: dynamic), got {loss_scale!r}")
    if loss_scale > 0:  # mpx's default bounds where they hold the scale (a static scale ignores them)
        x = float(loss_scale)
        bounds = {"min_scale": 1.0 if x >= 1.0 else None, "max_scale": 2.0**24 if x <= 2.0**24 else None}
        try:
            return policy, ScalerConfig(kind="static", init_scale=x, **bounds)
        except ScalerConfigError as e:
            raise ScalerConfigError(f"fp16.loss_scale: {e}") from None
    power = block["initial_scale_power"]
    if isinstance(power, bool) or not isinstance(power, int):
        raise ScalerConfigError(f"fp16.initial_scale_power: expected an int, got {power!r}")
    if not isinstance(block["consecutive_hysteresis"], bool):
        raise ScalerConfigError(
            f"fp16.consecutive_hysteresis: expected true or false, got {block['consecutive_hysteresis']!r}"
        )
    try:
        config = dataclasses.replace(
            SCALER_PRESETS["deepspeed_fp16"],
            init_scale=2.0**power,
            growth_interval=block["loss_scale_window"],
            hysteresis=block["hysteresis"],
            hysteresis_reset="finite" if block["consecutive_hysteresis"] else "growth",
            min_scale=block["min_loss_scale"],
        )
    except ScalerConfigError as e:
        field = str(e).split(":", 1)[0]
        raise ScalerConfigError(f"fp16.{_DS_NAMES.get(field, field)}: {e}") from None
    return policy, config


#: ScalerConfig fields and the fp16 keys that set them.
_DS_NAMES = {
    "init_scale": "initial_scale_power",
    "growth_interval": "loss_scale_window",
    "hysteresis": "hysteresis",
    "min_scale": "min_loss_scale",
}
