"""mpx inside FSDP through the stacks: Lightning's ModelParallelStrategy (FSDP2) and FSDPStrategy (FSDP1),
Fabric, and FP8 layers under FSDP2, on two gloo processes (tests/torch/fsdp_stack_worker.py, started once
per suite); each test reads what the ranks saw.

The four facts for each stack: the loss decreases; an inf injected into one rank's gradient shard skips
the step on every rank with the shards and the optimizer state bit-identical; clipping sees the unscaled
gradients (the run with loss scaling equals the run without, bit for bit); resuming restores the scale.
"""

from pathlib import Path

import pytest
import torch
from two_ranks import ranked_env, rendezvous_env, run_ranks

pytest.importorskip("lightning")

WORKER = Path(__file__).with_name("fsdp_stack_worker.py")
INF_STEP, STEPS = 2, 6


def _run_suite(suite: str, tmp: Path) -> list[dict]:
    return run_ranks(WORKER, suite, tmp, env=rendezvous_env(), rank_env=ranked_env)


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory):
    return _run_suite("lightning", tmp_path_factory.mktemp("lightning"))


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def _assert_four_facts_of_a_run(runs, key="fit"):
    """Loss down, one skip at INF_STEP on both ranks with shards and optimizer state unchanged there."""
    scales = [r[key]["scales"] for r in runs]
    # growth every 2 finite steps from 2**10, halved by the skipped step on both ranks
    assert scales[0] == scales[1] == [1024.0, 2048.0, 1024.0, 1024.0, 2048.0, 2048.0]
    for r in runs:
        seen = r[key]
        assert _same(seen["shards"][INF_STEP], seen["shards"][INF_STEP - 1])
        assert _same(seen["opt"][INF_STEP], seen["opt"][INF_STEP - 1])
        assert not _same(seen["shards"][INF_STEP + 1], seen["shards"][INF_STEP])
        losses = seen["losses"]
        assert sum(losses[-2:]) / 2 < losses[0]  # the mean of the last two below the first
    # the shards are different pieces of one model
    assert not _same(runs[0][key]["shards"][0], runs[1][key]["shards"][0])


def test_lightning_model_parallel_skips_together_and_learns(lightning_runs):
    _assert_four_facts_of_a_run(lightning_runs)
    # mpx_torch.fully_shard in configure_model: the float32-kept LayerNorm is a unit of its own
    assert lightning_runs[0]["fit"]["fsdp_units"] == ["net", "net.1"]
    norms = lightning_runs[0]["fit"]["norms"]
    assert norms[INF_STEP] == float("inf") and all(
        n < float("inf") for i, n in enumerate(norms) if i != INF_STEP
    )


def test_lightning_model_parallel_clips_the_unscaled_gradients(lightning_runs):
    for r in lightning_runs:
        scaled, unscaled = r["clip-scaled"], r["clip-unscaled"]
        assert min(scaled["norms"]) > 0.05  # clipping at 0.05 is active on both steps
        assert scaled["norms"] == unscaled["norms"]  # the norm clipping sees: unscaled
        assert _same(scaled["shards"], unscaled["shards"])
        assert _same(scaled["opt"], unscaled["opt"])


def test_lightning_model_parallel_resume_restores_the_scale(lightning_runs):
    for r in lightning_runs:
        saved = r["fit"]["saved_state"]
        assert saved["scale"] == 2048.0
        # the resumed plugin was made with init_scale 8 and another config: the checkpoint's wins
        assert r["resumed"]["start_state"] == saved
        assert r["resumed"]["scales"] == [4096.0, 4096.0]


def test_units_that_round_or_reduce_otherwise_are_refused(lightning_runs):
    units = lightning_runs[0]["units"]
    fix = "Shard with mpx_torch.fully_shard(module, policy, mesh=...)"
    assert units["bf16-everywhere"].startswith(
        "module 'root': this FSDP2 unit reduces its gradients in bfloat16, but the policy "
        "params=float32,compute=bfloat16,output=float32 asks for float32."
    )
    assert units["bf16-gather"].startswith(
        "module '1.weight': the FSDP2 unit 'root' all-gathers this float32 parameter in bfloat16, but here the "
        "policy params=float32,compute=float32,output=float32 computes in float32: it would arrive rounded."
    )
    assert fix in units["bf16-everywhere"] and fix in units["bf16-gather"]
    assert units["torch-default"] == [""]  # float32 all-gather: exact (only wider than needed)
    assert units["mpx"] == ["", "1"]  # the LayerNorm in a float32 unit of its own


