"""The ``fp8`` conformance cases, their expectations from the core (:mod:`mpx.float8`), and what a
native divergence is (:func:`trace_cause`, :func:`quantize_cause`, :func:`matmul_cause`).

Three kinds of case:

* ``fp8_quantize``: an input (random, overflowing, subnormal, NaN; float32 or bfloat16) quantized
  with a given float32 scale to e4m3 or e5m2: the bytes of :func:`mpx.float8.quantize`, NaN as NaN.
  A framework that keeps the *inverse* scale (Keras, Flax) is given ``float32(1 / scale)``, as it
  would hold after computing the same scale.
* ``fp8_trace``: 64 optimizer steps of one tensor's amaxes (spikes, a zero, infs, a NaN, a tiny
  amax whose scale overflows float32) with some steps skipped by the loss scaler: after each step,
  the scale the next step quantizes with, as float32 bits, equal to :func:`mpx.float8.float8_update`'s
  state.  Natively, a framework storing the inverse scale reports ``float32(1 / inverse)``.
* ``fp8_matmul``: ``a @ b`` with current scaling (each operand's own amax): every element within
  ``(4k + 4) * eps32 * (|qa| @ |qb|) / (sa * sb)`` of :func:`mpx.float8.fp8_dot` (docs/fp8.md's bound),
  and NaN where the reference is NaN (an inf operand).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from conformance.fp8 import (
    FP8_MAX,
    bits_to_f32,
    encode_fp8,
    f32_to_bits,
    matmul_inputs,
    quantize_inputs,
)
from mpx import float8 as F

GROUP = "fp8"
QUANTIZE_N = 256
TRACE_STEPS = 64
TRACE_HISTORY = 16
MATMUL_SHAPE = (16, 64, 16)
EPS32 = float(np.finfo(np.float32).eps)

#: (id, input kind, seed, format, scale or None (current scaling from the input's finite amax), dtype)
QUANTIZE_CASES: list[tuple[str, str, int, str, float | None, str]] = [
    ("random.e4m3", "random", 1, "e4m3", None, "float32"),
    ("random.e5m2", "random", 2, "e5m2", None, "float32"),
    ("random.pow2_scale.e4m3", "random", 3, "e4m3", 16.0, "float32"),
    ("overflow.e4m3", "overflow", 4, "e4m3", 448.0 / 3.7, "float32"),
    ("overflow.e5m2", "overflow", 5, "e5m2", 57344.0 / 3.7, "float32"),
    ("subnormal.e4m3", "subnormal", 6, "e4m3", 1.37 * 2.0**120, "float32"),
    ("subnormal.e5m2", "subnormal", 7, "e5m2", 1.37 * 2.0**120, "float32"),
    ("nan.e4m3", "nan", 8, "e4m3", None, "float32"),
    ("nan.e5m2", "nan", 9, "e5m2", None, "float32"),
    ("random.bfloat16.e4m3", "random", 10, "e4m3", None, "bfloat16"),
]


def _case(id_: str, kind: str, params: dict, expected: Any, spec: str) -> dict:
    return {"id": f"{GROUP}.{id_}", "group": GROUP, "kind": kind, "params": params, "expected": expected,
            "spec": spec}  # fmt: skip


def _f32(value: float) -> float:
    return float(np.float32(value))


def quantize_cases() -> list[dict]:
    out = []
    current = F.Float8Recipe(scaling="current")
    for id_, kind, seed, fmt, scale, dtype in QUANTIZE_CASES:
        x = quantize_inputs(kind, seed, QUANTIZE_N, dtype)
        if scale is None:
            finite = np.abs(x[np.isfinite(x)])
            scale = F.compute_scale(current, float(finite.max()), fmt)
        scale = _f32(scale)
        params = {"kind": kind, "seed": seed, "n": QUANTIZE_N, "fmt": fmt, "scale": scale, "dtype": dtype}
        expected = {"bytes": encode_fp8(F.quantize(x, scale, fmt), fmt)}
        words = {"random": "random", "overflow": "overflowing (±1e5..±3e38, ±inf)",
                 "subnormal": "float32-subnormal", "nan": "NaN-holding"}[kind]  # fmt: skip
        out.append(
            _case(
                f"quantize.{id_}", "fp8_quantize", params, expected,
                f"{QUANTIZE_N} {words} {dtype} values times the float32 scale {scale:.6g}, clipped to "
                f"±{FP8_MAX[fmt]:g} and cast to {fmt}: the bytes of mpx.float8.quantize (NaN compares as NaN)",
            )
        )  # fmt: skip
    return out


def trace_amaxes(seed: int = 26) -> tuple[list[float], list[bool]]:
    """The trace cases' 64 amaxes and skip flags: random in [0.25, 4] with a spike (step 5), a zero (12),
    an inf the loss scaler skips (20) and one it does not (26), a NaN (30), a tiny amax whose scale
    overflows float32 (40), a huge one (50), and skipped steps 8, 9, 20, 33, 45, 46."""
    rng = np.random.default_rng(seed)
    amaxes = [float(np.float32(v)) for v in 2.0 ** rng.uniform(-2, 2, TRACE_STEPS)]
    for step, value in {5: 1000.0, 12: 0.0, 20: math.inf, 26: math.inf, 30: math.nan, 40: 1e-39,
                        41: 1e-30, 50: 3e38}.items():  # fmt: skip
        amaxes[step] = float(np.float32(value))
    skipped = [step in (8, 9, 20, 33, 45, 46) for step in range(TRACE_STEPS)]
    return amaxes, skipped


#: (id, recipe fields, role, with skipped steps, words)
TRACE_CASES: list[tuple[str, dict, str, bool, str]] = [
    ("delayed.max.input", {}, "input", True, "delayed scaling, max over a 16-step history, e4m3 input"),
    ("delayed.max.grad", {}, "grad", True, "delayed scaling, max over a 16-step history, e5m2 gradient"),
    ("delayed.most_recent.margin2", {"amax_compute": "most_recent", "margin": 2}, "input", True,
     "delayed scaling, most recent amax, margin 2"),
    ("delayed.pow2", {"power_of_two": True}, "input", True, "delayed scaling, scales rounded down to powers of two"),
    ("current", {"scaling": "current"}, "input", False, "current scaling, no skipped step"),
    ("current.skips", {"scaling": "current"}, "input", True, "current scaling with skipped steps"),
]  # fmt: skip


def policy_spec(recipe: F.Float8Recipe) -> str:
    """The float32 policy spec whose ``fp8`` recipe is ``recipe`` (every key written)."""
    return (
        f"float32,fp8={recipe.format},fp8_scaling={recipe.scaling},fp8_history={recipe.amax_history_len},"
        f"fp8_amax={recipe.amax_compute},fp8_margin={recipe.margin},fp8_pow2={str(recipe.power_of_two).lower()}"
    )


def reference_trace(
    recipe: F.Float8Recipe, role: str, amaxes: list[float], skipped: list[bool]
) -> list[float]:
    """:func:`mpx.float8.float8_update`'s scale after each step."""
    state = F.float8_init(recipe, {"t": role})
    out = []
    for amax, skip in zip(amaxes, skipped, strict=True):
        state = F.float8_update(recipe, state, {"t": amax}, skipped=skip)
        out.append(state.tensors["t"].scale)
    return out


