"""What each native divergence means: findings with a kind, a severity and one sentence on training.

A *divergence* is a result in native mode whose status is ``differs``: the framework's own
mixed-precision machinery does not do what the mpx spec says.  :func:`findings` groups every
divergence of a report into findings, each of one kind:

- ``precision hazard``: a FLOAT32 op (softmax, norms, losses, exp/log/pow, reductions) computed
  in half precision, a float32 operand rounded to half, or a numerics error above tolerance;
- ``scaler semantics``: the loss-scale trace differs (no floor, no ceiling, no hysteresis,
  a non-finite step applied instead of skipped, factors rounded differently);
- ``default differs``: a different default (initial scale, growth one step later, float32 where
  the policy asks for half, a model output in the compute dtype);
- ``API or format gap``: the framework cannot parse a policy name, raises, or cannot save or
  load the neutral ``mpx.scaler/1`` scaler state.

Every divergence belongs to exactly one finding (``cases`` lists them).  Severities: ``high``
(silently changes what is trained), ``medium`` (changes results or breaks a workflow you will
notice), ``low`` (costs speed or convenience, not accuracy).

>>> KINDS[0], SEVERITIES
('precision hazard', ('high', 'medium', 'low'))
"""

from __future__ import annotations

import importlib
import itertools
import json
from collections import defaultdict
from typing import Any

import mpx

__all__ = [
    "ACCUMULATION_NAME",
    "KINDS",
    "KIND_HELP",
    "NATIVE",
    "REPLICA_NAME",
    "SCALER_NAME",
    "SEVERITIES",
    "SEVERITY_HELP",
    "SUBJECTS",
    "TEXTS",
    "CONSEQUENCES",
    "findings",
    "summary",
    "trace_cause",
]

KINDS = ("precision hazard", "scaler semantics", "default differs", "API or format gap")
KIND_HELP = {
    "precision hazard": "an op mpx keeps in float32 is computed in half precision, or a result is off "
    "by more than the tolerance",
    "scaler semantics": "the loss-scale trace differs: bounds, hysteresis, skipping or rounding",
    "default differs": "a different default: initial scale, growth timing, float32 where half is "
    "asked, the output dtype",
    "API or format gap": "the framework cannot parse a name, raises, or cannot save or load a format",
}
SEVERITIES = ("high", "medium", "low")
SEVERITY_HELP = {
    "high": "silently changes what is trained",
    "medium": "changes results or breaks a workflow, visibly",
    "low": "costs speed, memory or convenience, not accuracy",
}
#: What "native" means for each backend: the machinery the native column runs.
NATIVE = {
    "torch": "torch.autocast (CPU) and torch.amp.GradScaler, with their defaults; DDP and FSDP2 (fully_shard "
    "with a MixedPrecisionPolicy) on gloo; accumulation as scale(loss).backward() k times, then step/update; "
    "FP8: torchao's emulated float8 training (dynamic tensorwise scaling); the deepspeed group: deepspeed's "
    "DynamicLossScaler and non-ZeRO FP16_Optimizer",
    "tf": "Keras 3 dtype policies (keras.mixed_precision) and keras.optimizers.LossScaleOptimizer, under "
    "MirroredStrategy for replicas and with the inner optimizer's gradient_accumulation_steps; "
    "FP8: Keras's quantize(\"float8\") Dense",
    "jax": "plain JAX with jmp-style casts (inputs and params cast to the compute dtype), optax, "
    "and Flax's DynamicScale; a jmp-style loss scale (no axis name) under shard_map and jit sharding, "
    "optax.MultiSteps for accumulation; FP8: Flax's Fp8DirectDotGeneralOp and fp8_ops.quantize",
    "keras-jax": "Keras 3 on JAX: dtype policies (keras.mixed_precision) and keras.optimizers.LossScaleOptimizer, "
    "its steps through the pure stateless_apply under jax.jit (what fit does), with the inner optimizer's "
    "gradient_accumulation_steps",
    "keras-torch": "Keras 3 on PyTorch: dtype policies (keras.mixed_precision) and "
    "keras.optimizers.LossScaleOptimizer, eager apply (what fit does), with the inner optimizer's "
    "gradient_accumulation_steps",
}
#: The native loss scaler of each backend.
SCALER_NAME = {
    "torch": "torch.amp.GradScaler",
    "tf": "Keras's LossScaleOptimizer",
    "jax": "Flax's DynamicScale",
    "keras-jax": "Keras's LossScaleOptimizer on JAX",
    "keras-torch": "Keras's LossScaleOptimizer on PyTorch",
}
#: What runs replicas natively (group ``distributed``) and accumulates (group ``accumulation``).
REPLICA_NAME = {
    "torch": "torch.amp.GradScaler under DDP",
    "tf": "Keras's LossScaleOptimizer under MirroredStrategy",
    "jax": "a jmp-style loss scale under shard_map (no axis_name)",
    "keras-jax": "Keras's LossScaleOptimizer under keras.distribution on JAX",
}
ACCUMULATION_NAME = {"torch": "torch.amp.GradScaler with accumulated backward passes",
                     "tf": "Keras's gradient_accumulation_steps under its LossScaleOptimizer",
                     "jax": "optax.MultiSteps with a per-micro-batch loss scale",
                     "keras-jax": "Keras's gradient_accumulation_steps under its LossScaleOptimizer on JAX",
                     "keras-torch": "Keras's gradient_accumulation_steps under its LossScaleOptimizer on PyTorch"}  # fmt: skip
