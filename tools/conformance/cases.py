"""The conformance cases, as data.  Expectations come from the mpx core only.

Each case is a dict ``{"id", "group", "kind", "params", "expected", "spec"}``:
``params`` tell an adapter what to run, ``expected`` is what the mpx spec says
it must observe, ``spec`` says it in words for the report.

The runner resolves the cases here (this module imports mpx) and writes them as JSON
(:func:`write`); the native worker reads that file in a process where mpx cannot be imported
(conformance/isolation.py).  So ``params`` are plain JSON data and carry, precomputed, whatever a
native run needs of the core: a policy's dtypes (``policy_dtypes``, :func:`policy_dtypes`), a scaler
config as ``mpx.ScalerConfig.to_dict()`` (``config``), the core's saved state (``state_dict`` of
``portability.resume_from_core``), the ops the table keeps in float32 (``float32_ops``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import mpx

Case = dict[str, Any]
GROUPS = (
    "policy",
    "ops",
    "scaler",
    "skip",
    "numerics",
    "portability",
    "distributed",
    "accumulation",
    "models",
    "fp8",
    "blocks",
    "deepspeed",
)

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


def policy_dtypes(spec: str) -> dict[str, Any]:
    """What a native adapter needs of policy ``spec``, precomputed: ``param_dtype``, ``compute_dtype``,
    ``output_dtype`` (canonical names) and ``lowers_precision`` (the compute dtype is half)."""
    p = mpx.get_policy(spec)
    return {"param_dtype": p.param_dtype, "compute_dtype": p.compute_dtype, "output_dtype": p.output_dtype,
            "lowers_precision": p.lowers_precision}  # fmt: skip


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
                "policy", spec, "policy", {"spec": spec, "policy_dtypes": policy_dtypes(spec)}, expected,
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
                        {"op": op, "policy": spec, "dtype": dtype, "policy_dtypes": policy_dtypes(spec)},
                        {"dtype": expected},
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
                    {"op": op, "policy": spec, "dtype": compute, "other": "float32",
                     "policy_dtypes": policy_dtypes(spec)}, {"dtype": expected},
                    f"{op} of {compute} and float32 under {spec} promotes to {expected}",
                )
            )  # fmt: skip
    for op in mpx.OP_CATEGORIES:
        for dtype in ("float32", "bfloat16"):
            expected = mpx.result_dtype(op, KEEP_NONE_SPEC, [dtype])
            out.append(
                _case(
                    "ops", f"{op}.keep_fp32=none.{dtype}", "op",
                    {"op": op, "policy": KEEP_NONE_SPEC, "dtype": dtype,
                     "policy_dtypes": policy_dtypes(KEEP_NONE_SPEC)}, {"dtype": expected},
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
        out.append(scaler.get_scale())
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
                    {"optimizer": opt, "bad": bad, "steps": ["ok", bad, "ok"],
                     "config": mpx.ScalerConfig().to_dict()},
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
                {"policy": spec, "seed": 0, "tolerance": tol, "policy_dtypes": policy_dtypes(spec)},
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
                    {"op": op, "policy": spec, "dtype": compute, "policy_dtypes": policy_dtypes(spec)},
                    {"max_rel_error_at_most": OP_VALUE_TOL},
                    f"{op} of {compute} inputs under {spec} is computed in float32: within {OP_VALUE_TOL:g} "
                    f"of {op} of their float32 upcast (computing in {compute} is off by ~{mpx.dtype_info(compute).eps:.1g})",
                )
            )  # fmt: skip
    return out


PORTABILITY_CONFIG = {"init_scale": 2.0**12, "growth_interval": 3, "min_scale": 0.5, "hysteresis": 2}
PORTABILITY_PREFIX = [T, F, F, T, T]
PORTABILITY_REST = [T, F, T, T, T, F, F, T]
SOURCES = ("core", "torch", "tf", "jax", "keras-jax", "keras-torch")  # the core and every backend that saves


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
        params = {"source": source, "config": config.to_dict(), "flags": PORTABILITY_REST}
        if source == "core":  # the core's state, precomputed; the backends' are saved by their workers
            params["state_dict"] = saved_prefix_state()
        out.append(
            _case(
                "portability", f"resume_from_{source}", "portability", params,
                {"scales": full[len(PORTABILITY_PREFIX):]},
                f"a scaler state saved by {source} after {len(PORTABILITY_PREFIX)} steps resumes with the same trace",
            )
        )  # fmt: skip
    return out


def all_cases() -> list[Case]:
    return (policy_cases() + op_cases() + scaler_cases() + stuck_cases() + skip_cases() + numeric_cases()
            + portability_cases() + distributed_cases() + accumulation_cases() + model_cases() + fp8_cases() + blocks_cases() + deepspeed_cases())  # fmt: skip


def fp8_cases() -> list[Case]:
    """The ``fp8`` group (issue 26): quantized bytes, scale traces, FP8 GEMMs (conformance/fp8/cases.py)."""
    from conformance.fp8.cases import fp8_cases as cases

    return cases()


def blocks_cases() -> list[Case]:
    """The ``blocks`` group (issue 31): block-scaled quantized bytes and scales (conformance/blocks/cases.py)."""
    from conformance.blocks.cases import blocks_cases as cases

    return cases()


def deepspeed_cases() -> list[Case]:
    """The ``deepspeed`` group (issue 32): DeepSpeed's own loss scalers (conformance/deepspeed/cases.py)."""
    from conformance.deepspeed.cases import deepspeed_cases as cases

    return cases()


