"""The conformance cases, as data.  Expectations come from the mpx core only.

Each case is a dict ``{"id", "group", "kind", "params", "expected", "spec"}``:
``params`` tell an adapter what to run, ``expected`` is what the mpx spec says
it must observe, ``spec`` says it in words for the report.
"""

from __future__ import annotations

import random
from typing import Any

import mpx

Case = dict[str, Any]
GROUPS = ("policy", "ops", "scaler", "skip", "numerics", "portability")

POLICY_SPECS = (
    *mpx.PRESETS,
    *mpx.PRESET_ALIASES,
    "params=float32,compute=float16,output=float32",
    "p=f32,c=bf16",
)
OP_POLICIES = ("mixed_float16", "mixed_bfloat16")
#: a mixed policy that keeps no category in float32: softmax, norms and losses follow the compute dtype
KEEP_NONE_SPEC = "params=float32,compute=bfloat16,output=float32,keep_fp32=none"
#: how far a FLOAT32 op of half inputs may be from the same op on their float32 upcast (relative, in
#: norm): float32 rounding only; a computation in bfloat16 or float16 is off by ~1e-3
OP_VALUE_TOL = 1e-5
NUMERIC_POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
T, F = True, False


def _case(group: str, id_: str, kind: str, params: dict, expected: Any, spec: str) -> Case:
    return {
        "id": f"{group}.{id_}",
        "group": group,
        "kind": kind,
        "params": params,
        "expected": expected,
        "spec": spec,
    }


def policy_cases() -> list[Case]:
    out = []
    for spec in POLICY_SPECS:
        p = mpx.get_policy(spec)
        expected = {"params": p.param_dtype, "compute": p.compute_dtype, "output": p.output_dtype}
        out.append(
            _case(
                "policy", spec, "policy", {"spec": spec}, expected,
                f"a one-layer model under {spec!r}: parameters {p.param_dtype}, "
                f"the layer computes in {p.compute_dtype}, the model returns {p.output_dtype}",
            )
        )  # fmt: skip
    return out


def op_cases() -> list[Case]:
    out = []
    for op in mpx.OP_TABLE:
        for spec in OP_POLICIES:
            compute = mpx.get_policy(spec).compute_dtype
            for dtype in ("float32", compute):
                expected = mpx.result_dtype(op, spec, [dtype])
                cls = mpx.classify(op, spec).value
                out.append(
                    _case(
                        "ops", f"{op}.{spec}.{dtype}", "op",
                        {"op": op, "policy": spec, "dtype": dtype}, {"dtype": expected},
                        f"{op} ({cls}) on {dtype} inputs under {spec} returns {expected}",
                    )
                )  # fmt: skip
    for spec in OP_POLICIES:
        compute = mpx.get_policy(spec).compute_dtype
        for op in ("add", "mul", "cat"):
            expected = mpx.result_dtype(op, spec, [compute, "float32"])
            out.append(
                _case(
                    "ops", f"{op}.{spec}.{compute}+float32", "op",
                    {"op": op, "policy": spec, "dtype": compute, "other": "float32"}, {"dtype": expected},
                    f"{op} of {compute} and float32 under {spec} promotes to {expected}",
                )
            )  # fmt: skip
    for op in mpx.OP_CATEGORIES:
        for dtype in ("float32", "bfloat16"):
            expected = mpx.result_dtype(op, KEEP_NONE_SPEC, [dtype])
            out.append(
                _case(
                    "ops", f"{op}.keep_fp32=none.{dtype}", "op",
                    {"op": op, "policy": KEEP_NONE_SPEC, "dtype": dtype}, {"dtype": expected},
                    f"{op} ({mpx.OP_CATEGORIES[op]} category) on {dtype} inputs under {KEEP_NONE_SPEC} "
                    f"returns {expected}: keep_fp32=none lowers the category",
                )
            )  # fmt: skip
    return out


def _trace(config: mpx.ScalerConfig, flags: list[bool]) -> list[float]:
    scaler = mpx.LossScaler(config)
    out = []
    for finite in flags:
        scaler.update(finite)
        out.append(scaler.scale)
    return out