_WIDTH = {"float64": 64, "float32": 32, "float16": 16, "bfloat16": 16}


def _width(dtype: Any) -> int | None:
    return _WIDTH.get(dtype) if isinstance(dtype, str) else None


def _raised(r: dict) -> str | None:
    obs = r.get("observed")
    return obs.get("raised") if isinstance(obs, dict) else None


def _n(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "s")


def _error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    named = [ln for ln in lines if "Error" in ln.split(":")[0] or "Exception" in ln.split(":")[0]]
    return (named or lines or [""])[-1]


def _op(case: str) -> str:
    return case.split(".")[1]


# -- scale traces ---------------------------------------------------------------------------------

#: (name, how to change the config, what the framework does instead) tried by :func:`trace_cause`.
_VARIANTS: tuple[tuple[str, Any, str], ...] = (
    ("growth one step later", lambda c: {"growth_interval": c["growth_interval"] + 1},
     "grows on the (growth_interval+1)-th finite step, one step later than torch, Keras and mpx"),
    ("initial scale halved", lambda c: {"init_scale": c["init_scale"] / 2}, "starts at half the scale"),
    ("no floor", lambda c: {"min_scale": None}, "has no min_scale: overflows keep halving the scale"),
    ("no ceiling", lambda c: {"max_scale": None}, "has no max_scale: the scale grows without bound"),
    ("no hysteresis", lambda c: {"hysteresis": 1}, "backs off on every non-finite step"),
)  # fmt: skip


def _simulate(config: dict, flags: list[bool]) -> list[float]:
    scaler = mpx.LossScaler(mpx.ScalerConfig.from_dict(config))
    out = []
    for finite in flags:
        scaler.update(finite)
        out.append(scaler.get_scale())
    return out


def trace_cause(config: dict, flags: list[bool], observed: list[float]) -> list[str] | None:
    """The fewest config changes (names of ``_VARIANTS``) that make the mpx scaler reproduce ``observed``.

    Returns ``[]`` when ``observed`` is the spec's trace, ``["rounding"]`` when the traces agree to 1e-6
    relative, and None when no combination of up to three changes explains the trace.
    """
    spec = _simulate(config, flags)
    if observed == spec:
        return []
    relevant = [v for v in _VARIANTS if _changes(v, config)]
    for n in range(1, 4):
        for combo in itertools.combinations(relevant, n):
            changed = dict(config)
            for _, change, _ in combo:
                changed.update(change(config))
            try:
                if _simulate(changed, flags) == observed:
                    return [name for name, _, _ in combo]
            except (mpx.MPXError, ValueError, TypeError):
                continue
    if len(spec) == len(observed) and all(
        abs(a - b) <= 1e-6 * abs(a) for a, b in zip(spec, observed, strict=False)
    ):
        return ["rounding"]
    return None