def saved_prefix_state() -> dict:
    """The state dict the core saves after the portability prefix (what every backend must save too)."""
    scaler = mpx.LossScaler(mpx.ScalerConfig(**PORTABILITY_CONFIG))
    for finite in PORTABILITY_PREFIX:
        scaler.update(finite)
    return scaler.state_dict()


# -- replicas and accumulation (issue 16) ---------------------------------------------------------

#: Replicas: the scaler config and the global flag sequence; a False step puts an inf on the last
#: replica only.  Growth every 2nd finite step, so a replica that misses an overflow grows ahead.
DISTRIBUTED_CONFIG = {"init_scale": 2.0**10, "growth_interval": 2}
DISTRIBUTED_FLAGS = [T, F, T, T, F]
#: (id, where the inf enters on the last replica, words)
DISTRIBUTED_SCENARIOS: list[tuple[str, str, str]] = [
    ("inf_in_loss_one_replica", "loss",
     "an inf in the last replica's loss (before the gradient reduction)"),
    ("inf_in_grads_after_reduce", "grads_after_reduce",
     "an inf entering the last replica's gradients after the reduction (a hook, a custom reduction, a clipping bug)"),
]  # fmt: skip
#: engine kind -> what each backend runs for it (a backend without one skips and says why)
DISTRIBUTED_ENGINES = {
    "per_replica": "each replica runs its own step and reduces gradients (torch DDP on 2 gloo processes, "
    "tf MirroredStrategy on 2 logical CPUs, JAX shard_map over 4 host devices with a pmean, Keras on JAX "
    "keras.distribution.DataParallel over 4 host devices)",
    "sharded": "one program over sharded state (torch FSDP2 fully_shard on 2 gloo processes, JAX jit with "
    "NamedSharding over 4 host devices, Keras on JAX keras.distribution.ModelParallel with sharded kernels)",
}


def distributed_cases() -> list[Case]:
    config = mpx.ScalerConfig(**DISTRIBUTED_CONFIG)
    flags = list(DISTRIBUTED_FLAGS)
    expected = {"consistent": True, "scales": _trace(config, flags), "applied": flags}
    out = []
    for id_, where, words in DISTRIBUTED_SCENARIOS:
        for engine, engines in DISTRIBUTED_ENGINES.items():
            out.append(
                _case(
                    "distributed", f"{id_}.{engine}", "distributed",
                    {"scenario": where, "engine": engine, "config": config.to_dict(), "flags": flags},
                    expected,
                    f"{words} at steps {[i for i, f in enumerate(flags) if not f]} of {len(flags)}, {engines}: "
                    "every replica skips and backs off together (parameters bit-identical across replicas, "
                    "every shard updated or none, one scale trace: the core's for the global flags)",
                )
            )  # fmt: skip
    recipe = mpx.Float8Recipe(amax_history_len=4)
    out.append(_case(
        "distributed", "fp8_amax_one_shard.sharded", "distributed",
        {"scenario": "fp8_amax", "engine": "sharded", "recipe": recipe.to_dict(), "flags": [T] * 4},
        {"consistent": True, "global_amax": True},
        "a Dense layer with delayed-scaling FP8 (history 4) trained 4 steps with its batch sharded over the "
        "devices, each step's largest |x| on one device's rows only (JAX jit with NamedSharding over 4 host "
        "devices, Keras on JAX keras.distribution.ModelParallel): every device holds the same FP8 scales "
        "and histories (replicated) and the input amax recorded is the MAX over the whole batch; under mpx the "
        "scales and histories are also mpx.float8.float8_update's chain over the global amaxes, bit for bit "
        "(keras-jax: the gradient's amax as recorded, the input's and weight's from the whole arrays)",
    ))  # fmt: skip
    return out


