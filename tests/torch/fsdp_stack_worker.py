"""One rank of the 2-process gloo runs of tests/torch/test_fsdp_stacks.py (a spawn target, not a test).

``python tests/torch/fsdp_stack_worker.py SUITE RANK OUT_DIR`` with ``MASTER_ADDR``,
``MASTER_PORT``, ``WORLD_SIZE=2``, ``RANK``, ``LOCAL_RANK`` and ``NODE_RANK`` in the environment
(two_ranks.run_ranks; Lightning and Fabric read them as processes launched by a cluster).
Runs every scenario of SUITE (``lightning``, ``fabric`` or ``fp8``) and saves what
it saw to ``OUT_DIR/SUITE-RANK.pt`` (torch.save of plain data).
"""

from __future__ import annotations

import os
import sys
import warnings

from two_ranks import worker_main

os.environ.setdefault("MPX_NO_SLOW_WARNING", "1")

INF_STEP = 2  # the step (0-based) at which rank 1's gradient shard gets an inf
STEPS = 6
SCALER = {"kind": "dynamic", "init_scale": 2.0**10, "growth_interval": 2}
POLICY = "mixed_bfloat16"
RESUMED = {"kind": "dynamic", "init_scale": 2.0**3}  # a config the checkpoint's replaces



def _scale(plugin):
    """The plugin's loss scale: 1.0 without a scaler (kind "none": the plugin has none, as Lightning's bf16)."""
    return 1.0 if plugin.scaler is None else plugin.scaler.get_scale()

def _model(seed=0):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 1))


def _local(t):
    return (t._local_tensor if hasattr(t, "_local_tensor") else t).detach().clone()


def _shards(params):
    return [_local(p) for p in params]


def _opt_state(opt):
    """The optimizer state of this rank's shards (tensors cloned), in parameter order."""
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            out.append({k: _local(v) for k, v in opt.state.get(p, {}).items()})
    return out


def _inject_inf(params):
    import torch

    with torch.no_grad():
        _local_view = next(iter(params)).grad
        _local_view = _local_view._local_tensor if hasattr(_local_view, "_local_tensor") else _local_view
        _local_view.view(-1)[0] = float("inf")


def _data(rank_seed=7):
    import torch

    gen = torch.Generator().manual_seed(rank_seed)
    x = torch.randn(96, 4, generator=gen)
    return x, (x.sum(1, keepdim=True) * 0.5).tanh()


# -- lightning: Trainer + ModelParallelStrategy (FSDP2) -----------------------------------------------------
def _lightning_fit(tmp, *, config=SCALER, clip=None, inject=True, steps=STEPS, ckpt_in=None, ckpt_out=None):
    import lightning as L
    import torch
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import FSDPModule

    import mpx_torch
    from mpx_torch.lightning_fsdp import MPXModelParallelPrecision

    seen = {"losses": [], "scales": [], "shards": [], "opt": [], "start_state": None}

    class Regressor(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _model()

        def configure_model(self):
            if not isinstance(self.net, FSDPModule):
                policy = self.trainer.precision_plugin.policy
                mpx_torch.fully_shard(self.net, policy, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch, batch_idx):
            x, y = batch
            return (self.net(x).float() - y).pow(2).mean()

        def on_after_backward(self):
            if inject and self.global_rank == 1 and self.trainer.global_step == INF_STEP:
                _inject_inf(self.parameters())  # this rank's shard only, after the reduce-scatter

        def on_before_optimizer_step(self, optimizer):  # after the unscale, before clipping
            grads = [p.grad for p in self.parameters()]
            seen.setdefault("norms", []).append(float(torch.nn.utils.get_total_norm(grads).full_tensor()))

        def on_train_start(self):
            seen["start_state"] = self.trainer.precision_plugin.state_dict()

        def on_train_batch_end(self, outputs, batch, batch_idx):
            seen["losses"].append(float(outputs["loss"]))
            seen["scales"].append(_scale(self.trainer.precision_plugin))
            seen["shards"].append(_shards(self.parameters()))
            seen["opt"].append(_opt_state(self.trainer.optimizers[0]))

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.02)

    x, y = _data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    plugin = MPXModelParallelPrecision(POLICY, config)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo"
        ),
        plugins=[plugin],
        max_steps=steps,
        gradient_clip_val=clip,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp,
    )
    model = Regressor()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, loader, ckpt_path=ckpt_in)
    if ckpt_out is not None:
        trainer.save_checkpoint(ckpt_out)
        seen["saved_state"] = plugin.state_dict()
    seen["fsdp_units"] = sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule))
    return seen