def _changes(variant: tuple[str, Any, str], config: dict) -> bool:
    return any(config.get(k) != v for k, v in variant[1](config).items())


# -- classification of one divergence -------------------------------------------------------------


def _classify(r: dict, params: dict) -> tuple[str, str, str]:
    """(kind, severity, topic) of one native divergence; the topic groups divergences into findings."""
    group, obs, exp = r["group"], r.get("observed"), r["expected"]
    if _raised(r) and group == "portability":
        return "API or format gap", "medium", "resume"
    if _raised(r):
        return "API or format gap", ("low" if group == "policy" else "medium"), f"raises:{group}"
    if group == "ops":
        e, o = _width(exp.get("dtype")), _width(obs.get("dtype") if isinstance(obs, dict) else None)
        if e and o and o < e:
            if (
                e == 32
                and mpx.classify(_op(r["case"]), params.get("policy", "mixed_float16")).value == "float32"
            ):
                return "precision hazard", "high", f"half:{obs['dtype']}"
            return "precision hazard", "medium", "promote"
        return "default differs", "low", "wider"
    if group == "numerics":
        if r["case"].startswith("numerics.mlp."):
            return "precision hazard", "high", "mlp"
        return "precision hazard", "high", f"half:{mpx.get_policy(params['policy']).compute_dtype}"
    if group == "policy":
        if isinstance(obs, dict) and all(_width(obs.get(k)) for k in ("params", "compute", "output")):
            if any(_width(obs[k]) < _width(exp[k]) for k in ("params", "compute")):
                return "precision hazard", "high", "policy-dtypes"
            if _width(obs["output"]) < _width(exp["output"]):
                return "default differs", "medium", "policy-output"
        return "default differs", "low", "policy-other"
    if group == "scaler" and isinstance(obs, dict) and isinstance(obs.get("scales"), list):
        cause = trace_cause(params["config"], params["flags"], obs["scales"])
        if cause == []:  # the same scales: what differs is the count of skipped steps
            return "scaler semantics", "medium", "trace:skip count"
        cause = cause or ["unexplained"]
        if cause == ["rounding"]:
            return "scaler semantics", "low", "trace:rounding"
        if set(cause) <= {"growth one step later", "initial scale halved"}:
            return "default differs", "low", "trace:" + "+".join(cause)
        return "scaler semantics", "medium", "trace:" + "+".join(cause)
    if group == "skip":
        return "scaler semantics", "high", "skip"
    if group == "distributed" and isinstance(obs, dict) and obs.get("no_engine"):  # nothing runs replicas
        return "API or format gap", "medium", "replicas:no engine"
    if group == "distributed" and isinstance(obs, dict) and "consistent" in obs:
        # replicas that disagree, or agree on applying a step that is non-finite on one of them
        return "scaler semantics", "high", "replicas:diverge" if not obs["consistent"] else "replicas:applied"
    if group == "accumulation" and isinstance(obs, dict) and "scales" in obs:
        return "scaler semantics", "medium", "accumulation"
    if group == "models" and isinstance(obs, dict):  # real models: what the aspect observed differs
        aspect = r["case"].rsplit(".", 1)[1]
        if aspect == "ops" and obs.get("violations"):  # keras-hub's in the jax column: Keras's policy
            return "precision hazard", "high", "models:keras-ops" if ".keras_" in r["case"] else "models:ops"
        if aspect == "overflow":
            return "scaler semantics", "high", "models:overflow"
        return "default differs", "low", "models"
    if group == "portability":
        if r["case"] == "portability.saves_neutral_format":
            return "API or format gap", "medium", "saves"
        return "API or format gap", "medium", "resume"
    if group in ("fp8", "blocks", "deepspeed") and isinstance(obs, dict):  # issues 26, 31, 32: each group's
        cases = importlib.import_module(f"conformance.{group}.cases")  # own GROUP_topic names its divergences
        return getattr(cases, f"{group}_topic")(r["case"], params, exp, obs)
    return "default differs", "low", f"other:{group}"