#: (id, config fields, flags, words)
SCALER_TRACES: list[tuple[str, dict, list[bool], str]] = [
    ("defaults", {}, [T, F, T, T, F], "each scaler with no arguments: starts at 2**16, halves on each overflow"),
    ("growth_on_nth_step", {"init_scale": 256.0, "growth_interval": 3}, [T, T, T, T, T, T, T],
     "grows on the 3rd consecutive finite step (not the 4th)"),
    ("backoff_resets_growth", {"init_scale": 256.0, "growth_interval": 2}, [T, F, T, T, T, F, F, T, T],
     "a non-finite step halves the scale and restarts the growth count"),
    ("floor", {"init_scale": 4.0}, [F, F, F, F], "never below min_scale=1"),
    ("floor_below_one", {"init_scale": 1.0, "min_scale": 0.25}, [F, F, F, F], "min_scale below 1 is honoured"),
    ("ceiling", {"init_scale": 2.0**22, "growth_interval": 1}, [T, T, T, T], "never above max_scale=2**24"),
    ("hysteresis_2", {"init_scale": 1024.0, "hysteresis": 2, "growth_interval": 100}, [F, F, F, T, F, T, F, F],
     "backs off only from the 2nd consecutive non-finite step"),
    ("growth_factor_1_5", {"init_scale": 1.0 + 2.0**-23, "growth_factor": 1.5, "growth_interval": 1,
                           "max_scale": None}, [T, T, T, T, T, T],
     "factors act in float32, products rounded to float32"),
    ("backoff_0_3", {"init_scale": 3.0, "backoff_factor": 0.3, "min_scale": None}, [F, F, F],
     "backoff by a factor that is not a float32 number"),
    ("static", {"kind": "static", "init_scale": 128.0}, [T, F, T, T], "a static scale never changes"),
    ("random_long", {"init_scale": 2.0**10, "growth_interval": 4, "hysteresis": 1},
     [random.Random(7).random() > 0.2 for _ in range(60)], "60 steps, 20% non-finite, interval 4"),
]  # fmt: skip


def scaler_cases() -> list[Case]:
    out = []
    for id_, fields, flags, words in SCALER_TRACES:
        config = mpx.ScalerConfig(**fields)
        out.append(
            _case(
                "scaler", id_, "scaler_trace",
                {"config": config.to_dict(), "flags": flags, "native_defaults": id_ == "defaults"},
                {"scales": _trace(config, flags), "skipped": sum(1 for f in flags if not f) if config.skip_nonfinite else 0},
                words,
            )
        )  # fmt: skip
    return out


#: Stuck detection (issue 18): (id, steps, expected).  A step is "ok" (finite), "grad" (a finite loss whose
#: gradients are inf at every scale: sqrt(w - w)) or "loss" (an inf loss).  With max_consecutive_skips=3 the
#: scaler raises mpx.ScalerStuckError at the 3rd skip in a row, not before, saying why.
STUCK_CONFIG = {"init_scale": 4.0, "min_scale": 1.0, "max_consecutive_skips": 3}
STUCK_CASES: list[tuple[str, list[str], dict, str]] = [
    ("gradients_at_min_scale", ["grad", "ok", "grad", "grad", "grad", "grad"], {"raised_at": 5, "cause": "min_scale"},
     "finite loss, inf gradients: raises at the 3rd skip in a row (a finite step resets the count), "
     "saying the gradients overflow at the minimum scale"),
    ("nonfinite_loss", ["grad", "grad", "loss", "loss"], {"raised_at": 3, "cause": "loss"},
     "raises at the 3rd skip in a row, saying the forward loss itself is non-finite"),
]  # fmt: skip


def stuck_cause(message: str) -> str:
    """The cause a stuck message names: ``loss``, ``min_scale`` or ``other``."""
    if "forward loss itself is non-finite" in message:
        return "loss"
    return "min_scale" if "overflow at the minimum scale" in message else "other"


