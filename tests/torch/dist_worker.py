"""One rank of the 2-process gloo runs of tests/torch/test_distributed.py (a spawn target, not a test).

``python tests/torch/dist_worker.py SUITE RANK OUT_DIR`` (two_ranks.run_ranks): joins the
group through a file store in OUT_DIR, runs every scenario of SUITE (``ddp`` or ``fsdp``)
and saves what it saw to ``OUT_DIR/SUITE-RANK.pt`` (torch.save of plain data).
"""

from __future__ import annotations

import os
import sys

from two_ranks import init_gloo, worker_main

os.environ.setdefault("MPX_NO_SLOW_WARNING", "1")

INF_STEP = 2  # the step (0-based) at which rank 1 sees an inf
STEPS = 6


def _config():
    import mpx

    return mpx.ScalerConfig(init_scale=2.0**10, growth_interval=2)


def _flat(model):
    import torch

    out = []
    for p in model.parameters():
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(p.detach().reshape(-1).clone())
    return torch.cat(out)


def _model(seed=0):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _sync_recorder():
    """A TorchFunctionMode that counts the torch calls that copy a value to the host (.item() etc.)."""
    from torch.overrides import TorchFunctionMode

    names = {"item", "__bool__", "__float__", "__int__", "tolist", "cpu", "numpy"}

    class Recorder(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.syncs = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.syncs += getattr(func, "__name__", "") in names
            return func(*args, **(kwargs or {}))

    return Recorder()


def _count_all_reduce():
    """Wrap torch.distributed.all_reduce (what mpx_torch calls) with a counter."""
    import torch.distributed as dist

    counter = [0]
    original = dist.all_reduce

    def counting(*args, **kwargs):
        counter[0] += 1
        return original(*args, **kwargs)

    dist.all_reduce = counting
    return counter, lambda: setattr(dist, "all_reduce", original)


# -- the ddp suite ----------------------------------------------------------------------------------------
def _train_ddp(rank, scaler_kind, inject, *, group=None, optimizer="sgd", ddp=True, compiled=False):
    """Steps of a DDP (or plain, ddp=False) model; rank 1 sees an inf at INF_STEP in its loss or its grads."""
    import torch
    from torch import nn

    import mpx_torch

    model = _model()
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    if scaler_kind == "mpx":
        kwargs = {} if group is None else {"process_group": group}
        scaler = mpx_torch.GradScaler(_config(), **kwargs)
    else:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    # no DDP: the same data on both ranks, so they stay equal exactly when they take the same decisions
    gen = torch.Generator().manual_seed(100 + rank if ddp else 100)
    xs = [torch.randn(8, 4, generator=gen) for _ in range(STEPS)]
    one, inf = torch.tensor(1.0), torch.tensor(float("inf"))

    def step(x, bad):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        factor = inf if bad and inject == "loss" else one
        scaler.scale(loss * factor).backward()
        if bad and inject == "grad":  # after DDP's all-reduce: a hook, a custom reduction, a clipping bug
            with torch.no_grad():
                next(model.parameters()).grad.view(-1)[0] = float("inf")
        recorder = _sync_recorder()
        with recorder:
            scaler.step(opt)
            scaler.update()
        syncs.append(recorder.syncs)

    if compiled:
        step = torch.compile(step, backend="eager")
    counter, restore = _count_all_reduce()
    scales, params, counts, syncs = [], [], [], []
    try:
        for i, x in enumerate(xs):
            before = counter[0]
            step(x, rank == 1 and i == INF_STEP)
            counts.append(counter[0] - before)
            scales.append(scaler.get_scale())
            params.append(_flat(model))
    finally:
        restore()
    return {"scales": scales, "params": params, "all_reduce_calls": counts, "host_syncs": syncs}


def _accumulate_ddp(rank, k=2):
    """DDP with no_sync over windows of k micro-batches; rank 1's accumulated gradients get an inf at INF_STEP."""
    import contextlib

    import torch
    from torch import nn

    import mpx_torch

    model = nn.parallel.DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mpx_torch.GradScaler(_config())
    gen = torch.Generator().manual_seed(400 + rank)
    counter, restore = _count_all_reduce()
    scales, params, counts = [], [], []
    try:
        for i in range(STEPS):
            before = counter[0]
            for j in range(k):
                sync = contextlib.nullcontext() if j == k - 1 else model.no_sync()
                with sync:
                    scaler.scale(model(torch.randn(8, 4, generator=gen)).pow(2).mean() / k).backward()
            if rank == 1 and i == INF_STEP:
                with torch.no_grad():
                    next(model.parameters()).grad.view(-1)[0] = float("inf")
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            counts.append(counter[0] - before)
            scales.append(scaler.get_scale())
            params.append(_flat(model))
    finally:
        restore()
    return {"scales": scales, "params": params, "all_reduce_calls": counts}


def _unscale_then_update(rank):
    """unscale_() and update() without step(): the flags are combined in update (rank 1's grad is inf)."""
    import torch

    import mpx_torch

    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = mpx_torch.GradScaler(_config())
    scaler.scale(w.sum() * (float("inf") if rank == 1 else 1.0)).backward()
    scaler.unscale_(opt)
    scaler.update()
    return {"state": scaler.state_dict()}


def _grads_with_hook(rank, spec):
    """The all-reduced gradients of a DDP model under register_comm_hook(spec), and each rank's local ones."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import mpx_torch

    local = _model()
    model = nn.parallel.DistributedDataParallel(_model())
    hook = mpx_torch.register_comm_hook(model, spec)
    gen = torch.Generator().manual_seed(200 + rank)
    x = torch.randn(8, 4, generator=gen) * 3
    model(x).pow(2).mean().backward()
    local(x).pow(2).mean().backward()
    mine = torch.cat([p.grad.reshape(-1) for p in local.parameters()])
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    reduced = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return {"hook": None if hook is None else hook.__name__, "local": gathered, "reduced": reduced}


def suite_ddp(rank):
    import torch.distributed as dist

    out = {}
    for scaler_kind in ("mpx", "native"):
        for inject in ("loss", "grad"):
            out[f"{scaler_kind}-{inject}"] = _train_ddp(rank, scaler_kind, inject)
    group = dist.new_group([0, 1])
    out["mpx-grad-group"] = _train_ddp(rank, "mpx", "grad", group=group)
    out["mpx-grad-fused"] = _train_ddp(rank, "mpx", "grad", optimizer="adamw-fused")
    out["native-grad-fused"] = _train_ddp(rank, "native", "grad", optimizer="adamw-fused")
    out["mpx-accumulate-grad"] = _accumulate_ddp(rank)
    out["unscale-then-update"] = _unscale_then_update(rank)
    # no DDP, an inf in rank 1's loss only: the scaler alone keeps the ranks together, eager and compiled
    out["mpx-plain-loss"] = _train_ddp(rank, "mpx", "loss", ddp=False)
    out["mpx-plain-loss-compiled"] = _train_ddp(rank, "mpx", "loss", ddp=False, compiled=True)
    for reduce in ("bfloat16", "float16", "float32"):
        out[f"hook-{reduce}"] = _grads_with_hook(rank, f"params=float32,compute=float32,reduce={reduce}")
    return out


# -- the fsdp suite ---------------------------------------------------------------------------------------
def _fsdp_model(seed=0):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    with torch.no_grad():  # LayerNorm weights that bfloat16 cannot hold
        model[1].weight.copy_(1 + torch.arange(8) * 2.0**-12)
        model[1].bias.copy_(torch.arange(8) * 2.0**-13)
    return model


def _watch_dtypes(model, seen):
    import torch

    exact = 1 + torch.arange(8) * 2.0**-12

    def norm_hook(module, args):
        seen["norm_weight_dtype"] = str(module.weight.dtype)
        seen["norm_weight_exact"] = bool(torch.equal(module.weight.detach().float(), exact))
        seen["norm_input_dtype"] = str(args[0].dtype)

    def linear_hook(module, args):
        seen["linear_weight_dtype"] = str(module.weight.dtype)

    model[1].register_forward_pre_hook(norm_hook)
    model[0].register_forward_pre_hook(linear_hook)


def _fsdp_run(rank, scaler_kind, *, prepare_first):
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import mpx_torch

    policy = "mixed_bfloat16"
    mesh = init_device_mesh("cpu", (2,))
    reference = mpx_torch.prepare(_fsdp_model(), policy)
    model = _fsdp_model()
    if prepare_first:
        mpx_torch.prepare(model, policy)
    mpx_torch.fully_shard(model, policy, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # over the sharded parameters, before any forward
    seen = {}
    _watch_dtypes(model, seen)
    gen = torch.Generator().manual_seed(300 + rank)
    xs = [torch.randn(8, 4, generator=gen) for _ in range(STEPS)]
    out0 = model(xs[0])
    result = {
        "output_dtype": str(out0.dtype),
        "output_equals_prepared": bool(torch.equal(out0, reference(xs[0]))),
        "fsdp_types": sorted(
            {type(m).__name__ for m in model.modules() if type(m).__name__.startswith("FSDP")}
        ),
        **seen,
    }
    if scaler_kind == "mpx":
        scaler = mpx_torch.GradScaler(_config())
    else:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    counter, restore = _count_all_reduce()
    scales, params, counts, grad_types = [], [], [], set()
    try:
        for i, x in enumerate(xs):
            opt.zero_grad()
            scaler.scale(model(x).pow(2).mean()).backward()
            if rank == 1 and i == INF_STEP:  # into this rank's shard only, after the reduce-scatter
                with torch.no_grad():
                    next(model.parameters()).grad._local_tensor.view(-1)[0] = float("inf")
            grad_types |= {type(p.grad).__name__ for p in model.parameters()}
            before = counter[0]
            scaler.step(opt)
            scaler.update()
            counts.append(counter[0] - before)
            scales.append(scaler.get_scale())
            params.append(_flat(model))
    finally:
        restore()
    result.update(scales=scales, params=params, all_reduce_calls=counts, grad_types=sorted(grad_types))
    return result


def _native_fsdp_norm_dtype(rank):
    """torch's fully_shard with param_dtype=bfloat16 on the whole model: the LayerNorm weights inside forward."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import mpx_torch

    model = mpx_torch.prepare(_fsdp_model(), "mixed_bfloat16")
    fully_shard(
        model, mesh=init_device_mesh("cpu", (2,)), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    )
    seen = {}
    _watch_dtypes(model, seen)
    model(torch.randn(8, 4))
    return seen


def _fsdp_units(rank):
    """units=(nn.Sequential,): an inner block becomes a unit, its LayerNorm one of its own inside it."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    import mpx_torch

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8)), nn.Linear(8, 2))

    reference = mpx_torch.prepare(build(), "mixed_bfloat16")
    model = mpx_torch.fully_shard(
        build(), "mixed_bfloat16", mesh=init_device_mesh("cpu", (2,)), units=(nn.Sequential,)
    )
    x = torch.randn(8, 4)
    out = model(x)
    return {
        "units": [name for name, m in model.named_modules() if type(m).__name__.startswith("FSDP")],
        "output_dtype": str(out.dtype),
        "output_equals_prepared": bool(torch.equal(out, reference(x))),
    }


def suite_fsdp(rank):
    return {
        "units": _fsdp_units(rank),
        "mpx": _fsdp_run(rank, "mpx", prepare_first=False),
        "mpx-prepared-first": _fsdp_run(rank, "mpx", prepare_first=True),
        "native": _fsdp_run(rank, "native", prepare_first=False),
        "native-norm": _native_fsdp_norm_dtype(rank),
    }


def _init(suite, rank, out_dir):
    # a file store (no port to pick)
    init_gloo(rank, f"file://{os.path.join(out_dir, suite + '-store')}")


if __name__ == "__main__":
    worker_main(sys.argv, {"ddp": lambda rank, _: suite_ddp(rank), "fsdp": lambda rank, _: suite_fsdp(rank)},
                init=_init)  # fmt: skip
