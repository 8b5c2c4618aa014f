"""The ``deepspeed`` conformance cases, their expectations from the core, and what a native divergence is.

One kind of case, ``deepspeed_trace``: a sequence of steps (``flags``: finite or overflowing) given to
DeepSpeed's scaler built from DeepSpeed's own arguments (``ds``: ``init_scale``, ``scale_window``,
``min_scale``, ``delayed_shift``, ``consecutive_hysteresis``), observed as the scale after each step and
the 1-based step DeepSpeed raised "Current loss scale already at minimum" at (``raised_at``, None when
it did not; the scales stop there).  Each sequence is judged against three rules (``rule``), each a
:class:`mpx.ScalerConfig` the core runs (:func:`expected_trace`):

- ``deepspeed_mode``: ``SCALER_PRESETS["deepspeed_fp16"]`` with the sequence's arguments.  DeepSpeed's
  ``DynamicLossScaler`` passes here bit for bit; its non-ZeRO ``FP16_Optimizer`` (``native``) does not;
- ``mpx_default``: mpx's default rule with the same window, hysteresis and floor;
- ``torch_rule``: ``torch.amp.GradScaler``'s rule with the same window (no hysteresis, no bounds).

Under mpx (``mpx_torch.GradScaler`` with the rule's config) every row passes.  A native divergence is
named by :func:`deepspeed_topic`: the fewest config changes (:data:`VARIANTS`) that make the core
reproduce what DeepSpeed did.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import mpx

GROUP = "deepspeed"
T, F = True, False
#: what each native subject is: the scaler ZeRO stages 1-3 (and the BF16/FP16 engines) build, and the
#: non-ZeRO fused optimizer, which keeps its own copy of the rule
NATIVE = {
    "DynamicLossScaler": "deepspeed's DynamicLossScaler (runtime/fp16/loss_scaler.py), update_scale(overflow)",
    "FP16_Optimizer": "deepspeed's non-ZeRO FP16_Optimizer (runtime/fp16/fused_optimizer.py) over SGD, real "
    "float16 steps on CPU",
}


def ds_args(power: int, window: int, hysteresis: int, consecutive: bool = False, min_scale: int = 1) -> dict:
    """DeepSpeed's ``dynamic_loss_args`` (``DynamicLossScaler``'s constructor arguments)."""
    return {"init_scale": 2.0**power, "scale_window": window, "min_scale": min_scale,
            "delayed_shift": hysteresis, "consecutive_hysteresis": consecutive}  # fmt: skip


def _flags(seed: int, n: int, p_overflow: float) -> list[bool]:
    rng = random.Random(seed)
    return [rng.random() >= p_overflow for _ in range(n)]


REFILL = [F, T, F, T, T, T, T, F, F, T]
#: (id, DeepSpeed's arguments, flags, words)
SEQUENCES: list[tuple[str, dict, list[bool], str]] = [
    ("growth_window_4", ds_args(0, 4, 2), [T] * 9, "nine clean steps from scale 1, window 4"),
    ("hysteresis_refill", ds_args(10, 3, 2), REFILL,
     "hysteresis 2, an overflow, a clean step, an overflow (consecutive_hysteresis false)"),
    ("consecutive_hysteresis", ds_args(10, 3, 2, consecutive=True), REFILL,
     "the same steps with consecutive_hysteresis true"),
    ("floor", ds_args(1, 3, 1), [F, F, T], "two overflows from scale 2 with min_loss_scale 1, hysteresis 1"),
    ("defaults", ds_args(16, 1000, 2), _flags(3, 40, 0.2), "ds_config's defaults, 40 steps, 20% overflowing"),
    ("random_long", ds_args(12, 4, 2), _flags(5, 60, 0.25), "60 steps, 25% overflowing, window 4, hysteresis 2"),
]  # fmt: skip
#: the sequences FP16_Optimizer runs (against the DeepSpeed mode: it differs from DeepSpeed's own scaler)
FP16_OPTIMIZER_SEQUENCES = ("hysteresis_refill", "floor", "random_long")
RULES = ("deepspeed_mode", "mpx_default", "torch_rule")
RULE_WORDS = {
    "deepspeed_mode": "mpx's DeepSpeed mode (SCALER_PRESETS['deepspeed_fp16'] with these arguments)",
    "mpx_default": "mpx's default rule (ScalerConfig with the same window, hysteresis and min_scale)",
    "torch_rule": "torch.amp.GradScaler's rule (the same window; no hysteresis, no floor, no ceiling)",
}


def rule_config(rule: str, ds: dict) -> mpx.ScalerConfig:
    """The :class:`mpx.ScalerConfig` of ``rule`` for DeepSpeed's arguments ``ds``."""
    common = {"init_scale": float(ds["init_scale"]), "growth_interval": ds["scale_window"]}
    if rule == "deepspeed_mode":
        return mpx.ScalerConfig(**{**mpx.SCALER_PRESETS["deepspeed_fp16"].to_dict(), **common,
                                   "hysteresis": ds["delayed_shift"], "min_scale": float(ds["min_scale"]),
                                   "hysteresis_reset": "finite" if ds["consecutive_hysteresis"] else "growth"})  # fmt: skip
    if rule == "mpx_default":
        return mpx.ScalerConfig(**common, hysteresis=ds["delayed_shift"], min_scale=float(ds["min_scale"]))
    return mpx.ScalerConfig(**common, min_scale=None, max_scale=None)