def stuck_cases() -> list[Case]:
    return [
        _case("scaler", f"stuck.{id_}", "stuck", {"config": mpx.ScalerConfig(**STUCK_CONFIG).to_dict(), "steps": steps},
              expected, words)
        for id_, steps, expected, words in STUCK_CASES
    ]  # fmt: skip


SKIP_OPTIMIZERS = ("adam", "sgd_momentum")


def skip_cases() -> list[Case]:
    out = []
    for opt in SKIP_OPTIMIZERS:
        for bad in ("inf", "nan"):
            out.append(
                _case(
                    "skip", f"{opt}.{bad}", "skip",
                    {"optimizer": opt, "bad": bad, "steps": ["ok", bad, "ok"]},
                    {"changed": [True, False, True], "scale_halved": True},
                    f"{opt}: a step with {bad} gradients leaves parameters and optimizer state bit-identical; "
                    "finite steps change them",
                )
            )  # fmt: skip
    return out


def numeric_cases() -> list[Case]:
    out = []
    for spec in NUMERIC_POLICIES:
        compute = mpx.get_policy(spec).compute_dtype
        eps = mpx.dtype_info(compute).eps
        tol = 8 * eps if compute != "float32" else 1e-5
        out.append(
            _case(
                "numerics", f"mlp.{spec}", "numerics",
                {"policy": spec, "seed": 0, "tolerance": tol},
                {"max_rel_error_at_most": tol},
                f"one forward/backward of an 8-32-4 MLP under {spec}: loss and gradients within "
                f"{tol:.2g} (8 eps of {compute}) of float64 numpy",
            )
        )  # fmt: skip
    for spec in OP_POLICIES:
        compute = mpx.get_policy(spec).compute_dtype
        for op in mpx.OP_TABLE:
            if mpx.classify(op, spec) is not mpx.OpClass.FLOAT32:
                continue
            out.append(
                _case(
                    "numerics", f"{op}.{spec}", "op_value",
                    {"op": op, "policy": spec, "dtype": compute},
                    {"max_rel_error_at_most": OP_VALUE_TOL},
                    f"{op} of {compute} inputs under {spec} is computed in float32: within {OP_VALUE_TOL:g} "
                    f"of {op} of their float32 upcast (computing in {compute} is off by ~{mpx.dtype_info(compute).eps:.1g})",
                )
            )  # fmt: skip
    return out


PORTABILITY_CONFIG = {"init_scale": 2.0**12, "growth_interval": 3, "min_scale": 0.5, "hysteresis": 2}
PORTABILITY_PREFIX = [T, F, F, T, T]
PORTABILITY_REST = [T, F, T, T, T, F, F, T]
SOURCES = ("core", "torch", "tf", "jax")


def portability_cases() -> list[Case]:
    config = mpx.ScalerConfig(**PORTABILITY_CONFIG)
    full = _trace(config, PORTABILITY_PREFIX + PORTABILITY_REST)
    out = [
        _case(
            "portability", "saves_neutral_format", "portability_save",
            {"config": config.to_dict(), "flags": PORTABILITY_PREFIX}, {"state_dict": saved_prefix_state()},
            f"after {len(PORTABILITY_PREFIX)} steps the scaler saves the same mpx.scaler/1 dict as the core",
        )
    ]  # fmt: skip
    for source in SOURCES:
        out.append(
            _case(
                "portability", f"resume_from_{source}", "portability",
                {"source": source, "config": config.to_dict(), "flags": PORTABILITY_REST},
                {"scales": full[len(PORTABILITY_PREFIX):]},
                f"a scaler state saved by {source} after {len(PORTABILITY_PREFIX)} steps resumes with the same trace",
            )
        )  # fmt: skip
    return out


def all_cases() -> list[Case]:
    return (policy_cases() + op_cases() + scaler_cases() + stuck_cases() + skip_cases() + numeric_cases()
            + portability_cases())  # fmt: skip


def saved_prefix_state() -> dict:
    """The state dict the core saves after the portability prefix (what every backend must save too)."""
    scaler = mpx.LossScaler(mpx.ScalerConfig(**PORTABILITY_CONFIG))
    for finite in PORTABILITY_PREFIX:
        scaler.update(finite)
    return scaler.state_dict()
