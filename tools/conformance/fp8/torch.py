"""The ``fp8`` group on PyTorch: under mpx ``mpx_torch.float8`` (Float8Linear, commit), natively torchao's
emulated float8 training (``convert_to_float8_training`` with ``Float8LinearConfig(emulate=True)``:
dynamic, i.e. current, tensorwise scaling only; scale ``fp8_max / max(amax, 1e-12)`` in float64).

No mpx import at module level: the native paths import nothing of mpx (:mod:`conformance.fp8` is mpx-free).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from conformance.fp8 import (
    bits_to_f32,
    encode_fp8,
    f32_to_bits,
    matmul_inputs,
    quantize_inputs,
    trace_input,
    within_bound,
)
from mpx_tools.skip import Skip

TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
ROW = {"input": 0, "weight": 1, "grad": 2}


def _float8():
    from mpx_torch import float8

    return float8


def _torchao():
    from torchao import float8 as ao

    return ao


def _tensor(x: np.ndarray, dtype: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)).to(
        torch.bfloat16 if dtype == "bfloat16" else torch.float32
    )


def run_fp8_quantize(p: dict, mode: str) -> dict:
    """The quantized bytes of the case's inputs (mpx: ``mpx_torch.float8.quantize``; native: torchao's
    ``hp_tensor_and_scale_to_float8``, what its Float8Linear quantizes with)."""
    x = _tensor(quantize_inputs(p["kind"], p["seed"], p["n"], p["dtype"]), p["dtype"])
    scale = torch.tensor(p["scale"], dtype=torch.float32)
    if mode == "native":
        from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8

        q = hp_tensor_and_scale_to_float8(x, scale, TORCH_FP8[p["fmt"]])._data
    else:
        q = _float8().quantize(x, scale, p["fmt"])
    return {"bytes": encode_fp8(q.view(torch.uint8).numpy(), p["fmt"])}


def _mpx_trace(p: dict) -> list[int]:
    layer = nn.Linear(4, 4)
    float8 = _float8()
    float8.convert(layer, p["policy"], gemm="emulate")
    row = ROW[p["role"]]
    scales = []
    for bits, skipped in zip(p["amaxes"], p["skipped"], strict=True):
        amax = float(bits_to_f32([bits])[0])
        if p["role"] == "grad":
            y = layer(torch.ones(2, 4))
            y.backward(torch.from_numpy(trace_input(amax)))
        else:
            layer(torch.from_numpy(trace_input(amax)))
        layer.zero_grad()
        float8.commit_float8(layer, skipped)
        scales.append(float(layer.fp8_scale[row]))
    return f32_to_bits(scales)


def run_fp8_trace(p: dict, mode: str) -> dict:
    """The scale each step leaves for the next (mpx: a Float8Linear's ``fp8_scale`` after ``commit``;
    native: the scale torchao's Float8Linear computes for a tensor of that amax, ``tensor_to_scale``)."""
    if mode == "mpx":
        return {"scales": _mpx_trace(p)}
    recipe = p["recipe"]
    if recipe["scaling"] != "current":
        raise Skip("torchao 0.18 has dynamic (current) scaling only: delayed scaling was removed in 0.10")
    if any(p["skipped"]):
        raise Skip("torchao keeps no FP8 state (each tensor's own amax gives its scale): a step the loss "
                   "scaler skips has nothing to keep; the no-skip current trace compares the scales")  # fmt: skip
    from torchao.float8.float8_utils import tensor_to_scale

    dtype = TORCH_FP8["e5m2" if p["role"] == "grad" and recipe["format"] == "hybrid" else "e4m3"]
    scales = []
    for bits in p["amaxes"]:
        x = torch.from_numpy(trace_input(float(bits_to_f32([bits])[0])))
        scales.append(float(tensor_to_scale(x, dtype)))
    return {"scales": f32_to_bits(scales)}


def run_fp8_matmul(p: dict, mode: str) -> dict:
    """``a @ b`` through an FP8 Linear (weight ``b.T``, no bias): mpx's Float8Linear with current scaling,
    or torchao's emulated Float8Linear (tensorwise dynamic scaling)."""
    a, b = matmul_inputs(p["seed"], p["m"], p["k"], p["n"], p["bad"])
    layer = nn.Linear(p["k"], p["n"], bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(np.ascontiguousarray(b.T)))
    model = nn.Sequential(layer)
    if mode == "native":
        ao = _torchao()
        ao.convert_to_float8_training(model, config=ao.Float8LinearConfig(emulate=True))
        if type(model[0]).__name__ != "Float8Linear":
            raise RuntimeError(f"torchao did not convert the Linear ({type(model[0]).__name__})")
    else:
        _float8().convert(model, p["policy"], gemm="emulate")
    with torch.no_grad():
        out = model(torch.from_numpy(a))
    return within_bound(out.float().numpy(), p["reference"], p["bound"])
