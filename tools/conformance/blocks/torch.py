"""The ``blocks`` group on PyTorch: under mpx the core's kernel with mpx_torch's table
(``mpx_torch.blocks.quantize``, what ``BlockLinear`` quantizes with), natively torchao 0.18's emulation:
``to_mx`` (MXFP8/MXFP4, FLOOR and RCEIL), ``nvfp4_quantize`` with ``per_tensor_amax_to_scale`` (NVFP4)
and its rowwise float8 (``tensor_to_scale`` along rows with power-of-two scales, then
``hp_tensor_and_scale_to_float8``).  torchao's blockwise FP8 training runs Triton kernels only.
"""

from __future__ import annotations

import numpy as np
import torch

from conformance.blocks import block_input, observe

#: torchao's rule for each preset it has (to_mx's element dtype and ScaleCalculationMode name)
MX = {"mxfp8": (torch.float8_e4m3fn, "FLOOR"), "mxfp8_rceil": (torch.float8_e4m3fn, "RCEIL"),
      "mxfp4": (torch.float4_e2m1fn_x2, "FLOOR")}  # fmt: skip


def _fp4_codes(data: torch.Tensor) -> np.ndarray:
    u = data.view(torch.uint8).numpy()  # two per byte, the first element in the low nibble
    return np.stack([u & 0xF, u >> 4], -1).reshape(u.shape[0], -1).astype(np.int32)


def _native(p: dict, x: torch.Tensor) -> dict:
    name, recipe = p["preset"], p["recipe"]
    if name in MX:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx

        dtype, mode = MX[name]
        scale, data = to_mx(x, dtype, 32, getattr(ScaleCalculationMode, mode))
        codes = _fp4_codes(data) if recipe["element"] == "e2m1" else data.view(torch.uint8).numpy()
        return observe(codes, recipe["element"], scale.view(torch.uint8).numpy(), "e8m0", None)
    if name == "nvfp4":
        from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

        ts = per_tensor_amax_to_scale(x.abs().max())
        scale, data = nvfp4_quantize(x, 16, ts)
        return observe(_fp4_codes(data), "e2m1", scale.view(torch.uint8).numpy(), "e4m3_f32", ts.numpy())
    if name == "fp8_rowwise":
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
        from torchao.float8.float8_utils import tensor_to_scale

        scale = tensor_to_scale(x, torch.float8_e4m3fn, scaling_granularity=ScalingGranularity.AXISWISE,
                                axiswise_dim=-1, round_scales_to_power_of_2=True)  # fmt: skip
        data = hp_tensor_and_scale_to_float8(x, scale, torch.float8_e4m3fn, axiswise_dim=-1)._data
        inverse = (1.0 / scale.double()).float().numpy().reshape(-1, 1)  # mpx keeps float32(1 / scale)
        return observe(data.view(torch.uint8).numpy(), "e4m3", inverse, "pow2", None)
    return {"missing": "torchao 0.18's blockwise FP8 training (prototype.blockwise_fp8_training) quantizes "
            "with Triton kernels only: no CPU emulation"}  # fmt: skip


def run_block_quantize(p: dict, mode: str) -> dict:
    """The case's input quantized under its preset (module docs), as :func:`conformance.blocks.observe`."""
    x = torch.from_numpy(block_input(p["kind"], p["seed"]))
    if mode == "native":
        return _native(p, x)
    from mpx.blocks import BlockRecipe
    from mpx_torch.blocks import quantize

    recipe = BlockRecipe.from_dict(p["recipe"])
    q = quantize(x, recipe, p["role"], p["axis"])
    ts = None if q.tensor_scale is None else q.tensor_scale.numpy()
    return observe(q.codes.numpy(), recipe.element, q.scales.numpy(), recipe.scale, ts)
