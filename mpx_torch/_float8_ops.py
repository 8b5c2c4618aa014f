"""The tensor half of :mod:`mpx_torch.float8`: the core's FP8 kernels with the torch table, and the FP8 GEMM.

The numbers are the core's (:mod:`mpx.kernels.float8`, :func:`mpx.kernels.bits.abs_max`) run with
:class:`mpx_torch._array_ops.TorchOps` on the tensors' device: :func:`quantize` is
``mpx.float8.quantize`` (bytes equal, NaN as NaN), :func:`amax` is ``max(|x|)`` and :func:`scales`
``mpx.float8.compute_scale``, bit for bit; :func:`gemm` is ``mpx.float8.fp8_dot`` up to float32
rounding of the sums (the matmul is torch's).  All are tensor ops with no host sync.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mpx.float8 import Float8Recipe
from mpx.kernels import bits
from mpx.kernels import float8 as kernel
from mpx_torch import _compat
from mpx_torch._array_ops import ops_for

__all__ = [
    "TORCH_FORMATS",
    "Float8LinearFunction",
    "amax",
    "gemm",
    "observe",
    "quantize",
    "scaled_mm_available",
    "scales",
]

#: The torch dtype of each FP8 format of :data:`mpx.float8.FORMATS`.
TORCH_FORMATS: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def quantize(x: torch.Tensor, scale: torch.Tensor | float, fmt: str) -> torch.Tensor:
    """``fp8(clip(float32(x) * float32(scale), -fp8_max, fp8_max))`` (:func:`mpx.kernels.float8.quantize`).

    ``scale``: a float32 scalar tensor or a float (rounded to float32).  NaN stays NaN (torch's e5m2
    NaN byte is 0x7F, ml_dtypes' 0x7E).

    Raises:
        mpx.Float8Error: for an unknown ``fmt``.
    """
    return kernel.quantize(ops_for(x.device), x, scale, fmt)


def amax(x: torch.Tensor) -> torch.Tensor:
    """``max(|x|)`` as a float32 scalar (:func:`mpx.kernels.bits.abs_max`: a NaN wins, subnormals count)."""
    return bits.abs_max(ops_for(x.device), x.detach())


def observe(pending: torch.Tensor, amaxes: torch.Tensor) -> None:
    """Fold ``amaxes`` into the ``pending`` amaxes in place: their MAX with a NaN winning
    (:func:`mpx.kernels.float8.window_max`; -1, "none observed", loses to any amax)."""
    pending.copy_(kernel.window_max(ops_for(pending.device), pending, amaxes.reshape(pending.shape)))


def scales(recipe: Float8Recipe, amaxes: torch.Tensor, fmt: str, previous: Any = 1.0) -> torch.Tensor:
    """The float32 scales of float32 ``amaxes`` in ``fmt`` (:func:`mpx.kernels.float8.compute_scale`,
    elementwise): delayed scaling keeps ``previous`` for a zero or non-finite amax, current scaling
    floors the amax at 1e-12 and gives 1.0 for a non-finite one."""
    return kernel.compute_scale(ops_for(amaxes.device), recipe, amaxes, fmt, previous)


_PROBED: dict[torch.device, bool] = {}


def scaled_mm_available(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` runs FP8 GEMMs on ``device`` fast: a CUDA device it accepts
    e4m3 x e5m2 operands on (compute capability 8.9 and up).  The CPU kernel is a reference (it takes
    seconds where the float32 emulation takes milliseconds), so the CPU is never chosen by ``"auto"``."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    if device not in _PROBED:
        a = torch.zeros(16, 16, device=device, dtype=torch.float8_e4m3fn)
        b = torch.zeros(16, 16, device=device, dtype=torch.float8_e5m2).t()
        one = torch.ones((), device=device)
        try:
            _compat.scaled_mm()(a, b, one, one, out_dtype=torch.float32)
            _PROBED[device] = True
        except RuntimeError:
            _PROBED[device] = False
    return _PROBED[device]


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_inv: torch.Tensor,
    b_inv: torch.Tensor,
    use_scaled_mm: bool,
) -> torch.Tensor:
    """``(float32(a) @ float32(b)) * a_inv * b_inv`` in float32, for FP8 ``a`` (m, k) and ``b`` (k, n).

    ``use_scaled_mm``: through ``torch._scaled_mm`` (``a`` made row-major, ``b``
    column-major, as cuBLASLt wants); on CUDA only when m, k and n are multiples
    of 16, else the emulation.  The emulation dequantizes to float32 (exact: an
    FP8 value is a float32 value) and multiplies in float32, autocast off.
    """
    m, k = a.shape
    n = b.shape[1]
    if use_scaled_mm and (a.device.type != "cuda" or (m % 16 == 0 and k % 16 == 0 and n % 16 == 0)):
        return _compat.scaled_mm()(
            a.contiguous(), b.t().contiguous().t(), a_inv, b_inv, out_dtype=torch.float32
        )
    with torch.autocast(a.device.type, enabled=False):
        return torch.mm(a.to(torch.float32), b.to(torch.float32)) * a_inv * b_inv


class Float8LinearFunction(torch.autograd.Function):
    """``y = x @ W.T + b`` with both GEMMs of the backward in FP8 too.

    Forward: ``x`` and ``W`` quantized (e4m3) with their scales, one FP8 GEMM,
    the bias added in float32, the result cast to ``out_dtype``.  The quantized
    ``x`` and ``W`` (one byte an element) are what the backward keeps.
    Backward: the gradient's amax goes into ``grad_amax`` (a view of the module's
    pending amaxes, :func:`observe`), the gradient is quantized in the recipe's grad
    format (e5m2 under ``hybrid``) with ``grad_scale`` (delayed) or its own amax's scale
    (current), and dgrad ``g @ W`` and wgrad ``g.T @ x`` are FP8 GEMMs; the bias
    gradient is the float32 sum of the unquantized gradient.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        x_scale: torch.Tensor,
        w_scale: torch.Tensor,
        grad_scale: torch.Tensor,
        grad_amax: torch.Tensor,
        config: tuple[Float8Recipe, bool, torch.dtype],
    ) -> torch.Tensor:
        use_scaled_mm, out_dtype = config[1], config[2]
        x2d = x.reshape(-1, x.shape[-1])
        qx = quantize(x2d, x_scale, "e4m3")
        qw = quantize(weight, w_scale, "e4m3")
        x_inv, w_inv = 1.0 / x_scale, 1.0 / w_scale
        out = gemm(qx, qw.t(), x_inv, w_inv, use_scaled_mm)
        # an inf operand would be clipped to fp8_max and hide an overflow from the loss scaler: poison the GEMM
        finite = torch.isfinite(x2d).all() & torch.isfinite(weight).all()
        out = torch.where(finite, out, torch.full_like(out, math.nan))
        if bias is not None:
            out = out + bias.to(torch.float32)
        ctx.save_for_backward(qx, qw, x_inv, w_inv, grad_scale, finite)
        ctx.grad_amax = grad_amax
        ctx.config = config
        ctx.shapes = (x.shape, x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out.to(out_dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        qx, qw, x_inv, w_inv, grad_scale, finite = ctx.saved_tensors
        recipe, use_scaled_mm, _ = ctx.config
        grad_fmt = recipe.format_of("grad")
        x_shape, x_dtype, w_dtype, b_dtype = ctx.shapes
        g2d = grad_out.reshape(-1, grad_out.shape[-1])
        g_amax = amax(g2d)
        observe(ctx.grad_amax, g_amax)
        if recipe.scaling == "current":
            grad_scale = scales(recipe, g_amax, grad_fmt)
        qg = quantize(g2d, grad_scale, grad_fmt)
        g_inv = 1.0 / grad_scale
        finite = finite & torch.isfinite(g_amax)  # an overflowed (scaled) gradient poisons both GEMMs
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = gemm(qg, qw, g_inv, w_inv, use_scaled_mm)
            dx = torch.where(finite, dx, torch.full_like(dx, math.nan)).to(x_dtype).reshape(x_shape)
        if ctx.needs_input_grad[1]:
            dw = gemm(qg.t(), qx, g_inv, x_inv, use_scaled_mm)
            dw = torch.where(finite, dw, torch.full_like(dw, math.nan)).to(w_dtype)
        if b_dtype is not None and ctx.needs_input_grad[2]:
            db = g2d.to(torch.float32).sum(0).to(b_dtype)
        return dx, dw, db, None, None, None, None, None