def trace_cases() -> list[dict]:
    out = []
    amaxes, skips = trace_amaxes()
    for id_, fields, role, with_skips, words in TRACE_CASES:
        recipe = F.Float8Recipe(amax_history_len=TRACE_HISTORY, **fields)
        skipped = skips if with_skips else [False] * TRACE_STEPS
        params = {"recipe": recipe.to_dict(), "role": role, "policy": policy_spec(recipe),
                  "amaxes": f32_to_bits(amaxes), "skipped": skipped}  # fmt: skip
        expected = {"scales": f32_to_bits(reference_trace(recipe, role, amaxes, skipped))}
        n_skip = sum(skipped)
        out.append(
            _case(
                f"trace.{id_}", "fp8_trace", params, expected,
                f"{words}: {TRACE_STEPS} steps of amaxes with a spike, a zero, two infs, a NaN and a tiny amax"
                + (f", {n_skip} steps skipped by the loss scaler" if n_skip else "")
                + ": after each step the scale the next step quantizes with (float32 bits) equals "
                "mpx.float8.float8_update's",
            )
        )  # fmt: skip
    return out


def matmul_reference(a: np.ndarray, b: np.ndarray) -> tuple[float, float, list, list[float]]:
    """Current scaling's scales of ``a`` and ``b``, :func:`mpx.float8.fp8_dot` (None for NaN) and the bound."""
    current = F.Float8Recipe(scaling="current")
    sa = F.compute_scale(current, float(np.abs(a).max()), "e4m3")
    sb = F.compute_scale(current, float(np.abs(b).max()), "e4m3")
    ref = F.fp8_dot(a, b, sa, sb)
    qa = F.quantize(a, sa, "e4m3").astype(np.float64)
    qb = F.quantize(b, sb, "e4m3").astype(np.float64)
    k = a.shape[1]
    bound = (4 * k + 4) * EPS32 * (np.abs(qa) @ np.abs(qb)) / (sa * sb)
    reference = [None if math.isnan(v) else float(v) for v in ref.reshape(-1).tolist()]
    return sa, sb, reference, [float(v) for v in bound.reshape(-1)]


