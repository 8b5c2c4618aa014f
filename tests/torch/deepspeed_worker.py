"""One rank of the 2-process DeepSpeed runs of tests/torch/test_deepspeed.py (a spawn target, not a test).

``python tests/torch/deepspeed_worker.py SUITE RANK OUT_DIR`` (two_ranks.run_ranks): the parent sets RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT (env:// on gloo, as Accelerate and the HF Trainer read them) and
TORCH_EXTENSIONS_DIR (DeepSpeed's first ``init_distributed`` JIT-compiles its CPU shm op there).
Each suite runs its scenarios on DeepSpeed's bf16 engine with ZeRO-2 on CPU and saves what it saw
to ``OUT_DIR/SUITE-RANK.pt`` (torch.save of plain data).
"""

from __future__ import annotations

import os
import random
import sys
import time

from two_ranks import worker_main

_T0 = time.monotonic()


def mark(what):
    """A timing line in this rank's log (the test shows the logs when a rank fails)."""
    print(f"[{time.monotonic() - _T0:7.2f} s] {what}", flush=True)


os.environ.setdefault("MPX_NO_SLOW_WARNING", "1")

INF_STEP = 2  # the step (0-based) at which rank 1's loss is inf
STEPS = 6
LR = 1e-2
POLICY = "mixed_bfloat16"


def _model(seed=0):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 2))


def _base(**extra):
    return {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
        "steps_per_print": 10**9,
        **extra,
    }


def _batch(rank):
    import torch

    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(8, 4, generator=gen)
    return x, x[:, :2] * 2 - 1  # a target the model can fit


def snapshot(engine):
    """Everything a step may change on this rank: the module's (bf16) parameters, this rank's float32
    master partition and the optimizer state, cloned."""
    import torch

    opt = engine.optimizer
    module = torch.cat([p.detach().reshape(-1).float() for p in engine.module.parameters()])
    masters = [t.detach().clone() for t in opt.single_partition_of_fp32_groups]
    state = [
        {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in s.items()}
        for s in opt.optimizer.state.values()
    ]
    return {"module": module, "masters": masters, "opt_state": state}


def _train(rank, engine, scaler, *, inject=True, steps=STEPS):
    import torch.nn.functional as F

    x, y = _batch(rank)
    rows = []
    for i in range(steps):
        out = engine(x)
        loss = F.mse_loss(out.float(), y)
        if inject and rank == 1 and i == INF_STEP:
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        rows.append(
            {
                "loss": float(loss.detach()),
                "out_dtype": str(out.dtype),
                "norm": engine.get_global_grad_norm(),
                "scaler": scaler.state_dict(),
                **snapshot(engine),
            }
        )
    return rows


def _engine(base=None, config=None, policy=POLICY, **kwargs):
    from mpx_torch.deepspeed import EngineScaler, initialize

    model = _model()
    engine, *_ = initialize(model, policy, config, base=_base() if base is None else base,
                            model_parameters=model.parameters(), **kwargs)  # fmt: skip
    return engine, EngineScaler(engine)


def _clip(rank):
    """gradient_clipping=c with SGD: the first step's master update is lr * clipped gradient, and the
    norm DeepSpeed reports is the norm of the unscaled, rank-averaged gradients of the same module."""
    import copy

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    clip = 1e-3
    base = _base(
        gradient_clipping=clip,
        optimizer={"type": "SGD", "params": {"lr": LR}},
        zero_allow_untested_optimizer=True,
    )
    engine, _ = _engine(base)
    reference = copy.deepcopy(engine.module)  # the bf16 module the engine runs, prepared under the policy
    x, y = _batch(rank)
    F.mse_loss(reference(x).float(), y).backward()
    grads = torch.cat([p.grad.reshape(-1).float() for p in reference.parameters()])
    dist.all_reduce(grads)
    grads /= dist.get_world_size()
    before = [t.clone() for t in engine.optimizer.single_partition_of_fp32_groups]
    engine.backward(F.mse_loss(engine(x).float(), y))
    engine.step()
    after = engine.optimizer.single_partition_of_fp32_groups
    update = torch.cat([(b - a).reshape(-1) for b, a in zip(before, after, strict=True)]) / LR
    update_sq = update.double().pow(2).sum()
    dist.all_reduce(update_sq)  # each rank holds its partition of the master weights
    return {
        "clip": clip,
        "reported_norm": float(engine.get_global_grad_norm()),
        "reference_norm": float(grads.double().norm()),
        "update_norm": float(update_sq.sqrt()),
    }