#: Accumulation: the scaler config, the learning rate (SGD) and the micro-batch flag sequences.  Micro-batch
#: j's loss is c_j * sum(w) with c_j = j % 4 + 1, so every window mean and update is exact in float32.
ACCUMULATION_CONFIG = {"init_scale": 2.0**10, "growth_interval": 2}
ACCUMULATION_LR = 0.5
ACCUMULATION_W0 = 8.0
#: (id, k, micro-batch flags, words)
ACCUMULATION_SEQUENCES: list[tuple[str, int, list[bool], str]] = [
    ("k2.growth", 2, [T] * 10, "every micro-batch finite: the scale grows every 2nd window, not every 2nd micro-batch"),
    ("k2.bad_first", 2, [F, T, T, T, T, T, T, T], "a non-finite first micro-batch skips its whole window"),
    ("k2.bad_last", 2, [T, F, T, T, T, T, T, T], "a non-finite last micro-batch skips its whole window"),
    ("k2.consecutive_bad_windows", 2, [T, F, F, T, T, T, T, T, T, T],
     "two windows in a row with a non-finite micro-batch: two skips, two backoffs"),
    ("k4.growth", 4, [T] * 16, "every micro-batch finite, 4 per window"),
    ("k4.bad_first", 4, [F, T, T, T, T, T, T, T, T, T, T, T], "a non-finite first micro-batch of 4 skips the window"),
    ("k4.bad_last", 4, [T, T, T, F, T, T, T, T, T, T, T, T], "a non-finite last micro-batch of 4 skips the window"),
    ("k4.consecutive_bad_windows", 4, [T, F, T, T, T, T, F, F, T, T, T, T, T, T, T, T],
     "consecutive windows with non-finite micro-batches (one of them holding two)"),
]  # fmt: skip


