"""mpx_torch.GradScaler: traces bit-identical to mpx.scaler_update, skips that change nothing, torch's API."""

import copy
import json
import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import mpx
import mpx_torch
from mpx_torch import GradScaler
from mpx_torch import grad_scaler as grad_scaler_module


def _set_grads(params, scale, finite, bad=float("inf")):
    for i, p in enumerate(params):
        g = torch.full_like(p, 0.25) * scale
        if not finite and i == 0:
            g.view(-1)[0] = bad
        p.grad = g


def _snapshot(params, opt):
    state = copy.deepcopy(opt.state_dict()["state"])
    return [p.detach().clone() for p in params], state


def _same_bits(a, b):
    if isinstance(a, torch.Tensor):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_bits(a[k], b[k]) for k in a)
    return a == b


def _run(scaler, config, flags, opt_factory=None, bad=float("inf")):
    """Drive scaler through ``flags``; check the state and the skip behaviour after every step."""
    params = [nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(2, 2))]
    opt = (opt_factory or (lambda ps: torch.optim.SGD(ps, lr=0.1)))(params)
    ref = mpx.scaler_init(config)
    for finite in flags:
        scaled = scaler.scale(torch.tensor(1.0))
        _set_grads(params, scaled.item(), finite, bad)
        before = _snapshot(params, opt)
        scaler.step(opt)
        scaler.update()
        ref_next = mpx.scaler_update(config, ref, finite)
        assert scaler.state == ref_next, (config, flags)
        skipped = ref_next.skipped_steps != ref.skipped_steps
        after = _snapshot(params, opt)
        same = all(_same_bits(a, b) for a, b in zip(before[0], after[0], strict=True)) and _same_bits(
            before[1], after[1]
        )
        assert same == skipped
        ref = ref_next
    return params, opt


configs = st.builds(
    lambda kind, init, gf, bf, gi, lo, hi, hys, skip: _config(kind, init, gf, bf, gi, lo, hi, hys, skip),
    kind=st.sampled_from(["dynamic", "dynamic", "static", "none"]),
    init=st.sampled_from([1.0, 3.0, 2.0**10, 2.0**16, 1e-3, 3.4e38]),
    gf=st.sampled_from([2.0, 1.5, 1.1, 3.0, 10.0]),
    bf=st.sampled_from([0.5, 0.25, 0.3, 0.9, 0.125]),
    gi=st.integers(1, 4),
    lo=st.sampled_from([None, 1.0, 1e-3, 0.5]),
    hi=st.sampled_from([None, 2.0**24, 2.0**12, 3.4e38]),
    hys=st.integers(1, 3),
    skip=st.sampled_from([None, True, False]),
)


def _config(kind, init, gf, bf, gi, lo, hi, hys, skip):
    if lo is not None and init < lo:
        lo = None
    if hi is not None and init > hi:
        hi = None
    if kind == "none" and skip is not True:
        skip = True  # a non-skipping kind none is a pass-through, tested on its own
    return mpx.ScalerConfig(kind, init, gf, bf, gi, lo, hi, hys, skip)


@settings(max_examples=80, deadline=None)
@given(config=configs, flags=st.lists(st.booleans(), min_size=1, max_size=24))
def test_trace_matches_reference_and_skips_change_nothing(config, flags):
    _run(GradScaler(config), config, flags)


@settings(max_examples=25, deadline=None)
@given(config=configs, flags=st.lists(st.booleans(), min_size=1, max_size=12))
def test_trace_with_fused_adamw(config, flags):
    _run(
        GradScaler(config),
        config,
        flags,
        lambda ps: torch.optim.AdamW(ps, lr=0.01, fused=True),
        bad=float("nan"),
    )


def test_scale_edges_bit_identical():
    # growth past float32's max keeps the old scale; backoff with no floor goes through subnormals to 0
    for config, flags in (
        (mpx.ScalerConfig(init_scale=3e38, growth_interval=1, max_scale=None), [True] * 3),
        (mpx.ScalerConfig(init_scale=1e-30, backoff_factor=0.3, min_scale=None), [False] * 120),
        (
            mpx.ScalerConfig(init_scale=7.0, growth_factor=1.1, backoff_factor=0.7, growth_interval=1),
            [True] * 40,
        ),
    ):
        scaler = GradScaler(config)
        ref = mpx.scaler_init(config)
        p = nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([p], lr=0.1)
        for finite in flags:
            scaler.scale(torch.tensor(1.0))
            p.grad = torch.tensor([1.0, 1.0 if finite else float("inf")])
            scaler.step(opt)
            scaler.update()
            ref = mpx.scaler_update(config, ref, finite)
            got = scaler.state
            assert np.float32(got.scale).tobytes() == np.float32(ref.scale).tobytes() and got == ref