def _checked_units(rank):
    """check_fsdp_units on models sharded with torch's fully_shard (three MixedPrecisionPolicy) and mpx's."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import mpx
    import mpx_torch
    from mpx_torch.distributed import check_fsdp_units

    mesh = init_device_mesh("cpu", (2,))
    policies = {
        "bf16-everywhere": MixedPrecisionPolicy(torch.bfloat16),  # reduces in bfloat16 too
        "bf16-gather": MixedPrecisionPolicy(torch.bfloat16, reduce_dtype=torch.float32),  # LayerNorm rounded
        "torch-default": MixedPrecisionPolicy(),  # float32 all-gather and reduce: exact, only wider
    }
    out = {}
    for name, mp in policies.items():
        model = fully_shard(_model(), mesh=mesh, mp_policy=mp)
        try:
            out[name] = check_fsdp_units(model, POLICY)
        except mpx.MPXError as error:
            out[name] = str(error)
    out["mpx"] = check_fsdp_units(mpx_torch.fully_shard(_model(), POLICY, mesh=mesh), POLICY)
    return out


def suite_lightning(rank, tmp):
    ckpt = os.path.join(tmp, "resume.ckpt")
    return {
        "fit": _lightning_fit(tmp, ckpt_out=ckpt),
        "resumed": _lightning_fit(tmp, config=RESUMED, steps=STEPS + 2, ckpt_in=ckpt),
        "clip-scaled": _lightning_fit(tmp, clip=0.05, inject=False, steps=2),
        "clip-unscaled": _lightning_fit(tmp, config={"kind": "none"}, clip=0.05, inject=False, steps=2),
        "units": _checked_units(rank),
    }


# -- fabric: ModelParallelStrategy (FSDP2) and FSDPStrategy (FSDP1) -----------------------------------------
def _fabric_run(tmp, rank, kind, *, config=SCALER, clip=None, inject=True, steps=STEPS, save=None, load=None):
    import lightning as L
    import torch
    from lightning.fabric.strategies import ModelParallelStrategy

    import mpx_torch
    from mpx_torch.lightning_fsdp import MPXFabricModelParallelPrecision

    assert kind == "fsdp2"
    plugin = MPXFabricModelParallelPrecision(POLICY, config)

    def parallelize(module, mesh):
        return mpx_torch.fully_shard(module, plugin.policy, mesh=mesh["data_parallel"])

    strategy = ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin])
    fabric.launch()
    model = fabric.setup_module(_model())
    opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.02))
    seen = {"losses": [], "scales": [], "shards": [], "opt": [], "norms": []}
    if load is not None:
        state = {"model": model, "optimizer": opt, "precision": plugin}
        fabric.load(load, state)
        # Fabric's ModelParallelStrategy hands back what is not a module or optimizer as saved (a dict),
        # without calling load_state_dict on it (its single-device strategies do): load it here
        seen["loaded_type"] = type(state["precision"]).__name__
        plugin.load_state_dict(state["precision"])
        seen["start_state"] = plugin.state_dict()
    x, y = _data()
    x, y = x[rank::2], y[rank::2]  # each rank its own data
    for i in range(steps):
        xb, yb = x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8]
        loss = (model(xb).float() - yb).pow(2).mean()
        fabric.backward(loss)
        if inject and rank == 1 and i == INF_STEP:
            _inject_inf(model.parameters())
        if clip is not None:
            norm = fabric.clip_gradients(model, opt, max_norm=clip)
            seen["norms"].append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        opt.step()
        opt.zero_grad()
        seen["losses"].append(float(loss.detach()))
        seen["scales"].append(_scale(plugin))
        seen["shards"].append(_shards(model.parameters()))
        seen["opt"].append(_opt_state(opt.optimizer))
    if save is not None:
        fabric.save(save, {"model": model, "optimizer": opt, "precision": plugin})
        seen["saved_state"] = plugin.state_dict()
    return seen


def suite_fabric(rank, tmp):
    out = {}
    for kind in ("fsdp2",):  # FSDPStrategy (FSDP1): Fabric refuses it without a GPU (test_fsdp_stacks.py)
        ckpt = os.path.join(tmp, f"{kind}.ckpt")
        out[kind] = {
            "fit": _fabric_run(tmp, rank, kind, save=ckpt),
            "resumed": _fabric_run(tmp, rank, kind, config=RESUMED, steps=1, inject=False, load=ckpt),
            "clip-scaled": _fabric_run(tmp, rank, kind, clip=0.05, inject=False, steps=2),
            "clip-unscaled": _fabric_run(
                tmp, rank, kind, config={"kind": "none"}, clip=0.05, inject=False, steps=2
            ),
        }
    return out


# -- fp8: mpx's Float8Linear under FSDP2, amaxes reduced with MAX; torchao's float8 all-gather refused ------
FP8_POLICY = "mixed_bfloat16,fp8=hybrid,fp8_history=4"


def _fp8_run(rank, *, reduce):
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    import mpx_torch
    from mpx_torch import float8

    groups = [dist.new_group([0]), dist.new_group([1])]  # every rank makes every group
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8))
    mpx_torch.fully_shard(model, FP8_POLICY, mesh=init_device_mesh("cpu", (2,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = mpx_torch.GradScaler(SCALER)
    gen = torch.Generator().manual_seed(500 + rank)
    seen = {"local_amax": [], "state": [], "commit_all_reduces": [], "scales": [], "types": []}
    for i in range(4):
        x = torch.randn(8, 16, generator=gen) * (1 + 3 * rank)  # each rank its own data, its own amaxes
        opt.zero_grad()
        scaler.scale(model(x).float().pow(2).mean()).backward()
        if rank == 1 and i == INF_STEP:
            _inject_inf(model.parameters())
        scaler.step(opt)
        scaler.update()
        layers = [m for _, m in float8.float8_layers(model)]
        seen["types"] = sorted({type(m).__name__ for m in layers})
        seen["local_amax"].append([m.fp8_amax.clone() for m in layers])
        counter, restore = _count_all_reduce()
        try:
            float8.commit_float8(model, scaler, process_group=None if reduce else groups[rank])
        finally:
            restore()
        seen["commit_all_reduces"].append(counter[0])
        seen["scales"].append(scaler.get_scale())
        seen["state"].append(float8.float8_state_dict(model))
    return seen


def _count_all_reduce():
    import torch.distributed as dist

    counter = [0]
    original = dist.all_reduce

    def counting(*args, **kwargs):
        counter[0] += 1
        return original(*args, **kwargs)

    dist.all_reduce = counting
    return counter, lambda: setattr(dist, "all_reduce", original)


def _torchao_all_gather(rank):
    """torchao Float8Linears with enable_fsdp_float8_all_gather=True: mpx's fully_shard refuses them on a CPU
    mesh; torch's fully_shard takes them, and the first forward fails in gloo (bias-free Linears: each
    unit's all-gather is float8 only; with float32 biases in the unit FSDP2 packs bytes and gloo passes)."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    import mpx
    import mpx_torch

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.Linear(32, 16, bias=False))
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
        return convert_to_float8_training(model, config=config)

    mesh = init_device_mesh("cpu", (2,))
    out = {}
    try:
        mpx_torch.fully_shard(build(), "mixed_bfloat16", mesh=mesh)
    except mpx.MPXError as error:
        out["mpx"] = str(error)
    native = fully_shard(build(), mesh=mesh)
    try:
        native(torch.randn(4, 16))
    except Exception as error:  # what gloo says
        out["native"] = f"{type(error).__name__}: {error}"
    return out