# -- FSDPStrategy (FSDP1): the plugin's shape and mapping, and Lightning's refusal on a CPU ----------------
def test_fsdp_strategy_takes_the_plugin_and_its_mixed_precision():
    import lightning as L
    from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision
    from lightning.pytorch.strategies import FSDPStrategy

    from mpx_torch.lightning_fsdp import MPXFSDPPrecision

    plugin = MPXFSDPPrecision("params=float32,compute=bfloat16,output=float32,reduce=bfloat16")
    assert isinstance(plugin, FSDPPrecision) and plugin.precision == "bf16-mixed"
    strategy = FSDPStrategy(precision_plugin=plugin)
    mp = strategy.mixed_precision_config
    assert (mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype) == (torch.bfloat16, torch.bfloat16, None)
    assert plugin.scaler is None  # bfloat16: no loss scaler, as Lightning's bf16-mixed
    # Lightning's Trainer refuses FSDPStrategy without a GPU, whatever the precision plugin
    with pytest.raises(ValueError, match=r"The strategy `fsdp` requires a GPU accelerator, but received "
                       r"`accelerator='cpu'`"):  # fmt: skip
        L.Trainer(accelerator="cpu", devices=2, strategy=strategy)


def test_fsdp_plugins_scale_once_and_keep_inputs():
    import lightning as L

    from mpx_torch.lightning_fsdp import MPXFabricFSDPPrecision, MPXFSDPPrecision

    for cls in (MPXFSDPPrecision, MPXFabricFSDPPrecision):
        plugin = cls("mixed_float16", {"kind": "dynamic", "init_scale": 8.0})
        x = torch.ones(2, dtype=torch.float64)
        assert plugin.convert_input(x) is x
        with plugin.tensor_init_context():
            assert torch.empty(1).dtype == torch.float32
        w = torch.ones((), requires_grad=True)
        if cls is MPXFabricFSDPPrecision:
            plugin.backward(w * 1.0, None)
            assert w.grad.item() == 8.0  # scaled once (FSDPPrecision's own scaler is not used)
        else:
            module = L.LightningModule()
            module.trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
            module.trainer.strategy.connect(module)
            assert plugin.pre_backward(w * 1.0, module).item() == 8.0
    assert MPXFSDPPrecision("bfloat16").mixed_precision_config.param_dtype == torch.bfloat16


@pytest.fixture(scope="module")
def fabric_runs(tmp_path_factory):
    return _run_suite("fabric", tmp_path_factory.mktemp("fabric"))


def test_fabric_model_parallel_skips_together_and_learns(fabric_runs):
    _assert_four_facts_of_a_run([r["fsdp2"] for r in fabric_runs])


def test_fabric_model_parallel_clips_the_unscaled_gradients(fabric_runs):
    for r in fabric_runs:
        scaled, unscaled = r["fsdp2"]["clip-scaled"], r["fsdp2"]["clip-unscaled"]
        assert min(scaled["norms"]) > 0.05  # fabric.clip_gradients' returned norm: the unscaled global norm
        assert scaled["norms"] == unscaled["norms"]
        assert _same(scaled["shards"], unscaled["shards"]) and _same(scaled["opt"], unscaled["opt"])


def test_fabric_model_parallel_resume_restores_the_scale(fabric_runs):
    for r in fabric_runs:
        saved, resumed = r["fsdp2"]["fit"]["saved_state"], r["fsdp2"]["resumed"]
        assert resumed["loaded_type"] == "dict"  # Fabric gives the plugin's state back, as saved
        assert resumed["start_state"] == saved and saved["scale"] == 2048.0