def test_matches_torch_gradscaler_with_torch_semantics():
    config = mpx.ScalerConfig(init_scale=2.0**10, growth_interval=3, min_scale=None, max_scale=None)
    ours = GradScaler(config)
    native = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    rng = np.random.default_rng(0)
    pa, pb = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4))
    oa, ob = torch.optim.Adam([pa], lr=0.01), torch.optim.Adam([pb], lr=0.01)
    for _ in range(60):
        finite = bool(rng.random() < 0.7)
        for scaler, p, opt in ((ours, pa, oa), (native, pb, ob)):
            scaler.scale((p * torch.arange(4.0)).sum()).backward()
            if not finite:
                p.grad[1] = float("nan")
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert ours.get_scale() == native.get_scale()
        assert torch.equal(pa, pb)
    assert ours.state_dict()["growth_tracker"] == native.state_dict()["_growth_tracker"]


OPTIMIZERS = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adam-foreach": lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=True),
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=0.01, fused=True),
    "sgd-fused": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    "adagrad-fused": lambda ps: torch.optim.Adagrad(ps, lr=0.1, fused=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("explicit_unscale", [False, True])
def test_skipped_step_leaves_params_and_optimizer_state_bit_identical(name, bad, explicit_unscale):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = OPTIMIZERS[name](model.parameters())
    scaler = GradScaler(mpx.ScalerConfig(init_scale=2.0**8))
    x, y = torch.randn(16, 4), torch.randn(16, 2)

    def iteration(inject):
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        if inject:
            model[0].weight.grad[0, 0] = bad
        if explicit_unscale:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()

    for _ in range(3):
        iteration(False)
    params, state = _snapshot(list(model.parameters()), opt)
    assert state and any("step" in s or "momentum_buffer" in s for s in state.values())
    scale = scaler.get_scale()
    iteration(True)
    after_params, after_state = _snapshot(list(model.parameters()), opt)
    assert all(_same_bits(a, b) for a, b in zip(params, after_params, strict=True))
    assert _same_bits(state, after_state)
    assert scaler.get_scale() == scale * 0.5 and scaler.state.skipped_steps == 1
    iteration(False)
    changed_params, changed_state = _snapshot(list(model.parameters()), opt)
    assert not any(_same_bits(a, b) for a, b in zip(params, changed_params, strict=True))
    assert not _same_bits(state, changed_state)


@pytest.mark.parametrize("name", ["adam-fused", "adamw-fused", "sgd-fused"])
@pytest.mark.parametrize("explicit_unscale", [False, True])
def test_fused_optimizers_step_and_update_without_host_sync(name, explicit_unscale, host_reads):
    model = nn.Linear(4, 2)
    opt = OPTIMIZERS[name](model.parameters())
    scaler = GradScaler()
    for i, inject in enumerate((False, False, True, False)):
        opt.zero_grad()
        scaler.scale(model(torch.randn(8, 4)).square().mean()).backward()
        if inject:
            model.weight.grad[0, 0] = float("inf")
        with host_reads() as rec:
            if explicit_unscale:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        # the first step, which creates the optimizer state, syncs once; the others never
        assert rec.syncs == (["item"] if i == 0 else [])
    assert scaler.state.skipped_steps == 1 and scaler.state.steps == 4


def test_fused_first_step_skipped_creates_no_state():
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    scaler = GradScaler()
    scaler.scale(p.sum()).backward()
    p.grad[0] = float("nan")
    scaler.step(opt)
    scaler.update()
    assert len(opt.state) == 0 and torch.equal(p.detach(), torch.ones(3))


@pytest.mark.parametrize("record", [False, True], ids=["plain", "recording-history"])
def test_non_fused_step_syncs_once_and_update_never(record, host_reads):
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # SGD itself never syncs (Adam reads its step count)
    scaler = GradScaler(mpx.ScalerConfig(hysteresis=2))
    if record:
        scaler.record_history(capacity=2)
    scaler.scale(model(torch.randn(8, 4)).sum()).backward()
    with host_reads() as rec:
        scaler.step(opt)
    assert rec.syncs == ["item"]
    with host_reads() as rec:
        scaler.update()
    assert rec.syncs == []


def test_fused_matches_plain_adam():
    torch.manual_seed(0)
    a = nn.Linear(4, 3)
    b = copy.deepcopy(a)
    runs = []
    for model, fused in ((a, False), (b, True)):
        opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=fused)
        scaler = GradScaler(mpx.ScalerConfig(growth_interval=2))
        torch.manual_seed(1)
        for i in range(8):
            opt.zero_grad()
            scaler.scale(model(torch.randn(8, 4)).square().mean()).backward()
            if i == 3:
                model.bias.grad[0] = float("inf")
            scaler.step(opt)
            scaler.update()
        runs.append((scaler.state, [p.detach() for p in model.parameters()]))
    assert runs[0][0] == runs[1][0]
    for pa, pb in zip(runs[0][1], runs[1][1], strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_gradient_accumulation_and_clipping_after_unscale():
    torch.manual_seed(0)
    ref = nn.Linear(6, 1)
    model = copy.deepcopy(ref)
    xs, ys = torch.randn(4, 5, 6), torch.randn(4, 5, 1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler(mpx.ScalerConfig(init_scale=2.0**12, growth_interval=1))
    for _ in range(2):
        for micro in range(4):  # four micro-batches per optimizer step
            loss = nn.functional.mse_loss(model(xs[micro]), ys[micro]) / 4
            scaler.scale(loss).backward()
            (nn.functional.mse_loss(ref(xs[micro]), ys[micro]) / 4).backward()
        scaler.unscale_(opt)
        torch.testing.assert_close(model.weight.grad, ref.weight.grad)
        norm = nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        ref_norm = nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        torch.testing.assert_close(norm, ref_norm)
        scaler.step(opt)
        scaler.update()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        torch.testing.assert_close(model.weight, ref.weight)
    assert scaler.state.steps == 2 and scaler.get_scale() == 2.0**14  # update once per stepping iteration


def test_several_optimizers_skip_independently_and_update_once():
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    oa, ob = torch.optim.SGD([a], lr=0.1), torch.optim.Adam([b], lr=0.1, fused=True)
    scaler = GradScaler()
    scaler.scale((a.sum() + b.sum()) * 2).backward()
    b.grad[0] = float("inf")
    scaler.step(oa)
    scaler.step(ob)
    scaler.update()
    assert torch.equal(b.detach(), torch.ones(2)) and not torch.equal(a.detach(), torch.ones(2))
    assert scaler.get_scale() == 2.0**15 and scaler.state.skipped_steps == 1


def test_misuse_errors_match_torch():
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = GradScaler()
    for call in (lambda: scaler.unscale_(opt), lambda: scaler.step(opt), lambda: scaler.update()):
        with pytest.raises(AssertionError, match="did not use scaler.scale"):
            call()
    scaler.scale(p.sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(
        RuntimeError,
        match=r"unscale_\(\) has already been called on this optimizer since the last update\(\)\.",
    ):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) is being called after step\(\)\."):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called since the last update\(\)\."):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
        scaler.step(opt, closure=lambda: 0.0)
    scaler.update()
    with pytest.raises(AssertionError, match="No inf checks were recorded prior to update"):
        scaler.update()
    opt.zero_grad(set_to_none=True)
    with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer"):
        scaler.step(opt)


def test_fp16_parameters_with_dynamic_scaler_point_at_the_policy():
    model = mpx_torch.prepare(nn.Linear(4, 2), "float16")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("float16")
    assert scaler.config.kind == "dynamic"
    scaler.scale(model(torch.randn(3, 4)).float().sum()).backward()
    with pytest.raises(mpx.PolicyError, match="Attempting to unscale FP16 gradients") as info:
        scaler.step(opt)
    assert "mixed_float16" in str(info.value) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("make", [lambda: GradScaler("mixed_bfloat16"), lambda: GradScaler(enabled=False)])
def test_pass_through(make):
    scaler = make()
    assert not scaler.is_enabled()
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.5)
    loss = (p * 2).sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    scaler.unscale_(opt)
    scaler.unscale_(opt)  # no-ops, as in a disabled torch GradScaler
    scaler.step(opt)
    scaler.update()
    assert torch.equal(p.detach(), torch.zeros(2))
    assert scaler.get_scale() == 1.0
    assert scaler.state == mpx.scaler_init(scaler.config)


