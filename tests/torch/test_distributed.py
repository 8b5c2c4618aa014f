"""mpx_torch across replicas: one skip decision and scale on every rank (DDP, FSDP2), the reduce dtype.

The multi-rank runs are two gloo processes of tests/torch/dist_worker.py per
suite (a file store), started once per module; each test reads what they saw.
Native torch (torch.amp.GradScaler) is run the same way and its behaviour asserted,
so the tests document it.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from two_ranks import run_ranks

import mpx
import mpx_torch

WORKER = Path(__file__).with_name("dist_worker.py")
CONFIG = mpx.ScalerConfig(init_scale=2.0**10, growth_interval=2)
STEPS, INF_STEP = 6, 2


def _run_suite(suite: str, tmp: Path) -> list[dict]:
    return run_ranks(WORKER, suite, tmp)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    return _run_suite("ddp", tmp_path_factory.mktemp("ddp"))


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    return _run_suite("fsdp", tmp_path_factory.mktemp("fsdp"))


def _expected_scales(bad_steps=(INF_STEP,)):
    scaler = mpx.LossScaler(CONFIG)
    out = []
    for i in range(STEPS):
        scaler.update(i not in bad_steps)
        out.append(scaler.get_scale())
    return out


def _bits(t):
    return t.view(torch.int32)


def _same_bits(a, b):
    return a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _assert_replicas_agree(r0, r1, *, skipped=INF_STEP):
    assert r0["scales"] == r1["scales"] == _expected_scales()
    for a, b in zip(r0["params"], r1["params"], strict=True):
        assert _same_bits(a, b)  # bit-identical on both ranks after every step
    for r in (r0, r1):  # the skipped step changed nothing; the others moved the parameters
        assert _same_bits(r["params"][skipped], r["params"][skipped - 1])
        assert not torch.equal(r["params"][skipped + 1], r["params"][skipped])


# -- DDP: an inf on rank 1 only ----------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["mpx-loss", "mpx-grad", "mpx-grad-group", "mpx-grad-fused"])
def test_mpx_ranks_skip_together_and_stay_bit_identical(ddp, case):
    """(a) inf in rank 1's loss, (b) inf in rank 1's gradients after DDP's all-reduce; explicit group; fused AdamW."""
    _assert_replicas_agree(ddp[0][case], ddp[1][case])


def test_accumulation_under_ddp_no_sync(ddp):
    """Windows of 2 micro-batches (no_sync on the first): one decision per window on both ranks, one flag
    all-reduce per optimizer step, and the trace of mpx.accumulation_trace."""
    r0, r1 = ddp[0]["mpx-accumulate-grad"], ddp[1]["mpx-accumulate-grad"]
    _assert_replicas_agree(r0, r1)
    flags = [not (i == INF_STEP and j == 1) for i in range(STEPS) for j in range(2)]
    assert r0["scales"] == [w["scale"] for w in mpx.accumulation_trace(CONFIG, flags, 2)]
    assert r0["all_reduce_calls"] == r1["all_reduce_calls"] == [1] * STEPS


def test_native_inf_in_the_loss_reaches_every_rank_through_ddp(ddp):
    _assert_replicas_agree(ddp[0]["native-loss"], ddp[1]["native-loss"])


@pytest.mark.parametrize("case", ["native-grad", "native-grad-fused"])
def test_native_inf_after_the_all_reduce_makes_only_that_rank_skip(ddp, case):
    """torch.amp.GradScaler decides per rank: rank 1 skips and backs off, rank 0 steps and grows."""
    r0, r1 = ddp[0][case], ddp[1][case]
    assert r1["scales"] == _expected_scales()
    assert r0["scales"] == _expected_scales(bad_steps=())
    assert r0["scales"] != r1["scales"]
    assert all(
        _same_bits(a, b) for a, b in zip(r0["params"][:INF_STEP], r1["params"][:INF_STEP], strict=True)
    )
    assert not torch.equal(r0["params"][INF_STEP], r1["params"][INF_STEP])  # the replicas diverged
    assert not torch.equal(r0["params"][-1], r1["params"][-1])