def saturated(state, config):
    """``state`` with what DeepSpeed does not keep set aside: overflows in a row (0 here), and the
    overflows since growth past ``hysteresis - 1`` (DeepSpeed's counter stops at 1 there; every later
    overflow backs off either way)."""
    import dataclasses

    since = min(state.nonfinite_since_growth, config.hysteresis - 1)
    return dataclasses.replace(state, consecutive_nonfinite=0, nonfinite_since_growth=since)


def _mapping():
    """DeepSpeed's own DynamicLossScaler against mpx's DeepSpeed mode, on random overflow sequences: the
    state read from DeepSpeed's scaler equals mpx's after every step, and a DeepSpeed scaler loaded from
    mpx's state midway goes on exactly as the one it was read from."""
    import dataclasses

    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    import mpx
    from mpx_torch.deepspeed import load_into_loss_scaler, state_from_loss_scaler

    rng = random.Random(0)
    mismatches, cases = [], 0
    for _ in range(120):
        window, hysteresis = rng.randint(1, 4), rng.randint(1, 3)
        consecutive = rng.random() < 0.5
        config = dataclasses.replace(
            mpx.SCALER_PRESETS["deepspeed_fp16"],
            init_scale=2.0**40,
            growth_interval=window,
            hysteresis=hysteresis,
            hysteresis_reset="finite" if consecutive else "growth",
        )
        flags = [rng.random() < 0.35 for _ in range(rng.randint(1, 30))]  # True: an overflow
        cut = rng.randint(0, len(flags))

        def make(window=window, hysteresis=hysteresis, consecutive=consecutive):
            return DynamicLossScaler(
                init_scale=2.0**40,
                scale_window=window,
                min_scale=1,
                delayed_shift=hysteresis,
                consecutive_hysteresis=consecutive,
            )

        native, ours = make(), mpx.LossScaler(config)
        skipped = 0
        for i, overflow in enumerate(flags):
            if i == cut:  # a fresh DeepSpeed scaler, loaded from mpx's state, takes over
                native = make()
                load_into_loss_scaler(native, config, ours.state)
            native.update_scale(overflow)
            ours.update(not overflow)
            skipped += overflow
            read = state_from_loss_scaler(native, config, skipped_steps=skipped)
            want = ours.state
            exact = saturated(read, config) == saturated(want, config)
            bound = (read.consecutive_nonfinite == 0) == (want.consecutive_nonfinite == 0) and (
                read.consecutive_nonfinite <= want.consecutive_nonfinite
                and read.nonfinite_since_growth <= want.nonfinite_since_growth
            )
            if not (exact and bound and float(native.cur_scale) == ours.get_scale()):
                mismatches.append({"config": config.to_dict(), "flags": flags, "cut": cut, "step": i,
                                   "read": read, "want": want})  # fmt: skip
                break
        cases += 1
    return {"cases": cases, "mismatches": mismatches[:3]}


# two overflows in a row on rank 1: hysteresis 2 absorbs the first, halves on the second
FP16_INF_STEPS = (2, 3)


