"""torch replicas: DDP and FSDP2 (``fully_shard``) on 2 gloo processes, natively and under mpx.

    python -m conformance.distributed.torch IN.json OUT.json

Spawned with ``torch.multiprocessing`` (start method spawn), rendezvous through a file store.
Each rank runs every case in the modes ``MPX_CONFORMANCE_MODES`` names (both by default; without
``mpx`` every rank blocks mpx's imports, :mod:`conformance.isolation`); rank 0 writes ``OUT`` (see
:mod:`conformance.distributed`).
Natively: ``torch.amp.GradScaler`` (DDP; FSDP2 with a hand-made ``MixedPrecisionPolicy``);
under mpx: ``mpx_torch.GradScaler`` (found-inf combined over the process group) and
``mpx_torch.fully_shard``.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from conformance import isolation

WORLD = 2
FSDP_POLICY = "mixed_bfloat16"
ENGINE_NAMES = {
    "per_replica": "DDP, gloo, 2 processes",
    "sharded": f"FSDP2 fully_shard ({FSDP_POLICY}), gloo, 2 processes",
}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(_local(p.detach()).contiguous().numpy().tobytes())
    return h.hexdigest()


def _model(engine: str, mode: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    if engine == "per_replica":
        return nn.parallel.DistributedDataParallel(model)
    if mode == "native":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in (model[0], model[2]):
            fully_shard(layer, mp_policy=mp_policy)
        return fully_shard(model, mp_policy=mp_policy)
    import mpx_torch

    return mpx_torch.fully_shard(model, FSDP_POLICY)


def _scaler(mode: str, cfg: dict):
    """torch's GradScaler from the config dict (``mpx.ScalerConfig.to_dict()``) natively, mpx_torch's under mpx."""
    if mode == "native":
        return torch.amp.GradScaler("cpu", init_scale=cfg["init_scale"], growth_factor=cfg["growth_factor"],
                                    backoff_factor=cfg["backoff_factor"], growth_interval=cfg["growth_interval"])  # fmt: skip
    import mpx_torch

    return mpx_torch.GradScaler(cfg, device="cpu")


def _run(p: dict, mode: str, rank: int) -> dict:
    model = _model(p["engine"], mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = _scaler(mode, p["config"])
    gen = torch.Generator().manual_seed(rank + 1)  # each rank its own data
    x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 4, generator=gen)
    bad_rank = WORLD - 1
    scales, applied, digests = [], [], []
    for finite in p["flags"]:
        bad = not finite and rank == bad_rank
        before = _digest(model)
        opt.zero_grad()
        loss = ((model(x).float() - y) ** 2).mean()
        if bad and p["scenario"] == "loss":
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if bad and p["scenario"] == "grads_after_reduce":  # DDP/FSDP2 have reduced by now
            with torch.no_grad():
                _local(next(model.parameters()).grad).view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        after = _digest(model)
        scales.append(float(scaler.get_scale()))
        applied.append(after != before)
        digests.append(after)
    return {"scales": scales, "applied": applied, "digests": digests}


def _combine(engine: str, per_rank: list[dict]) -> dict:
    """One observation from every rank's: rank 0's trace; consistent when all ranks agree at every step."""
    same = all(r["scales"] == per_rank[0]["scales"] and r["applied"] == per_rank[0]["applied"] for r in per_rank)
    if engine == "per_replica":  # replicas hold the whole model: bitwise equal at every step
        same = same and all(r["digests"] == per_rank[0]["digests"] for r in per_rank)
    return {"consistent": same, "scales": per_rank[0]["scales"], "applied": per_rank[0]["applied"],
            "scales_per_replica": [r["scales"] for r in per_rank], "engine": ENGINE_NAMES[engine]}  # fmt: skip


def _rank_main(rank: int, store: str, src: str, dst: str) -> None:
    modes = isolation.modes_from_env()  # every rank: spawned, each is a process of its own
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=30))  # fmt: skip
    specs = json.loads(Path(src).read_text())
    out: dict[str, dict] = {}
    for cid, p in specs.items():
        out[cid] = {}
        for mode in modes:
            if p["scenario"] == "fp8_amax":
                out[cid][mode] = {"skip": "the FP8 replica case runs in the jax and keras-jax columns; the suite has "
                                          "no torch FP8 scenario on FSDP2 yet"}  # fmt: skip
                continue
            try:
                mine: Any = _run(p, mode, rank)
            except Exception as err:  # every rank runs the same code, so they fail alike
                mine = {"raised": traceback.format_exception_only(type(err), err)[-1].strip()[:300]}
            gathered: list[Any] = [None] * WORLD
            dist.all_gather_object(gathered, mine)
            raised = [g["raised"] for g in gathered if "raised" in g]
            out[cid][mode] = {"raised": raised[0]} if raised else _combine(p["engine"], gathered)
    reports: list[Any] = [None] * WORLD
    dist.all_gather_object(reports, isolation.report())
    out["_isolation"] = {key: sorted({n for r in reports for n in r[key]}) for key in ("mpx_modules", "blocked")}
    if rank == 0:
        Path(dst).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    src, dst = argv
    isolation.modes_from_env()  # checks the modes; natively the blocker, before anything runs
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="mpx-gloo-") as tmp:
        mp.spawn(_rank_main, args=(str(Path(tmp) / "store"), src, dst), nprocs=WORLD, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