def matmul_cases() -> list[dict]:
    out = []
    m, k, n = MATMUL_SHAPE
    for id_, bad, seed, words in (
        ("current", None, 11, "random operands"),
        ("inf_operand", "inf", 12, "an inf in the left operand (an overflowed activation)"),
    ):
        a, b = matmul_inputs(seed, m, k, n, bad)
        sa, sb, reference, bound = matmul_reference(a, b)
        recipe = F.Float8Recipe(scaling="current")
        params = {"seed": seed, "m": m, "k": k, "n": n, "bad": bad, "scales": [sa, sb], "recipe": recipe.to_dict(),
                  "policy": policy_spec(recipe), "reference": reference, "bound": bound}  # fmt: skip
        rule = (
            "every element NaN (a non-finite operand poisons the GEMM, so the loss scaler sees the overflow)"
            if bad
            else "every element within (4k+4) eps32 (|qa| @ |qb|) / (sa sb) of mpx.float8.fp8_dot"
        )
        out.append(
            _case(
                f"matmul.{id_}", "fp8_matmul", params, {"within_bound": True},
                f"an FP8 GEMM ({m}x{k} @ {k}x{n}, e4m3 operands, current scaling) of {words}: {rule}",
            )
        )  # fmt: skip
    return out


def fp8_cases() -> list[dict]:
    """Every case of the ``fp8`` group."""
    return quantize_cases() + trace_cases() + matmul_cases()


# -- what a native divergence is ----------------------------------------------------------------------

#: The named ways a native scale trace differs from the core's, tried by :func:`trace_cause`.
TRACE_VARIANTS = {
    "delayed": ("one more step of lag", "non-finite amaxes recorded", "inverse scale"),
    "current": ("no non-finite rule",),
}


def _te_next(
    recipe: F.Float8Recipe, fmt: str, window: np.float32, stored: np.float32, inverse: bool
) -> np.float32:
    """The next stored scale from a window's amax: the core's rule, or Keras's/Flax's ``compute_float8_scale``
    (float32 ``fp8_max / amax``, the inverse stored, a zero or non-finite amax keeps the scale)."""
    if not inverse:
        return np.float32(F.compute_scale(recipe, float(window), fmt, float(stored)))
    one = np.float32(1.0)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        previous = one / stored
        sf = np.float32(FP8_MAX[fmt]) / window / np.float32(2.0**recipe.margin)
        if not (np.isfinite(window) and window > 0):
            sf = previous
        return one / sf


