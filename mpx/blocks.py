"""Block-scaled low precision: one recipe type (:class:`BlockRecipe`) and its presets.

A sibling of :class:`mpx.Float8Recipe`: where FP8's per-tensor scaling keeps a state (an
amax history and a scale per tensor), a block-scaled format computes every scale from the
block being quantized, so a block recipe is stateless (its ``mpx.float8/1`` state dict
holds the recipe and no tensors).  The numbers are :mod:`mpx.kernels.blocks`' (quantize,
dequantize, every scale rule, padding, NaN/inf/zero blocks); this module only names them.

Fields
    ``element``: the element format: ``e4m3`` (``float8_e4m3fn``), ``e5m2``
    (``float8_e5m2``), ``e2m1`` (``float4_e2m1fn``), ``e2m3`` (``float6_e2m3fn``) or
    ``e3m2`` (``float6_e3m2fn``), all ml_dtypes types.  ``grad_element``: the
    gradients' format (None: ``element``).

    ``input_block``, ``weight_block``, ``grad_block``: the block of each GEMM role,
    written along the GEMM's reduction dimension: ``"tensor"`` (one scale),
    ``"row"`` (one scale per row: the whole reduction dimension), ``"1xN"`` (N
    elements along the reduction dimension) or ``"NxN"`` (a square tile, the same
    bytes in the forward and the backward GEMM).

    ``scale``: ``"e8m0"`` (a power of two, one byte: MX), ``"pow2"`` (a float32 power
    of two), ``"float32"``, ``"e4m3"`` (an E4M3 scale per block) or ``"e4m3_f32"`` (an
    E4M3 scale per block and a float32 scale per tensor: NVFP4).

    ``scale_rule``: for ``e8m0`` scales ``"floor"`` (OCP/torchao), ``"rceil"``
    (Transformer Engine/cuBLAS) or ``"even"`` (torchao); ``"floor"`` for ``pow2``
    (``fp8_max / amax`` rounded down to a power of two); ``"nearest"`` for
    ``float32``, ``e4m3`` and ``e4m3_f32`` (a round-to-nearest cast).

    ``rounding``: ``"nearest"`` (ties to even) or ``"stochastic"``: the gradients' elements are
    rounded stochastically with the core's counter generator keyed by (seed, step, tensor index),
    so every backend rounds the same bits (:mod:`mpx.kernels.blocks`); inputs and weights round
    to nearest, as Transformer Engine's NVFP4 does.

    ``hadamard``: the random Hadamard transform (16x16, random signs per step) of the
    weight-gradient GEMM's operands before they are quantized (:mod:`mpx.kernels.hadamard`).

>>> r = PRESETS["mxfp8"]
>>> r.element, r.block_of("weight"), r.scale, r.scale_rule
('e4m3', (1, 32), 'e8m0', 'floor')
>>> PRESETS["fp8_blockwise"].block_of("weight")
(128, 128)
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mpx.errors import Float8Error

__all__ = [
    "BLOCK_KINDS",
    "ELEMENTS",
    "FP4_PRESETS",
    "FP8_PRESETS",
    "PRESETS",
    "SCALES",
    "SCALE_RULES",
    "BlockRecipe",
    "is_block_recipe_dict",
    "storage_bytes",
]

#: The element formats (short name: ml_dtypes type name).
ELEMENTS: dict[str, str] = {
    "e4m3": "float8_e4m3fn",
    "e5m2": "float8_e5m2",
    "e2m1": "float4_e2m1fn",
    "e2m3": "float6_e2m3fn",
    "e3m2": "float6_e3m2fn",
}
#: The scale formats and the scale rules each allows (the first is the default).
SCALE_RULES: dict[str, tuple[str, ...]] = {
    "e8m0": ("floor", "rceil", "even"),
    "pow2": ("floor",),
    "float32": ("nearest",),
    "e4m3": ("nearest",),
    "e4m3_f32": ("nearest",),
}
SCALES = tuple(SCALE_RULES)
#: The block kinds a role's block may name.
BLOCK_KINDS = ("tensor", "row", "1xN", "NxN")
_ROLES = ("input", "weight", "grad")
_BLOCK = re.compile(r"^([1-9][0-9]{0,4})x([1-9][0-9]{0,4})$")
_ROUNDINGS = ("nearest", "stochastic")


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else f"{value!r} ({type(value).__name__})"


def _block(name: str, value: Any) -> tuple[int, int]:
    """A block string as ``(rows, cols)`` along (across, along) the reduction dimension; 0 means whole."""
    if value == "tensor":
        return (0, 0)
    if value == "row":
        return (1, 0)
    match = _BLOCK.match(value) if isinstance(value, str) else None
    if match is None or not (match[1] == "1" or match[1] == match[2]):
        raise Float8Error(
            f"{name}: {_show(value)} is not allowed; allowed: tensor, row, 1xN or NxN (N in 1..99999), "
            "e.g. 1x32 or 128x128"
        )
    return (int(match[1]), int(match[2]))


@dataclass(frozen=True)
class BlockRecipe:
    """A block-scaled low-precision recipe (frozen, hashable; see the module docs for every field).

    Attributes:
        element: element format (default ``"e4m3"``).
        grad_element: the gradients' element format, or None for ``element``.
        input_block, weight_block, grad_block: each role's block (default ``"1x32"``).
        scale: scale format (default ``"e8m0"``).
        scale_rule: how a block's amax becomes its scale (default ``"floor"``).
        rounding: the gradients' element rounding (``"nearest"`` or ``"stochastic"``).
        hadamard: the random Hadamard transform of the weight-gradient operands (False).
    """

    element: str = "e4m3"
    grad_element: str | None = None
    input_block: str = "1x32"
    weight_block: str = "1x32"
    grad_block: str = "1x32"
    scale: str = "e8m0"
    scale_rule: str = "floor"
    rounding: str = "nearest"
    hadamard: bool = False

    def __post_init__(self) -> None:
        for name in ("element", "grad_element"):
            value = getattr(self, name)
            if (value is not None or name == "element") and (
                not isinstance(value, str) or value not in ELEMENTS
            ):
                raise Float8Error(f"{name}: {_show(value)} is not allowed; allowed: {', '.join(ELEMENTS)}")
        for role in _ROLES:
            _block(f"{role}_block", getattr(self, f"{role}_block"))
        if not isinstance(self.scale, str) or self.scale not in SCALE_RULES:
            raise Float8Error(f"scale: {_show(self.scale)} is not allowed; allowed: {', '.join(SCALES)}")
        rules = SCALE_RULES[self.scale]
        if self.scale_rule not in rules:
            raise Float8Error(
                f"scale_rule: {_show(self.scale_rule)} is not allowed with scale={self.scale!r}; "
                f"allowed: {', '.join(rules)}"
            )
        if self.scale in ("pow2", "float32"):
            for name in ("element", "grad_element"):
                if getattr(self, name) not in (None, "e4m3", "e5m2"):
                    raise Float8Error(
                        f"{name}: {getattr(self, name)!r} is not allowed with scale={self.scale!r} "
                        "(float32 scales come from fp8_max / amax); allowed: e4m3, e5m2"
                    )
        if self.rounding not in _ROUNDINGS:
            raise Float8Error(
                f"rounding: {_show(self.rounding)} is not allowed; allowed: {', '.join(_ROUNDINGS)}"
            )
        if not isinstance(self.hadamard, bool):
            raise Float8Error(f"hadamard: expected a bool, got {_show(self.hadamard)}")

    # -- what the kernels read ---------------------------------------------------
    def element_of(self, role: str) -> str:
        """The element format of a tensor with this ``role`` (``input``, ``weight`` or ``grad``)."""
        if role not in _ROLES:
            raise Float8Error(f"role: {_show(role)} is not allowed; allowed: {', '.join(_ROLES)}")
        return self.grad_element or self.element if role == "grad" else self.element

    def block_of(self, role: str) -> tuple[int, int]:
        """``(rows, cols)`` of a role's block: cols along the reduction dimension, rows across it; 0 is
        the whole dimension (``"tensor"`` is ``(0, 0)``, ``"row"`` ``(1, 0)``)."""
        self.element_of(role)
        return _block(f"{role}_block", getattr(self, f"{role}_block"))

    @property
    def name(self) -> str | None:
        """The preset name of this recipe (``"mxfp8"``...), or None."""
        return next((name for name, recipe in PRESETS.items() if recipe == self), None)

    @property
    def stateless(self) -> bool:
        """Always True: every scale comes from the block being quantized (no amax history)."""
        return True

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict of every field, with ``"kind": "block"`` (what tells it from a Float8Recipe's)."""
        return {"kind": "block", **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BlockRecipe:
        """Read :meth:`to_dict` back; unknown keys raise :class:`Float8Error`, missing ones take defaults."""
        if not isinstance(data, Mapping):
            raise Float8Error(f"recipe: expected a mapping, got {type(data).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in data if k not in (*names, "kind")]
        if unknown:
            raise Float8Error(f"recipe: unknown key {_show(unknown[0])}; allowed: kind, {', '.join(names)}")
        if data.get("kind", "block") != "block":
            raise Float8Error(f"recipe.kind: {_show(data['kind'])} is not allowed; allowed: block")
        return cls(**{k: v for k, v in data.items() if k != "kind"})


def is_block_recipe_dict(data: Any) -> bool:
    """Whether a recipe dict (``to_dict`` form) is a :class:`BlockRecipe`'s (it has ``"kind": "block"``)."""
    return isinstance(data, Mapping) and data.get("kind") == "block"


#: The block presets by name (policy specs: ``fp8=NAME`` for the FP8 ones, ``fp4=NAME`` for the FP4 one).
PRESETS: dict[str, BlockRecipe] = {
    # OCP MX / torchao MXFP8: 1x32 blocks along the reduction dimension, E8M0 scales, FLOOR
    "mxfp8": BlockRecipe(),
    # Transformer Engine / cuBLAS MXFP8: the same with the RCEIL rule
    "mxfp8_rceil": BlockRecipe(scale_rule="rceil"),
    "mxfp4": BlockRecipe(element="e2m1"),
    # NVFP4 (torchao's nvfp4 with a per-tensor scale): 1x16 blocks, E4M3 block scales, float32 tensor scale
    "nvfp4": BlockRecipe(
        element="e2m1", input_block="1x16", weight_block="1x16", grad_block="1x16",
        scale="e4m3_f32", scale_rule="nearest",
    ),
    # Transformer Engine's NVFP4BlockScaling: 16x16 weight tiles, stochastically rounded gradients and
    # the random Hadamard transform of the weight-gradient operands
    "nvfp4_te": BlockRecipe(
        element="e2m1", input_block="1x16", weight_block="16x16", grad_block="1x16",
        scale="e4m3_f32", scale_rule="nearest", rounding="stochastic", hadamard=True,
    ),
    # Transformer Engine Float8BlockScaling (DeepSeek-V3): 1x128 activations and gradients, 128x128 weights
    "fp8_blockwise": BlockRecipe(
        input_block="1x128", weight_block="128x128", grad_block="1x128", scale="pow2",
    ),
    # torchao's rowwise float8: one power-of-two scale per row, E4M3 everywhere
    "fp8_rowwise": BlockRecipe(input_block="row", weight_block="row", grad_block="row", scale="pow2"),
}  # fmt: skip
#: The presets a spec's ``fp8=`` key names (FP8 elements) and those ``fp4=`` names (FP4 elements).
FP8_PRESETS = tuple(name for name, r in PRESETS.items() if r.element in ("e4m3", "e5m2"))
FP4_PRESETS = tuple(name for name, r in PRESETS.items() if r.element == "e2m1")


#: The stored bits of each element format (FP6 packed: 6 bits, as the OCP MX spec stores it).
ELEMENT_BITS = {"e4m3": 8, "e5m2": 8, "e2m1": 4, "e2m3": 6, "e3m2": 6}
#: The bytes of one scale of each scale format (``e4m3_f32`` adds 4 bytes per tensor).
SCALE_BYTES = {"e8m0": 1, "pow2": 4, "float32": 4, "e4m3": 1, "e4m3_f32": 1}
_PLAIN_BITS = {"float32": 32, "bfloat16": 16, "float16": 16}


def storage_bytes(recipe: BlockRecipe | str, role: str, shape: tuple[int, int], axis: int = 1) -> int:
    """The bytes a 2-D operand of ``shape`` takes quantized under ``recipe`` as ``role`` with blocks along
    ``axis`` (as :func:`mpx.kernels.blocks.quantize` lays it out): the elements packed at their bits
    (rounded up to a byte per tensor), one scale per block, 4 bytes of tensor scale for ``e4m3_f32``; the
    weight-gradient operands of a Hadamard recipe (``input``/``grad`` along axis 0) count the reduction
    dimension padded to 16.  ``recipe`` may also be ``"float32"``, ``"bfloat16"`` or ``"float16"`` (the
    plain bytes).  Deterministic: a function of the shapes only.

    >>> storage_bytes(PRESETS["mxfp8"], "weight", (64, 128)), storage_bytes("bfloat16", "weight", (64, 128))
    (8448, 16384)
    """
    rows, cols = (shape[0], shape[1]) if axis in (1, -1) else (shape[1], shape[0])
    if isinstance(recipe, str):
        if recipe not in _PLAIN_BITS:
            raise Float8Error(
                f"recipe: {recipe!r} is not allowed; allowed: a BlockRecipe or {', '.join(_PLAIN_BITS)}"
            )
        return rows * cols * _PLAIN_BITS[recipe] // 8
    if recipe.hadamard and axis == 0 and role in ("input", "grad"):
        cols = -(-cols // 16) * 16
    br, bc = recipe.block_of(role)
    br, bc = br or rows, bc or cols
    blocks = -(-rows // br) * -(-cols // bc)
    extra = 4 if recipe.scale == "e4m3_f32" else 0
    return (
        -(-rows * cols * ELEMENT_BITS[recipe.element_of(role)] // 8)
        + blocks * SCALE_BYTES[recipe.scale]
        + extra
    )