def expected_trace(config: dict, flags: list[bool]) -> dict:
    """The core's observation of ``flags`` under ``config`` (a ``ScalerConfig.to_dict()``): ``scales`` after
    each step up to the one that raised :class:`mpx.ScalerFloorError`, and that step (``raised_at``)."""
    scaler = mpx.LossScaler(mpx.ScalerConfig.from_dict(config))
    scales: list[float] = []
    for i, finite in enumerate(flags, 1):
        try:
            scaler.update(finite)
        except mpx.ScalerFloorError:
            return {"scales": scales, "raised_at": i}
        scales.append(scaler.get_scale())
    return {"scales": scales, "raised_at": None}


def _case(id_: str, native: str, rule: str, ds: dict, flags: list[bool], words: str) -> dict:
    config = rule_config(rule, ds).to_dict()
    return {
        "id": f"{GROUP}.{id_}", "group": GROUP, "kind": "deepspeed_trace",
        "params": {"native": native, "rule": rule, "ds": ds, "config": config, "flags": flags},
        "expected": expected_trace(config, flags),
        "spec": f"{words}: natively {NATIVE[native]}; the scale after each step and the step it raises at "
        f"equal {RULE_WORDS[rule]}, bit for bit",
    }  # fmt: skip


def deepspeed_cases() -> list[dict]:
    """Every case of the ``deepspeed`` group."""
    out = [_case(f"{id_}.{rule}", "DynamicLossScaler", rule, ds, flags, words)
           for id_, ds, flags, words in SEQUENCES for rule in RULES]  # fmt: skip
    out += [_case(f"fp16_optimizer.{id_}", "FP16_Optimizer", "deepspeed_mode", ds, flags, words)
            for id_, ds, flags, words in SEQUENCES if id_ in FP16_OPTIMIZER_SEQUENCES]  # fmt: skip
    return out


# -- what a native divergence is ----------------------------------------------------------------------