# -- one sentence per finding ---------------------------------------------------------------------

#: Who a finding is about, per backend: ``subject`` of each entry of :data:`TEXTS`.
SUBJECTS: dict[str, dict[str, str]] = {
    "framework": {"torch": "torch autocast", "tf": "Keras", "jax": "plain JAX", "keras-jax": "Keras on JAX",
                  "keras-torch": "Keras on PyTorch"},
    "scaler": SCALER_NAME,
    "stepper": {**SCALER_NAME, "jax": "plain optax"},  # what applies (or skips) a non-finite step
    "replicas": REPLICA_NAME,
    "accumulation": ACCUMULATION_NAME,
    # the models group: each column's own mixed precision on real model code (mpx_tools.models.COLUMNS)
    "models": {"torch": "torch autocast", "tf": "Keras's mixed policy", "jax": "Flax's dtype argument",
               "keras-jax": "Keras's mixed policy on JAX", "keras-torch": "Keras's mixed policy on PyTorch"},
    "keras-models": {"jax": "Keras's mixed policy on JAX (keras-hub's GPT-2 in the jax column)"},
    "fp8": {"torch": "torchao float8 training", "tf": "Keras float8 Dense", "jax": "Flax fp8_ops",
            "keras-jax": "Keras float8 Dense on JAX", "keras-torch": "Keras float8 Dense on PyTorch"},
    "blocks": {"torch": "torchao's mx_formats and rowwise float8 (emulated)",
               "jax": "JAX's block quantizer (jax.nn.scaled_dot_general)", "tf": "Keras (TensorFlow)",
               "keras-jax": "Keras on JAX", "keras-torch": "Keras on PyTorch"},
    "deepspeed": {"torch": "DeepSpeed's loss scalers"},
}

#: What a scale-trace cause means for training, the second half of a ``trace`` finding's explanation.
CONSEQUENCES = {
    "no floor": "after a burst of overflows the scale can fall below 1, so small float16 gradients underflow "
    "to zero",
    "no ceiling": "the scale can grow until scaled losses overflow float16, and then every such step is skipped",
    "no hysteresis": "each isolated overflow halves the scale, so a noisy run trains at a needlessly small scale",
    "growth one step later": "the scale grows a step later than elsewhere, so a run resumed in another "
    "framework follows another trace",
    "initial scale halved": "the first steps use half the scale, which matters only for the first "
    "growth_interval steps",
}