def test_config_forms_and_errors():
    assert GradScaler().config == mpx.ScalerConfig()
    assert GradScaler("mixed_float16").config == mpx.ScalerConfig.for_policy("mixed_float16")
    assert GradScaler(mpx.get_policy("bf16")).config.kind == "none"
    assert GradScaler(mpx.get_policy("bf16").to_dict()).config.kind == "none"
    cfg = mpx.ScalerConfig(growth_interval=7, hysteresis=2)
    assert GradScaler(cfg.to_dict()).config == cfg
    assert GradScaler(mpx.ScalerConfig(kind="static", init_scale=128.0)).get_scale() == 128.0
    with pytest.raises(mpx.PolicyError, match="device="):
        GradScaler("cuda")
    with pytest.raises(mpx.PolicyError):
        GradScaler("mixed_float17")
    with pytest.raises(mpx.ScalerConfigError):
        GradScaler(3)
    with pytest.raises(mpx.MPXError, match="device"):
        GradScaler(device="nowhere")
    scaler = GradScaler(device="cpu")
    assert scaler.scale(torch.tensor(2.0)).item() == 2.0**17


def test_update_new_scale():
    scaler = GradScaler()
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler.scale(p.sum()).backward()
    scaler.step(opt)
    scaler.update(1024.0)
    assert scaler.get_scale() == 1024.0
    scaler.update(torch.tensor(8.0))
    assert scaler.get_scale() == 8.0
    with pytest.raises(mpx.ScalerConfigError, match="new_scale"):
        scaler.update(2.0**30)