@pytest.mark.parametrize("case", ["mpx-plain-loss", "mpx-plain-loss-compiled"])
def test_scaler_alone_keeps_ranks_together_eager_and_compiled(ddp, case):
    """No DDP: only rank 1's loss is inf; the scaler's all-reduce makes rank 0 skip too (also in a compiled step)."""
    _assert_replicas_agree(ddp[0][case], ddp[1][case])
    assert ddp[0]["mpx-plain-loss-compiled"]["scales"] == ddp[0]["mpx-plain-loss"]["scales"]
    for a, b in zip(
        ddp[0]["mpx-plain-loss-compiled"]["params"], ddp[0]["mpx-plain-loss"]["params"], strict=True
    ):
        assert _same_bits(a, b)


@pytest.mark.parametrize(
    "case", ["mpx-loss", "mpx-grad", "mpx-grad-group", "mpx-grad-fused", "mpx-plain-loss-compiled"]
)
def test_one_all_reduce_per_step(ddp, case):
    """The cost: exactly one torch.distributed.all_reduce (of one flag) per optimizer step, on every rank."""
    for rank in range(2):
        assert ddp[rank][case]["all_reduce_calls"] == [1] * STEPS


def test_no_host_sync_added(ddp):
    """step + update host syncs per step: fused AdamW none after its first step (which creates the state),
    SGD the one .item() of any non-fused step (as torch's own GradScaler)."""
    for rank in range(2):
        assert ddp[rank]["mpx-grad-fused"]["host_syncs"] == [1] + [0] * (STEPS - 1)
        assert ddp[rank]["mpx-grad"]["host_syncs"] == [1] * STEPS
        assert ddp[rank]["native-grad"]["host_syncs"] == [1] * STEPS


def test_unscale_without_step_agrees_in_update(ddp):
    reference = mpx.LossScaler(CONFIG)
    reference.update(False)
    assert (
        ddp[0]["unscale-then-update"]["state"]
        == ddp[1]["unscale-then-update"]["state"]
        == reference.state_dict()
    )


def test_native_scaler_makes_no_collective(ddp):
    assert ddp[0]["native-grad"]["all_reduce_calls"] == [0] * STEPS


# -- DDP: the reduce dtype ---------------------------------------------------------------------------------
@pytest.mark.parametrize("reduce", ["bfloat16", "float16"])
def test_comm_hook_reduces_in_the_half_dtype_exactly(ddp, reduce):
    """Each rank's gradient rounded to the half dtype, halved, summed in that dtype: bit for bit."""
    half = getattr(torch, reduce)
    for rank in range(2):
        got = ddp[rank][f"hook-{reduce}"]
        g0, g1 = got["local"]
        expected = ((g0.to(half) / 2) + (g1.to(half) / 2)).float()
        assert _same_bits(got["reduced"], expected)
        assert not torch.equal(got["reduced"], (g0 + g1) / 2)  # the half rounding is visible
    # gloo reduces bfloat16, but torch refuses its bf16_compress_hook without NCCL: mpx's hook runs
    assert ddp[0]["hook-bfloat16"]["hook"] == "bf16_reduce_hook"
    assert ddp[0]["hook-float16"]["hook"] == "fp16_compress_hook"


def test_float32_reduce_registers_nothing(ddp):
    got = ddp[0]["hook-float32"]
    assert got["hook"] is None
    g0, g1 = got["local"]
    assert _same_bits(got["reduced"], (g0 + g1) / 2)