def _fp16(rank):
    """DeepSpeed's fp16 engine, where the CPU has float16 kernels (oneDNN's float16 support, which
    DeepSpeed's CPU accelerator asks); elsewhere the error it refuses with."""
    import dataclasses

    import torch.nn.functional as F
    from deepspeed.accelerator import get_accelerator

    import mpx

    config = dataclasses.replace(mpx.SCALER_PRESETS["deepspeed_fp16"], init_scale=2.0**10, growth_interval=2)
    supported = bool(get_accelerator().is_fp16_supported())
    try:
        engine, scaler = _engine(policy="mixed_float16", config=config)
    except Exception as e:  # the message is what the test reads
        return {"supported": supported, "error": f"{type(e).__name__}: {e}"}
    x, y = _batch(rank)
    rows = []
    for i in range(STEPS):
        loss = F.mse_loss(engine(x).float(), y)
        if rank == 1 and i in FP16_INF_STEPS:
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        rows.append({"loss": float(loss.detach()), "scaler": scaler.state_dict(), **snapshot(engine)})
    return {"supported": supported, "error": None, "config": config.to_dict(),
            "ds_config": dict(engine._config._param_dict), "rows": rows}  # fmt: skip


def suite_engine(rank, out_dir):
    """mpx_torch.deepspeed on the engine itself."""
    import torch.distributed as dist

    from mpx_torch.deepspeed import EngineScaler, load_checkpoint, save_checkpoint

    out = {}
    engine, scaler = _engine()
    mark("engine made")
    out["config"] = dict(engine._config._param_dict)
    out["train"] = _train(rank, engine, scaler)
    mark("trained")
    ckpt = os.path.join(out_dir, "engine-ckpt")
    save_checkpoint(engine, ckpt, tag="t")
    saved = scaler.state_dict()
    fresh, fresh_scaler = _engine()
    before_load = fresh_scaler.state_dict()
    _, client = load_checkpoint(fresh, ckpt, tag="t")
    out["resume"] = {"saved": saved, "before": before_load, "after": fresh_scaler.state_dict(),
                     "client_keys": sorted(client), "after_snapshot": snapshot(fresh),
                     "saved_snapshot": snapshot(engine)}  # fmt: skip
    mark("saved and resumed")
    # a neutral dict with other counters goes into the engine too (the scale of a bf16 engine is 1)
    moved = {**saved, "steps": saved["steps"] + 3, "skipped_steps": saved["skipped_steps"] + 2}
    EngineScaler(fresh).load_state_dict(moved)
    out["moved"] = {"loaded": moved, "read": fresh_scaler.state_dict(), "engine_skipped": fresh.skipped_steps}
    try:
        EngineScaler(fresh).load_state_dict(
            {**saved, "config": {**saved["config"], "max_consecutive_skips": 5}}
        )
        out["mismatch_error"] = None
    except Exception as e:  # the message is what the test reads
        out["mismatch_error"] = f"{type(e).__name__}: {e}"
    noskip, noskip_scaler = _engine(config={"kind": "none", "skip_nonfinite": False})
    out["noskip"] = {
        "config": dict(noskip._config._param_dict),
        "rows": _train(rank, noskip, noskip_scaler)[: INF_STEP + 1],
    }
    mark("no-skip run")
    out["clip"] = _clip(rank)
    mark("clip run")
    out["fp16"] = _fp16(rank)
    mark("fp16 run")
    if rank == 0:
        out["mapping"] = _mapping()
    mark("done")
    dist.barrier()
    return out


def _accelerate_step(accelerator, model, opt, x, y, bad):
    import torch.nn.functional as F

    loss = F.mse_loss(model(x).float(), y)
    if bad:
        loss = loss * float("inf")
    accelerator.backward(loss)
    norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return float(loss.detach()), norm