def simulate_trace(params: dict, variants: tuple[str, ...] = ()) -> list[int]:
    """The scale trace (float32 bits) of ``params`` under the core's rules changed by ``variants``
    (names of :data:`TRACE_VARIANTS`)."""
    recipe = F.Float8Recipe.from_dict(params["recipe"])
    fmt = recipe.format_of(params["role"])
    amaxes = bits_to_f32(params["amaxes"])
    if not variants:
        return f32_to_bits(
            reference_trace(recipe, params["role"], [float(a) for a in amaxes], params["skipped"])
        )
    out: list[float] = []
    if recipe.scaling == "current":
        scale = 1.0
        for amax, skip in zip(amaxes, params["skipped"], strict=True):
            a = float(amax)
            with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
                new = (
                    float(np.float32(FP8_MAX[fmt] / max(a, F.CURRENT_AMAX_FLOOR)))
                    if not math.isnan(a)
                    else math.nan
                )
            if not skip:
                scale = new
            out.append(scale)
        return f32_to_bits(out)
    lag = "one more step of lag" in variants
    record_all = "non-finite amaxes recorded" in variants
    inverse = "inverse scale" in variants
    history: list[np.float32] = [np.float32(0.0)] * recipe.amax_history_len
    stored = np.float32(1.0)
    for amax, skip in zip(amaxes, params["skipped"], strict=True):
        new_history = [amax, *history[:-1]] if (record_all or np.isfinite(amax)) else history
        source = history if lag else new_history
        window = source[0] if recipe.amax_compute == "most_recent" else np.max(np.asarray(source, np.float32))
        new = _te_next(recipe, fmt, np.float32(window), stored, inverse)
        if not skip:
            history, stored = new_history, new
        with np.errstate(divide="ignore"):
            out.append(float(np.float32(1.0) / stored) if inverse else float(stored))
    return f32_to_bits(out)


def trace_cause(params: dict, observed: list[int]) -> list[str] | None:
    """The fewest :data:`TRACE_VARIANTS` that reproduce ``observed`` bit for bit (``[]``: the core's
    trace), else None."""
    names = TRACE_VARIANTS[F.Float8Recipe.from_dict(params["recipe"]).scaling]
    for n in range(len(names) + 1):
        for combo in itertools.combinations(names, n):
            if simulate_trace(params, combo) == observed:
                return list(combo)
    return None


