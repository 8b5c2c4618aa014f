"""The CUDA checks of mpx_torch, as one script (not a test): run it on a machine with a GPU.

    python tests/torch/cuda_check.py          # prints six sections, exits 1 on a failed check

1. CUDA autocast op dtypes, native torch.autocast vs mpx_torch.autocast, against mpx.result_dtype;
2. GradScaler with fused AdamW under torch.cuda.set_sync_debug_mode("error") (no host sync);
3. step time of an MLP (1024-4096-1024, batch 256, AdamW): bf16 vs fp32, native and mpx;
4. block formats (#31): the bytes and scales mpx_torch.blocks.quantize gives on the device equal the
   CPU reference (mpx.kernels.blocks with numpy) for mxfp8, mxfp8_rceil, nvfp4 and fp8_blockwise, and
   MXFP8 and blockwise FP8 GEMMs through torch._scaled_mm where this build and device support them
   (each one's error vs the emulated GEMM, and its throughput ratio vs a bf16 matmul); an unsupported
   GEMM prints why (it is not a failure);
5. DeepSpeed's fp16 engine (#32; it refuses this project's CPU machines where oneDNN has no float16):
   mpx_torch.deepspeed.initialize under mixed_float16 with the deepspeed_fp16 scaler, ZeRO-2, one rank
   (nccl): overflows injected at chosen steps, the engine's scale after every step (EngineScaler) equals
   mpx.scaler_update's trace for the same flags bit for bit, and a skipped step leaves the float32
   master partition bit-identical;
6. FSDP2 with torchao's float8 all-gather (#32; gloo refuses float8 collectives, so mpx refuses it on a
   CPU mesh): mpx_torch.fully_shard of a torchao Float8Linear model with
   enable_fsdp_float8_all_gather=True on a one-GPU mesh trains (finite, falling loss) and its first
   output equals the same model's without the float8 all-gather (one rank: the gathered weight is the
   same).  Sections 5 and 6 print why when deepspeed or torchao is missing (not a failure).
Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

import mpx
import mpx_torch
import mpx_torch._array_ops

NAMES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
}


def op_dtypes() -> int:
    spec = importlib.util.spec_from_file_location("cases", Path(__file__).with_name("test_autocast.py"))
    cases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cases)
    failures = differs = 0
    print("== 1. CUDA op dtypes: op form | input | native | mpx | expected")
    for compute in ("float16", "bfloat16"):
        policy = mpx.get_policy(f"mixed_{compute}")
        for in_name, dt in (("float32", torch.float32), (compute, cases.HALF[compute])):
            for op, forms in cases.CASES.items():
                for form, fn in forms.items():
                    expected = mpx.result_dtype(op, policy, [in_name])
                    with torch.autocast("cuda", dtype=cases.HALF[compute]):
                        native = NAMES[fn(dt, "cuda").dtype]
                    with mpx_torch.autocast(policy, "cuda"):
                        ours = NAMES[fn(dt, "cuda").dtype]
                    failures += ours != expected
                    differs += native != expected
                    flag = "FAIL" if ours != expected else ("differs natively" if native != expected else "")
                    print(f"  {compute:8} {op}/{form:34} {in_name:8} {native:8} {ours:8} {expected:8} {flag}")
    print(f"  mpx failures: {failures}; native differs from mpx's spec: {differs}")
    return failures


def no_sync() -> int:
    print("== 2. GradScaler + fused AdamW under set_sync_debug_mode('error')")
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).cuda()
    mpx_torch.prepare(model, "mixed_float16")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = mpx_torch.GradScaler("mixed_float16")
    x = torch.randn(64, 256, device="cuda")

    def iteration(inject: bool) -> None:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), x)
        scaler.scale(loss).backward()
        if inject:
            model[0].weight.grad[0, 0] = float("inf")  # an indexed write of a constant: no sync
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()

    iteration(False)  # the first step creates the AdamW state and syncs once, by design
    before = [p.detach().clone() for p in model.parameters()]
    try:
        torch.cuda.set_sync_debug_mode("error")
        for i in range(20):
            iteration(inject=(i == 10))
        torch.cuda.set_sync_debug_mode(0)
    except RuntimeError as err:
        torch.cuda.set_sync_debug_mode(0)
        print(f"  FAIL: a host sync: {err}")
        return 1
    state = scaler.state
    changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    ok = state.steps == 21 and state.skipped_steps == 1 and changed
    print(f"  no sync in 20 iterations; state {state}; {'ok' if ok else 'FAIL'}")
    return 0 if ok else 1


def step_times() -> None:
    print("== 3. MLP 1024-4096-1024, batch 256, AdamW (fused): median ms per step")
    x, y = torch.randn(256, 1024, device="cuda"), torch.randn(256, 1024, device="cuda")

    def run(spec: str, use_mpx: bool) -> float:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        policy = mpx.get_policy(spec)
        if use_mpx:
            mpx_torch.prepare(model, policy, device_type="cuda")
            scaler = mpx_torch.GradScaler(policy)

            def forward():
                return model(x)
        else:
            scaler = torch.amp.GradScaler("cuda", enabled=policy.compute_dtype == "float16")
            dtype = mpx_torch.to_torch_dtype(policy.compute_dtype)

            def forward():
                with torch.autocast("cuda", dtype=dtype, enabled=policy.lowers_precision):
                    return model(x)

        def step():
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(forward().float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

        for _ in range(10):
            step()
        times = []
        for _ in range(50):
            torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1000

    res = {
        (spec, m): run(spec, m)
        for spec in ("float32", "mixed_bfloat16", "mixed_float16")
        for m in (False, True)
    }
    for use_mpx in (False, True):
        f32 = res[("float32", use_mpx)]
        line = ", ".join(
            f"{spec} {res[(spec, use_mpx)]:.2f} ({res[(spec, use_mpx)] / f32:.2f}x)"
            for spec in ("float32", "mixed_bfloat16", "mixed_float16")
        )
        print(f"  {'mpx   ' if use_mpx else 'native'}: {line}")


def _bench_ms(fn, n: int = 30) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def _scaled_mm_mxfp8(qa, qb):
    """``torch._scaled_mm`` of two MXFP8 operands (1x32 blocks along K; scales swizzled as cuBLAS reads them)."""
    from torchao.prototype.mx_formats.utils import to_blocked

    a = qa.codes.to(torch.uint8).view(torch.float8_e4m3fn)
    b = qb.codes.to(torch.uint8).view(torch.float8_e4m3fn)
    sa = to_blocked(qa.scales.to(torch.uint8).view(torch.float8_e8m0fnu))
    sb = to_blocked(qb.scales.to(torch.uint8).view(torch.float8_e8m0fnu))
    return lambda: torch._scaled_mm(a, b.t(), sa, sb, out_dtype=torch.bfloat16)


def _scaled_mm_blockwise(qa, qb):
    """``torch._scaled_mm`` of 1x128 activations and 128x128 weights (float32 dequantization scales, the
    activation's outer-dim-major as cuBLAS reads them)."""
    a = qa.codes.to(torch.uint8).view(torch.float8_e4m3fn)
    b = qb.codes.to(torch.uint8).view(torch.float8_e4m3fn)
    sa = qa.scales.t().contiguous().t()
    sb = qb.scales.t().contiguous().t()
    return lambda: torch._scaled_mm(a, b.t(), sa, sb.t(), out_dtype=torch.bfloat16)


def blocks() -> int:
    """Section 4 (module docs); returns the number of failed byte checks."""
    import numpy as np

    from mpx.blocks import PRESETS
    from mpx.kernels import blocks as kb
    from mpx.kernels.array_ops import NUMPY_OPS
    from mpx_torch.blocks import quantize

    print("== 4. block formats: device bytes vs the CPU reference; torch._scaled_mm vs bf16")
    failures = 0
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 1024, generator=gen) * torch.exp(torch.randn(256, 1, generator=gen) * 4)
    x[3, :32] = 0.0
    for name in ("mxfp8", "mxfp8_rceil", "nvfp4", "fp8_blockwise"):
        recipe = PRESETS[name]
        for role, axis in (("input", 1), ("weight", 1), ("weight", 0), ("input", 0)):
            got = quantize(x.cuda(), recipe, role, axis)
            want = kb.quantize(NUMPY_OPS, x.numpy(), recipe, role, axis)
            same = np.array_equal(got.codes.cpu().numpy(), want.codes) and np.array_equal(
                got.scales.cpu().numpy().view(np.int32), np.asarray(want.scales).view(np.int32)
            )
            failures += not same
            print(f"  {name:14} {role:6} axis {axis}: {'same bytes and scales' if same else 'FAIL: differ'}")
    m = n = k = 4096
    a = torch.randn(m, k, device="cuda")
    w = torch.randn(n, k, device="cuda") / k**0.5
    ab, wb = a.bfloat16(), w.bfloat16()
    bf16_ms = _bench_ms(lambda: ab @ wb.t())
    print(f"  bf16 matmul {m}x{k}x{n}: {bf16_ms:.3f} ms")
    for name, make in (("mxfp8", _scaled_mm_mxfp8), ("fp8_blockwise", _scaled_mm_blockwise)):
        recipe = PRESETS[name]
        qa, qw = quantize(a, recipe, "input", 1), quantize(w, recipe, "weight", 1)
        emulated = (
            kb.dequantize(mpx_torch._array_ops.ops_for(a.device), qa, recipe, "input", 1)
            @ kb.dequantize(mpx_torch._array_ops.ops_for(a.device), qw, recipe, "weight", 1).t()
        )
        try:
            gemm = make(qa, qw)
            out = gemm().float()
        except (RuntimeError, ImportError, AttributeError, TypeError, ValueError) as err:
            print(f"  {name}: torch._scaled_mm not supported here ({type(err).__name__}: {str(err)[:160]})")
            continue
        rel = float((out - emulated).abs().max() / emulated.abs().max())
        ms = _bench_ms(gemm)
        print(f"  {name}: torch._scaled_mm {ms:.3f} ms ({bf16_ms / ms:.2f}x bf16's throughput); "
              f"max error vs the emulated GEMM {rel:.2e} of its max (bf16 output)")  # fmt: skip
        failures += not rel < 1e-2
    return failures


