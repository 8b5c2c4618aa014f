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

One implementation: :func:`quantize`, :func:`compute_scale`, :func:`float8_update` and
:func:`reduce_amaxes` run the kernels of :mod:`mpx.kernels.float8` with the numpy table;
every backend runs the same kernels on its own arrays (``float8_init``/``float8_update``
take a backend's table as ``ops=``, and :class:`TensorScale`/:class:`Float8State` then hold
its arrays: JAX registers them as pytrees).

State dicts (:func:`state_dict`, :func:`load_state_dict`; every backend's model-level
``float8_state_dict(model)`` writes one) are JSON-safe: ``{"format": "mpx.float8/1", "recipe": {...}, "tensors": {name:
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

import numpy as np

from mpx.blocks import BlockRecipe, is_block_recipe_dict
from mpx.errors import Float8Error, StateDictError
from mpx.formats import FORMATS, fp8_max
from mpx.kernels import float8 as _kernel
from mpx.kernels.array_ops import NUMPY_OPS, ArrayOps
from mpx.kernels.float8 import CURRENT_AMAX_FLOOR

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
    "float8_update",
    "fp8_dot",
    "fp8_max",
    "load_state_dict",
    "one_recipe",
    "quantize",
    "recipe_from_dict",
    "reduce_amaxes",
    "scale_inv",
    "state_dict",
    "tensor_key",
]

#: The ``format`` tag of every FP8 state dict this version writes and reads.
FLOAT8_FORMAT = "mpx.float8/1"
#: What a quantized tensor is to its GEMM: forward operands (input, weight) and the backward's gradient.
ROLES = ("input", "weight", "grad")
#: The ops a policy's ``fp8`` recipe turns into FP8 GEMMs when the op table classifies them LOWER
#: (:meth:`mpx.OpTable.fp8_applies`); every other op follows the policy's compute dtype.
FP8_OPS = ("linear", "matmul", "einsum")
_RECIPE_FORMATS = ("hybrid", "e4m3")
_SCALINGS = ("delayed", "current")
_AMAX_COMPUTE = ("max", "most_recent")


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


def recipe_from_dict(data: Mapping[str, Any]) -> Float8Recipe | BlockRecipe:
    """A recipe dict read back: a :class:`mpx.blocks.BlockRecipe` when it says ``"kind": "block"``,
    else a :class:`Float8Recipe` (either raises :class:`Float8Error` on a bad field)."""
    return BlockRecipe.from_dict(data) if is_block_recipe_dict(data) else Float8Recipe.from_dict(data)


def scale_inv(scale: float) -> float:
    """``float32(1 / scale)``: what the GEMM multiplies its float32 result by, per operand."""
    return float(np.float32(1.0) / np.float32(scale))


def quantize(x: Any, scale: float, fmt: str) -> np.ndarray:
    """``fp8(clip(float32(x) * float32(scale), -fp8_max, fp8_max))``: an ml_dtypes FP8 array (NaN stays NaN).

    :func:`mpx.kernels.float8.quantize` with the numpy table.
    """
    return _kernel.quantize(NUMPY_OPS, np.asarray(x), scale, fmt)


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


def compute_scale(recipe: Float8Recipe, amax: float, fmt: str, previous: float = 1.0) -> float:
    """The float32 scale for an ``amax`` (see the module docs for every rule); ``previous``: the scale to keep.

    :func:`mpx.kernels.float8.compute_scale` with the numpy table.
    """
    with np.errstate(over="ignore"):
        a = np.float32(amax)
    return float(_kernel.compute_scale(NUMPY_OPS, recipe, a, fmt, np.float32(previous)))


@dataclass(frozen=True)
class TensorScale:
    """One quantized tensor's scaling state: its role, float32 scale and amax history (most recent first).

    Host values (a float and a tuple of floats) from the numpy reference; a backend's arrays (a
    float32 scalar and a float32 ``(amax_history_len,)`` array) when built with its ``ops``.
    """

    role: str
    scale: Any = 1.0
    amax_history: Any = ()


@dataclass(frozen=True)
class Float8State:
    """The FP8 state of a model: per tensor name, a :class:`TensorScale` (an immutable value)."""

    tensors: Mapping[str, TensorScale] = field(default_factory=dict)


def _history_length(recipe: Float8Recipe) -> int:
    return recipe.amax_history_len if recipe.scaling == "delayed" else 0


def float8_init(recipe: Float8Recipe, roles: Mapping[str, str], *, ops: ArrayOps | None = None) -> Float8State:
    """A fresh state for tensors ``{name: role}``: scale 1.0, a zero history of ``amax_history_len``
    (delayed scaling; empty under current scaling).

    ``ops``: None for host values, or a backend's :class:`~mpx.kernels.array_ops.ArrayOps` for its
    arrays (a float32 scalar scale and a float32 history).
    """
    length = _history_length(recipe)
    tensors = {}
    for name, role in roles.items():
        recipe.format_of(role)  # validates the role
        if ops is None:
            tensors[str(name)] = TensorScale(role, 1.0, (0.0,) * length)
        else:
            zeros = ops.from_numpy(np.zeros(length, np.float32))
            tensors[str(name)] = TensorScale(role, ops.float32(1.0), zeros)
    return Float8State(tensors)


def reduce_amaxes(per_replica: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Replicas' amaxes combined with MAX (NaN wins, as in a MAX all-reduce), so every replica takes one update
    (:func:`mpx.kernels.float8.window_max` with the numpy table)."""
    out: dict[str, Any] = {}
    for amaxes in per_replica:
        for name, value in amaxes.items():
            with np.errstate(over="ignore"):
                v = np.float32(value)
            out[name] = v if name not in out else _kernel.window_max(NUMPY_OPS, out[name], v)
    return {name: float(v) for name, v in out.items()}


def float8_update(
    recipe: Float8Recipe,
    state: Float8State,
    amaxes: Mapping[str, Any],
    *,
    skipped: Any = False,
    ops: ArrayOps | None = None,
) -> Float8State:
    """The state after one optimizer step that saw ``amaxes`` (pure), by :func:`mpx.kernels.float8.update_tensor`.

    Delayed scaling records each finite amax at the front of its history (dropping the oldest) and
    computes the scale the next step quantizes with.  Current scaling keeps no history: the scale
    recorded is the one the step's own amax gave.  ``skipped``: the loss scaler skipped this step, so
    nothing is committed (a Python bool, or with ``ops`` a traced bool scalar: a select).  Tensors not
    in ``amaxes`` are unchanged; unknown names raise Float8Error.

    ``ops``: None for a state of host values (the reference), or a backend's table for a state holding
    its arrays (as :func:`float8_init` with ``ops`` builds it); the kernel is the same.
    """
    unknown = [name for name in amaxes if name not in state.tensors]
    if unknown:
        raise Float8Error(f"amaxes: unknown tensor {unknown[0]!r}; known: {', '.join(state.tensors)}")
    if skipped is True or (ops is None and skipped):
        return state
    o = NUMPY_OPS if ops is None else ops
    skip = None if skipped is False or ops is None else skipped
    tensors = dict(state.tensors)
    for name, value in amaxes.items():
        ts = tensors[name]
        history = np.asarray(ts.amax_history, np.float32) if ops is None else ts.amax_history
        scale, history = _kernel.update_tensor(o, recipe, ts.role, ts.scale, history, value, skip)
        if ops is None:
            scale, history = float(scale), tuple(float(v) for v in history)
        tensors[name] = TensorScale(ts.role, scale, history)
    return Float8State(tensors)


def state_dict(recipe: Float8Recipe | BlockRecipe, state: Float8State) -> dict[str, Any]:
    """The neutral JSON-safe state dict (format ``mpx.float8/1``) of a state of host values or of any
    backend's arrays (read to the host here).

    A :class:`mpx.blocks.BlockRecipe` is stateless: its dict holds the recipe (``"kind": "block"``,
    ``"stateless": true``) and no tensors (``state`` must hold none).
    """
    if isinstance(recipe, BlockRecipe):
        if state.tensors:
            raise StateDictError("tensors: a block-scaled recipe is stateless; its state holds no tensors")
        return {"format": FLOAT8_FORMAT, "recipe": {**recipe.to_dict(), "stateless": True}, "tensors": {}}
    return {
        "format": FLOAT8_FORMAT,
        "recipe": recipe.to_dict(),
        "tensors": {
            name: {
                "role": ts.role,
                "scale": float(np.asarray(ts.scale, np.float32)),
                "amax_history": [float(v) for v in np.asarray(ts.amax_history, np.float32).reshape(-1)],
            }
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
        recipe, state: what :func:`load_state_dict` read.
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


def load_state_dict(data: Mapping[str, Any]) -> tuple[Float8Recipe | BlockRecipe, Float8State]:
    """Read :func:`state_dict` back (host values), validating every field (all or nothing); a block
    recipe's dict reads back as the :class:`mpx.blocks.BlockRecipe` and an empty state.

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
    if is_block_recipe_dict(data.get("recipe")):
        return _load_block(data)
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


def _load_block(data: Mapping[str, Any]) -> tuple[BlockRecipe, Float8State]:
    """A block recipe's ``mpx.float8/1`` dict: the recipe, ``stateless: true`` and no tensors."""
    fields = dict(data["recipe"])
    if fields.pop("stateless", None) is not True:
        raise StateDictError("recipe.stateless: expected true (a block-scaled recipe keeps no state)")
    try:
        recipe = BlockRecipe.from_dict(fields)
    except Float8Error as exc:
        raise StateDictError(f"recipe: {exc}") from None
    if data.get("tensors") != {}:
        raise StateDictError("tensors: a block-scaled recipe is stateless; expected an empty mapping")
    return recipe, Float8State({})
