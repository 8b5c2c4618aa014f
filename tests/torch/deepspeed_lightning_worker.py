"""One rank of the 2-process Lightning DeepSpeed runs of tests/torch/test_deepspeed.py (a spawn target, not a test).

``python tests/torch/deepspeed_lightning_worker.py SUITE RANK OUT_DIR`` with the environment of
deepspeed_worker.py.  Lightning's ``DeepSpeedStrategy`` (Trainer and Fabric) with mpx's plugins, on
DeepSpeed's bf16 engine with ZeRO-2 on CPU.  Lightning refuses every accelerator but CUDA in one place,
``DeepSpeedStrategy.setup_environment`` (lightning/pytorch/strategies/deepspeed.py lines 341-347 and
lightning/fabric/strategies/deepspeed.py lines 639-645 in lightning 2.6); the strategies here lift only
that check.  Everything else is Lightning's and DeepSpeed's code; the CPU devices are given their
indices (``parallel_devices``) so Lightning's ``_validate_device_index_selection`` passes as on GPUs.
"""

from __future__ import annotations

import copy
import os
import sys
import warnings

from deepspeed_worker import INF_STEP, LR, POLICY, STEPS, _batch, _model, init_deepspeed, mark, snapshot
from two_ranks import worker_main

CLIP = 1e-3


def _strategies():
    """Lightning's DeepSpeedStrategy (Trainer, Fabric) less only its CUDA check, on indexed CPU devices."""
    import torch
    from lightning.fabric.strategies import DeepSpeedStrategy as FabricDeepSpeedStrategy
    from lightning.fabric.strategies.ddp import DDPStrategy as FabricDDPStrategy
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        def setup_environment(self):
            DDPStrategy.setup_environment(self)  # DeepSpeedStrategy's: the CUDA check, then this

    class CPUFabricDeepSpeedStrategy(FabricDeepSpeedStrategy):
        def setup_environment(self):
            FabricDDPStrategy.setup_environment(self)

    devices = [torch.device("cpu", 0), torch.device("cpu", 1)]
    return CPUDeepSpeedStrategy, CPUFabricDeepSpeedStrategy, devices


def _fit(tmp, rank, *, inject=True, clip=None, steps=STEPS, ckpt_in=None, ckpt_out=None, sgd=False):
    import lightning as L
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from mpx_torch.lightning_deepspeed import MPXDeepSpeedPrecision

    Strategy, _, devices = _strategies()
    seen = {"rows": [], "loaded": None}

    class Regressor(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _model()

        def training_step(self, batch, batch_idx):
            x, y = batch
            if clip is not None and self.trainer.global_step == 0:
                # the reference: the module the engine runs, plain torch autograd, gradients averaged
                reference = copy.deepcopy(self.net)
                F.mse_loss(reference(x).float(), y).backward()
                grads = torch.cat([p.grad.reshape(-1).float() for p in reference.parameters()])
                dist.all_reduce(grads)
                seen["reference_norm"] = float((grads / dist.get_world_size()).double().norm())
            out = self.net(x)
            loss = F.mse_loss(out.float(), y)
            if inject and self.global_rank == 1 and self.trainer.global_step == INF_STEP:
                loss = loss * float("inf")
            return loss

        def on_train_start(self):
            seen["start_state"] = self.trainer.precision_plugin.state_dict()
            seen["start_snapshot"] = snapshot(self.trainer.model)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            engine = self.trainer.model
            seen["rows"].append({"loss": float(outputs["loss"]), "norm": engine.get_global_grad_norm(),
                                 "scaler": self.trainer.precision_plugin.scaler.state_dict(),
                                 **snapshot(engine)})  # fmt: skip

        def on_load_checkpoint(self, checkpoint):
            seen["loaded"] = {k: checkpoint[k] for k in checkpoint if k.startswith("MPX")}

        def configure_optimizers(self):
            if sgd:
                return torch.optim.SGD(self.parameters(), lr=LR)
            return torch.optim.AdamW(self.parameters(), lr=LR)

    x, y = _batch(rank)  # each rank its own batch, the same at every step
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    plugin = MPXDeepSpeedPrecision(POLICY)
    strategy = Strategy(stage=2, parallel_devices=devices, process_group_backend="gloo")
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin], max_steps=steps,
        gradient_clip_val=clip, use_distributed_sampler=False, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Regressor(), loader, ckpt_path=ckpt_in)
    engine = trainer.model
    seen["config"] = dict(engine._config._param_dict)
    seen["precision"] = trainer.precision
    if ckpt_out is not None:
        trainer.save_checkpoint(ckpt_out)
        seen["saved_state"] = plugin.state_dict()
        seen["saved_snapshot"] = snapshot(engine)
    return seen


