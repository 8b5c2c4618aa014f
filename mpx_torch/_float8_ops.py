"""The tensor half of :mod:`mpx_torch.float8`: quantization, the scale rules and the FP8 GEMM.

Every function here is the torch form of one function of :mod:`mpx.float8`, bit for bit:
:func:`quantize` is ``mpx.float8.quantize`` (bytes equal, NaN as NaN), :func:`delayed_scales` and
:func:`current_scales` are ``mpx.float8.compute_scale`` (float64 arithmetic, one rounding to
float32), and :func:`gemm` is ``mpx.float8.fp8_dot`` up to float32 rounding of the sums.  All are
tensor ops with no host sync, traceable by dynamo.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mpx.float8 import CURRENT_AMAX_FLOOR, fp8_max
from mpx_torch import _compat

__all__ = [
    "TORCH_FORMATS",
    "Float8LinearFunction",
    "current_scales",
    "delayed_scales",
    "gemm",
    "quantize",
    "scaled_mm_available",
]

#: The torch dtype of each FP8 format of :data:`mpx.float8.FORMATS`.
TORCH_FORMATS: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_LIMITS = {fmt: fp8_max(fmt) for fmt in TORCH_FORMATS}  # constants dynamo reads (it traces no ml_dtypes)
_F32_MAX = float(torch.finfo(torch.float32).max)
_F32_TINY = float(torch.finfo(torch.float32).tiny)
_EXPONENT_BITS = 0x7F800000  # a positive normal float32 with its mantissa bits cleared: 2**floor(log2(x))


def quantize(x: torch.Tensor, scale: torch.Tensor | float, fmt: str) -> torch.Tensor:
    """``fp8(clip(float32(x) * float32(scale), -fp8_max, fp8_max))``, as :func:`mpx.float8.quantize`.

    ``scale``: a float32 scalar tensor or a float (rounded to float32).  The clip
    comes first because torch's e4m3fn cast saturates where ml_dtypes, JAX and TF
    give NaN; NaN stays NaN (torch's e5m2 NaN byte is 0x7F, ml_dtypes' 0x7E).
    """
    if fmt not in TORCH_FORMATS:
        fp8_max(fmt)  # raises mpx.float8.Float8Error naming the allowed formats
    limit = _LIMITS[fmt]
    if not isinstance(scale, torch.Tensor):
        scale = torch.tensor(scale, dtype=torch.float32, device=x.device)
    scaled = x.to(torch.float32) * scale.to(torch.float32)
    return torch.clamp(scaled, -limit, limit).to(TORCH_FORMATS[fmt])


def _margin_factor(margin: int) -> float:
    """``2**-margin`` as a float64 (0.0 past float64's range: the scale then underflows to the floor)."""
    return 2.0**-margin if margin <= 1074 else 0.0


def _to_scale(value: torch.Tensor, power_of_two: bool) -> torch.Tensor:
    """A float64 ``fp8_max / amax / 2**margin`` to the float32 scale: the ceiling, the floor, powers of two."""
    scale = torch.where(value >= _F32_MAX, _F32_MAX, value).to(torch.float32)
    scale = torch.where(scale < _F32_TINY, _F32_TINY, scale)  # zero or subnormal: the smallest normal
    if power_of_two:  # mpx.float8._round_down_pow2: clear the mantissa of a positive normal float32
        scale = (scale.view(torch.int32) & _EXPONENT_BITS).view(torch.float32)
    return scale


def delayed_scales(
    window: torch.Tensor,
    maxima: torch.Tensor,
    margin: int,
    power_of_two: bool,
    previous: torch.Tensor,
) -> torch.Tensor:
    """Delayed scaling's scales for float32 amax ``window``s (``maxima``: each one's float64 fp8_max).

    A zero or non-finite window keeps ``previous`` (Transformer Engine's rule).
    """
    amax = window.to(torch.float64)
    ok = torch.isfinite(amax) & (amax > 0.0)
    value = maxima / torch.where(ok, amax, 1.0) * _margin_factor(margin)
    return torch.where(ok, _to_scale(value, power_of_two), previous)


def current_scales(
    amax: torch.Tensor, maxima: torch.Tensor | float, margin: int, power_of_two: bool
) -> torch.Tensor:
    """Current scaling's scales for float32 ``amax``es: floored at 1e-12 in float64 (torchao's rule);
    a non-finite amax gives 1.0 (Transformer Engine's ``Float8CurrentScaling``)."""
    value64 = amax.to(torch.float64)
    ok = torch.isfinite(value64)
    value64 = torch.clamp(torch.where(ok, value64, 1.0), min=CURRENT_AMAX_FLOOR)
    scale = _to_scale(maxima / value64 * _margin_factor(margin), power_of_two)
    return torch.where(ok, scale, 1.0)


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
    pending amaxes, max-combined), the gradient is quantized in ``grad_fmt``
    (e5m2 under ``hybrid``) with ``grad_scale`` (delayed) or its own amax's scale
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
        config: tuple[str, bool, torch.dtype, bool, float, int, bool],
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
        grad_fmt, use_scaled_mm, _, current, grad_max, margin, power_of_two = ctx.config
        x_shape, x_dtype, w_dtype, b_dtype = ctx.shapes
        g2d = grad_out.reshape(-1, grad_out.shape[-1])
        amax = g2d.abs().amax().to(torch.float32)
        ctx.grad_amax.copy_(torch.maximum(ctx.grad_amax, amax.reshape(ctx.grad_amax.shape)))
        if current:
            grad_scale = current_scales(amax, grad_max, margin, power_of_two)
        qg = quantize(g2d, grad_scale, grad_fmt)
        g_inv = 1.0 / grad_scale
        finite = finite & torch.isfinite(amax)  # an overflowed (scaled) gradient poisons both GEMMs
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
