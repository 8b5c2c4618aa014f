"""mpx inside DeepSpeed engines: mpx_torch.deepspeed, 2 gloo processes, bf16 ZeRO-2 on CPU.

Each suite is two processes of tests/torch/deepspeed_worker.py (Lightning's DeepSpeedStrategy:
deepspeed_lightning_worker.py), started once per module; the tests read what they saw.  DeepSpeed's first ``init_distributed`` JIT-compiles its CPU shm op
(about 3 minutes on 2 loaded cores, 1 s once built): the build is kept in the pytest cache
(``.pytest_cache/d/torch_extensions``) unless TORCH_EXTENSIONS_DIR names another place.

DeepSpeed's fp16 engine refuses a CPU (asserted below); the fp16 path is covered by the
DeepSpeed scaler mode's tests (traces equal DeepSpeed's ``DynamicLossScaler``) and by the state
mapping here, which drives DeepSpeed's own scaler.
"""

import math
import os
from pathlib import Path

import pytest
from two_ranks import ranked_env, rendezvous_env, run_ranks

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")

import mpx  # noqa: E402

WORKER = Path(__file__).with_name("deepspeed_worker.py")
ROOT = Path(__file__).resolve().parents[2]
STEPS, INF_STEP = 6, 2
FP16_INF_STEPS = (2, 3)


def run_suite(suite: str, tmp: Path, extensions: Path, module: Path = WORKER) -> list[dict]:
    """Run ``suite`` of ``module`` on 2 gloo ranks (env://); returns each rank's saved dict."""
    env = {
        **rendezvous_env(),
        "LOCAL_WORLD_SIZE": "2",
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(extensions)),
    }
    return run_ranks(module, suite, tmp, env=env, rank_env=ranked_env)


@pytest.fixture(scope="session")
def extensions_dir(request, tmp_path_factory):
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider: built per session
    return Path(cache.mkdir("torch_extensions")) if cache else tmp_path_factory.mktemp("torch_extensions")


@pytest.fixture(scope="module")
def engine(tmp_path_factory, extensions_dir):
    return run_suite("engine", tmp_path_factory.mktemp("engine"), extensions_dir)


def _same(a, b):
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def same_snapshot(a, b):
    """Bit-identical module parameters, master partition and optimizer state."""
    if not _same(a["module"], b["module"]):
        return False
    if not all(_same(x, y) for x, y in zip(a["masters"], b["masters"], strict=True)):
        return False
    for sa, sb in zip(a["opt_state"], b["opt_state"], strict=True):
        if sa.keys() != sb.keys():
            return False
        for k in sa:
            x, y = sa[k], sb[k]
            if torch.is_tensor(x) and not _same(x, y):
                return False
            if not torch.is_tensor(x) and x != y:
                return False
    return True


def test_the_policy_is_in_the_engine_config(engine):
    config = engine[0]["config"]
    assert config["bf16"] == {"enabled": True, "check_grad_overflow": True}
    assert not config.get("fp16", {}).get("enabled", False)
    assert config["communication_data_type"] == "fp32"  # the policy's reduce dtype (its param dtype)
    assert config["zero_optimization"] == {"stage": 2}


def test_loss_decreases_and_outputs_take_the_policy_dtype(engine):
    for rank in engine:
        losses = [row["loss"] for row in rank["train"]]
        finite = [loss for loss in losses if math.isfinite(loss)]
        assert finite[-1] < finite[0]
        assert {row["out_dtype"] for row in rank["train"]} == {"torch.float32"}  # output=float32, bf16 engine