def test_state_dict_round_trips_through_json_and_loss_scaler():
    config = mpx.ScalerConfig(init_scale=2.0**10, growth_interval=3, hysteresis=2, min_scale=2.0)
    flags = [True, True, False, False, True, False, True, True, True, True]
    scaler = GradScaler(config)
    _run(scaler, config, flags[:6])
    saved = json.loads(json.dumps(scaler.state_dict()))
    assert saved["format"] == "mpx.scaler/1" and saved["scale"] == scaler.get_scale()

    resumed = GradScaler()  # a default scaler: the saved config comes back too
    resumed.load_state_dict(saved)
    assert resumed.config == config and resumed.state == scaler.state

    core = mpx.LossScaler.from_state_dict(saved)
    assert core.state == scaler.state
    for finite in flags[6:]:
        core.update(finite)
    _run(resumed, config, [])  # nothing: keeps state
    params = [nn.Parameter(torch.randn(3))]
    opt = torch.optim.SGD(params, lr=0.1)
    for finite in flags[6:]:
        _set_grads(params, resumed.scale(torch.tensor(1.0)).item(), finite)
        resumed.step(opt)
        resumed.update()
    assert resumed.state == core.state
    assert resumed.state_dict() == core.state_dict()

    fresh = GradScaler()
    fresh.load_state_dict(core.state_dict())  # before any scale(): held on the host until then
    assert fresh.get_scale() == core.get_scale() and fresh.state == core.state
    assert fresh.scale(torch.tensor(1.0)).item() == core.get_scale()


def test_load_native_torch_state_dict_keeps_torch_semantics():
    native = torch.amp.GradScaler(
        "cpu", init_scale=2.0**5, growth_factor=3.0, backoff_factor=0.25, growth_interval=4
    )
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    for _ in range(2):
        native.scale(p.sum()).backward()
        native.step(opt)
        native.update()
    ours = GradScaler()
    ours.load_state_dict(native.state_dict())
    cfg = ours.config
    assert (cfg.kind, cfg.min_scale, cfg.max_scale, cfg.hysteresis) == ("dynamic", None, None, 1)
    assert (cfg.growth_factor, cfg.backoff_factor, cfg.growth_interval) == (3.0, 0.25, 4)
    assert ours.get_scale() == native.get_scale() == 2.0**5
    assert ours.state.growth_tracker == 2
    mpx.load_state_dict(ours.state_dict())  # a valid neutral dict


def test_load_state_dict_errors_change_nothing():
    scaler = GradScaler()
    before = scaler.state_dict()
    bad = [
        {},
        {
            "scale": "x",
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": 10,
            "_growth_tracker": 0,
        },
        {
            "scale": 8.0,
            "growth_factor": 0.5,
            "backoff_factor": 0.5,
            "growth_interval": 10,
            "_growth_tracker": 0,
        },
        {
            "scale": 8.0,
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": 10,
            "_growth_tracker": 10,
        },
        {**before, "format": "torch"},
        {**before, "scale": -1.0},
        {"scale": 8.0},
        [1, 2],
    ]
    for data in bad:
        with pytest.raises(mpx.StateDictError):
            scaler.load_state_dict(data)
    assert scaler.state_dict() == before


def test_doctest_example_values():
    # the module docstring's numbers, by hand: w - lr * 3 in float32
    assert math.isclose(float(np.float32(1.0) - np.float32(0.1) * np.float32(3.0)), 0.699999988079071)