#: Per topic: (subject, title, explanation). A topic is looked up whole, then by its part before ``:``,
#: then as ``other``. Title and explanation are :meth:`str.format` templates over the fields of
#: :class:`_Fields` (``{name}`` is the subject's name for the backend).
TEXTS: dict[str, tuple[str, str, str]] = {
    "half": (
        "framework",
        "{name} computes {ops} in {dtype}: {cases}{err}",
        "These ops accumulate sums and exponentials; in {dtype} they lose about {eps:.0e} relative precision "
        "each, so losses, norms and softmax probabilities are noisier and training can stall or diverge where "
        "mpx keeps them in float32.",
    ),
    "mlp": (
        "framework",
        "{name}: the MLP's loss and gradients are off by more than the tolerance{err}",
        "A whole forward/backward pass drifts from the float64 reference by more than 8 eps of the compute "
        "dtype, so the training signal itself is less accurate.",
    ),
    "promote": (
        "framework",
        "{name} rounds float32 inputs or operands to half in {ops}: {cases}",
        "A float32 input (or the float32 side of a mixed add, mul or cat) is rounded to half before use, so "
        "values kept in float32 on purpose, such as a residual stream, lose precision.",
    ),
    "wider": (
        "framework",
        "{name} runs {ops} in float32 where the policy asks for half: {cases}",
        "No accuracy is lost, but these ops run at float32 speed and keep float32 activations (for "
        "keep_fp32=none or float32 inputs to matmul/conv you must cast by hand).",
    ),
    "policy-output": (
        "framework",
        "{name} models return the compute dtype, not float32: {policies}",
        "A loss computed on the model's output starts from half-precision values unless you cast it.",
    ),
    "policy-dtypes": (
        "framework",
        "{name} stores or computes in a narrower dtype than the policy says: {policies}",
        "Parameters or computation are in half precision where the policy asks for float32.",
    ),
    "raises:policy": (
        "framework",
        "{name} cannot parse {count} policy names ({specs})",
        "Names from Lightning, Accelerate or mpx's own key syntax must be translated by hand; nothing about "
        "the numerics changes ({error:.80}).",
    ),
    "raises": (
        "framework",
        "{name} raises on {some_cases}: {cases}",
        "The operation cannot be run this way natively ({error:.100}).",
    ),
    "raises:portability": (
        "scaler",
        "{name} raises on {some_cases}: {cases}",
        "The operation cannot be run this way natively ({error:.100}).",
    ),
    "trace:rounding": (
        "scaler",
        "{name} rounds its factors differently: {traces}",
        "Scales differ in the last bits of float32, so traces are not bit-identical across frameworks; "
        "harmless for training, but a resumed run does not reproduce exactly.",
    ),
    "trace:skip count": (
        "scaler",
        "{name} skips a different number of steps: {traces}",
        "The scale trace matches the spec but the count of skipped steps does not, so a step the spec skips "
        "is applied, or the reverse.",
    ),
    "trace:unexplained": (
        "scaler",
        "{name} follows other scaling rules: {traces}",
        "The loss-scale trace differs in a way no single default explains; see the aligned traces.",
    ),
    "trace": ("scaler", "{name}: {causes}: {traces}", "It {said}: {consequence}."),
    "skip": (
        "stepper",
        "{name}: a step with inf/NaN gradients is applied, not skipped: {cases}",
        "One overflowing step writes inf/NaN into the parameters or the optimizer moments, and training "
        "cannot recover from it.",
    ),
    "replicas:diverge": (
        "replicas",
        "{name}: replicas take different skip decisions: {cases}",
        "An inf that reaches one replica's gradients after the reduction ({engines}) makes only that replica "
        "skip and back off while the others step and grow, so the parameters diverge silently and the "
        "replicas train different models.",
    ),
    "replicas:no engine": (
        "framework",
        "{name}: no engine runs these replica cases: {cases}",
        "{no_engine}. A user of this column cannot train on several devices this way at all, with or "
        "without mpx; the cases run in the columns that have an engine.",
    ),
    "replicas:applied": (
        "replicas",
        "{name}: a step non-finite on one replica is applied: {cases}",
        "Keras checks each replica's gradients before the all-reduce and acts on the first replica's flag, "
        "so an inf on another replica is summed into every replica's update: all parameters become inf/NaN "
        "and every later step is skipped.",
    ),
    "accumulation": (
        "accumulation",
        "{name}: the scale moves per micro-batch and only the bad micro-batch is dropped: {traces}",
        "The same config grows the scale up to k times faster per optimizer step than torch and mpx, and a "
        "window with an overflow is applied without its bad micro-batch, so scale traces and updates differ "
        "from other frameworks' for the same run.",
    ),
    "saves": (
        "scaler",
        "{name} saves its own state format ({keys})",
        "Another framework, or mpx, cannot resume the loss scale from it without a converter.",
    ),
    "resume": (
        "scaler",
        "{name} cannot resume from the neutral mpx.scaler/1 state: {cases}",
        "A loss scale saved by another framework (or by mpx) cannot be loaded{because}, so a moved run "
        "restarts its scale and counters.",
    ),
    "models:ops": (
        "models",
        "{name} computes {model_ops} in half precision inside real models",
        "In real model code (tiny configs, random weights: Hugging Face on torch, keras-hub on Keras, Flax's "
        "examples on JAX), ops the table keeps in float32 run in half precision under the framework's own "
        "mixed precision (torch autocast: an activation's pow, a norm after a matmul; Keras's policies and "
        "Flax's dtype: the attention softmax), so those activations lose precision where mpx computes them "
        "in float32.",
    ),
    "models:overflow": (
        "scaler",
        "{name}: the float16 run with an injected overflow differs in real models: {some_cases}",
        "The overflowing step is not skipped as the spec says, or the scale does not follow the core's trace.",
    ),
    "models": (
        "models",
        "{name} differs from mpx on real models: {some_cases}",
        "See the observed values: trace or graph counts, the logits' error or the bytes kept for backward.",
    ),
    "fp8-quantize": ("fp8", "{name}: quantized bytes differ ({causes}): {some_cases}", "{fp8_effects}"),
    "fp8-trace": ("fp8", "{name}: FP8 scales follow other rules ({causes}): {some_cases}", "{fp8_effects}"),
    "fp8-matmul": ("fp8", "{name}: the FP8 GEMM differs ({causes}): {some_cases}", "{fp8_effects}"),
    "blocks-quantize": ("blocks", "{name}: block-scaled bytes differ ({causes}): {some_cases}", "{block_effects}"),
    "blocks-missing": ("blocks", "{name}: no native block-scaled format: {some_cases}", "{block_effects}"),
    "deepspeed-trace": ("deepspeed", "{deepspeed[0]}", "{deepspeed[1]}"),  # conformance/deepspeed/cases.py
    "other": (
        "framework",
        "{name}: {count} other divergences in {group}",
        "The observed value differs from the spec; see the case table.",
    ),
}
TEXTS["models:keras-ops"] = ("keras-models", *TEXTS["models:ops"][1:])  # keras-hub in the jax column