def test_an_inf_on_one_rank_skips_on_every_rank_with_state_bit_identical(engine):
    """DeepSpeed's bf16 ZeRO engine checks the gradients (bf16.check_grad_overflow, mpx's skip_nonfinite)
    and all-reduces the flag: both ranks skip the step, nothing moves, and the scaler says so."""
    r0, r1 = engine[0]["train"], engine[1]["train"]
    assert math.isinf(r1[INF_STEP]["loss"]) and math.isfinite(r0[INF_STEP]["loss"])
    for rows in (r0, r1):
        assert same_snapshot(rows[INF_STEP], rows[INF_STEP - 1])  # the skipped step changed nothing
        assert not _same(rows[INF_STEP + 1]["module"], rows[INF_STEP]["module"])  # the next one trains
        assert [row["scaler"]["skipped_steps"] for row in rows] == [0, 0, 1, 1, 1, 1]
        assert [row["scaler"]["consecutive_nonfinite"] for row in rows] == [0, 0, 1, 0, 0, 0]
        assert [row["scaler"]["steps"] for row in rows] == list(range(1, STEPS + 1))
        assert {row["scaler"]["scale"] for row in rows} == {1.0}
    for a, b in zip(r0, r1, strict=True):
        assert _same(a["module"], b["module"])  # the replicated bf16 parameters agree on both ranks
    # the trace is mpx's state machine for the config the engine runs
    config = mpx.ScalerConfig(kind="none", skip_nonfinite=True)
    assert r0[0]["scaler"]["config"] == config.to_dict()
    scaler = mpx.LossScaler(config)
    for i, row in enumerate(r0):
        scaler.update(i != INF_STEP)
        assert row["scaler"] == scaler.state_dict()


def test_without_skip_nonfinite_deepspeed_applies_the_step(engine):
    """ScalerConfig(kind='none', skip_nonfinite=False) writes check_grad_overflow false: the engine
    applies the non-finite step, as mpx's kind 'none' says (and torch's bf16 autocast does)."""
    for rank in engine:
        noskip = rank["noskip"]
        assert noskip["config"]["bf16"]["check_grad_overflow"] is False
        rows = noskip["rows"]
        assert torch.isfinite(rows[INF_STEP - 1]["module"]).all()
        assert not torch.isfinite(rows[INF_STEP]["module"]).all()
        assert rows[INF_STEP]["scaler"]["skipped_steps"] == 0


def test_clipping_sees_the_unscaled_gradients(engine):
    for rank in engine:
        clip = rank["clip"]
        assert clip["reported_norm"] > 10 * clip["clip"]
        assert clip["reported_norm"] == pytest.approx(clip["reference_norm"], rel=2e-2)
        assert clip["update_norm"] == pytest.approx(clip["clip"], rel=1e-3)  # clipped to max norm, unscaled


def test_resume_restores_the_scaler_state(engine):
    for rank in engine:
        resume = rank["resume"]
        assert resume["before"]["steps"] == 0 and resume["saved"]["steps"] == STEPS
        assert resume["after"] == resume["saved"]
        assert "mpx.scaler" in resume["client_keys"]
        assert same_snapshot(resume["after_snapshot"], resume["saved_snapshot"])
        moved = rank["moved"]
        assert moved["read"]["skipped_steps"] == moved["loaded"]["skipped_steps"] == moved["engine_skipped"]
        assert rank["mismatch_error"].startswith("StateDictError: config:")