def suite_lightning(rank, out_dir):
    import torch.distributed as dist

    ckpt = os.path.join(out_dir, "lightning-ckpt")
    out = {"fit": _fit(out_dir, rank, ckpt_out=ckpt)}
    mark("fit")
    out["resumed"] = _fit(out_dir, rank, inject=False, steps=STEPS + 2, ckpt_in=ckpt)
    mark("resumed")
    out["clip"] = _fit(out_dir, rank, inject=False, clip=CLIP, steps=1, sgd=True)
    mark("clip")
    out["fabric"] = _fabric(rank, out_dir)
    mark("fabric")
    dist.barrier()
    return out


def _fabric_setup(plugin):
    """A Fabric on Lightning's DeepSpeedStrategy (the plugin's ds_config in it), its engine and optimizer."""
    import lightning as L
    import torch

    _, Strategy, devices = _strategies()
    base = {"zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
            "train_micro_batch_size_per_gpu": 8}  # fmt: skip
    strategy = Strategy(config=plugin.ds_config(base), parallel_devices=devices, process_group_backend="gloo")
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin])
    fabric.launch()
    model = _model()
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    return fabric, model, opt


def _fabric(rank, out_dir):
    """Fabric: an inf on rank 1, save with the plugin, a new run loads it, a mismatching plugin refused."""
    import torch.nn.functional as F

    import mpx
    from mpx_torch.lightning_deepspeed import MPXFabricDeepSpeedPrecision

    plugin = MPXFabricDeepSpeedPrecision(POLICY)
    fabric, model, opt = _fabric_setup(plugin)
    x, y = _batch(rank)
    rows = []
    for i in range(STEPS):
        loss = F.mse_loss(model(x).float(), y)
        if rank == 1 and i == INF_STEP:
            loss = loss * float("inf")
        fabric.backward(loss)
        opt.step()
        rows.append({"loss": float(loss.detach()), "scaler": plugin.scaler.state_dict(),
                     **snapshot(model._forward_module)})  # fmt: skip
    ckpt = os.path.join(out_dir, "fabric-ckpt")
    fabric.save(ckpt, {"model": model, "optimizer": opt, "precision": plugin})
    saved, saved_snapshot = plugin.state_dict(), snapshot(model._forward_module)
    fresh = MPXFabricDeepSpeedPrecision(POLICY)  # a new run
    fabric2, model2, opt2 = _fabric_setup(fresh)
    fabric2.load(ckpt, {"model": model2, "optimizer": opt2, "precision": fresh})
    pending = fresh.state_dict()  # loaded before the first backward: kept for the engine
    loaded_snapshot = snapshot(model2._forward_module)
    fabric2.backward(F.mse_loss(model2(x).float(), y))  # the first backward puts the state into the engine
    after_backward = fresh.scaler.state_dict()
    # an engine that runs another scaler than the plugin's is refused at the first backward
    other = MPXFabricDeepSpeedPrecision(POLICY, mpx.ScalerConfig(kind="none", skip_nonfinite=False))
    try:
        other.backward(loss, model2._forward_module)
        mismatch = None
    except mpx.MPXError as error:
        mismatch = str(error)
    return {"config": dict(model._forward_module._config._param_dict), "rows": rows, "saved": saved,
            "pending": pending, "after_backward": after_backward, "mismatch": mismatch,
            "saved_snapshot": saved_snapshot, "loaded_snapshot": loaded_snapshot}  # fmt: skip


if __name__ == "__main__":
    # the process group made by DeepSpeed's init_distributed, which Lightning's strategies then find
    worker_main(sys.argv, {"lightning": suite_lightning}, init=init_deepspeed)