# -- FSDP2 -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["mpx", "mpx-prepared-first"])
def test_fully_shard_keeps_norms_float32_and_returns_the_output_dtype(fsdp, case):
    for rank in range(2):
        got = fsdp[rank][case]
        assert got["fsdp_types"] == ["FSDPLayerNorm", "FSDPSequential"]  # the norm is a unit of its own
        assert got["linear_weight_dtype"] == "torch.bfloat16"
        assert got["norm_weight_dtype"] == "torch.float32"
        assert got["norm_weight_exact"]  # not rounded to bfloat16 before the float32 region
        assert got["norm_input_dtype"] == "torch.float32"
        assert got["output_dtype"] == "torch.float32"
        assert got["output_equals_prepared"]  # bit for bit the prepared (unsharded) model's output
        assert got["grad_types"] == ["DTensor"]


def test_fully_shard_units(fsdp):
    got = fsdp[0]["units"]
    assert got["units"] == ["", "0", "0.1"]  # the root, the block, the block's LayerNorm
    assert got["output_dtype"] == "torch.float32"
    assert got["output_equals_prepared"]


def test_native_param_dtype_rounds_layernorm_weights(fsdp):
    """torch's fully_shard with param_dtype=bfloat16 on the whole model: the LayerNorm sees bf16 weights."""
    got = fsdp[0]["native-norm"]
    assert got["norm_weight_dtype"] == "torch.bfloat16"
    assert not got["norm_weight_exact"]


@pytest.mark.parametrize("case", ["mpx", "mpx-prepared-first"])
def test_fsdp_gradscaler_on_dtensor_grads_skips_on_every_rank(fsdp, case):
    """An inf in rank 1's gradient shard: both ranks skip, same trace, full parameters bit-identical."""
    _assert_replicas_agree(fsdp[0][case], fsdp[1][case])
    assert fsdp[0][case]["all_reduce_calls"] == [1] * STEPS


def test_native_fsdp2_agrees_through_dtensor(fsdp):
    """Native: DTensor's dispatch of the found-inf kernel combines the flag over the mesh, so torch agrees too."""
    _assert_replicas_agree(fsdp[0]["native"], fsdp[1]["native"])