def test_deepspeed_fp16_engine_on_cpu(engine):
    """DeepSpeed's fp16 engine runs on a CPU whose oneDNN has float16 kernels (DeepSpeed's CPU
    accelerator asks ``torch.ops.mkldnn._is_mkldnn_fp16_supported()``) and refuses any other.  Where it
    runs: the scale follows mpx's DeepSpeed mode step for step (hysteresis 2 absorbs the first of two
    overflows in a row, halves on the second), both ranks skip both steps with the state bit-identical."""
    for rank in engine:
        fp16 = rank["fp16"]
        if not fp16["supported"]:
            assert fp16["error"] == "ValueError: Type fp16 is not supported on your device."
            continue
        assert fp16["error"] is None
        config = mpx.ScalerConfig.from_dict(fp16["config"])
        assert fp16["ds_config"]["fp16"] == {
            "enabled": True, "loss_scale": 0, "initial_scale_power": 10, "loss_scale_window": 2,
            "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1,
        }  # fmt: skip
        rows, scaler = fp16["rows"], mpx.LossScaler(config)
        for i, row in enumerate(rows):
            scaler.update(i not in FP16_INF_STEPS)
            got, want = row["scaler"], scaler.state_dict()
            for key in ("scale", "growth_tracker", "steps", "skipped_steps", "config"):
                assert got[key] == want[key], (i, key)
            assert (
                0 < got["consecutive_nonfinite"] <= want["consecutive_nonfinite"]
                or got["consecutive_nonfinite"] == want["consecutive_nonfinite"] == 0
            )
        assert [row["scaler"]["scale"] for row in rows] == [2.0**10, 2.0**10, 2.0**10, 2.0**9, 2.0**9, 2.0**9]
        for i in FP16_INF_STEPS:
            assert same_snapshot(rows[i], rows[FP16_INF_STEPS[0] - 1])
    for a, b in zip(engine[0]["fp16"].get("rows", []), engine[1]["fp16"].get("rows", []), strict=True):
        assert _same(a["module"], b["module"])


def test_deepspeed_scaler_state_maps_onto_mpx_exactly(engine):
    """DeepSpeed's DynamicLossScaler, read as mpx state after every step, equals mpx's DeepSpeed mode; a
    DeepSpeed scaler loaded midway from mpx's state continues exactly (random windows, hysteresis, both
    consecutive_hysteresis settings)."""
    mapping = engine[0]["mapping"]
    assert mapping["cases"] == 120
    assert mapping["mismatches"] == []


# -- Accelerate's DeepSpeed plugin ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def accelerate(tmp_path_factory, extensions_dir):
    return run_suite("accelerate", tmp_path_factory.mktemp("accelerate"), extensions_dir)


def test_accelerate_writes_the_policy_into_the_plugin_config(accelerate):
    config = accelerate[0]["config"]
    assert accelerate[0]["engine_type"] == "DeepSpeedEngine"
    assert config["bf16"] == {"enabled": True, "check_grad_overflow": True}
    assert config["fp16"] == {"enabled": False}
    assert config["communication_data_type"] == "fp32"


def test_accelerate_trains_skips_on_every_rank_and_clips_unscaled(accelerate):
    r0, r1 = accelerate[0]["rows"], accelerate[1]["rows"]
    for rows in (r0, r1):
        finite = [row["loss"] for row in rows if math.isfinite(row["loss"])]
        assert finite[-1] < finite[0]
        assert [row["skipped"] for row in rows] == [i == INF_STEP for i in range(STEPS)]
        assert same_snapshot(rows[INF_STEP], rows[INF_STEP - 1])
        assert [row["scaler"]["skipped_steps"] for row in rows] == [0, 0, 1, 1, 1, 1]
        assert math.isinf(rows[INF_STEP]["norm"])
        assert all(math.isfinite(row["norm"]) for i, row in enumerate(rows) if i != INF_STEP)
    for a, b in zip(r0, r1, strict=True):
        assert _same(a["module"], b["module"])
        assert a["norm"] == b["norm"]  # the norm of the all-reduced, unscaled gradients


def test_accelerate_resume_restores_the_scaler_state(accelerate):
    for rank in accelerate:
        resume = rank["resume"]
        assert resume["moved"]["steps"] == resume["saved"]["steps"] + 1
        assert resume["after"] == resume["saved"]
        assert any(name.startswith("custom_checkpoint_") for name in resume["files"])
        assert same_snapshot(rank["after_snapshot"], rank["saved_snapshot"])


# -- the HF Trainer with TrainingArguments(deepspeed=...) -----------------------------------------------
@pytest.fixture(scope="module")
def hf(tmp_path_factory, extensions_dir):
    return run_suite("hf", tmp_path_factory.mktemp("hf"), extensions_dir)


