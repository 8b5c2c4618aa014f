"""Block-scaled GEMMs for PyTorch: a policy's :class:`mpx.blocks.BlockRecipe` on ``nn.Linear`` modules.

:func:`convert` (which :func:`mpx_torch.prepare` runs) turns every ``nn.Linear`` whose policy
names a block recipe (``mixed_bfloat16,fp8=mxfp8``, ``fp4=nvfp4``; ``@head={fp8=none}`` keeps a
module out) into a :class:`BlockLinear`, in place: the same object and parameters.  Each of its
three GEMMs quantizes both operands with the core's kernel (:func:`mpx.kernels.blocks.quantize`
run with the torch table: the bytes and scales are the core's) along that GEMM's reduction
dimension (:data:`mpx.kernels.blocks.GEMM_OPERANDS`: forward ``x``, ``w`` along K; input
gradient ``dy``, ``w`` along N; weight gradient ``dy``, ``x`` along M), each copy from the
high-precision tensor, then multiplies the dequantized operands in float32.  A GEMM with an inf
or NaN operand returns NaN (the quantization saturates an inf), so a loss scaler sees the overflow.

The GEMM is emulated (``BlockLinear.block_gemm == "emulate"``) on every device in this version:
``torch._scaled_mm`` with block scales is not wired in, so a CUDA device runs the same emulation
and says so in the label.  Block recipes are stateless: there is nothing to commit, and a step
the loss scaler skips changes nothing.

>>> import torch
>>> from mpx_torch import blocks
>>> model = blocks.convert(torch.nn.Sequential(torch.nn.Linear(32, 4)), "mixed_bfloat16,fp8=mxfp8")
>>> type(model[0]).__name__, model[0].block_gemm
('BlockLinear', 'emulate')
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mpx import MPXError, OpTable, PolicySpec, StateDictError
from mpx.blocks import BlockRecipe
from mpx.kernels import blocks as kernel
from mpx_torch._array_ops import ops_for
from mpx_torch._convert import check_model, linear_recipes, to_linear

__all__ = ["BlockLinear", "block_recipe_of", "convert", "quantize"]


def quantize(
    x: torch.Tensor, recipe: BlockRecipe, role: str, axis: int = 1, *,
    seed: int | None = None, step: Any = 0, index: int = 0,
) -> kernel.BlockQuantized:  # fmt: skip
    """A 2-D tensor quantized by the core's kernel with the torch table (int32 codes, per-block scales);
    ``seed``, ``step``, ``index``: :func:`mpx.kernels.blocks.quantize`'s (stochastic rounding, RHT)."""
    return kernel.quantize(
        ops_for(x.device), x.detach(), recipe, role, axis, seed=seed, step=step, index=index
    )


def _qdq(x: torch.Tensor, recipe: BlockRecipe, role: str, axis: int, **rng: Any) -> torch.Tensor:
    """``x`` (2-D) quantized and dequantized: the float32 operand the GEMM multiplies (for the
    weight-gradient operands of a Hadamard recipe: the transformed operand, M padded to 16)."""
    o = ops_for(x.device)
    return kernel.dequantize(o, kernel.quantize(o, x.detach(), recipe, role, axis, **rng), recipe, role, axis)