def _list(names: list[str], limit: int = 8) -> str:
    names = list(dict.fromkeys(names))
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


class _Fields(dict):
    """The template fields of one finding, each computed when a template first names it."""

    def __init__(self, backend: str, subject: str, topic: str, rows: list[dict], extra: dict) -> None:
        super().__init__()
        self.backend, self.subject, self.topic, self.rows, self.extra = backend, subject, topic, rows, extra

    def __missing__(self, field: str) -> Any:
        value = self[field] = getattr(self, "_" + field)()
        return value

    def _name(self) -> str:
        return SUBJECTS[self.subject].get(self.backend, self.backend)

    def _count(self) -> int:
        return len(self.rows)

    def _cases(self) -> str:
        return _n(len(self.rows), "case")

    def _traces(self) -> str:
        return _n(len(self.rows), "trace")

    def _policies(self) -> str:
        return f"{len(self.rows)} " + ("policy" if len(self.rows) == 1 else "policies")

    def _some_cases(self) -> str:
        return _list([r["case"] for r in self.rows], 4)

    def _ops(self) -> str:
        return _list([_op(r["case"]) for r in self.rows])

    def _model_ops(self) -> str:
        return _list([f"{op} ({r['case'].split('.')[1]})" for r in self.rows for op in r["observed"]["violations"]])

    def _specs(self) -> str:
        return _list([r["case"].split(".", 1)[1] for r in self.rows], 6)

    def _group(self) -> str:
        return self.rows[0]["group"]

    def _dtype(self) -> str:
        return self.topic.split(":")[1]

    def _eps(self) -> float:
        return mpx.dtype_info(self["dtype"]).eps

    def _err(self) -> str:
        if "max_rel_error" not in self.extra:
            return ""
        return f", max rel. error {self.extra['max_rel_error']:.1e} (tolerance {self.extra['tolerance']:g})"

    def _error(self) -> str:
        return _error_line(_raised(self.rows[0]) or "")

    def _because(self) -> str:
        return f" ({self['error']})" if self["error"] else ""

    def _causes(self) -> str:
        return ", ".join(self.topic.split(":")[1].split("+"))

    def _said(self) -> str:
        words = {n: w for n, _, w in _VARIANTS}
        return "; ".join(words[c] for c in self.topic.split(":")[1].split("+"))

    def _consequence(self) -> str:
        return CONSEQUENCES[self.topic.split(":")[1].split("+")[0]]

    def _engines(self) -> str:
        return _list([r["observed"].get("engine", "") for r in self.rows], 3)

    def _fp8_effects(self) -> str:
        from conformance.fp8.cases import FP8_EFFECTS

        return " ".join(FP8_EFFECTS.get(c, c) for c in self.topic.split(":")[1].split("+"))

    def _no_engine(self) -> str:
        return str(self.rows[0]["observed"]["no_engine"]).rstrip(".")

    def _block_effects(self) -> str:
        from conformance.blocks.cases import BLOCK_EFFECTS

        cause = self.topic.split(":")[1].split("+")[0] if ":" in self.topic else "missing"
        return BLOCK_EFFECTS.get(cause, cause)

    def _deepspeed(self) -> tuple[str, str]:
        from conformance.deepspeed.cases import finding_text

        return finding_text(self.topic, [r["case"] for r in self.rows])

    def _keys(self) -> str:
        return _list(sorted((self.rows[0].get("observed") or {}).get("state_dict", {}) or {}), 4)