def _one_rank_group(backend: str = "nccl") -> None:
    """A one-rank process group (sections 5 and 6), once (``backend="gloo"`` dry-runs section 5 on a CPU
    whose oneDNN has float16: ``deepspeed_fp16("gloo")``)."""
    import os

    import torch.distributed as dist

    if not dist.is_initialized():
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                           ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29531")):  # fmt: skip
            os.environ.setdefault(key, value)
        dist.init_process_group(backend, rank=0, world_size=1)


def deepspeed_fp16(backend: str = "nccl") -> int:
    """Section 5 (module docs); returns the number of failed checks."""
    print("== 5. DeepSpeed fp16 engine (ZeRO-2, one rank): scale trace vs mpx.scaler_update")
    try:
        import deepspeed  # noqa: F401

        from mpx_torch.deepspeed import EngineScaler, initialize
    except ImportError as err:
        print(f"  deepspeed is not installed ({err}): pip install --no-deps deepspeed hjson einops py-cpuinfo ninja")
        return 0
    _one_rank_group(backend)
    config = dataclasses.replace(mpx.SCALER_PRESETS["deepspeed_fp16"], growth_interval=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.GELU(), nn.Linear(256, 64))
    base = {
        "train_micro_batch_size_per_gpu": 32,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "steps_per_print": 10**9,
    }
    engine, *_ = initialize(model, "mixed_float16", config, base=base, model_parameters=model.parameters())
    scaler = EngineScaler(engine)
    x = torch.randn(32, 64, device=engine.device)
    overflows = {1, 2, 6, 7, 8}
    flags, scales, failures = [], [], 0
    for step in range(12):
        before = [t.detach().clone() for t in engine.optimizer.single_partition_of_fp32_groups]
        loss = engine(x).float().pow(2).mean()
        if step in overflows:
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        flags.append(step not in overflows)
        scales.append(scaler.get_scale())
        if step in overflows:
            after = engine.optimizer.single_partition_of_fp32_groups
            same = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
            failures += not same
            if not same:
                print(f"  step {step}: FAIL: the skipped step changed the float32 master partition")
    state, want = mpx.scaler_init(scaler.config), []
    for finite in flags:
        state = mpx.scaler_update(scaler.config, state, finite)
        want.append(state.scale)
    same = scales == want
    failures += not same
    print(f"  engine scales {scales}")
    print(f"  mpx trace     {want}: {'equal' if same else 'FAIL: differ'}")
    return failures