def accumulation_expected(config: mpx.ScalerConfig, flags: list[bool], steps: int) -> dict:
    """What every backend must observe per optimizer step, from :func:`mpx.accumulation_trace`.

    ``applied`` and ``scales`` (after each window's one transition) per window; ``micro_scales``: the scale
    each micro-batch's loss is multiplied by (the scale before its window's transition); ``param``: the
    final value of every parameter entry, ``w0 - lr * mean(c_j over the window)`` for every applied window.
    """
    trace = mpx.accumulation_trace(config, flags, steps)
    scales = [t["scale"] for t in trace]
    before = [config.init_scale if config.kind != "none" else 1.0, *scales[:-1]]
    w = ACCUMULATION_W0
    for i, t in enumerate(trace):
        if t["applied"]:
            w -= ACCUMULATION_LR * sum(j % 4 + 1 for j in range(i * steps, (i + 1) * steps)) / steps
    return {
        "applied": [t["applied"] for t in trace],
        "scales": scales,
        "micro_scales": [before[j // steps] for j in range(len(flags))],
        "param": w,
    }


def accumulation_cases() -> list[Case]:
    config = mpx.ScalerConfig(**ACCUMULATION_CONFIG)
    return [
        _case(
            "accumulation", id_, "accumulation",
            {"config": config.to_dict(), "flags": flags, "steps": k, "lr": ACCUMULATION_LR, "w0": ACCUMULATION_W0},
            accumulation_expected(config, flags, k),
            f"gradient accumulation over {k} micro-batches per optimizer step: {words}; the scaler moves once "
            "per optimizer step, the loss scale is constant inside a window, a window with a non-finite "
            "micro-batch is skipped whole (its finite micro-batches too)",
        )
        for id_, k, flags, words in ACCUMULATION_SEQUENCES
    ]  # fmt: skip


# -- real models (issue 23) ------------------------------------------------------------------------------
#: The models group's words per model: what each is, as the report names it (the columns that run it and
#: with what code: mpx_tools.models.COLUMNS).
MODEL_NAMES = {
    "gpt2": "GPT-2",
    "llama": "Llama",
    "bert": "BERT",
    "t5": "T5",
    "vit": "ViT",
    "nnx_gpt": "a small GPT in Flax NNX (scan over remat-ed layers)",
    "resnet": "a ResNet in Flax linen (BatchNorm batch statistics)",
    "keras_gpt2": "keras-hub's GPT-2 on Keras's JAX backend, as a JAX function (model.stateless_call)",
}


def _model_words(model: str) -> str:
    from mpx_tools.models import COLUMNS

    runs: dict[str, list[str]] = {}
    for column, what in COLUMNS[model].items():
        runs.setdefault(what, []).append(column)
    columns = "; ".join(", ".join(cs) + f": {what}" for what, cs in runs.items())
    return f"{MODEL_NAMES[model]} ({columns})"


def model_cases() -> list[Case]:
    """Per model of :data:`mpx_tools.models.MODELS` (tiny configs, random weights), one case per aspect."""
    from mpx_tools import models as M

    config = mpx.ScalerConfig(**M.OVERFLOW_CONFIG)
    flags = list(M.OVERFLOW_FLAGS)
    bad = [i for i, f in enumerate(flags) if not f]
    aspects = {
        "ops": ({"violations": []},
                f"no op the table keeps in float32 (softmax, norms, losses, pow, exp, sum...) computes in half "
                f"precision under {M.POLICY}; the dtype every op computed in is listed"),
        "compile": ({"fullgraph": True, "graphs": 1, "breaks": 0},
                    "the forward compiles to one graph over two calls, no break: torch.compile(fullgraph=True) "
                    "(graphs and breaks counted), one trace of jax.jit or tf.function"),
        "overflow": ({"scales": _trace(config, flags), "skipped": bad, "unchanged_on_skip": True,
                      "losses_finite": True},
                     f"{len(flags)} AdamW steps under {M.OVERFLOW_POLICY} with an inf in the loss at step "
                     f"{bad[0]}: that step is skipped (parameters and optimizer state bit-identical), the scale "
                     "follows the core's trace"),
        "logits": ({"within_tolerance": True},
                   f"max |logits - float32 logits| under {M.POLICY} within {M.LOGITS_TOL:g} of max |logits| "
                   "(a keras-hub backbone's sequence output)"),
        "activations": ({"within_ratio": True},
                        f"the bytes kept for backward (torch: saved-tensor hooks; jax: the residuals of jax.vjp) "
                        f"at most {M.ACTIVATION_RATIO:g} x native autocast's on torch (the same ops in float32); "
                        "at most float32's where native mixed precision computes softmax and norm outputs in "
                        "half (Keras, Flax: mpx keeps them float32), the ratio to native reported"),
    }  # fmt: skip
    float32_ops = sorted(op for op in mpx.OP_TABLE if mpx.classify(op, M.POLICY) is mpx.OpClass.FLOAT32)
    extra = {  # what a native run needs of the core, per aspect
        "ops": {"policy": M.POLICY, "policy_dtypes": policy_dtypes(M.POLICY), "float32_ops": float32_ops},
        "compile": {"policy": M.POLICY, "policy_dtypes": policy_dtypes(M.POLICY)},
        "overflow": {"policy": M.OVERFLOW_POLICY, "policy_dtypes": policy_dtypes(M.OVERFLOW_POLICY),
                     "config": config.to_dict(), "flags": flags},
        "logits": {"policy": M.POLICY, "policy_dtypes": policy_dtypes(M.POLICY)},
        "activations": {"policy": M.POLICY, "policy_dtypes": policy_dtypes(M.POLICY)},
    }  # fmt: skip
    out = []
    for model in M.MODELS:
        for aspect in M.ASPECTS:
            expected, words = aspects[aspect]
            out.append(
                _case("models", f"{model}.{aspect}", "models", {"model": model, "aspect": aspect, **extra[aspect]},
                      expected, f"{_model_words(model)} from a tiny config: {words}")
            )  # fmt: skip
    return out


# -- the cases as a file (what the workers read) ------------------------------------------------------
#: The format of the cases file (:func:`write`; read by conformance.worker without importing this module).
CASES_FORMAT = "mpx.conformance-cases/1"


def write(cases: list[Case], path: Path) -> Path:
    """Write ``cases`` to ``path`` as JSON (what ``python -m conformance.worker --cases FILE`` reads)."""
    path = Path(path)
    path.write_text(json.dumps({"format": CASES_FORMAT, "cases": cases}))
    return path
