"""mpx_torch.optim.PolicyOptimizer: the core's reference trace, optimi's Kahan SGD bit for bit, torchao's
stochastically rounded AdamW in distribution, a skipped GradScaler step, checkpoints, bytes per parameter."""

import copy
import math

import numpy as np
import optim_parity
import pytest
import torch
from hypothesis import given, settings

import mpx
import mpx_torch
from mpx_torch.optim import PolicyOptimizer

POLICY = {"plain": "bfloat16", "kahan": "bf16_kahan", "stochastic": "bf16_sr"}


def _bits(t):
    return t.detach().float().numpy().view(np.int32)


@settings(max_examples=25, deadline=None)
@given(optim_parity.traces())
def test_sgd_trace_is_the_core_reference(case):
    _check_trace(case)


@settings(max_examples=10, deadline=None)
@given(optim_parity.momentum_traces())
def test_momentum_trace_with_stored_state_is_the_core_reference(case):
    """SGD momentum 0.5, the buffer stored in float32, bfloat16 or int8 blocks: the bits optax and Keras give."""
    _check_trace(case)


def _sgd(case, w0, seed=None):
    params = [torch.nn.Parameter(torch.from_numpy(w0[i]).to(torch.bfloat16)) for i in range(2)]
    inner = torch.optim.SGD(params, lr=case["lr"], momentum=case.get("momentum", 0.0))
    return params, PolicyOptimizer(
        inner, optim_parity.policy_of(case), seed=case["seed"] if seed is None else seed
    )


def _check_trace(case, start=0, params=None, opt=None):
    if opt is None:
        params, opt = _sgd(case, case["w0"])
    trace = optim_parity.reference_trace(case)
    for step in range(start, len(trace)):
        want_w, want_c = trace[step]
        for i, p in enumerate(params):
            p.grad = torch.from_numpy(case["grads"][step, i]).to(torch.bfloat16)
        opt.step()
        for i, p in enumerate(params):
            assert p.dtype == torch.bfloat16
            assert np.array_equal(_bits(p), want_w[i].view(np.int32)), (step, i)
            if case["update"] == "kahan":
                assert np.array_equal(_bits(opt.state_of(p)["kahan_comp"]), want_c[i].view(np.int32))


@settings(max_examples=10, deadline=None)
@given(optim_parity.momentum_traces())
def test_neutral_checkpoint_is_the_reference_and_resumes_from_it(case):
    """After k steps the mpx.optim/1 dict equals the numpy reference's (the one optax and Keras save too); a fresh
    optimizer that reads the reference's dict continues the reference trace bit for bit."""
    k = (len(case["grads"]) + 1) // 2
    params, opt = _sgd(case, case["w0"])
    for step in range(k):
        for i, p in enumerate(params):
            p.grad = torch.from_numpy(case["grads"][step, i]).to(torch.bfloat16)
        opt.step()
    saved = optim_parity.reference_checkpoint(case, k)
    assert optim_parity.equal_checkpoints(opt.neutral_state_dict(), saved)
    params2, opt2 = _sgd(case, optim_parity.reference_trace(case)[k - 1][0], seed=0)
    opt2.load_neutral_state_dict(saved)
    assert opt2.seed == case["seed"] and opt2.steps == k
    _check_trace(case, k, params2, opt2)


@settings(max_examples=15, deadline=None)
@given(optim_parity.traces())
def test_kahan_sgd_equals_optimis_bit_for_bit(case):
    """optimi.SGD(kahan_sum=True) adds -lr * grad to its bfloat16 compensation; mpx adds the float32 step's
    difference: equal where the step is exact in float32 (lr a power of two, these magnitudes)."""
    import optimi

    ours = [torch.nn.Parameter(torch.from_numpy(w).to(torch.bfloat16)) for w in case["w0"]]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = PolicyOptimizer(torch.optim.SGD(ours, lr=case["lr"]), "bf16_kahan")
    ref = optimi.SGD(theirs, lr=case["lr"], kahan_sum=True, foreach=False)
    for grads in case["grads"]:
        for p, q, g in zip(ours, theirs, grads, strict=True):
            p.grad, q.grad = (torch.from_numpy(g).to(torch.bfloat16) for _ in range(2))
        opt.step()
        ref.step()
        for p, q in zip(ours, theirs, strict=True):
            assert np.array_equal(_bits(p), _bits(q))
            assert np.array_equal(_bits(opt.state_of(p)["kahan_comp"]), _bits(ref.state[q]["kahan_comp"]))