def fsdp_float8_all_gather() -> int:
    """Section 6 (module docs); returns the number of failed checks."""
    import copy

    print("== 6. FSDP2 + torchao float8 all-gather (one-GPU mesh) under mpx_torch.fully_shard")
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:
        print(f"  torchao is not installed ({err})")
        return 0
    from torch.distributed.device_mesh import init_device_mesh

    _one_rank_group()
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).cuda()
    x = torch.randn(64, 256, device="cuda")
    outputs, losses = [], []
    for gather in (False, True):
        model = convert_to_float8_training(
            copy.deepcopy(dense), config=Float8LinearConfig(enable_fsdp_float8_all_gather=gather)
        )
        mpx_torch.fully_shard(model, "mixed_bfloat16", mesh=init_device_mesh("cuda", (1,)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        run = []
        for step in range(8):
            with mpx_torch.autocast("mixed_bfloat16"):
                out = model(x)
            if step == 0:
                outputs.append(out.detach().float())
            loss = (out.float() - x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(float(loss))
        losses.append(run)
    failures = 0
    same = torch.equal(outputs[0], outputs[1])
    falls = all(l[-1] < l[0] and all(v == v and abs(v) != float("inf") for v in l) for l in losses)  # noqa: E741
    failures += (not same) + (not falls)
    print(f"  first output with and without the float8 all-gather: {'equal' if same else 'FAIL: differ'}")
    print(f"  loss (float8 all-gather) {losses[1][0]:.4f} -> {losses[1][-1]:.4f}: {'falls' if falls else 'FAIL'}")
    return failures


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    failures = op_dtypes() + no_sync()
    step_times()
    failures += blocks()
    failures += deepspeed_fp16()
    failures += fsdp_float8_all_gather()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