# -- single process ----------------------------------------------------------------------------------------
def _train_single(**kwargs):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mpx_torch.GradScaler(CONFIG, **kwargs)
    x = torch.randn(8, 4)
    for i in range(STEPS):
        opt.zero_grad()
        scaler.scale(model(x).pow(2).mean() * (float("inf") if i == INF_STEP else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
    return scaler, [p.detach().clone() for p in model.parameters()]


def _counting_all_reduce(monkeypatch):
    calls = []
    original = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", counting)
    return calls


def test_single_process_makes_no_distributed_call(monkeypatch):
    assert not dist.is_initialized()
    calls = _counting_all_reduce(monkeypatch)
    scaler, _ = _train_single()
    assert calls == []
    reference = mpx.LossScaler(CONFIG)
    for i in range(STEPS):
        reference.update(i != INF_STEP)
    assert scaler.state_dict() == reference.state_dict()


def test_world_of_one_and_group_of_one(monkeypatch, tmp_path):
    """Initialized with one rank: no collective, the same state and parameters; DDP hook checks."""
    plain_scaler, plain_params = _train_single()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        calls = _counting_all_reduce(monkeypatch)
        for kwargs in ({}, {"process_group": dist.new_group([0])}):
            scaler, params = _train_single(**kwargs)
            assert scaler.state_dict() == plain_scaler.state_dict()
            assert all(torch.equal(a, b) for a, b in zip(params, plain_params, strict=True))
        assert calls == []
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
        assert mpx_torch.register_comm_hook(ddp, "mixed_bfloat16") is None  # reduce = params = float32
        bf16 = nn.parallel.DistributedDataParallel(nn.Linear(4, 2).to(torch.bfloat16))
        with pytest.raises(mpx.MPXError, match="reduce_dtype float32 cannot be honoured by DDP"):
            mpx_torch.register_comm_hook(bf16, "params=bfloat16,compute=bfloat16,reduce=float32")
        with pytest.raises(mpx.MPXError, match="float16 cannot be honoured"):
            mpx_torch.register_comm_hook(bf16, "params=bfloat16,compute=bfloat16,reduce=float16")
    finally:
        dist.destroy_process_group()


def test_comm_hook_is_chosen_up_front_and_registration_errors_propagate(tmp_path):
    """No silent fallback (#22): the bf16 hook is mpx's only for a bfloat16 reduce dtype where torch refuses
    its own, decided before registering; a TypeError from registering either hook reaches the caller."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    class RefusingDDP(nn.parallel.DistributedDataParallel):  # a user's wrapper that refuses comm hooks
        def register_comm_hook(self, state, hook):
            raise TypeError(f"refused {hook.__name__}")

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert not mpx_torch.distributed.torch_takes_bf16_hook()  # a CPU build: no NCCL, no XPU
        fp16 = "params=float32,compute=float16,reduce=float16"
        bf16 = "params=float32,compute=bfloat16,reduce=bfloat16"
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
        assert mpx_torch.register_comm_hook(ddp, fp16) is default_hooks.fp16_compress_hook
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
        assert mpx_torch.register_comm_hook(ddp, bf16) is mpx_torch.distributed.bf16_reduce_hook
        for spec, name in ((fp16, "fp16_compress_hook"), (bf16, "bf16_reduce_hook")):
            with pytest.raises(TypeError, match=f"^refused {name}$"):
                mpx_torch.register_comm_hook(RefusingDDP(nn.Linear(4, 2)), spec)
    finally:
        dist.destroy_process_group()


def test_bad_arguments_raise_mpx_errors():
    with pytest.raises(mpx.MPXError, match="process_group: expected None"):
        mpx_torch.GradScaler(process_group="world")
    with pytest.raises(mpx.MPXError, match="ddp_model: expected"):
        mpx_torch.register_comm_hook(nn.Linear(2, 2), "mixed_bfloat16")
    model = mpx_torch.prepare(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)), "mixed_bfloat16")
    with pytest.raises(mpx.PolicyError, match="prepared under"):
        mpx_torch.fully_shard(model, "float32")
    with pytest.raises(mpx.MPXError, match="mp_policy"):
        mpx_torch.fully_shard(model, "mixed_bfloat16", mp_policy=None)
    with pytest.raises(mpx.MPXError, match="units: expected"):
        mpx_torch.fully_shard(model, "mixed_bfloat16", units=("Linear",))


# -- fsdp_mixed_precision ----------------------------------------------------------------------------------
def test_fsdp_mixed_precision_from_policies():
    policy = mpx.get_policy("params=float32,compute=bfloat16,output=float32,reduce=bfloat16")
    root, inner = mpx_torch.fsdp_mixed_precision(policy), mpx_torch.fsdp_mixed_precision(policy, root=False)
    assert (root.param_dtype, root.reduce_dtype, root.output_dtype) == (
        torch.bfloat16,
        torch.bfloat16,
        torch.float32,
    )
    assert (inner.param_dtype, inner.reduce_dtype, inner.output_dtype) == (
        torch.bfloat16,
        torch.bfloat16,
        None,
    )
    assert not root.cast_forward_inputs  # mpx's autocast casts op by op
    norm = mpx_torch.fsdp_mixed_precision(policy.for_module("1", "normalization"), root=False)
    assert (norm.param_dtype, norm.reduce_dtype, norm.output_dtype) == (torch.float32, torch.bfloat16, None)
    assert norm.cast_forward_inputs  # half inputs cast up, as mpx's float32 region does
    default = mpx_torch.fsdp_mixed_precision("mixed_float16")
    assert (default.param_dtype, default.reduce_dtype) == (torch.float16, torch.float32)  # reduce = params
    pure = mpx_torch.fsdp_mixed_precision("bfloat16")
    assert (pure.param_dtype, pure.reduce_dtype, pure.output_dtype) == (torch.bfloat16,) * 3
    assert mpx_torch.fsdp_mixed_precision("float32", cast_forward_inputs=False).cast_forward_inputs is False
    with pytest.raises(mpx.PolicyError):
        mpx_torch.fsdp_mixed_precision("compute=int8")