@pytest.mark.parametrize("fused", [False, True])
def test_on_device_trace_and_skip(device, fused):
    torch.manual_seed(0)
    model = nn.Linear(8, 4).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=fused)
    config = mpx.ScalerConfig(init_scale=2.0**8, growth_interval=2, hysteresis=2)
    scaler = GradScaler(config, device=device)
    ref = mpx.scaler_init(config)
    x = torch.randn(16, 8, device=device)
    for finite in (True, True, False, True, False, False, True, True, True):
        opt.zero_grad()
        with mpx_torch.autocast("mixed_float16", device):  # the scaler's ops under the mpx mode as well
            loss = model(x).float().square().mean()
            scaler.scale(loss).backward()
        if not finite:
            model.weight.grad[0, 0] = float("nan")
        before = _snapshot(list(model.parameters()), opt)
        scaler.step(opt)
        scaler.update()
        ref_next = mpx.scaler_update(config, ref, finite)
        assert scaler.state == ref_next
        after = _snapshot(list(model.parameters()), opt)
        unchanged = all(_same_bits(a, b) for a, b in zip(before[0], after[0], strict=True))
        assert unchanged == (not finite)
        assert (not finite) == _same_bits(before[1], after[1]) or not before[1]
        ref = ref_next
    assert scaler._tensors.scale.device.type == device


# -- issue #13 -------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["step", "unscale_", "fused"])
def test_overflow_only_after_unscaling_skips_the_step(how):
    # item 1: finite scaled gradients whose unscaled values overflow (scale < 1) are a non-finite step
    config = mpx.ScalerConfig(init_scale=0.25, min_scale=0.25)
    scaler = GradScaler(config)
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([p], lr=0.1, fused=how == "fused")
    scaler.scale(p.sum()).backward()
    p.grad[0] = 1e38  # finite; times 4 is inf
    if how == "unscale_":
        scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert torch.equal(p.detach(), torch.ones(2)) and not opt.state
    assert scaler.state == mpx.scaler_update(config, mpx.scaler_init(config), False)
    assert scaler.state.skipped_steps == 1


def test_unscaled_check_costs_no_sync_and_only_runs_below_one(host_reads):
    for config, expected in ((mpx.ScalerConfig(), False), (mpx.ScalerConfig(min_scale=None), True)):
        assert config.scale_can_drop_below_one is expected
        scaler = GradScaler(config)
        p = nn.Parameter(torch.ones(2))
        opt = torch.optim.AdamW([p], lr=0.1, fused=True)
        scaler.scale(p.sum()).backward()
        opt.step()  # the optimizer state exists: the fused path needs no first-step sync
        with host_reads() as rec:
            scaler.unscale_(opt)
            scaler.update()
        assert rec.syncs == []


def _torch_trace(init, factors_flags, interval):
    """torch's own kernel, then mpx's floor (2**-126): the reference for a torch-equivalent config."""
    scale = torch.full((), init, dtype=torch.float32)
    tracker = torch.zeros((), dtype=torch.int32)
    out = []
    for (gf, bf), finite in factors_flags:
        found = torch.full((), 0.0 if finite else 1.0)
        torch._amp_update_scale_(scale, tracker, found, gf, bf, interval)
        scale.clamp_(min=2.0**-126)
        out.append(scale.item())
    return out


factor_pairs = st.tuples(
    st.one_of(st.floats(1.0, 2.0**32, exclude_min=True), st.sampled_from([1.1, 1.5, 2.0, 3.0])),
    st.one_of(st.floats(2.0**-32, 1.0, exclude_max=True), st.sampled_from([0.9, 0.8, 0.5, 0.3])),
)


@settings(max_examples=150, deadline=None)
@given(
    st.floats(2.0**-126, 3.4e38).map(lambda x: float(np.float32(x))).filter(lambda x: x >= 2.0**-126),
    factor_pairs,
    st.integers(1, 3),
    st.lists(st.booleans(), min_size=1, max_size=30),
)
def test_scale_bit_identical_to_torch_kernel(init, factors, interval, flags):
    # item 9: core, mpx_torch and torch._amp_update_scale_ agree for any (scale, factor) history
    gf, bf = factors
    config = mpx.ScalerConfig(
        init_scale=init, growth_factor=gf, backoff_factor=bf, growth_interval=interval,
        min_scale=None, max_scale=None,
    )  # fmt: skip
    want = _torch_trace(init, [(factors, f) for f in flags], interval)
    core = mpx.LossScaler(config)
    scaler = GradScaler(config)
    scaler.scale(torch.tensor(1.0))
    for finite, expected in zip(flags, want, strict=True):
        core.update(finite)
        assert core.get_scale() == expected
        scaler._tensors.advance(torch.full((), 0.0 if finite else 1.0))
        assert scaler._tensors.scale.item() == expected