def test_fabric_refuses_fsdp1_without_a_gpu():
    import lightning as L
    from lightning.fabric.strategies import FSDPStrategy

    from mpx_torch.lightning_fsdp import MPXFabricFSDPPrecision

    plugin = MPXFabricFSDPPrecision("mixed_bfloat16")
    strategy = FSDPStrategy(precision=plugin)
    assert strategy.mixed_precision_config.param_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="You selected the FSDP strategy but FSDP is only available on GPU"):
        L.Fabric(accelerator="cpu", devices=2, strategy=strategy)


# -- FP8 under FSDP2 ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp8_runs(tmp_path_factory):
    pytest.importorskip("torchao")
    return _run_suite("fp8", tmp_path_factory.mktemp("fp8"))


def test_fp8_amaxes_are_reduced_with_max_in_one_all_reduce(fp8_runs):
    r0, r1 = fp8_runs[0]["reduced"], fp8_runs[1]["reduced"]
    assert r0["types"] == ["Float8Linear"]
    assert r0["commit_all_reduces"] == r1["commit_all_reduces"] == [1, 1, 1, 1]  # one per commit, all layers
    assert r0["scales"] == r1["scales"] == [1024.0, 2048.0, 1024.0, 1024.0]
    # the ranks saw different amaxes (different data), and committed the same state, step after step
    assert not torch.equal(r0["local_amax"][0][0], r1["local_amax"][0][0])
    assert r0["state"] == r1["state"]
    # the committed history holds the MAX over the ranks of each applied step's amaxes; the skipped one is absent
    applied = [i for i in range(4) if i != INF_STEP]
    history = r0["state"][-1]["tensors"]["0.input"]["amax_history"]
    expected = [max(float(r0["local_amax"][i][0][0]), float(r1["local_amax"][i][0][0])) for i in applied]
    assert history == [*expected[::-1], 0.0]  # newest first (TE's rolled history), one slot still empty
    assert r0["state"][INF_STEP] == r0["state"][INF_STEP - 1]


def test_fp8_without_the_reduction_the_ranks_diverge(fp8_runs):
    # a one-rank group each: nothing is combined, and the two ranks commit different scales
    r0, r1 = fp8_runs[0]["per-rank"], fp8_runs[1]["per-rank"]
    assert r0["commit_all_reduces"] == [0, 0, 0, 0]
    assert r0["state"][-1] != r1["state"][-1]


def test_torchao_float8_all_gather_is_refused_on_a_cpu_mesh(fp8_runs):
    for r in fp8_runs:
        seen = r["torchao"]
        assert seen["mpx"].startswith("module '0': torchao's enable_fsdp_float8_all_gather=True")
        assert "enable_fsdp_float8_all_gather=False" in seen["mpx"]
        assert seen["native"] == "RuntimeError: Invalid scalar type"  # what gloo says at the first forward


def test_accelerate_and_the_trainer_run_ddp_not_fsdp_on_cpu(fp8_runs):
    # Accelerate 1.16 decides MULTI_CPU for CPU processes and drops the FSDP plugin (FSDP is chosen only
    # for GPU-like device types), so accelerator.prepare wraps the model in DDP; the HF Trainer builds
    # the same plugin from fsdp=/fsdp_config and gets the same. mpx under DDP: tests/torch/test_accelerate.py.
    for r in fp8_runs:
        assert r["accelerate"]["accelerate"] == ["MULTI_CPU", "DistributedDataParallel"]
        enabled, kind, plugin_args = r["accelerate"]["trainer"]
        assert (enabled, kind, plugin_args["fsdp_version"]) == (False, "MULTI_CPU", 2)


def test_fsdp1_driven_through_the_fabric_plugin_skips_together_and_clips_unscaled(fp8_runs):
    # torch's FSDP1 (device_id=cpu, which Lightning does not pass) with the plugin's mixed_precision_config
    _assert_four_facts_of_a_run(fp8_runs, key="fsdp1")
    for r in fp8_runs:
        assert r["fsdp1"]["param_dtype"] == "torch.bfloat16"
        scaled, unscaled = r["fsdp1-clip-scaled"], r["fsdp1-clip-unscaled"]
        assert (
            min(scaled["norms"]) > 0.05 and scaled["norms"] == unscaled["norms"]
        )  # the root's clip_grad_norm_
        assert _same(scaled["shards"], unscaled["shards"]) and _same(scaled["opt"], unscaled["opt"])