#: (name, the config change that reproduces it, what it means for training), tried by :func:`trace_causes`
VARIANTS: tuple[tuple[str, Any, str], ...] = (
    ("growth one step later", lambda c, ds: {"first_growth_delay": 1},
     "it grows on the (window+1)-th clean step after an overflow or the start, then every window steps "
     "(torch and mpx's default: on the window-th), so a run moved to or from DeepSpeed follows another trace"),
    ("hysteresis refilled only on growth", lambda c, ds: {"hysteresis_reset": "growth"},
     "its hysteresis budget (delayed_shift) is refilled only when the scale grows, not by a clean step "
     "(consecutive_hysteresis false, ds_config's default), so isolated overflows a window apart back off "
     "where mpx's and the consecutive rule's hysteresis absorbs them"),
    ("raise at the floor", lambda c, ds: {"on_floor": "raise"},
     "it raises 'Current loss scale already at minimum' when a back-off is due at min_loss_scale and the "
     "run dies, where torch and mpx's default stay at the floor and skip the step"),
    ("hysteresis", lambda c, ds: {"hysteresis": ds["delayed_shift"]},
     "it backs off only when its hysteresis (delayed_shift) is spent, torch on every overflow"),
    ("floor at min_loss_scale", lambda c, ds: {"min_scale": float(ds["min_scale"])},
     "it never backs off below min_loss_scale (torch's GradScaler has no floor)"),
    ("no hysteresis", lambda c, ds: {"hysteresis": 1},
     "it backs off on every overflow, ignoring hysteresis (delayed_shift) in its ds_config"),
    ("no raise at the floor", lambda c, ds: {"on_floor": "keep"},
     "it stays at min_loss_scale and goes on where DeepSpeed's own scaler raises"),
)  # fmt: skip
_WORDS = {name: words for name, _, words in VARIANTS}


def trace_causes(params: dict, observed: dict) -> list[str] | None:
    """The fewest :data:`VARIANTS` applied to the case's config that make the core reproduce ``observed``
    (``[]``: it is the expectation; None: no combination does)."""
    config, ds, flags = params["config"], params["ds"], params["flags"]
    if expected_trace(config, flags) == observed:
        return []
    relevant = [v for v in VARIANTS if any(config.get(k) != x for k, x in v[1](config, ds).items())]
    for n in range(1, len(relevant) + 1):
        for combo in itertools.combinations(relevant, n):
            changed = dict(config)
            for _, change, _ in combo:
                changed.update(change(config, ds))
            try:
                if expected_trace(changed, flags) == observed:
                    return [name for name, _, _ in combo]
            except mpx.MPXError:  # a combination the config refuses (a hysteresis reset with hysteresis 1)
                continue
    return None


def deepspeed_topic(case_id: str, params: dict, expected: dict, observed: dict) -> tuple[str, str, str]:
    """(kind, severity, topic) of a native divergence: ``deepspeed-trace:<native>:<rule>:<causes>``."""
    causes = trace_causes(params, observed) or ["unexplained"]
    timing_only = set(causes) <= {"growth one step later"}
    kind, severity = ("default differs", "low") if timing_only else ("scaler semantics", "medium")
    return kind, severity, f"deepspeed-trace:{params['native']}:{params['rule']}:" + "+".join(causes)


def finding_text(topic: str, cases: list[str]) -> tuple[str, str]:
    """(title, explanation) of a ``deepspeed-trace`` finding."""
    _, native, rule, causes = topic.split(":", 3)
    names = causes.split("+")
    shown = ", ".join(cases[:4]) + (f" and {len(cases) - 4} more" if len(cases) > 4 else "")
    against = RULE_WORDS[rule].split(" (")[0]
    title = f"DeepSpeed's {native} against {against}: {', '.join(names)}: {shown}"
    if names == ["unexplained"]:
        return title, "The traces differ in a way no combination of DeepSpeed's known rules explains."
    return title, " ".join(_WORDS[n][0].upper() + _WORDS[n][1:] + "." for n in names)


__all__ = ["FP16_OPTIMIZER_SEQUENCES", "RULES", "SEQUENCES", "VARIANTS", "deepspeed_cases", "deepspeed_topic",
           "expected_trace", "finding_text", "rule_config", "trace_causes"]  # fmt: skip
