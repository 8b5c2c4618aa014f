"""A small classifier on scikit-learn's digits reaches the same test accuracy in float32 and mixed precision."""

import time

import pytest
import torch
from torch import nn

import mpx
import mpx_torch

datasets = pytest.importorskip("sklearn.datasets")


def _data():
    digits = datasets.load_digits()  # ships with scikit-learn: no download
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    n = int(0.75 * len(x))
    return x[:n], y[:n], x[n:], y[n:]


def _train(spec, data, epochs=15):
    xtr, ytr, xte, yte = data
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.GELU(), nn.Linear(128, 10))
    model = mpx_torch.prepare(model, spec)
    loss_fn = mpx_torch.prepare(nn.CrossEntropyLoss(), spec)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = mpx_torch.GradScaler(spec)
    gen = torch.Generator().manual_seed(1)
    for _ in range(epochs):
        for idx in torch.randperm(len(xtr), generator=gen).split(64):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(xtr[idx]), ytr[idx])
            assert loss.dtype == torch.float32
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    with torch.no_grad():
        acc = (model(xte).argmax(-1) == yte).float().mean().item()
    return acc, scaler


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(
        1
    )  # a tiny MLP: one thread is fastest, and idle threads don't spin beside other jobs
    yield
    torch.set_num_threads(threads)


def test_same_accuracy_in_float32_bfloat16_and_float16(one_thread):
    data = _data()
    start = time.perf_counter()
    results = {spec: _train(spec, data) for spec in ("float32", "mixed_bfloat16", "mixed_float16")}
    accs = {spec: acc for spec, (acc, _) in results.items()}
    print({k: round(v * 100, 2) for k, v in accs.items()}, f"{time.perf_counter() - start:.1f}s")
    assert accs["float32"] > 0.95, accs
    for spec in ("mixed_bfloat16", "mixed_float16"):
        assert abs(accs[spec] - accs["float32"]) <= 0.01, accs
    fp16 = results["mixed_float16"][1]
    assert fp16.is_enabled() and fp16.state.steps == 15 * 22
    assert not results["mixed_bfloat16"][1].is_enabled()  # bf16: no loss scaling
    assert mpx.ScalerConfig.for_policy("mixed_float16").kind == "dynamic"