def _explain(backend: str, kind: str, topic: str, rows: list[dict]) -> tuple[str, str, dict]:
    """(title, explanation, extra fields) of one finding: its topic's :data:`TEXTS` entry, filled in."""
    subject, title, explanation = TEXTS.get(topic) or TEXTS.get(topic.split(":")[0]) or TEXTS["other"]
    extra: dict[str, Any] = {}
    errors = [r["observed"]["max_rel_error"] for r in rows
              if isinstance(r.get("observed"), dict) and isinstance(r["observed"].get("max_rel_error"), float)]  # fmt: skip
    if errors:
        extra["max_rel_error"] = max(errors)
        extra["tolerance"] = max(
            (r["expected"].get("max_rel_error_at_most", 0) for r in rows if r["group"] == "numerics"),
            default=0,
        )
    fields = _Fields(backend, subject, topic, rows, extra)
    return title.format_map(fields), explanation.format_map(fields), extra


def findings(data: dict) -> list[dict]:
    """Every native divergence of ``data`` (a report dict) grouped into findings, most severe first.

    Each finding: ``kind`` (one of :data:`KINDS`), ``severity`` (one of :data:`SEVERITIES`), ``backend``,
    ``title`` (one line), ``explanation`` (what it means for training), ``cases`` (case ids), and for
    numerics ``max_rel_error`` and ``tolerance``.
    """
    params = {cid: c.get("params", {}) for cid, c in data.get("cases", {}).items()}
    groups: dict[tuple[str, str, str, str], list[dict]] = defaultdict(list)
    for r in data["results"]:
        if r["mode"] != "native" or r["status"] != "differs":
            continue
        kind, severity, topic = _classify(r, params.get(r["case"]) or _case_params(r["case"]))
        groups[(r["backend"], kind, severity, topic)].append(r)
    out = []
    for (backend, kind, severity, topic), rows in groups.items():
        title, explanation, extra = _explain(backend, kind, topic, rows)
        out.append({"kind": kind, "severity": severity, "backend": backend, "topic": topic, "title": title,
                    "explanation": explanation, "cases": [r["case"] for r in rows], **extra})  # fmt: skip
    order = {b: i for i, b in enumerate(data.get("backends", {}))}
    out.sort(key=lambda f: (order.get(f["backend"], 99), SEVERITIES.index(f["severity"]), KINDS.index(f["kind"]),
                            -len(f["cases"])))  # fmt: skip
    return out


def _case_params(case_id: str) -> dict:
    from conformance.cases import all_cases

    for c in all_cases():
        if c["id"] == case_id:
            return json.loads(json.dumps(c["params"]))
    return {}


def summary(data: dict, found: list[dict]) -> dict[str, dict]:
    """Per backend: what native means, result counts per mode and status, and its findings' titles."""
    out: dict[str, dict] = {}
    for backend in data.get("backends", {}):
        counts: dict[str, dict[str, int]] = {"native": defaultdict(int), "mpx": defaultdict(int)}
        for r in data["results"]:
            if r["backend"] == backend and r["mode"] in counts:
                counts[r["mode"]][r["status"]] += 1
        mine = [f for f in found if f["backend"] == backend]
        out[backend] = {
            "native": NATIVE.get(backend, backend),
            "counts": {m: dict(c) for m, c in counts.items()},
            "by_severity": {s: sum(1 for f in mine if f["severity"] == s) for s in SEVERITIES},
            "findings": [f["title"] for f in mine],
        }
    return out