def test_issue_examples_match_torch_grad_scaler():
    cases = [
        (3.0, 2.0, 0.9, [False], 2.700000047683716),
        (3.0, 1.333333412806193, 0.5, [True], 4.0),  # the float64 product is a float32 tie
        (7.0, 1.1, 0.8, [True, False, True, True, False], None),
    ]
    for init, gf, bf, flags, expected in cases:
        native = torch.amp.GradScaler("cpu", init_scale=init, growth_factor=gf, backoff_factor=bf, growth_interval=1)
        ours = GradScaler(mpx.ScalerConfig(
            init_scale=init, growth_factor=gf, backoff_factor=bf, growth_interval=1, min_scale=None, max_scale=None
        ))  # fmt: skip
        for finite in flags:
            for scaler in (native, ours):
                p = nn.Parameter(torch.ones(1))
                opt = torch.optim.SGD([p], lr=0.1)
                scaler.scale(p.sum()).backward()
                if not finite:
                    p.grad.fill_(float("inf"))
                scaler.step(opt)
                scaler.update()
            assert ours.get_scale() == native.get_scale()
        if expected is not None:
            assert ours.get_scale() == expected


def test_hysteresis_uses_the_kernel_and_matches_the_core():
    config = mpx.ScalerConfig(init_scale=3.0, growth_factor=1.1, backoff_factor=0.9, growth_interval=2,
                              hysteresis=2, min_scale=None)  # fmt: skip
    _run(GradScaler(config), config, [True, False, False, False, True, True, True, False, True, True])


def test_scale_floor_round_trips():
    # item 5: min_scale=None never reaches 0; the state dict loads back
    config = mpx.ScalerConfig(min_scale=None)
    scaler = GradScaler(config)
    _run(scaler, config, [False] * 170)
    assert scaler.get_scale() == 2.0**-126
    fresh = GradScaler()
    fresh.load_state_dict(json.loads(json.dumps(scaler.state_dict())))
    assert fresh.state == scaler.state and fresh.config == config


def _state_and_config(scaler):
    return scaler.state, scaler.config


@pytest.mark.parametrize("initialized", [False, True])
@pytest.mark.parametrize(
    "tamper",
    [
        lambda d: d.update(steps=2**64),  # item 2: accepted by the core before, OverflowError here
        lambda d: d.update(steps=2**31),
        lambda d: d.update(scale=10**400),  # item 3
        lambda d: d["config"].update(growth_interval=2**70, init_scale=4.0),  # item 4
        lambda d: d["config"].update(growth_factor=3.5e38),
        lambda d: d.update(growth_tracker=1, consecutive_nonfinite=1, steps=5, skipped_steps=1),  # item 6
        lambda d: d.update(growth_tracker=3, steps=2),
        lambda d: d.update(consecutive_nonfinite=2, skipped_steps=1, steps=5),
        lambda d: d["config"].update(min_scale=0.25),  # a valid config with an invalid state: no half-load
    ],
)
def test_rejected_loads_change_nothing(initialized, tamper):
    good = GradScaler(mpx.ScalerConfig(init_scale=2.0**10, min_scale=None, growth_interval=4)).state_dict()
    data = json.loads(json.dumps(good))
    data["scale"] = 0.125  # only valid under min_scale=None
    tamper(data)
    scaler = GradScaler(mpx.ScalerConfig(init_scale=8.0, growth_interval=3))
    if initialized:
        scaler.scale(torch.tensor(1.0))
    before = _state_and_config(scaler)
    with pytest.raises(mpx.StateDictError):
        scaler.load_state_dict(data)
    assert _state_and_config(scaler) == before


@pytest.mark.parametrize(
    "native",
    [
        {"scale": 10**400, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 10, "_growth_tracker": 0},
        {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2**70, "_growth_tracker": 0},
        {"scale": 8.0, "growth_factor": 3.5e38, "backoff_factor": 0.5, "growth_interval": 9, "_growth_tracker": 0},
        {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 9, "_growth_tracker": 2**64},
        {"scale": 0.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 9, "_growth_tracker": 0},
        {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 9, "_growth_tracker": -1},
    ],
)
def test_rejected_native_loads_change_nothing(native):
    scaler = GradScaler(mpx.ScalerConfig(init_scale=8.0, growth_interval=3))
    scaler.scale(torch.tensor(1.0))
    before = _state_and_config(scaler)
    with pytest.raises(mpx.StateDictError):
        scaler.load_state_dict(native)
    assert _state_and_config(scaler) == before


