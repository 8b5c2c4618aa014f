"""The PyTorch adapter: natively torch.autocast + torch.amp.GradScaler, under mpx mpx_torch.

Native paths import nothing of mpx (a native worker blocks it, conformance/isolation.py): they read
the case's precomputed params (``policy_dtypes``, the ``config`` dict).  mpx paths import mpx and
mpx_torch inside the function (:func:`_mpx`, :func:`_mpx_torch`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from conformance.adapters._common import (
    dtype_name,
    flag_gradient,
    max_rel_error,
    mlp_data,
    mlp_reference,
    op_input,
    rel_error,
)
from mpx_tools.skip import Skip

DEVICE = "cpu"
TORCH_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


def info() -> dict:
    return {"version": f"torch {torch.__version__}", "device": DEVICE}


def _mpx():
    import mpx

    return mpx


def _mpx_torch():
    import mpx_torch

    return mpx_torch


def _context(mode: str, p: dict):
    """Natively torch.autocast at the compute dtype of ``p["policy_dtypes"]`` (none for float32); under mpx
    mpx_torch.autocast of ``p["policy"]``."""
    if mode == "native":
        dtypes = p["policy_dtypes"]
        if not dtypes["lowers_precision"]:
            return contextlib.nullcontext()
        return torch.autocast(DEVICE, dtype=TORCH_DTYPES[dtypes["compute_dtype"]])
    return _mpx_torch().autocast(p["policy"], device_type=DEVICE)


def _t(shape, dtype, seed=0, positive=False):
    return torch.from_numpy(op_input(shape, seed, positive)).to(TORCH_DTYPES[dtype])


def _op(op: str, dtype: str, other: str | None, upcast: bool = False) -> Any:
    """A callable for one canonical op on inputs of ``dtype`` (``upcast``: those inputs cast to float32)."""

    def up(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.float() if upcast else tensor

    def t(shape, dt, seed=0, positive=False):
        return up(_t(shape, dt, seed, positive))

    x = t((4, 8), dtype)
    y = t((4, 8), other or dtype, seed=1)
    w = t((6, 8), dtype, seed=2)
    img = t((1, 2, 6, 6), dtype)
    target = up(torch.sigmoid(_t((4, 8), other or dtype, seed=1)))  # probabilities, at the input dtype
    table = {
        "matmul": lambda: torch.matmul(x, t((8, 3), dtype, 3)),
        "linear": lambda: F.linear(x, w),
        "conv": lambda: F.conv2d(img, t((3, 2, 3, 3), dtype, 4)),
        "conv_transpose": lambda: F.conv_transpose2d(img, t((2, 3, 3, 3), dtype, 4)),
        "bmm": lambda: torch.bmm(t((2, 4, 8), dtype), t((2, 8, 3), dtype, 5)),
        "einsum": lambda: torch.einsum("ij,kj->ik", x, w),
        "attention": lambda: F.scaled_dot_product_attention(t((1, 2, 4, 8), dtype), t((1, 2, 4, 8), dtype, 6), t((1, 2, 4, 8), dtype, 7)),
        "softmax": lambda: torch.softmax(x, dim=-1),
        "log_softmax": lambda: F.log_softmax(x, dim=-1),
        "layer_norm": lambda: F.layer_norm(x, (8,)),
        "batch_norm": lambda: F.batch_norm(x, None, None, training=True),
        "group_norm": lambda: F.group_norm(img, 2),
        "rms_norm": lambda: F.rms_norm(x, (8,)),
        "cross_entropy": lambda: F.cross_entropy(x, torch.tensor([0, 1, 2, 3])),
        "nll_loss": lambda: F.nll_loss(x, torch.tensor([0, 1, 2, 3])),
        "mse_loss": lambda: F.mse_loss(x, y),
        "bce_with_logits": lambda: F.binary_cross_entropy_with_logits(x, target),
        "exp": lambda: torch.exp(x),
        "log": lambda: torch.log(t((4, 8), dtype, positive=True)),
        "pow": lambda: torch.pow(x, 2),
        "sum": lambda: x.sum(),
        "mean": lambda: x.mean(),
        "cumsum": lambda: torch.cumsum(x, dim=0),
        "prod": lambda: x.prod(),
        "logsumexp": lambda: torch.logsumexp(x, dim=-1),
        "vector_norm": lambda: torch.linalg.vector_norm(x),
        "add": lambda: x + y,
        "mul": lambda: x * y,
        "cat": lambda: torch.cat([x, y]),
        "stack": lambda: torch.stack([x, y]),
        "where": lambda: torch.where(x > 0, x, y),
        "relu": lambda: F.relu(x),
        "gelu": lambda: F.gelu(x),
        "max_pool": lambda: F.max_pool2d(img, 2),
        "reshape": lambda: x.reshape(8, 4),
        "transpose": lambda: x.transpose(0, 1),
        "dropout": lambda: F.dropout(x, 0.5, training=True),
        "embedding": lambda: F.embedding(torch.tensor([0, 2, 1]), w),
    }  # fmt: skip
    return table[op]


def run_op(p: dict, mode: str) -> dict:
    fn = _op(p["op"], p["dtype"], p.get("other"))
    with _context(mode, p):
        out = fn()
    return {"dtype": dtype_name(out.dtype)}


def run_op_value(p: dict, mode: str) -> dict:
    fn, reference = _op(p["op"], p["dtype"], None), _op(p["op"], p["dtype"], None, upcast=True)
    with _context(mode, p):
        out = fn()
    ref = reference()
    return {"max_rel_error": rel_error(out.detach().double().numpy(), ref.detach().double().numpy())}


def run_policy(p: dict, mode: str) -> dict:
    if mode == "native":
        raise Skip("torch has no named policies: torch.autocast takes a dtype, parameters stay as created")
    policy = _mpx().get_policy(p["spec"])
    model = nn.Sequential(nn.Linear(4, 3))
    seen = {}

    def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        seen["compute"] = dtype_name(output.dtype)

    model[0].register_forward_hook(hook)
    _mpx_torch().prepare(model, policy)
    out = model(torch.randn(2, 4))
    return {
        "params": dtype_name(model[0].weight.dtype),
        "compute": seen["compute"],
        "output": dtype_name(out.dtype),
    }


def _native_scaler(cfg: dict):
    """torch.amp.GradScaler from a config dict (``mpx.ScalerConfig.to_dict()``)."""
    if cfg["kind"] != "dynamic":
        raise Skip(f"torch.amp.GradScaler has no {cfg['kind']!r} mode")
    return torch.amp.GradScaler(
        DEVICE, init_scale=cfg["init_scale"], growth_factor=cfg["growth_factor"],
        backoff_factor=cfg["backoff_factor"], growth_interval=cfg["growth_interval"],
    )  # fmt: skip


def _scaler(mode: str, cfg: dict):
    """The scaler of ``mode`` for the config dict ``cfg`` (mpx_torch.GradScaler takes the dict itself)."""
    return _native_scaler(cfg) if mode == "native" else _mpx_torch().GradScaler(cfg, device=DEVICE)


def _train_flags(scaler, flags: list[bool]) -> tuple[list[float], int]:
    param = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1)
    scales, skipped = [], 0
    for finite in flags:
        before = param.detach().clone()
        opt.zero_grad()
        loss = (param * flag_gradient(finite)).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(float(scaler.get_scale()))
        skipped += bool(torch.equal(before, param.detach()))
    return scales, skipped


def run_scaler_trace(p: dict, mode: str) -> dict:
    native_defaults = mode == "native" and p.get("native_defaults")
    scaler = torch.amp.GradScaler(DEVICE) if native_defaults else _scaler(mode, p["config"])
    scales, skipped = _train_flags(scaler, p["flags"])
    return {"scales": scales, "skipped": skipped}


def run_stuck(p: dict, mode: str) -> dict:
    """Issue 18's stuck detection: the step that raises mpx.ScalerStuckError and the cause it names."""
    if mode == "native":
        raise Skip("torch.amp.GradScaler has no stuck detection")
    from conformance.cases import stuck_cause

    mpx = _mpx()
    scaler = _scaler(mode, p["config"])
    w = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    for i, step in enumerate(p["steps"], 1):
        opt.zero_grad()
        if step == "grad":
            loss = torch.sqrt(w - w.detach()).sum()
        else:
            loss = (w * flag_gradient(step == "ok")).sum()
        try:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        except mpx.ScalerStuckError as e:
            return {"raised_at": i, "cause": stuck_cause(str(e))}
    return {"raised_at": None, "cause": None}


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> list[bytes]:
    tensors = [t.detach() for t in model.state_dict().values()]
    for state in opt.state_dict()["state"].values():
        tensors += [v for v in state.values() if torch.is_tensor(v)]
    return [t.cpu().numpy().tobytes() for t in tensors]