def _accelerate_on_cpu(rank, tmp):
    """Accelerate's FSDP plugin (FSDP2) and the HF Trainer's fsdp= on CPU processes: what they become."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import TrainingArguments

    from mpx_torch.accelerate import attach
    from mpx_torch.transformers import MPXTrainer

    accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    attach(accelerator, POLICY)
    model = accelerator.prepare(_model())
    args = TrainingArguments(
        os.path.join(tmp, "hf"), use_cpu=True, fsdp=True, fsdp_config={"version": 2}, report_to="none"
    )
    trainer = MPXTrainer(model=_model(), args=args, policy=POLICY)
    return {
        "accelerate": [accelerator.distributed_type.value, type(model).__name__],
        "trainer": [
            trainer.is_fsdp_enabled,
            trainer.accelerator.distributed_type.value,
            args.fsdp_plugin_args,
        ],
    }


def _fsdp1_run(rank, *, config=SCALER, inject=True, clip=None, steps=4):
    """torch's FSDP1 driven through MPXFabricFSDPPrecision as Fabric's FSDPStrategy would (which Lightning
    refuses on a CPU): the module converted, wrapped with the plugin's mixed_precision_config, steps
    through the plugin's backward, unscale, the root's clip_grad_norm_ and optimizer_step."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel

    from mpx_torch.lightning_fsdp import MPXFabricFSDPPrecision

    plugin = MPXFabricFSDPPrecision(POLICY, config)
    # device_id=cpu: without it FSDP1 refuses a CPU ("FSDP needs a non-CPU accelerator device"), and
    # Lightning passes None on a CPU
    mixed = plugin.mixed_precision_config
    model = FullyShardedDataParallel(
        plugin.convert_module(_model()), mixed_precision=mixed, device_id=torch.device("cpu")
    )
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    x, y = _data()
    x, y = x[rank::2], y[rank::2]
    seen = {"losses": [], "scales": [], "shards": [], "opt": [], "norms": []}
    for i in range(steps):
        with plugin.forward_context():
            loss = (model(x[8 * i : 8 * i + 8]).float() - y[8 * i : 8 * i + 8]).pow(2).mean()
        plugin.backward(loss, model)
        if inject and rank == 1 and i == INF_STEP:
            _inject_inf(model.parameters())
        if clip is not None:
            plugin.unscale_gradients(opt)
            seen["norms"].append(float(model.clip_grad_norm_(clip)))
        plugin.optimizer_step(opt)
        opt.zero_grad()
        seen["losses"].append(float(loss.detach()))
        seen["scales"].append(_scale(plugin))
        seen["shards"].append(_shards(model.parameters()))
        seen["opt"].append(_opt_state(opt))
    seen["param_dtype"] = str(plugin.mixed_precision_config.param_dtype)
    return seen


def suite_fp8(rank, tmp):
    return {
        "reduced": _fp8_run(rank, reduce=True),
        "per-rank": _fp8_run(rank, reduce=False),
        "torchao": _torchao_all_gather(rank),
        "accelerate": _accelerate_on_cpu(rank, tmp),  # here: the process is up, the group made
        "fsdp1": _fsdp1_run(rank, steps=STEPS),
        "fsdp1-clip-scaled": _fsdp1_run(rank, inject=False, clip=0.05, steps=2),
        "fsdp1-clip-unscaled": _fsdp1_run(rank, config={"kind": "none"}, inject=False, clip=0.05, steps=2),
    }


if __name__ == "__main__":
    # env:// (the launcher's MASTER_ADDR/PORT, RANK, LOCAL_RANK): Lightning and Fabric reuse the group
    worker_main(sys.argv, {"lightning": suite_lightning, "fabric": suite_fabric, "fp8": suite_fp8})