def test_hf_trainer_runs_the_policy_in_the_engine(hf):
    config = hf[0]["first"]["config"]
    assert config["bf16"] == {"enabled": True, "check_grad_overflow": True}
    assert config["communication_data_type"] == "fp32"
    assert config["gradient_clipping"] == 1.0  # max_grad_norm: DeepSpeed clips the unscaled gradients


def test_hf_trainer_trains_and_skips_on_every_rank(hf):
    r0, r1 = hf[0]["first"]["rows"], hf[1]["first"]["rows"]
    for rank in hf:
        first = rank["first"]
        rows, logs = first["rows"], first["logs"]
        assert len(rows) == len(first["losses"]) == STEPS
        finite = [loss for loss in first["losses"] if math.isfinite(loss)]
        assert finite[-1] < finite[0], (first["losses"], logs)
        assert same_snapshot(rows[INF_STEP], rows[INF_STEP - 1])
        assert [row["scaler"]["skipped_steps"] for row in rows] == [0, 0, 1, 1, 1, 1]
        assert [log["skipped_steps"] for log in logs] == [0, 0, 1, 1, 1, 1]
        assert {log["loss_scale"] for log in logs} == {1.0}
    for a, b in zip(r0, r1, strict=True):
        assert _same(a["module"], b["module"])


def test_hf_trainer_resume_restores_the_scaler_state(hf):
    """resume_from_checkpoint (the engine's checkpoint) brings back the step count and the skipped step."""
    for rank in hf:
        rows = rank["resumed"]["rows"]
        assert [row["steps"] for row in rows] == [STEPS + 1, STEPS + 2]
        assert [row["skipped_steps"] for row in rows] == [1, 1]
        assert rows[0]["config"] == rank["first"]["scaler"]["config"]


# -- Lightning's DeepSpeedStrategy (Trainer and Fabric) with mpx's plugins -------------------------------
LIGHTNING_WORKER = Path(__file__).with_name("deepspeed_lightning_worker.py")


@pytest.fixture(scope="module")
def lightning(tmp_path_factory, extensions_dir):
    """Lightning's DeepSpeedStrategy less only its CUDA check (``setup_environment``, lines 341-347 of
    lightning/pytorch/strategies/deepspeed.py, 639-645 of the Fabric one, lightning 2.6), CPU devices
    given their indices: see deepspeed_lightning_worker.py."""
    return run_suite(
        "lightning", tmp_path_factory.mktemp("lightning"), extensions_dir, module=LIGHTNING_WORKER
    )


def test_lightning_writes_the_policy_into_the_strategy_config(lightning):
    fit = lightning[0]["fit"]
    assert fit["precision"] == "bf16-mixed"
    assert fit["config"]["bf16"] == {"enabled": True, "check_grad_overflow": True}
    assert fit["config"]["communication_data_type"] == "fp32"
    assert fit["config"]["zero_optimization"]["stage"] == 2
    assert lightning[0]["fabric"]["config"]["bf16"] == {"enabled": True, "check_grad_overflow": True}


@pytest.mark.parametrize("stack", ["fit", "fabric"])
def test_lightning_trains_and_skips_on_every_rank(lightning, stack):
    """Trainer.fit and Fabric: the loss falls, an inf in rank 1's loss skips the step on both ranks with
    the bf16 module, the float32 master partition and the optimizer state bit-identical."""
    r0, r1 = lightning[0][stack]["rows"], lightning[1][stack]["rows"]
    assert math.isinf(r1[INF_STEP]["loss"]) and math.isfinite(r0[INF_STEP]["loss"])
    for rows in (r0, r1):
        finite = [row["loss"] for row in rows if math.isfinite(row["loss"])]
        assert finite[-1] < finite[0]
        assert same_snapshot(rows[INF_STEP], rows[INF_STEP - 1])
        assert not _same(rows[INF_STEP + 1]["module"], rows[INF_STEP]["module"])
        assert [row["scaler"]["skipped_steps"] for row in rows] == [0, 0, 1, 1, 1, 1]
        assert [row["scaler"]["steps"] for row in rows] == list(range(1, STEPS + 1))
    for a, b in zip(r0, r1, strict=True):
        assert _same(a["module"], b["module"])