def test_stochastic_adamw_matches_torchaos_in_distribution(monkeypatch):
    """One AdamW step on 2**15 copies of one weight: the mean and variance of the rounded weights are torchao's
    ``_AdamW(bf16_stochastic_round=True)``'s within a few standard errors.  torchao compiles its step function
    with inductor (15 s on this CPU): here the same function runs eagerly (``torch.compile`` returns it)."""
    import torchao.optim

    n, value, grad = 1 << 15, 1.0, 0.37
    ours = torch.nn.Parameter(torch.full((n,), value, dtype=torch.bfloat16))
    theirs = torch.nn.Parameter(ours.detach().clone())
    lr = 3e-3  # the float32 step lands between two bfloat16 values
    opt = PolicyOptimizer(torch.optim.AdamW([ours], lr=lr, weight_decay=0.0), "bf16_sr", seed=3)
    ref = torchao.optim._AdamW([theirs], lr=lr, weight_decay=0.0, bf16_stochastic_round=True)
    ours.grad, theirs.grad = torch.full_like(ours, grad), torch.full_like(theirs, grad)
    opt.step()
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    ref.step()
    a, b = ours.detach().double(), theirs.detach().double()
    target = value - lr * grad / (abs(grad) + 1e-8)  # Adam's first step: lr * sign(grad)
    gap = 2.0 ** (math.floor(math.log2(target)) - 7)  # bfloat16's spacing at the target
    frac = (target - math.floor(target / gap) * gap) / gap
    se = gap * math.sqrt(frac * (1 - frac) / n)
    assert abs(a.mean().item() - target) < 4 * se and abs(b.mean().item() - target) < 4 * se
    var = gap**2 * frac * (1 - frac)
    assert abs(a.var().item() - var) < 0.05 * var and abs(b.var().item() - var) < 0.05 * var
    assert set(a.unique().tolist()) == set(b.unique().tolist())  # the same two neighbours


def _model(policy):
    torch.manual_seed(0)
    return mpx_torch.prepare(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)), policy)


def _snapshot(model, opt):
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        out += [v.clone() for v in opt.state[p].values() if torch.is_tensor(v)]
        out += [v.clone() for v in opt.state_of(p).values()]
    return out, opt.steps


@pytest.mark.parametrize(
    "policy",
    ["bf16_kahan", "bf16_sr", "bfloat16,master=float32,opt_state=bf16", "bf16_kahan,opt_state=int8:32"],
)
def test_a_skipped_grad_scaler_step_leaves_everything_bit_identical(policy):
    model = _model(policy)
    opt = PolicyOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), model
    )  # the prepared model's policy
    scaler = mpx_torch.GradScaler(mpx.ScalerConfig(kind="dynamic", init_scale=2.0**8))
    x = torch.randn(16, 4)
    for _ in range(2):
        opt.zero_grad()
        scaler.scale(model(x).float().square().mean()).backward()
        scaler.step(opt)
        scaler.update()
    before, steps = _snapshot(model, opt)
    assert steps == 2
    opt.zero_grad()
    scaler.scale(model(x).float().square().mean() * float("inf")).backward()
    scaler.step(opt)
    scaler.update()
    after, steps_after = _snapshot(model, opt)
    assert steps_after == steps and len(after) == len(before)
    for a, b in zip(after, before, strict=True):
        assert a.dtype == b.dtype and torch.equal(
            a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b
        )


#: Each checkpoint form's (save, load): torch's state dict (copied, as torch.save would) and the neutral mpx.optim/1.
CHECKPOINTS = {
    "torch": (lambda opt: copy.deepcopy(opt.state_dict()), PolicyOptimizer.load_state_dict),
    "neutral": (PolicyOptimizer.neutral_state_dict, PolicyOptimizer.load_neutral_state_dict),
}


def _adamw_run(policy, seed=0, weights=None):
    """A prepared model (``weights`` loaded), its AdamW PolicyOptimizer, and ``run(steps)`` of a fixed batch."""
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    model = _model(policy)
    if weights is not None:
        model.load_state_dict(weights)
    opt = PolicyOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), policy, seed=seed)

    def run(steps):
        for _ in range(steps):
            opt.zero_grad()
            model(x).float().square().mean().backward()
            opt.step()

    return model, opt, run


@pytest.mark.parametrize(
    ("form", "policy"),
    [(form, policy) for form in CHECKPOINTS
     for policy in ["bf16_kahan", "bf16_sr", "bfloat16,opt_state=bf16", "bf16_sr,opt_state=bf16",
                    "bf16_kahan,opt_state=int8:32", "mixed_bfloat16_8bit_adam"]],
)  # fmt: skip
def test_a_checkpoint_resumes_bit_for_bit(form, policy):
    """A fresh optimizer that loads either checkpoint form (taken after 2 steps; the neutral one round-trips)
    continues bit for bit: weights, the wrapped optimizer's state, compensation and stored state, seed, steps."""
    save, load = CHECKPOINTS[form]
    model, opt, run = _adamw_run(policy, seed=9)
    run(2)
    saved, weights = save(opt), copy.deepcopy(model.state_dict())
    run(2)
    resumed, opt2, run2 = _adamw_run(policy, weights=weights)
    load(opt2, saved)
    assert opt2.seed == 9 and opt2.steps == 2
    if form == "neutral":
        assert optim_parity.equal_checkpoints(opt2.neutral_state_dict(), saved)
    run2(2)
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)
        for k, v in opt.state[p].items():
            assert opt2.state[q][k].dtype == v.dtype and torch.equal(opt2.state[q][k], v)
        for k, v in opt.state_of(p).items():
            assert opt2.state_of(q)[k].dtype == v.dtype and torch.equal(opt2.state_of(q)[k], v)
    assert optim_parity.equal_checkpoints(opt2.neutral_state_dict(), opt.neutral_state_dict())


