"""The PyTorch side of ``mpx compare``: the built-in models and :func:`compare` for a user's own model."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import mpx
import mpx_torch
from mpx.update_policy import needs_policy_optimizer
from mpx_compare.workers.common import Settings, batches, record, run_all
from mpx_torch import blocks, float8
from mpx_torch.optim import PolicyOptimizer

__all__ = ["build", "compare", "info"]


def info(device: str) -> dict[str, Any]:
    return {"framework": "torch", "versions": {"torch": torch.__version__}, "device": device}


class _Block(nn.Module):
    def __init__(self, d: int, heads: int, ff: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, ff), nn.GELU(), nn.Linear(ff, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class _Transformer(nn.Module):
    def __init__(self, classes: int, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.block = _Block(d, 2, 2 * d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.block(self.embed(x))).mean(dim=1))


class _CNN(nn.Module):
    def __init__(self, classes: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.head = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv2(F.relu(self.conv1(x.unsqueeze(1)))))
        return self.head(x.mean(dim=(2, 3)))


def _uses_fp8(policy: mpx.Policy) -> bool:
    return policy.fp8 is not None or any(rule.policy.fp8 is not None for rule in policy.overrides)


def build(model: str, classes: int) -> Callable[[int], nn.Module]:
    """``make_model(seed)`` for a built-in model (mlp, cnn, transformer) on ``(n, 8, 8)`` inputs."""

    def make(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        if model == "mlp":
            return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, classes))
        if model == "cnn":
            return _CNN(classes)
        return _Transformer(classes)

    return make


def _train(make_model: Callable[[int], nn.Module], data: Sequence[np.ndarray], policy: str, seed: int,
           settings: Settings) -> dict[str, Any]:  # fmt: skip
    t0 = time.perf_counter()
    device = torch.device(settings.device)
    p = mpx.get_policy(policy)
    model = make_model(seed).to(device)
    if p.lowers_precision or _uses_fp8(p):
        model = mpx_torch.prepare(model, p)  # under fp8=: the policy's nn.Linear modules run FP8 GEMMs
        blocks.convert(model, p, seed=seed)  # block recipes (fp8=mxfp8, fp4=nvfp4): the run's seed keys SR
    tensor_fp8 = sum(1 for _ in float8.float8_layers(model))
    fp8_layers = tensor_fp8 + sum(isinstance(m, blocks.BlockLinear) for m in model.modules())
    opt: Any = torch.optim.Adam(model.parameters(), lr=settings.lr)
    if needs_policy_optimizer(p):  # master/update/opt_state keys: the policy optimizer steps Adam
        opt = PolicyOptimizer(opt, p, seed=seed)
    scaler = mpx_torch.GradScaler(mpx.ScalerConfig.for_policy(p))
    scaler.record_history()  # on device; read once at the end
    xt, yt, xv, yv = (torch.as_tensor(a).to(device) for a in data)
    losses, scales = [], []
    model.train()
    for idx in batches(len(xt), settings, seed):
        i = torch.as_tensor(idx, device=device)
        loss = F.cross_entropy(model(xt[i]).float(), yt[i])
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if tensor_fp8:
            float8.commit_float8(model, scaler)  # nothing on a skipped step (block recipes keep no state)
        losses.append(float(loss.detach()))
        scales.append(float(scaler.get_scale()) if scaler.config.kind != "none" else 1.0)
    model.eval()
    with torch.no_grad():
        logits = model(xv).float()
        val_loss = float(F.cross_entropy(logits, yv))
        acc = float((logits.argmax(dim=1) == yv).float().mean())
    return record("torch", policy, seed, losses, scales, scaler.state.skipped_steps, val_loss, acc,
                  time.perf_counter() - t0, history=scaler.history(), fp8_layers=fp8_layers)  # fmt: skip


def compare(make_model: Callable[[int], nn.Module], data: Sequence[np.ndarray], *, policies: Sequence[str],
            seeds: Sequence[int] = (0,), settings: Settings | None = None,
            progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Train ``make_model(seed)`` in float32 and under each policy; one run record per policy and seed.

    ``make_model(seed)`` must return the same initialization for the same seed
    (seed torch inside it); ``data`` is ``(x_train, y_train, x_val, y_val)``
    (numpy; integer class labels, cross-entropy loss).  Each run: Adam,
    ``mpx_torch.prepare`` for a lowering policy, ``mpx_torch.GradScaler`` with
    ``ScalerConfig.for_policy``; the batch order depends on the seed only.
    Under a policy with ``fp8=``, ``prepare`` turns the policy's ``nn.Linear``
    modules into FP8 GEMMs (``mpx_torch.float8``) and their state commits after
    each step (nothing on a skipped one); ``fp8_layers`` in each run counts them.  Under a block recipe
    (``fp8=mxfp8``, ``fp4=nvfp4``...) they are ``mpx_torch.blocks.BlockLinear`` (stateless; keyed by
    the run's seed) and ``fp8_layers`` counts those.
    """
    settings = settings or Settings()
    return run_all(
        lambda p, s: _train(make_model, data, p, s, settings), list(policies), list(seeds), progress
    )
