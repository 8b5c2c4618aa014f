"""The ``blocks`` conformance cases, their expectations from the core (:mod:`mpx.kernels.blocks`), and what
a native divergence is (:func:`blocks_topic`).

One kind of case, ``block_quantize``: an input (:func:`conformance.blocks.block_input`: random,
all-zero blocks, specials (NaN, ±inf, 3e38, subnormals), an all-zero tensor) quantized under a block
preset (``mxfp8``, ``mxfp8_rceil``, ``mxfp4``, ``nvfp4``, ``fp8_blockwise``, ``fp8_rowwise``) as the
``input`` role of the forward GEMM (blocks along the last axis): the sha256 of the element codes and
of the scales, and the tensor scale's bits, equal to :func:`mpx.kernels.blocks.quantize`'s.

A native column names the rule it has (``native`` in its observation); a framework with no
block-scaled format for the preset observes ``{"missing": ...}``, an ``API or format gap`` finding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from conformance.blocks import block_input, observe
from mpx.blocks import PRESETS, BlockRecipe
from mpx.kernels import blocks as kb
from mpx.kernels.array_ops import NUMPY_OPS

GROUP = "blocks"
BLOCK_PRESETS = ("mxfp8", "mxfp8_rceil", "mxfp4", "nvfp4", "fp8_blockwise", "fp8_rowwise")
#: (input kind, seed, words)
INPUTS = (
    ("random", 31, "random values, each row of its own magnitude in 2**[-20, 20]"),
    ("zero_blocks", 32, "random values with all-zero blocks"),
    ("specials", 33, "random values with a NaN, ±inf, 3e38 and float32 subnormals in their blocks"),
)
WORDS = {"zero_tensor": "an all-zero tensor", **{k: w for k, _, w in INPUTS}}


def expected_of(x: Any, recipe: BlockRecipe) -> dict:
    """The core's observation of ``x`` quantized under ``recipe`` (the forward input, axis 1)."""
    q = kb.quantize(NUMPY_OPS, x, recipe, "input", 1)
    return observe(q.codes, recipe.element, q.scales, recipe.scale, q.tensor_scale)


def blocks_cases() -> list[dict]:
    """Every case of the ``blocks`` group."""
    out = []
    for name in BLOCK_PRESETS:
        recipe = PRESETS[name]
        inputs = [*INPUTS, ("zero_tensor", 34, WORDS["zero_tensor"])] if name == "nvfp4" else INPUTS
        for kind, seed, words in inputs:
            x = block_input(kind, seed)
            params = {"preset": name, "recipe": recipe.to_dict(), "kind": kind, "seed": seed, "role": "input",
                      "axis": 1}  # fmt: skip
            out.append({
                "id": f"{GROUP}.{name}.{kind}", "group": GROUP, "kind": "block_quantize", "params": params,
                "expected": expected_of(x, recipe),
                "spec": f"{x.shape[0]}x{x.shape[1]} float32 {words} quantized under {name} ({recipe.element} "
                f"elements, {recipe.input_block} blocks, {recipe.scale} scales, {recipe.scale_rule}): the sha256 "
                "of the element codes and of the scales and the tensor scale's bits of mpx.kernels.blocks.quantize",
            })  # fmt: skip
    return out


# -- what a native divergence is ----------------------------------------------------------------------

#: What each named divergence means for training (the explanation of a ``blocks-*`` finding).
BLOCK_EFFECTS = {
    "RCEIL rule": "It has only Transformer Engine's/cuBLAS's RCEIL rule (amax / element max rounded up to a "
    "power of two); OCP MX and torchao's default FLOOR put most blocks' scales one power of two lower, so a "
    "FLOOR recipe's bytes cannot be reproduced.",
    "FLOOR rule": "It computes the FLOOR scale where RCEIL is asked (or RCEIL another way), so scales differ "
    "by a power of two for some blocks.",
    "random": "Ordinary blocks quantize to other bytes: another scale rule, or the divisions in another order "
    "(x / tensor scale / block scale instead of x * (1 / tensor scale / block scale)).",
    "zero_blocks": "An all-zero block gets another scale or NaN elements (JAX's NVFP4 block scale of a zero "
    "block is 0, so 0 / 0 is NaN; eager XLA also flushes the E8M0 scale 2**-127 to zero): one zero block "
    "(padding, a dead feature) poisons the GEMM.",
    "specials": "A block with NaN, ±inf, float32's largest values or subnormals quantizes otherwise: the "
    "other elements of a NaN block (torchao's MX: zeros or stray FP4 bits beside the NaN, mpx: NaN, so the "
    "block reads NaN either way), a NaN or inf row under rowwise scaling (torchao: scale NaN or 0, so NaN "
    "or zero elements; mpx: scale 1.0 and saturation), or subnormals flushed.",
    "zero_tensor": "An all-zero tensor gets NaN scales (its tensor scale 0 divides): the GEMM is NaN where "
    "mpx's is zero.",
    "missing": "The framework has no block-scaled format for this preset (MXFP8, MXFP4, NVFP4, blockwise or "
    "rowwise FP8): block-scaled training needs mpx's kernels or an emulation of one's own.",
}
#: (kind, severity) of each named divergence
BLOCK_SEVERITY = {
    "RCEIL rule": ("default differs", "medium"),
    "FLOOR rule": ("default differs", "medium"),
    "random": ("precision hazard", "medium"),
    "zero_blocks": ("precision hazard", "high"),
    "specials": ("precision hazard", "medium"),
    "zero_tensor": ("precision hazard", "high"),
    "missing": ("API or format gap", "medium"),
}


def rule_cause(params: dict, observed: dict) -> str | None:
    """``"RCEIL rule"`` / ``"FLOOR rule"`` when the core with the other E8M0 rule reproduces ``observed``'s
    scales (the element codes follow the scales), else None."""
    recipe = BlockRecipe.from_dict(params["recipe"])
    if recipe.scale != "e8m0":
        return None
    other = "floor" if recipe.scale_rule == "rceil" else "rceil"
    alt = expected_of(
        block_input(params["kind"], params["seed"]), dataclasses.replace(recipe, scale_rule=other)
    )
    if alt["scales"] == observed.get("scales"):
        return "RCEIL rule" if other == "rceil" else "FLOOR rule"
    return None


def blocks_topic(case_id: str, params: dict, expected: dict, observed: dict) -> tuple[str, str, str]:
    """(kind, severity, topic) of a native divergence of the ``blocks`` group: ``blocks-missing``, or
    ``blocks-quantize:<cause>`` (the E8M0 rule, else the case's input kind, with the parts that differ)."""
    if "missing" in observed:
        return (*BLOCK_SEVERITY["missing"], "blocks-missing")
    cause = rule_cause(params, observed) or params["kind"]
    parts = [p for p in ("codes", "scales", "tensor_scale") if observed.get(p) != expected.get(p)]
    kind, severity = BLOCK_SEVERITY[cause]
    return kind, severity, f"blocks-quantize:{cause}+" + "+".join(parts or ["raised"])


__all__ = ["BLOCK_EFFECTS", "BLOCK_PRESETS", "BLOCK_SEVERITY", "blocks_cases", "blocks_topic", "rule_cause"]