def run_skip(p: dict, mode: str) -> dict:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    if p["optimizer"] == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    scaler = _scaler(mode, p["config"])
    x = torch.randn(8, 4)
    changed, scales = [], []
    for step in p["steps"]:
        before = _snapshot(model, opt)
        opt.zero_grad()
        loss = model(x).sum() * flag_gradient(step == "ok", step)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(float(scaler.get_scale()))
        changed.append(_snapshot(model, opt) != before)
    return {"changed": changed, "scale_halved": scales[1] == scales[0] / 2}


class _MLP(nn.Module):
    def __init__(self, d: dict[str, np.ndarray]) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 4)
        with torch.no_grad():
            self.fc1.weight.copy_(torch.from_numpy(d["w1"].T.copy()))
            self.fc1.bias.copy_(torch.from_numpy(d["b1"]))
            self.fc2.weight.copy_(torch.from_numpy(d["w2"].T.copy()))
            self.fc2.bias.copy_(torch.from_numpy(d["b2"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def run_numerics(p: dict, mode: str) -> dict:
    d = mlp_data(p["seed"])
    model = _MLP(d)
    x, y = torch.from_numpy(d["x"]), torch.from_numpy(d["y"])
    if mode == "native":
        with _context("native", p):
            out = model(x)
            loss = F.mse_loss(out, y)
    else:
        _mpx_torch().prepare(model, p["policy"])
        with _context("mpx", p):
            loss = F.mse_loss(model(x), y)
    loss.backward()
    got = {
        "loss": loss.detach().double().numpy(),
        "w1": model.fc1.weight.grad.double().numpy().T, "b1": model.fc1.bias.grad.double().numpy(),
        "w2": model.fc2.weight.grad.double().numpy().T, "b2": model.fc2.bias.grad.double().numpy(),
    }  # fmt: skip
    return {"max_rel_error": max_rel_error(got, mlp_reference(d)), "loss_dtype": dtype_name(loss.dtype)}


def save_state(config: dict, flags: list[bool]) -> dict:
    """The state mpx_torch's GradScaler saves after ``flags`` (``config``: ScalerConfig fields; mpx only)."""
    scaler = _mpx_torch().GradScaler(_mpx().ScalerConfig(**config), device=DEVICE)
    _train_flags(scaler, flags)
    return scaler.state_dict()


def run_portability_save(p: dict, mode: str) -> dict:
    scaler = _scaler(mode, p["config"])
    _train_flags(scaler, p["flags"])
    return {"state_dict": scaler.state_dict()}


def run_portability(p: dict, mode: str) -> dict:
    scaler = _scaler(mode, p["config"])
    scaler.load_state_dict(p["state_dict"])
    scales, _ = _train_flags(scaler, p["flags"])
    return {"scales": scales}


def run_distributed(p: dict, mode: str) -> dict:
    """DDP / FSDP2 on 2 gloo processes, spawned once for every case and mode (conformance.distributed)."""
    from conformance import distributed

    return distributed.observed("torch", p, mode)


def run_accumulation(p: dict, mode: str) -> dict:
    """torch's accumulation pattern: ``scale(loss / k).backward()`` k times, then one step/update/zero_grad."""
    k = p["steps"]
    scaler = _scaler(mode, p["config"])
    w = nn.Parameter(torch.full((3,), float(p["w0"])))
    opt = torch.optim.SGD([w], lr=p["lr"])
    applied, scales, micro = [], [], []
    start = w.detach().clone()
    for j, finite in enumerate(p["flags"]):
        micro.append(float(scaler.get_scale()))
        loss = (w * ((j % 4 + 1) * flag_gradient(finite))).sum() / k
        scaler.scale(loss).backward()
        if (j + 1) % k == 0:
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            applied.append(not torch.equal(w.detach(), start))
            scales.append(float(scaler.get_scale()))
            start = w.detach().clone()
    return {"applied": applied, "scales": scales, "micro_scales": micro, "param": float(w.detach()[0])}


def run_models(p: dict, mode: str) -> dict:
    """HF Transformers models from tiny configs, torch.autocast against prepare (mpx_tools.models.torch)."""
    from mpx_tools.models import check_column
    from mpx_tools.models import torch as models

    check_column("torch", p["model"])
    return models.observe(p, mode)

# the fp8 group (issue 26): conformance/fp8/torch.py; the blocks group (issue 31): conformance/blocks/;
# the deepspeed group (issue 32): conformance/deepspeed/
from conformance.blocks.torch import run_block_quantize  # noqa: E402, F401
from conformance.deepspeed.torch import run_deepspeed_trace  # noqa: E402, F401
from conformance.fp8.torch import run_fp8_matmul, run_fp8_quantize, run_fp8_trace  # noqa: E402, F401