def test_a_neutral_checkpoint_of_another_policy_or_optimizer_is_refused():
    model, opt, run = _adamw_run("bf16_sr,opt_state=bf16")
    run(1)
    saved = opt.neutral_state_dict()
    with pytest.raises(mpx.StateDictError, match="policy"):
        PolicyOptimizer(torch.optim.AdamW(model.parameters()), "bfloat16").load_neutral_state_dict(saved)
    sgd = PolicyOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), opt.policy)
    with pytest.raises(mpx.StateDictError, match="optimizer: the checkpoint holds 'adam' state"):
        sgd.load_neutral_state_dict(saved)


# bytes per parameter of Adam (weights + compensation or master + optimizer state + gradients), from the tensors
BYTES = {"mixed_bfloat16": 16, "bf16_kahan": 14, "bf16_sr": 12, "bf16_kahan,opt_state=bf16": 10,
         "bf16_sr,opt_state=bf16": 8, "bfloat16,master=float32": 16,
         "mixed_bfloat16_8bit_adam": 10.03125, "bf16_kahan,opt_state=int8": 8.03125,
         "bf16_sr,opt_state=int8": 6.03125}  # fmt: skip


@pytest.mark.parametrize(("policy", "expected"), BYTES.items())
def test_bytes_per_parameter_from_the_state_tensors(policy, expected):
    torch.manual_seed(0)  # 512 weights: two whole blocks of 256
    model = mpx_torch.prepare(torch.nn.Linear(16, 32, bias=False), policy)
    opt = PolicyOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), policy)
    model(torch.randn(2, 16)).float().sum().backward()
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    total = 0
    for p in model.parameters():
        total += p.numel() * p.element_size() + p.grad.numel() * p.grad.element_size()
        tensors = [v for k, v in opt.state[p].items() if k != "step"] + list(opt.state_of(p).values())
        total += sum(t.numel() * t.element_size() for t in tensors)
    assert total / n == expected


def test_errors_name_the_key():
    w = torch.nn.Parameter(torch.ones(2))
    opt = PolicyOptimizer(torch.optim.SGD([w], lr=0.1), mpx.Policy("bfloat16", update="kahan"))
    w.grad = torch.ones(2)
    with pytest.raises(mpx.PolicyError, match="^update: kahan writes bfloat16 master weights"):
        opt.step()
    with pytest.raises(mpx.PolicyError, match="^policy: the module was not prepared"):
        PolicyOptimizer(torch.optim.SGD([w], lr=0.1), torch.nn.Linear(2, 2))
    with pytest.raises(mpx.StateDictError, match="saved under policy"):
        PolicyOptimizer(torch.optim.SGD([w], lr=0.1), "bf16_sr").load_state_dict(opt.state_dict())


def test_int8_state_is_the_core_quantization_of_the_float32_moments():
    """One Adam step: the stored codes and absmaxes are the numpy kernel's of the moments a float32 Adam computes,
    and the next step starts from their dequantized values."""
    from mpx.kernels import NUMPY_OPS
    from mpx.kernels import blockwise as kb

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(300))
    twin = torch.nn.Parameter(w.detach().clone())
    opt = PolicyOptimizer(torch.optim.Adam([w], lr=1e-2), "mixed_bfloat16_8bit_adam")
    ref = torch.optim.Adam([twin], lr=1e-2)
    g = torch.randn(300)
    w.grad, twin.grad = g.clone(), g.clone()
    opt.step()
    ref.step()
    assert torch.equal(w, twin) and set(opt.state[w]) == {"step"}
    for key in ("exp_avg", "exp_avg_sq"):
        q, absmax = kb.quantize(NUMPY_OPS, ref.state[twin][key].numpy(), 256)
        assert opt.state_of(w)[f"{key}.q"].dtype == torch.int8 and opt.state_of(w)[f"{key}.q"].shape == (
            2,
            256,
        )
        assert np.array_equal(opt.state_of(w)[f"{key}.q"].numpy(), q)
        assert np.array_equal(opt.state_of(w)[f"{key}.absmax"].numpy().view(np.int32), absmax.view(np.int32))
        ref.state[twin][key] = torch.from_numpy(kb.dequantize(NUMPY_OPS, q, absmax, 300))
    w.grad, twin.grad = g.clone(), g.clone()
    opt.step()
    ref.step()
    assert torch.equal(w, twin)
