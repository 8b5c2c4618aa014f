"""Per-op overhead of mpx_torch.autocast and the cost of mpx_torch.GradScaler (not a test).

    python tests/torch/bench_overhead.py [cpu|cuda]

Prints microseconds per call, the median of several runs, native torch against mpx.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from torch import nn

import mpx
import mpx_torch


def _per_call(fn, n=5000, repeats=7, sync=lambda: None):
    times = []
    for _ in range(repeats):
        sync()
        start = time.thread_time()
        for _ in range(n):
            fn()
        sync()
        times.append((time.thread_time() - start) / n * 1e6)
    return statistics.median(times)


def main(device: str = "cpu") -> None:
    torch.set_num_threads(1)  # thread CPU time is then the whole cost, and contention does not count
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    dt = torch.bfloat16
    x = torch.randn(16, 16, device=device)
    h = x.to(dt)
    rows = []
    for name, fn in (
        ("x + y (not targeted)", lambda: x + x),
        ("x.view(-1) (not targeted)", lambda: x.view(-1)),
        ("x @ x (LOWER, native)", lambda: x @ x),
        ("softmax(bf16) (FLOAT32, handled)", lambda: torch.softmax(h, -1)),
        ("h.sum() (FLOAT32, handled)", lambda: h.sum()),
    ):
        with torch.autocast(device, dtype=dt):
            native = _per_call(fn, sync=sync)
        with mpx_torch.autocast("mixed_bfloat16", device):
            ours = _per_call(fn, sync=sync)
        rows.append((name, native, ours))
    print(f"device {device}, torch {torch.__version__}: microseconds per call (median of 7 x 5000)")
    print(f"{'op':36} {'torch.autocast':>14} {'mpx autocast':>13} {'overhead':>9}")
    for name, native, ours in rows:
        print(f"{name:36} {native:14.2f} {ours:13.2f} {ours - native:9.2f}")

    # a training step: Linear-LayerNorm-GELU-Linear, batch 64
    def step_fn(model, opt, scaler, ctx, data):
        xb, yb = data

        def run():
            opt.zero_grad(set_to_none=True)
            with ctx():
                loss = nn.functional.cross_entropy(model(xb), yb)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

        return run

    data = (torch.randn(64, 256, device=device), torch.randint(0, 10, (64,), device=device))

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(256, 512), nn.LayerNorm(512), nn.GELU(), nn.Linear(512, 10)).to(device)

    results = {}
    for label, policy, use_mpx in (
        ("fp16 torch.autocast + torch GradScaler", "mixed_float16", False),
        ("fp16 mpx prepare + mpx GradScaler", "mixed_float16", True),
        ("bf16 torch.autocast", "mixed_bfloat16", False),
        ("bf16 mpx prepare", "mixed_bfloat16", True),
    ):
        model = make()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        cdt = mpx_torch.to_torch_dtype(mpx.get_policy(policy).compute_dtype)
        if use_mpx:
            mpx_torch.prepare(model, policy)
            scaler = mpx_torch.GradScaler(policy)
            ctx = lambda: torch.autocast(device, enabled=False)  # noqa: E731  (prepare runs the policy)
        else:
            scaler = torch.amp.GradScaler(device, enabled=cdt == torch.float16)
            ctx = lambda cdt=cdt: torch.autocast(device, dtype=cdt)  # noqa: E731
        run = step_fn(model, opt, scaler, ctx, data)
        for _ in range(20):
            run()
        results[label] = _per_call(run, n=100, repeats=5, sync=sync)
    print("training step, microseconds (median of 5 x 100):")
    for label, us in results.items():
        print(f"  {label:40} {us:9.1f}")


if __name__ == "__main__":
    main(*sys.argv[1:])