_FIELDS = st.sampled_from(["scale", "growth_tracker", "consecutive_nonfinite", "steps", "skipped_steps"])
_VALUES = st.one_of(
    st.integers(-(2**70), 2**70), st.integers(0, 6), st.floats(allow_nan=True),
    st.sampled_from([10**400, 2.0**-126, 0.5, 8.0, 2.0**31, None]),
)  # fmt: skip


@settings(max_examples=120, deadline=None)
@given(st.lists(st.tuples(_FIELDS, _VALUES), min_size=1, max_size=3))
def test_state_dict_mutations_load_whole_or_not_at_all(mutations):
    src = GradScaler(mpx.ScalerConfig(init_scale=8.0, growth_interval=4, min_scale=0.5))
    _run(src, src.config, [True, False, True])
    data = src.state_dict()
    for key, value in mutations:
        data[key] = value
    scaler = GradScaler(mpx.ScalerConfig(init_scale=2.0))
    scaler.scale(torch.tensor(1.0))
    before = _state_and_config(scaler)
    try:
        expected = mpx.load_state_dict(data)
    except mpx.StateDictError:
        with pytest.raises(mpx.StateDictError):
            scaler.load_state_dict(data)
        assert _state_and_config(scaler) == before
    else:
        scaler.load_state_dict(data)  # whatever the core accepts, the backend loads
        assert (scaler.config, scaler.state) == expected


@pytest.mark.parametrize(
    "config",
    [
        mpx.ScalerConfig(growth_factor=2.0**32, backoff_factor=2.0**-32, growth_interval=1, min_scale=None,
                         max_scale=None),
        mpx.ScalerConfig(growth_interval=2**31 - 1, hysteresis=2**31 - 1),
        mpx.ScalerConfig(init_scale=3.4e38, max_scale=None, growth_factor=1.0000001, growth_interval=1),
    ],
)  # fmt: skip
def test_extreme_accepted_configs_run(config):
    # item 4: what the core accepts, the backend runs
    _run(GradScaler(config), config, [True, False, True, True, False])


def test_counters_saturate_like_the_core():
    config = mpx.ScalerConfig(init_scale=8.0, growth_interval=4)
    m = mpx.COUNTER_MAX
    state = mpx.ScalerState(8.0, 0, m - 1, m - 1, m - 1)
    scaler = GradScaler()
    scaler.load_state_dict(mpx.state_dict(config, state))
    ref = state
    for finite in (False, False, True):
        scaler.scale(torch.tensor(1.0))
        p = nn.Parameter(torch.ones(1))
        p.grad = torch.full((1,), 1.0 if finite else float("inf"))
        scaler.step(torch.optim.SGD([p], lr=0.1))
        scaler.update()
        ref = mpx.scaler_update(config, ref, finite)
        assert scaler.state == ref
    assert ref.steps == m


def test_huge_new_scale_is_a_scaler_config_error():
    scaler = GradScaler()
    scaler.scale(torch.tensor(1.0))
    with pytest.raises(mpx.ScalerConfigError, match="^new_scale: "):
        scaler.update(new_scale=10**400)


def test_disabled_scaler_state_dicts_follow_torch():
    # item 8: {} out, {} in, as torch's; the neutral dict on request
    ours, native = GradScaler(enabled=False), torch.amp.GradScaler("cpu", enabled=False)
    assert ours.state_dict() == native.state_dict() == {}
    ours.load_state_dict(native.state_dict())
    ours.load_state_dict({})
    assert ours.state_dict(neutral=True) == mpx.state_dict(mpx.ScalerConfig(), mpx.scaler_init(mpx.ScalerConfig()))
    assert GradScaler().state_dict(neutral=True) == GradScaler().state_dict()
    with pytest.raises(mpx.StateDictError, match="empty"):
        GradScaler().load_state_dict({})  # an enabled scaler has something to restore


class _GradScalerKwargOptimizer(torch.optim.SGD):
    """An optimizer of torch's older protocol: step(grad_scaler=...) does its own checks."""

    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):
        self.seen = grad_scaler
        found = grad_scaler._check_inf_per_device(self)
        if sum(v.item() for v in found.values()):
            return None
        inv = 1.0 / grad_scaler.get_scale()
        for group in self.param_groups:
            for p in group["params"]:
                p.grad.mul_(inv)
        return super().step()


@pytest.mark.parametrize("finite", [True, False])
def test_grad_scaler_kwarg_protocol_as_torch(finite):
    results = []
    for make in (lambda: torch.amp.GradScaler("cpu", init_scale=4.0), lambda: GradScaler(mpx.ScalerConfig(init_scale=4.0))):
        scaler = make()
        p = nn.Parameter(torch.ones(2))
        opt = _GradScalerKwargOptimizer([p], lr=0.5)
        scaler.scale(p.sum()).backward()
        if not finite:
            p.grad[0] = float("inf")
        with pytest.warns(FutureWarning, match="stop passing itself"):
            scaler.step(opt)
        scaler.update()
        assert opt.seen is scaler
        results.append((p.detach().clone(), scaler.get_scale()))
    assert torch.equal(results[0][0], results[1][0]) and results[0][1] == results[1][1]