def quantize_cause(params: dict, expected: str, observed: str) -> list[str]:
    """Why quantized bytes differ: ``NaN on overflow``, ``subnormals lost``, ``rounded in bfloat16`` or
    ``divides by the inverse scale`` (a byte one step off)."""
    x = quantize_inputs(params["kind"], params["seed"], params["n"], params["dtype"])
    pairs = [
        (expected[i : i + 2], observed[i : i + 2], x[i // 2])
        for i in range(0, min(len(expected), len(observed)), 2)
    ]
    causes = set()
    for want, got, value in pairs:
        if want == got:
            continue
        if got == "nn":
            causes.add("NaN on overflow")
        elif 0 < abs(value) < np.finfo(np.float32).tiny:
            causes.add("subnormals lost")
        elif params["dtype"] == "bfloat16":
            causes.add("rounded in bfloat16")
        else:
            causes.add("divides by the inverse scale")
    return sorted(causes)


def matmul_cause(observed: dict) -> str:
    """Why an FP8 GEMM is outside its bound: ``saturates`` (NaN expected, finite observed) or ``bound``."""
    if observed.get("nan_expected", 0) > observed.get("nan_observed", 0):
        return "saturates"
    return "bound"


__all__ = [
    "FP8_EFFECTS",
    "FP8_SEVERITY",
    "fp8_cases",
    "fp8_topic",
    "matmul_cause",
    "quantize_cause",
    "simulate_trace",
    "trace_cause",
]


#: What each named divergence means for training (the explanation of an ``fp8-*`` finding).
FP8_EFFECTS = {
    "NaN on overflow": "An out-of-range value becomes NaN instead of ±fp8_max: one large activation poisons "
    "the tensor.",
    "subnormals lost": "float32 subnormal inputs are flushed to zero (XLA:CPU, TensorFlow's CPU kernels) or lose "
    "their low bits before the scale is applied, so tiny values a large scale brings into FP8's range "
    "quantize to other bytes (0 when flushed).",
    "rounded in bfloat16": "It quantizes in the compute dtype (bfloat16 under mixed_bfloat16): x / scale is "
    "rounded to bfloat16 before the FP8 cast, so some values land one FP8 step off the float32 recipe's.",
    "divides by the inverse scale": "It stores the inverse scale and divides by it: x / (1/s) is not x * s in "
    "float32, so some values land one FP8 step off Transformer Engine's convention.",
    "one more step of lag": "Step t quantizes with a scale computed from the amaxes of steps <= t-2 (the scale "
    "is written by the optimizer one step after its amax was recorded), one step more than Transformer "
    "Engine's and mpx's: after a spike the next step still quantizes with the old, too large scale and "
    "saturates.",
    "non-finite amaxes recorded": "An inf or NaN amax is recorded in the history, and while it is in the window "
    "the max is non-finite, so the scale is frozen for the whole window (here 16 steps; 1024 by default) "
    "whatever the real amaxes do; mpx records no non-finite amax.",
    "inverse scale": "The scale is computed in float32 and kept as its inverse (1/s rounded, then 1/(1/s)), so "
    "scales differ from the float64-then-float32 recipe in the last bits, and a scale past float32's range "
    "becomes inf (no ceiling) instead of float32's largest value.",
    "no non-finite rule": "A non-finite amax gives scale 0 (inf) or NaN (NaN) instead of 1.0: the tensor "
    "quantizes to NaN or zeros with an infinite inverse, so the GEMM is NaN; there is no keep-previous rule.",
    "saturates": "An inf operand is clipped to ±fp8_max (saturating) instead of making the GEMM NaN, so an "
    "overflow upstream (an inf activation, an overflowed scaled gradient) reaches the loss as a finite, "
    "wrong value and the loss scaler applies the step.",
    "bound": "The GEMM's result is farther from the reference than float32 rounding of the sums explains.",
}
#: (kind, severity) of each named divergence; a finding takes its most severe cause's.
FP8_SEVERITY = {
    "NaN on overflow": ("precision hazard", "high"),
    "subnormals lost": ("precision hazard", "low"),
    "rounded in bfloat16": ("precision hazard", "medium"),
    "divides by the inverse scale": ("default differs", "low"),
    "one more step of lag": ("scaler semantics", "medium"),
    "non-finite amaxes recorded": ("scaler semantics", "high"),
    "inverse scale": ("default differs", "low"),
    "no non-finite rule": ("scaler semantics", "high"),
    "saturates": ("precision hazard", "high"),
    "bound": ("precision hazard", "medium"),
}
_SEVERITY_ORDER = ("high", "medium", "low")


def fp8_topic(case_id: str, params: dict, expected: dict, observed: dict) -> tuple[str, str, str]:
    """(kind, severity, topic) of a native divergence of the ``fp8`` group (conformance/findings.py);
    the topic is ``fp8-<kind>:<cause>+<cause>`` (``unexplained`` when no named cause reproduces it)."""
    part = case_id.split(".")[1]
    causes: list[str] | None
    if part == "quantize":
        causes = quantize_cause(params, expected["bytes"], observed.get("bytes", ""))
    elif part == "trace":
        causes = trace_cause(params, observed.get("scales", []))
    else:
        causes = [matmul_cause(observed)]
    if not causes:
        return "default differs", "medium", f"fp8-{part}:unexplained"
    worst = min((FP8_SEVERITY[c] for c in causes), key=lambda ks: _SEVERITY_ORDER.index(ks[1]))
    return worst[0], worst[1], f"fp8-{part}:" + "+".join(causes)