def _poison(y: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``y``, or NaN everywhere when an operand holds inf or NaN (quantization saturates an inf, which
    would hide an overflow from the loss scaler: :func:`mpx.float8.fp8_dot`'s rule); no host sync."""
    finite = torch.logical_and(torch.isfinite(a).all(), torch.isfinite(b).all())
    return torch.where(finite, y, torch.full_like(y, float("nan")))


class _BlockLinearFunction(torch.autograd.Function):
    """``y = x @ w.T (+ b)`` with each GEMM's operands block-quantized (see the module docs)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, recipe: BlockRecipe,
                out_dtype: torch.dtype, rng: tuple[int, torch.Tensor, int]) -> torch.Tensor:  # fmt: skip
        ctx.save_for_backward(x, w)
        ctx.recipe, ctx.has_bias, ctx.rng = recipe, b is not None, rng
        y = _poison(_qdq(x, recipe, "input", 1) @ _qdq(w, recipe, "weight", 1).T, x, w)
        if b is not None:
            y = y + b.float()
        return y.to(out_dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        recipe = ctx.recipe
        seed, step, index = ctx.rng
        dy = dy.float()
        rng = {"seed": seed, "step": step}
        dyq = _qdq(dy, recipe, "grad", 1, index=2 * index, **rng)
        dx = _poison(dyq @ _qdq(w, recipe, "weight", 0), dy, w)
        dyq = _qdq(dy, recipe, "grad", 0, index=2 * index + 1, **rng)
        dw = _poison(dyq.T @ _qdq(x, recipe, "input", 0, **rng), dy, x)  # M padded to 16 under the RHT
        db = dy.sum(0).to(w.dtype) if ctx.has_bias else None
        return dx.to(x.dtype), dw.to(w.dtype), db, None, None, None


class BlockLinear(nn.Linear):
    """An ``nn.Linear`` whose GEMMs run block-scaled (made by :func:`convert`, never directly).

    Attributes:
        block_recipe: the :class:`mpx.blocks.BlockRecipe`.
        block_gemm: ``"emulate"`` (see the module docs).
        block_seed: the seed of stochastic rounding and the Hadamard signs (:func:`convert`'s ``seed``).
        block_index: this layer's index among the model's block layers (its gradients' rounding keys
            are ``2 * index`` for the input gradient's copy and ``2 * index + 1`` for the weight's).
        block_step: the counter of the forward passes run with gradients enabled (the step of the
            random bits; it advances on a step the loss scaler skips too: it is not state).
    """

    block_recipe: BlockRecipe
    block_gemm: str
    block_seed: int
    block_index: int
    block_step: int

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        device_type = input.device.type
        out_dtype = (
            torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else input.dtype
        )
        with torch.autocast(device_type, enabled=False):
            x2 = input.reshape(-1, input.shape[-1])
            step = torch.tensor(self.block_step, dtype=torch.int32, device=input.device)
            if torch.is_grad_enabled():
                self.block_step += 1
            rng = (self.block_seed, step, self.block_index)
            y = _BlockLinearFunction.apply(x2, self.weight, self.bias, self.block_recipe, out_dtype, rng)
        return y.reshape(*input.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        name = self.block_recipe.name or "custom block recipe"
        return f"{super().extra_repr()}, recipe={name}, gemm={self.block_gemm}"


def _revert(module: BlockLinear) -> None:
    to_linear(module, ("block_recipe", "block_gemm", "block_seed", "block_index", "block_step"))


def convert(
    model: nn.Module, policy: PolicySpec, *, op_table: OpTable | None = None, seed: int = 0
) -> nn.Module:
    """Run the ``nn.Linear`` modules of ``model`` whose policy names a block recipe as :class:`BlockLinear`,
    in place (only modules whose class is exactly ``nn.Linear``); a :class:`BlockLinear` whose policy no
    longer names one becomes an ``nn.Linear`` again.  ``seed`` (default 0): the layers' ``block_seed``
    (stochastic rounding, Hadamard signs); the layers are indexed in ``named_modules`` order.

    Raises:
        mpx.UnsupportedTypeError: for a ``model`` that is not a ``torch.nn.Module``.
    """
    check_model(model, "mpx_torch.blocks.convert")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise MPXError(f"seed: {seed!r} is not allowed; allowed: a Python int")
    found = linear_recipes(
        model, policy, op_table, recipe_type=BlockRecipe, converted=BlockLinear, revert=_revert
    )
    for index, (path, sub, recipe) in enumerate(found):
        if sub.weight.dim() != 2:
            raise MPXError(f"module {path!r}: a block-scaled Linear needs a 2-D weight")
        sub.__class__ = BlockLinear
        sub.block_recipe = recipe
        sub.block_gemm = "emulate"
        sub.block_seed, sub.block_index = seed, index
        sub.__dict__.setdefault("block_step", 0)
    return model


def block_recipe_of(model: nn.Module) -> BlockRecipe | None:
    """The one block recipe of ``model``'s :class:`BlockLinear` modules (None without any): what its
    ``mpx.float8/1`` dict holds (stateless: no tensors).

    Raises:
        mpx.StateDictError: when they use more than one recipe.
    """
    found = {m.block_recipe for m in model.modules() if isinstance(m, BlockLinear)}
    if len(found) > 1:
        raise StateDictError(
            f"model: its block-scaled layers use {len(found)} different recipes; an mpx.float8/1 dict holds one"
        )
    return found.pop() if found else None