def suite_accelerate(rank, out_dir):
    """mpx_torch.accelerate.attach under Accelerate's DeepSpeed plugin (bf16 ZeRO-2)."""
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    from mpx_torch.accelerate import attach

    base = {k: v for k, v in _base(gradient_clipping=1.0).items() if k != "optimizer"}
    base["bf16"] = {"enabled": "auto"}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=base))
    scaler = attach(accelerator, POLICY)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = accelerator.prepare(model, opt)
    engine = accelerator.deepspeed_engine_wrapped.engine
    mark("accelerate prepared")
    x, y = _batch(rank)
    rows = []
    for i in range(STEPS):
        loss, norm = _accelerate_step(accelerator, model, opt, x, y, rank == 1 and i == INF_STEP)
        rows.append({"loss": loss, "norm": None if norm is None else float(norm),
                     "skipped": accelerator.optimizer_step_was_skipped, "scaler": scaler.state_dict(),
                     **snapshot(engine)})  # fmt: skip
    mark("accelerate trained")
    ckpt = os.path.join(out_dir, "accelerate-ckpt")
    accelerator.save_state(ckpt)
    saved, saved_snapshot = scaler.state_dict(), snapshot(engine)
    _accelerate_step(accelerator, model, opt, x, y, rank == 1)  # one more step (skipped) after the save
    moved = scaler.state_dict()
    accelerator.load_state(ckpt)
    out = {
        "config": dict(engine._config._param_dict),
        "engine_type": type(engine).__name__,
        "rows": rows,
        "resume": {
            "saved": saved,
            "moved": moved,
            "after": scaler.state_dict(),
            "files": sorted(os.listdir(ckpt)),
        },
        "after_snapshot": snapshot(engine),
        "saved_snapshot": saved_snapshot,
    }
    mark("accelerate resumed")
    dist.barrier()
    return out


def _hf_trainer(rank, out_dir, *, resume=None, max_steps=STEPS):
    import torch.nn.functional as F
    from torch import nn
    from transformers import TrainerCallback, TrainingArguments

    from mpx_torch.transformers import MPXTrainer

    class Regressor(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _model()
            self.calls = 0
            self.losses = []

        def forward(self, x, labels):
            loss = F.mse_loss(self.net(x).float(), labels)
            if self.training:
                self.losses.append(float(loss.detach()))
                self.calls += 1
                if rank == 1 and self.calls == INF_STEP + 1:
                    loss = loss * float("inf")
            return {"loss": loss}

    x, y = _batch(0)
    # one sample, repeated: every shuffled batch is the same, so the loss falls step by step
    data = [{"x": x[0], "labels": y[0]} for _ in range(16 * STEPS)]
    ds = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": "auto"},
        "steps_per_print": 10**9,
    }
    args = TrainingArguments(
        os.path.join(out_dir, "hf"), deepspeed=ds, per_device_train_batch_size=8, max_steps=max_steps,
        learning_rate=LR, logging_steps=1, save_steps=STEPS, report_to="none", max_grad_norm=1.0,
        lr_scheduler_type="constant", disable_tqdm=True, seed=0,
    )  # fmt: skip
    rows = []

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            rows.append({"scaler": trainer.scaler.state_dict(), **snapshot(trainer.model_wrapped)})

    model = Regressor()
    trainer = MPXTrainer(model=model, args=args, train_dataset=data, policy=POLICY, callbacks=[Record()])
    trainer.train(resume_from_checkpoint=resume)
    engine = trainer.model_wrapped
    return {
        "config": dict(engine._config._param_dict),
        "rows": rows,
        "logs": [log for log in trainer.state.log_history if "loss" in log],
        "losses": model.losses,
        "scaler": trainer.scaler.state_dict(),
        "snapshot": snapshot(engine),
    }


def suite_hf(rank, out_dir):
    """MPXTrainer with TrainingArguments(deepspeed=ds_config) (bf16 ZeRO-2), then a resume from its checkpoint."""
    import torch.distributed as dist

    first = _hf_trainer(rank, out_dir)
    mark("hf trained")
    checkpoint = os.path.join(out_dir, "hf", f"checkpoint-{STEPS}")
    resumed = _hf_trainer(rank, out_dir, resume=checkpoint, max_steps=STEPS + 2)
    mark("hf resumed")
    dist.barrier()
    return {"first": first, "resumed": {"rows": [row["scaler"] for row in resumed["rows"]]}}


def init_deepspeed(suite, rank, out_dir):
    """DeepSpeed's init_distributed on gloo (env://; the first one JIT-compiles its CPU shm op)."""
    import deepspeed

    mark("imported")
    deepspeed.init_distributed(dist_backend="gloo")
    mark("init_distributed")


if __name__ == "__main__":
    worker_main(sys.argv, {"engine": suite_engine, "accelerate": suite_accelerate, "hf": suite_hf},
                init=init_deepspeed)  # fmt: skip