def test_lightning_clipping_sees_the_unscaled_gradients(lightning):
    """gradient_clip_val becomes DeepSpeed's gradient_clipping: the norm it reports is the reference's
    (plain autograd on the same module, rank-averaged) and the SGD update is clipped to that norm."""
    clip = [rank["clip"] for rank in lightning]
    assert clip[0]["config"]["gradient_clipping"] == 1e-3
    sq = 0.0
    for run in clip:
        norm = float(run["rows"][0]["norm"])
        assert norm > 100 * 1e-3
        assert norm == pytest.approx(run["reference_norm"], rel=2e-2)
        before, after = run["start_snapshot"]["masters"], run["rows"][0]["masters"]
        sq += sum(float((b - a).double().pow(2).sum()) for b, a in zip(before, after, strict=True))
    assert math.sqrt(sq) / 1e-2 == pytest.approx(1e-3, rel=1e-3)  # each rank holds its master partition


def test_lightning_resume_restores_the_scaler_state(lightning):
    for rank in lightning:
        fit, resumed = rank["fit"], rank["resumed"]
        assert fit["saved_state"]["steps"] == STEPS and fit["saved_state"]["skipped_steps"] == 1
        # the plugin's entry, in the engine's client state
        assert resumed["loaded"] == {"MPXDeepSpeedPrecision": fit["saved_state"]}
        assert resumed["start_state"] == fit["saved_state"]
        assert same_snapshot(resumed["start_snapshot"], fit["saved_snapshot"])
        assert [row["scaler"]["steps"] for row in resumed["rows"]] == [STEPS + 1, STEPS + 2]
        fabric = rank["fabric"]
        assert fabric["saved"]["steps"] == STEPS and fabric["saved"]["skipped_steps"] == 1
        assert fabric["pending"] == fabric["saved"]  # loaded before the engine's first backward
        assert fabric["after_backward"] == fabric["saved"]
        assert same_snapshot(fabric["loaded_snapshot"], fabric["saved_snapshot"])


def test_lightning_refuses_an_engine_that_runs_another_scaler(lightning):
    assert lightning[0]["fabric"]["mismatch"].startswith("engine: the DeepSpeed engine computes in bfloat16")
    assert "plugin.ds_config(base)" in lightning[0]["fabric"]["mismatch"]


def test_lightning_plugins_refuse_what_deepspeed_cannot_run():
    from torch import nn

    from mpx_torch.lightning_deepspeed import MPXDeepSpeedPrecision, MPXFabricDeepSpeedPrecision

    for cls in (MPXDeepSpeedPrecision, MPXFabricDeepSpeedPrecision):
        with pytest.raises(mpx.MPXError, match="^policy: .*fp8"):
            cls("mixed_bfloat16,fp8=hybrid")
        with pytest.raises(mpx.MPXError, match="^policy: params=bfloat16"):
            cls("bfloat16")
        with pytest.raises(mpx.ScalerConfigError, match="^kind: "):
            cls("mixed_bfloat16", {"kind": "dynamic"})
        assert cls("mixed_float16").precision == "16-mixed"
        plugin = cls("mixed_bfloat16")
        assert plugin.state_dict() == {}
        with pytest.raises(mpx.StateDictError):
            plugin.load_state_dict({"format": "mpx.scaler/1"})
    with pytest.raises(mpx.MPXError, match="^strategy: MPXDeepSpeedPrecision runs under Lightning's"):
        MPXDeepSpeedPrecision("mixed_bfloat16").convert_module(nn.Linear(2, 2))