# -- a torch.amp.GradScaler (#23 item 2) --------------------------------------------------------------
def test_is_a_torch_grad_scaler_without_torch_init():
    scaler = GradScaler(mpx.ScalerConfig(init_scale=8.0))
    assert isinstance(scaler, torch.amp.GradScaler) and issubclass(GradScaler, torch.amp.GradScaler)
    # torch's __init__ did not run: it would have taken the device first and (device "cuda" without
    # CUDA) disabled the scaler; its private config attributes do not exist here
    assert scaler.is_enabled() and not hasattr(scaler, "_init_scale") and not hasattr(scaler, "_growth_factor")
    assert scaler._scale is None and scaler._get_scale_async() is None and scaler._growth_tracker is None
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler.scale(w.sum()).backward()
    # torch's private names are views of the mpx device state, no copies
    assert scaler._scale is scaler._get_scale_async() is scaler._tensors.scale
    assert scaler._scale.dtype == torch.float32 and scaler._growth_tracker.dtype == torch.int32
    with pytest.raises(AttributeError):
        scaler._scale = torch.ones(())  # read-only: the scale changes through update()/load_state_dict()
    scaler.step(opt)
    scaler.update()
    assert scaler._get_growth_tracker() == scaler.state.growth_tracker == 1
    assert GradScaler(enabled=False)._get_growth_tracker() == 0


def test_parent_init_would_conflict():
    """Measured reason torch's __init__ is not called: on a machine without CUDA its default device
    disables the scaler, and on the CPU it assigns the names mpx reads from its device state."""
    if torch.cuda.is_available():
        pytest.skip("the disabling happens on machines without CUDA")
    scaler = GradScaler()
    with pytest.warns(UserWarning, match="CUDA is not available"):
        torch.amp.GradScaler.__init__(scaler)
    assert not scaler.is_enabled()
    with pytest.raises(AttributeError, match="_scale"):
        torch.amp.GradScaler.__init__(GradScaler(), "cpu")


def test_optimizer_record_is_a_dataclass_with_torchs_keys():
    scaler = GradScaler()
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    assert scaler.optimizer_stage(opt) is grad_scaler_module.OptState.READY
    scaler.scale(w.sum()).backward()
    scaler.unscale_(opt)
    record = scaler._per_optimizer_states[id(opt)]
    assert isinstance(record, grad_scaler_module.OptimizerStep)
    assert record.stage is record["stage"] is grad_scaler_module.OptState.UNSCALED
    assert scaler.optimizer_stage(opt) is grad_scaler_module.OptState.UNSCALED
    assert record["found_inf_per_device"] is record.found_inf_per_device
    assert record.found_inf(torch.device("cpu")).item() == 0.0
    with pytest.raises(KeyError):
        record["agreed"]  # mpx's own field is an attribute only
    scaler.step(opt)
    assert scaler.optimizer_stage(opt) is grad_scaler_module.OptState.STEPPED
    scaler.update()
    assert scaler.optimizer_stage(opt) is grad_scaler_module.OptState.READY


@pytest.mark.parametrize("protocol", ["plain", "fused", "grad_scaler_kwarg"])
def test_each_step_protocol_is_its_own_function(protocol, monkeypatch):
    """step() picks one of the three protocol functions by the optimizer's markers, as torch's step does."""
    from mpx_torch import _optimizer_step

    called = []
    for name in ("step_plain", "step_fused", "step_grad_scaler_kwarg"):
        real = getattr(_optimizer_step, name)
        monkeypatch.setattr(grad_scaler_module, name, lambda *a, _n=name, _r=real: called.append(_n) or _r(*a))
    w = nn.Parameter(torch.ones(2))
    opt = {
        "plain": lambda: torch.optim.SGD([w], lr=0.1),
        "fused": lambda: torch.optim.SGD([w], lr=0.1, fused=True),
        "grad_scaler_kwarg": lambda: _GradScalerKwargOptimizer([w], lr=0.1),
    }[protocol]()
    scaler = GradScaler()
    scaler.scale(w.sum()).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        scaler.step(opt)
    scaler.update()
    assert called == [f"step_{protocol}"]
    assert w.tolist() == [pytest.approx(0.9)] * 2
