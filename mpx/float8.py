"""FP8: one recipe, one quantization and one per-tensor scaling state machine for every backend.

The reference every backend must match bit for bit (numpy + ml_dtypes only).

Formats
    ``e4m3`` is ``float8_e4m3fn`` (max 448, no inf), ``e5m2`` is ``float8_e5m2``
    (max 57344).  :class:`Float8Recipe` ``format="hybrid"`` (the default, as in
    Transformer Engine) quantizes inputs and weights in e4m3 and gradients in
    e5m2; ``format="e4m3"`` uses e4m3 for all three.

Quantization (:func:`quantize`)
    ``q = fp8(clip(float32(x) * scale, -fp8_max, fp8_max))`` with ``scale`` a
    float32 and round-to-nearest-even in the cast.  The clip is part of the
    recipe: frameworks disagree on overflow (torch's e4m3fn cast saturates to
    448, JAX, TF and ml_dtypes give NaN), so every backend clips first.  NaN
    stays NaN (its byte differs between frameworks: compare NaN as NaN).  The
    GEMM multiplies by the inverse, ``scale_inv = float32(1 / scale)``
    (:func:`fp8_dot`).

Scaling (:func:`float8_update`), per tensor, Transformer Engine's convention
    The scale multiplies; ``scale = float32((fp8_max / amax) / 2**margin)``.

    * ``delayed`` (default; TE's ``DelayedScaling``): each tensor keeps a
      history of its last ``amax_history_len`` amaxes (most recent first).
      The scale that step t quantizes with was computed at the end of step
      t-1 from the amaxes of steps <= t-1 (TE's lag).  ``amax_compute``
      ``max`` uses the window's maximum, ``most_recent`` the last amax.
    * ``current`` (torchao's dynamic scaling): the scale comes from the amax
      of the tensor being quantized, in float64 and then rounded to float32,
      with the amax floored at :data:`CURRENT_AMAX_FLOOR` (``1e-12``, torchao's).

    The rules, every one tested:

    * a zero amax (the window is all zeros) keeps the previous scale (TE);
    * a non-finite amax is never recorded, and the scale stays (mpx's rule; TE
      records it, and with ``max`` the scale then freezes for the whole
      window); under ``current`` scaling a non-finite amax gives scale 1.0 (TE's
      ``Float8CurrentScaling``);
    * when ``fp8_max / amax`` overflows float32 the scale is the largest finite
      float32 (TE's ceiling); when it falls below float32's smallest normal
      (a huge amax or margin) the scale is that smallest normal, whose inverse
      is finite (mpx's floor);
    * ``power_of_two=True`` rounds every scale down to a power of two (exact
      inverse; torchao's rowwise recipe does the same);
    * an FP8 GEMM with a non-finite operand returns NaN (:func:`fp8_dot`), so a
      loss scaler sees the overflow the clip would hide and skips the step;
    * a step the loss scaler skips commits no amax and no scale
      (``float8_update(..., skipped=True)`` returns the state unchanged): the
      FP8 state moves exactly when the optimizer state does, accumulation
      windows and replicas included (replicas reduce amaxes with MAX first,
      :func:`reduce_amaxes`).

State dicts (:func:`float8_state_dict`, :func:`load_float8_state_dict`) are
JSON-safe: ``{"format": "mpx.float8/1", "recipe": {...}, "tensors": {name:
{"role": ..., "scale": ..., "amax_history": [...]}}}``; loading validates every
field, all or nothing, and raises :class:`mpx.StateDictError`.

>>> r = Float8Recipe(amax_history_len=4)
>>> s = float8_init(r, {"x": "input"})
>>> s = float8_update(r, s, {"x": 2.0})
>>> s.tensors["x"].scale, s.tensors["x"].amax_history
(224.0, (2.0, 0.0, 0.0, 0.0))
>>> quantize([1.0, 3.0, -1e9], 224.0, "e4m3").astype("float32").tolist()
[224.0, 448.0, -448.0]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

from mpx.errors import MPXError, StateDictError

__all__ = [
    "CURRENT_AMAX_FLOOR",
    "FLOAT8_FORMAT",
    "FORMATS",
    "FP8_OPS",
    "ROLES",
    "Float8Error",
    "Float8Recipe",
    "Float8State",
    "TensorScale",
    "check_model_state",
    "compute_scale",
    "float8_init",
    "float8_state_dict",
    "float8_update",
    "fp8_dot",
    "fp8_max",
    "load_float8_state_dict",
    "one_recipe",
    "quantize",
    "reduce_amaxes",
    "scale_inv",
    "tensor_key",
]

#: The ``format`` tag of every FP8 state dict this version writes and reads.
FLOAT8_FORMAT = "mpx.float8/1"
#: The FP8 formats by short name: numpy dtypes (ml_dtypes).
FORMATS: dict[str, np.dtype] = {
    "e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
    "e5m2": np.dtype(ml_dtypes.float8_e5m2),
}
#: What a quantized tensor is to its GEMM: forward operands (input, weight) and the backward's gradient.
ROLES = ("input", "weight", "grad")
#: The ops a policy's ``fp8`` recipe turns into FP8 GEMMs when the op table classifies them LOWER
#: (:meth:`mpx.Policy.fp8_applies`); every other op follows the policy's compute dtype.
FP8_OPS = ("linear", "matmul", "einsum")
#: The amax floor of ``current`` scaling (torchao's ``EPS``).
CURRENT_AMAX_FLOOR = 1e-12
_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.finfo(np.float32).tiny)
_RECIPE_FORMATS = ("hybrid", "e4m3")
_SCALINGS = ("delayed", "current")
_AMAX_COMPUTE = ("max", "most_recent")


class Float8Error(MPXError):
    """An FP8 recipe field, format or role is not allowed."""


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else f"{value!r} ({type(value).__name__})"


@dataclass(frozen=True)
class Float8Recipe:
    """How FP8 GEMMs quantize and scale (frozen, hashable).

    Attributes:
        format: ``"hybrid"`` (default: e4m3 inputs and weights, e5m2 gradients) or ``"e4m3"`` (all e4m3).
        scaling: ``"delayed"`` (default, Transformer Engine's) or ``"current"`` (torchao's dynamic scaling).
        amax_history_len: amaxes a tensor remembers under delayed scaling (default 1024, TE's), >= 1.
        amax_compute: ``"max"`` over the history (default) or ``"most_recent"``.
        margin: the scale is divided by ``2**margin`` (default 0), an int >= 0.
        power_of_two: round every scale down to a power of two (default False).
    """

    format: str = "hybrid"
    scaling: str = "delayed"
    amax_history_len: int = 1024
    amax_compute: str = "max"
    margin: int = 0
    power_of_two: bool = False

    def __post_init__(self) -> None:
        for name, allowed in (
            ("format", _RECIPE_FORMATS),
            ("scaling", _SCALINGS),
            ("amax_compute", _AMAX_COMPUTE),
        ):
            value = getattr(self, name)
            if not isinstance(value, str) or value not in allowed:
                raise Float8Error(f"{name}: {_show(value)} is not allowed; allowed: {', '.join(allowed)}")
        for name, low in (("amax_history_len", 1), ("margin", 0)):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, np.integer))
                or not low <= value <= 2**31 - 1
            ):
                raise Float8Error(f"{name}: expected an int in [{low}, 2**31 - 1], got {_show(value)}")
            object.__setattr__(self, name, int(value))
        if not isinstance(self.power_of_two, (bool, np.bool_)):
            raise Float8Error(f"power_of_two: expected a bool, got {_show(self.power_of_two)}")
        object.__setattr__(self, "power_of_two", bool(self.power_of_two))

    def format_of(self, role: str) -> str:
        """The FP8 format (``"e4m3"`` or ``"e5m2"``) of a tensor with this ``role`` (one of :data:`ROLES`)."""
        if role not in ROLES:
            raise Float8Error(f"role: {_show(role)} is not allowed; allowed: {', '.join(ROLES)}")
        return "e5m2" if self.format == "hybrid" and role == "grad" else "e4m3"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Float8Recipe:
        """Read :meth:`to_dict` back; unknown keys raise :class:`Float8Error`, missing ones take defaults."""
        if not isinstance(data, Mapping):
            raise Float8Error(f"recipe: expected a mapping, got {type(data).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in data if k not in names]
        if unknown:
            raise Float8Error(f"recipe: unknown key {_show(unknown[0])}; allowed: {', '.join(names)}")
        return cls(**data)


def fp8_max(fmt: str) -> float:
    """The largest finite value of an FP8 format (``"e4m3"``: 448, ``"e5m2"``: 57344)."""
    if fmt not in FORMATS:
        raise Float8Error(f"fmt: {_show(fmt)} is not allowed; allowed: {', '.join(FORMATS)}")
    return float(ml_dtypes.finfo(FORMATS[fmt]).max)


def scale_inv(scale: float) -> float:
    """``float32(1 / scale)``: what the GEMM multiplies its float32 result by, per operand."""
    return float(np.float32(1.0) / np.float32(scale))


def quantize(x: Any, scale: float, fmt: str) -> np.ndarray:
    """``fp8(clip(float32(x) * float32(scale), -fp8_max, fp8_max))``: an ml_dtypes FP8 array (NaN stays NaN)."""
    limit = np.float32(fp8_max(fmt))
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = np.asarray(x, dtype=np.float32) * np.float32(scale)
    return np.clip(scaled, -limit, limit).astype(FORMATS[fmt])


def fp8_dot(
    a: Any, b: Any, a_scale: float, b_scale: float, a_fmt: str = "e4m3", b_fmt: str = "e4m3"
) -> np.ndarray:
    """The FP8 GEMM: quantize both operands, multiply in float32, then apply both inverse scales.

    ``(float32(qa) @ float32(qb)) * scale_inv(a_scale) * scale_inv(b_scale)``, in float32.  An operand
    holding inf or NaN makes the whole result NaN: quantization clips inf to ``fp8_max``, which would
    hide an overflowed (scaled) value from the loss scaler, so every backend poisons the GEMM instead
    and the step is skipped.  Backends
    accumulate in float32 in their own order, so they match this within float32 rounding of the sums
    (the products of FP8 values are exact in float32).
    """
    qa = quantize(a, a_scale, a_fmt).astype(np.float32)
    qb = quantize(b, b_scale, b_fmt).astype(np.float32)
    out = (qa @ qb * np.float32(scale_inv(a_scale)) * np.float32(scale_inv(b_scale))).astype(np.float32)
    if not (np.isfinite(np.asarray(a, np.float32)).all() and np.isfinite(np.asarray(b, np.float32)).all()):
        out[...] = np.nan  # the clip would hide an overflow from the loss scaler: poison the whole GEMM
    return out


def _round_down_pow2(scale: float) -> float:
    _, exponent = math.frexp(scale)  # scale = m * 2**exponent with m in [0.5, 1)
    return math.ldexp(1.0, exponent - 1)


def compute_scale(recipe: Float8Recipe, amax: float, fmt: str, previous: float = 1.0) -> float:
    """The float32 scale for an ``amax`` (see the module docs for every rule); ``previous``: the scale to keep."""
    amax = float(amax)
    if recipe.scaling == "current":
        if not math.isfinite(amax):
            return 1.0
        amax = max(amax, CURRENT_AMAX_FLOOR)
    elif not math.isfinite(amax) or amax <= 0.0:
        return float(np.float32(previous))
    # float64, then one rounding to float32; ldexp divides by 2**margin exactly (no overflow for any margin)
    value = math.ldexp(fp8_max(fmt) / amax, -recipe.margin)
    scale = _F32_MAX if value >= _F32_MAX else float(np.float32(value))
    if scale < _F32_TINY:  # zero or subnormal (a huge amax or margin): its float32 inverse would overflow
        scale = _F32_TINY  # the smallest normal float32 keeps it invertible

    return _round_down_pow2(scale) if recipe.power_of_two else scale


@dataclass(frozen=True)
class TensorScale:
    """One quantized tensor's scaling state: its role, float32 scale and amax history (most recent first)."""

    role: str
    scale: float = 1.0
    amax_history: tuple[float, ...] = ()


@dataclass(frozen=True)
class Float8State:
    """The FP8 state of a model: per tensor name, a :class:`TensorScale` (an immutable value)."""

    tensors: Mapping[str, TensorScale] = field(default_factory=dict)


def float8_init(recipe: Float8Recipe, roles: Mapping[str, str]) -> Float8State:
    """A fresh state for tensors ``{name: role}``: scale 1.0, a zero history of ``amax_history_len``
    (delayed scaling; empty under current scaling)."""
    length = recipe.amax_history_len if recipe.scaling == "delayed" else 0
    tensors = {}
    for name, role in roles.items():
        recipe.format_of(role)  # validates the role
        tensors[str(name)] = TensorScale(role, 1.0, (0.0,) * length)
    return Float8State(tensors)


def reduce_amaxes(per_replica: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Replicas' amaxes combined with MAX (NaN wins, as in a MAX all-reduce), so every replica takes one update."""
    out: dict[str, float] = {}
    for amaxes in per_replica:
        for name, value in amaxes.items():
            v = float(value)
            old = out.get(name)
            out[name] = v if old is None or math.isnan(v) or (not math.isnan(old) and v > old) else old
    return out


def float8_update(
    recipe: Float8Recipe, state: Float8State, amaxes: Mapping[str, float], *, skipped: bool = False
) -> Float8State:
    """The state after one optimizer step that saw ``amaxes`` (pure).

    Delayed scaling records each finite amax at the front of its history (dropping the oldest) and
    computes the scale the next step quantizes with.  Current scaling keeps no history: the scale
    recorded is the one the step's own amax gave.  ``skipped``: the loss scaler skipped this step, so
    nothing is committed.  Tensors not in ``amaxes`` are unchanged; unknown names raise Float8Error.
    """
    unknown = [name for name in amaxes if name not in state.tensors]
    if unknown:
        raise Float8Error(f"amaxes: unknown tensor {unknown[0]!r}; known: {', '.join(state.tensors)}")
    if skipped:
        return state
    tensors = dict(state.tensors)
    for name, value in amaxes.items():
        ts = tensors[name]
        with np.errstate(over="ignore"):
            amax = float(np.float32(value))  # backends measure amaxes in float32
        fmt = recipe.format_of(ts.role)
        if recipe.scaling == "current":
            tensors[name] = dataclasses.replace(ts, scale=compute_scale(recipe, amax, fmt, ts.scale))
            continue
        history = ts.amax_history
        if math.isfinite(amax):
            history = ((amax, *history))[: recipe.amax_history_len]
        window = history[0] if recipe.amax_compute == "most_recent" else max(history, default=0.0)
        tensors[name] = TensorScale(ts.role, compute_scale(recipe, window, fmt, ts.scale), history)
    return Float8State(tensors)


def float8_state_dict(recipe: Float8Recipe, state: Float8State) -> dict[str, Any]:
    """The neutral JSON-safe state dict (format ``mpx.float8/1``)."""
    return {
        "format": FLOAT8_FORMAT,
        "recipe": recipe.to_dict(),
        "tensors": {
            name: {"role": ts.role, "scale": ts.scale, "amax_history": list(ts.amax_history)}
            for name, ts in state.tensors.items()
        },
    }


def tensor_key(path: str, role: str) -> str:
    """The key of one tensor's scale in an ``mpx.float8/1`` dict: ``"<layer path>.<role>"`` (the role alone
    for a layer at the model's root), the same in every backend.

    >>> tensor_key("blocks.0.mlp", "weight"), tensor_key("", "grad")
    ('blocks.0.mlp.weight', 'grad')
    """
    return f"{path}.{role}" if path else role


def one_recipe(recipes: Iterable[Float8Recipe], what: str = "FP8 layers") -> Float8Recipe:
    """The one recipe a model's ``what`` share (``Float8Recipe()`` when there are none): an
    ``mpx.float8/1`` dict holds one.

    Raises:
        StateDictError: when they use more than one recipe.
    """
    found = set(recipes)
    if len(found) > 1:
        raise StateDictError(
            f"model: its {what} use {len(found)} different recipes; an {FLOAT8_FORMAT} dict holds one "
            "(give every FP8 layer the same fp8 keys, or save the model's own state instead)"
        )
    return found.pop() if found else Float8Recipe()


def check_model_state(
    recipe: Float8Recipe, state: Float8State, model_recipe: Float8Recipe | None, paths: Iterable[str]
) -> None:
    """Check, before anything is written, that a loaded ``mpx.float8/1`` dict fits a model: every backend's
    ``load_float8_state_dict(model, d)`` runs it, so a dict fits the same models everywhere.

    Args:
        recipe, state: what :func:`load_float8_state_dict` read.
        model_recipe: the recipe the model's FP8 layers share (:func:`one_recipe`); None for a model
            without FP8 layers.
        paths: the FP8 layers' paths; the dict must hold exactly ``tensor_key(path, role)`` for each path
            and role of :data:`ROLES`, with that role.

    Raises:
        StateDictError: naming the recipe fields that differ, the missing and unexpected tensors, or the
            tensor whose role is not its key's.
    """
    if model_recipe is not None and recipe != model_recipe:
        diff = [k for k, v in model_recipe.to_dict().items() if recipe.to_dict()[k] != v]
        raise StateDictError(f"recipe: the state dict's recipe differs from the model's in {', '.join(diff)}")
    want = {tensor_key(path, role): role for path in paths for role in ROLES}
    missing = sorted(set(want) - set(state.tensors))
    extra = sorted(set(state.tensors) - set(want))
    if missing or extra:
        raise StateDictError(
            f"tensors: expected the model's {len(want)} FP8 tensors with their roles; "
            f"missing {missing[:3]}, unexpected {extra[:3]}"
        )
    for name, role in want.items():
        if state.tensors[name].role != role:
            raise StateDictError(
                f"tensors[{name!r}].role: expected {role!r}, got {state.tensors[name].role!r}"
            )


def _f32_value(where: str, value: Any, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise StateDictError(f"{where}: expected a number, got {_show(value)}")
    v = float(value)
    if (
        not math.isfinite(v)
        or (positive and v <= 0.0)
        or (not positive and v < 0.0)
        or float(np.float32(v)) != v
    ):
        kind = "a positive finite float32" if positive else "a finite float32 >= 0"
        raise StateDictError(f"{where}: expected {kind}, got {_show(value)}")
    return v


def load_float8_state_dict(data: Mapping[str, Any]) -> tuple[Float8Recipe, Float8State]:
    """Read :func:`float8_state_dict` back, validating every field (all or nothing).

    Raises:
        StateDictError: naming the bad field.
    """
    if not isinstance(data, Mapping):
        raise StateDictError(f"state dict: expected a mapping, got {type(data).__name__}")
    if data.get("format") != FLOAT8_FORMAT:
        raise StateDictError(f"format: expected {FLOAT8_FORMAT!r}, got {_show(data.get('format'))}")
    extra = sorted(set(data) - {"format", "recipe", "tensors"})
    if extra:
        raise StateDictError(f"state dict: unknown key {extra[0]!r}; allowed: format, recipe, tensors")
    try:
        recipe = Float8Recipe.from_dict(data.get("recipe", {}))
    except Float8Error as exc:
        raise StateDictError(f"recipe: {exc}") from None
    tensors_in = data.get("tensors")
    if not isinstance(tensors_in, Mapping):
        raise StateDictError(f"tensors: expected a mapping of tensor names, got {_show(tensors_in)}")
    length = recipe.amax_history_len if recipe.scaling == "delayed" else 0
    tensors = {}
    for name, entry in tensors_in.items():
        where = f"tensors[{name!r}]"
        if not isinstance(name, str) or not isinstance(entry, Mapping):
            raise StateDictError(f"{where}: expected a str name and a mapping")
        if set(entry) != {"role", "scale", "amax_history"}:
            raise StateDictError(
                f"{where}: expected exactly the keys role, scale, amax_history, got {sorted(entry)}"
            )
        if entry["role"] not in ROLES:
            raise StateDictError(
                f"{where}.role: {_show(entry['role'])} is not allowed; allowed: {', '.join(ROLES)}"
            )
        scale = _f32_value(f"{where}.scale", entry["scale"], positive=True)
        history = entry["amax_history"]
        if not isinstance(history, (list, tuple)) or len(history) != length:
            raise StateDictError(
                f"{where}.amax_history: expected a list of {length} amaxes (the recipe's length)"
            )
        values = tuple(
            _f32_value(f"{where}.amax_history[{i}]", v, positive=False) for i, v in enumerate(history)
        )
        tensors[name] = TensorScale(entry["role"], scale, values)
    return recipe, Float8State(tensors)
