"""mpx_torch.float8 (#26): quantization bytes, scale rules and commit traces against mpx.float8, the FP8
Linear against fp8_dot, skipped steps, torch.compile, state dicts, a small transformer training."""

from __future__ import annotations

import io
import json
import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import mpx
import mpx_torch
from mpx.float8 import (
    Float8Recipe,
    compute_scale,
    float8_init,
    float8_update,
    fp8_dot,
)
from mpx.float8 import load_state_dict as core_load_state_dict
from mpx.float8 import quantize as core_quantize
from mpx_torch import _float8_ops, float8
from mpx_torch.float8 import Float8Linear, commit_float8, convert

ML = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
F32 = np.finfo(np.float32)


def _same_nan_as_nan(torch_q: torch.Tensor, core_q: np.ndarray) -> bool:
    got = torch_q.view(torch.uint8).numpy()
    ref = core_q.view(np.uint8)
    got_nan = np.isnan(torch_q.float().numpy())
    ref_nan = np.isnan(core_q.astype(np.float32))
    return bool(np.array_equal(got_nan, ref_nan) and np.array_equal(got[~got_nan], ref[~ref_nan]))


# -- quantize: bytes equal to the core's -------------------------------------------------------------
floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)
specials = st.sampled_from(
    [0.0, -0.0, 448.0, 449.0, 464.0, 57344.0, 61440.0, 1e9, -1e9, 2.0**-9, 2.0**-10, 2.0**-16, 2.0**-17,
     float(F32.tiny), 1e-45, math.inf, -math.inf, math.nan]
)  # fmt: skip
scales = st.one_of(st.floats(min_value=2.0**-30, max_value=2.0**30, width=32), st.sampled_from([1.0, 448.0]))


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.one_of(floats32, specials), min_size=1, max_size=64),
    scales,
    st.sampled_from(["e4m3", "e5m2"]),
)
def test_quantize_is_the_cores_byte_for_byte(xs, scale, fmt):
    x = np.asarray(xs, dtype=np.float32)
    got = float8.quantize(torch.from_numpy(x), scale, fmt)
    assert got.dtype == _float8_ops.TORCH_FORMATS[fmt]
    assert _same_nan_as_nan(got, core_quantize(x, scale, fmt))
    as_tensor = float8.quantize(torch.from_numpy(x), torch.tensor(scale, dtype=torch.float32), fmt)
    assert torch.equal(as_tensor.view(torch.uint8), got.view(torch.uint8))


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.one_of(floats32, specials), min_size=1, max_size=32),
    scales,
    st.sampled_from(["e4m3", "e5m2"]),
)
def test_quantize_from_half_and_double_inputs(xs, scale, fmt):
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        t = torch.tensor(xs, dtype=torch.float64).to(dtype)
        ref = core_quantize(t.to(torch.float32).numpy(), scale, fmt)  # float32(x): exact for half inputs
        assert _same_nan_as_nan(float8.quantize(t, scale, fmt), ref)


def test_quantize_overflow_nan_and_the_e5m2_nan_byte():
    x = torch.tensor([1e9, -1e9, math.inf, -math.inf, math.nan])
    assert float8.quantize(x, 1.0, "e4m3").float()[:4].tolist() == [448.0, -448.0, 448.0, -448.0]
    e5 = float8.quantize(x, 1.0, "e5m2")
    assert e5.float()[:4].tolist() == [57344.0, -57344.0, 57344.0, -57344.0]
    assert torch.isnan(e5.float()[4])
    assert (
        e5.view(torch.uint8)[4].item() == 0x7F
        and core_quantize([math.nan], 1.0, "e5m2").view(np.uint8)[0] == 0x7E
    )
    with pytest.raises(mpx.Float8Error, match="fmt: 'e3m4' is not allowed"):
        float8.quantize(x, 1.0, "e3m4")


# -- the scale rules, bit for bit ------------------------------------------------------------------
amaxes = st.one_of(
    st.floats(min_value=0.0, width=32, allow_infinity=True, allow_subnormal=True),
    st.sampled_from([0.0, 1e-45, 1e-40, 1e-13, 1e-12, 1.0, 448.0, float(F32.max), math.inf, math.nan]),
)
recipes = st.builds(
    Float8Recipe,
    format=st.sampled_from(["hybrid", "e4m3"]),
    scaling=st.sampled_from(["delayed", "current"]),
    amax_history_len=st.integers(1, 6),
    amax_compute=st.sampled_from(["max", "most_recent"]),
    margin=st.one_of(st.integers(0, 4), st.sampled_from([60, 127, 150, 1023, 1074, 1075, 2000])),
    power_of_two=st.booleans(),
)


@settings(max_examples=400, deadline=None)
@given(recipes, st.lists(amaxes, min_size=3, max_size=3), st.sampled_from([1.0, 8.0, 0.375]))
def test_scale_rules_are_compute_scale(recipe, values, previous):
    amax = torch.tensor(values, dtype=torch.float32)
    formats = ("e4m3", "e4m3", recipe.format_of("grad"))
    prev = torch.full((3,), previous)
    got = torch.cat([
        _float8_ops.scales(recipe, amax[:2], "e4m3", prev[:2]),
        _float8_ops.scales(recipe, amax[2:], formats[2], prev[2:]),
    ])  # fmt: skip
    expected = [
        compute_scale(recipe, float(a), f, previous) for a, f in zip(amax.tolist(), formats, strict=True)
    ]
    assert got.dtype == torch.float32 and got.tolist() == expected


# -- commit: the trace of mpx.float8.float8_update ---------------------------------------------------
ROLES3 = ("input", "weight", "grad")


def _step(layer: nn.Module, a_in: float, a_w: float, a_g: float, *, k: int = 8, n: int = 4) -> None:
    """One forward and backward whose input, weight and gradient have exactly these amaxes."""
    with torch.no_grad():
        w = torch.zeros(n, k)
        w[0, 0] = a_w
        layer.weight.copy_(w)
    x = torch.zeros(3, k)
    x[1, 2] = -a_in
    g = torch.zeros(3, n)
    g[2, 1] = a_g
    (layer(x) * g).sum().backward()


step_amax = st.one_of(
    st.floats(min_value=0.0, max_value=1e6, width=32),
    st.sampled_from([0.0, 1e-30, 3.0, 448.0, 1e30, math.inf, math.nan]),
)


@settings(max_examples=60, deadline=None)
@given(
    recipes,
    st.lists(
        st.tuples(step_amax, step_amax, step_amax, st.booleans(), st.integers(0, 5)), min_size=1, max_size=24
    ),
)
def test_commit_trace_is_float8_update(recipe, steps):
    layer = convert(nn.Linear(8, 4, bias=False), mpx.Policy(fp8=recipe))
    state = float8_init(recipe, {r: r for r in ROLES3})
    for a_in, a_w, a_g, skipped, what in steps:
        seen = {}
        if what:  # 0: a step where the layer is not called (nothing observed)
            _step(layer, a_in, a_w, a_g)
            seen = {"input": a_in, "weight": a_w, "grad": a_g}
            if what == 5:  # a second micro-batch: amaxes max-combined (NaN wins) before the commit
                _step(layer, 1.5, 1.0, 2.5)
                seen = mpx.float8.reduce_amaxes([seen, {"input": 1.5, "weight": 1.0, "grad": 2.5}])
        commit_float8(layer, skipped)
        state = float8_update(recipe, state, seen, skipped=skipped)
        _, got = core_load_state_dict(float8.float8_state_dict(layer))
        assert got == state


def test_step_t_quantizes_with_the_amaxes_of_earlier_steps_only():
    layer = convert(nn.Linear(4, 2, bias=False), "float32,fp8=hybrid,fp8_history=2")
    used = []
    for a in (2.0, 4.0, 1.0, 0.5):
        used.append(layer.fp8_scale[0].item())
        _step(layer, a, 1.0, 1.0, k=4, n=2)
        commit_float8(layer)
    assert used == [1.0, 224.0, 112.0, 112.0]  # the first step uses 1.0; then max over the last 2 amaxes


def test_current_scaling_quantizes_with_the_tensors_own_amax():
    layer = convert(nn.Linear(4, 2, bias=False), "float32,fp8=e4m3,fp8_scaling=current")
    x = torch.tensor([[3.0, -1.0, 0.5, 0.25]])
    out = layer(x)
    w = layer.weight.detach()
    sx, sw = 448.0 / 3.0, 448.0 / float(w.abs().max())
    ref = fp8_dot(x.numpy(), w.numpy().T, float(np.float32(sx)), float(np.float32(sw)))
    assert np.allclose(out.detach().numpy(), ref, rtol=1e-6, atol=1e-7)
    commit_float8(layer)
    assert layer.fp8_scale[0].item() == float(np.float32(sx)) and layer.fp8_amax_history.shape == (3, 0)


# -- the GEMMs against fp8_dot ------------------------------------------------------------------------
def _bound(qa: np.ndarray, qb: np.ndarray, k: int, sa: float, sb: float) -> np.ndarray:
    """float32 rounding of a k-term sum of exact FP8 products, plus the two inverse-scale products."""
    return (4 * k + 4) * F32.eps * (np.abs(qa) @ np.abs(qb)) / (sa * sb) + 1e-30


@pytest.mark.parametrize("gemm", ["emulate", "scaled_mm"])
@pytest.mark.parametrize("bias", [False, True])
def test_forward_and_backward_match_fp8_dot(gemm, bias):
    torch.manual_seed(0)
    k, n = 24, 8
    layer = convert(nn.Linear(k, n, bias=bias), "float32,fp8=hybrid", gemm=gemm)
    x = torch.randn(2, 3, k, requires_grad=True)
    with torch.no_grad():
        layer.fp8_scale.copy_(torch.tensor([448.0 / 3.0, 448.0 / 0.2, 57344.0 / 2.0]))
    sx, sw, sg = layer.fp8_scale.tolist()
    out = layer(x)
    g = torch.randn(2, 3, n)
    out.backward(g)
    x2, w, g2 = x.detach().reshape(-1, k).numpy(), layer.weight.detach().numpy(), g.reshape(-1, n).numpy()
    qx, qw = core_quantize(x2, sx, "e4m3").astype(np.float32), core_quantize(w, sw, "e4m3").astype(np.float32)
    qg = core_quantize(g2, sg, "e5m2").astype(np.float32)
    ref = fp8_dot(x2, w.T, sx, sw)
    if bias:
        ref = ref + layer.bias.detach().numpy()
    assert np.all(np.abs(out.detach().reshape(-1, n).numpy() - ref) <= _bound(qx, qw.T, k, sx, sw))
    ref_dx = fp8_dot(g2, w, sg, sw, "e5m2", "e4m3")
    assert np.all(np.abs(x.grad.reshape(-1, k).numpy() - ref_dx) <= _bound(qg, qw, n, sg, sw))
    ref_dw = fp8_dot(g2.T, x2, sg, sx, "e5m2", "e4m3")
    assert np.all(np.abs(layer.weight.grad.numpy() - ref_dw) <= _bound(qg.T, qx, 6, sg, sx))
    if bias:
        assert torch.equal(layer.bias.grad, g.reshape(-1, n).sum(0))


def test_output_dtype_follows_autocast_and_prepare():
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    mpx_torch.prepare(model, "mixed_bfloat16_fp8")
    convert(model, "mixed_bfloat16_fp8")
    assert isinstance(model[0], Float8Linear) and isinstance(model[2], Float8Linear)
    assert model[0].weight.dtype == torch.float32
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model[0](x).dtype == torch.bfloat16
    assert model[0](x).dtype == torch.float32  # no autocast: the input's dtype
    assert model(x).dtype == torch.float32  # the prepared model's output dtype


# -- convert ------------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class Tiny(nn.Module):
    """A tiny transformer-style LM: embedding, pre-norm attention and MLP blocks, a head."""

    def __init__(self, vocab: int = 32, d: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(layers))
        self.proj = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.final = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        t = tokens.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()
        for qkv, proj, norm, block in zip(self.qkv, self.proj, self.norms, self.blocks, strict=True):
            q, k, v = qkv(norm(h)).chunk(3, dim=-1)
            att = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~mask, -1e4).softmax(-1)
            h = block(h + proj(att @ v))
        return self.head(self.final(h))


def test_convert_follows_the_policy_and_its_overrides():
    model = Tiny()
    params = {name: id(p) for name, p in model.named_parameters()}
    convert(model, "mixed_bfloat16,fp8=hybrid,@head={fp8=none},@qkv.0={fp8_margin=1}")
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert (
        kinds["head"] == "Linear"
        and kinds["qkv.1"] == "Float8Linear"
        and kinds["blocks.0.fc2"] == "Float8Linear"
    )
    assert model.qkv[0].fp8_recipe == Float8Recipe(margin=1) and model.qkv[1].fp8_recipe == Float8Recipe()
    assert {name: id(p) for name, p in model.named_parameters()} == params  # the same Parameter objects
    model.qkv[1].fp8_scale.fill_(2.0)
    convert(model, "mixed_bfloat16,fp8=hybrid,@head={fp8=none}")  # unchanged recipe: state kept
    assert model.qkv[1].fp8_scale.tolist() == [2.0, 2.0, 2.0] and model.qkv[0].fp8_scale.tolist() == [1.0] * 3
    convert(model, "mixed_bfloat16,@blocks.*={fp8=e4m3}")  # FP8 only in the blocks
    assert type(model.qkv[1]) is nn.Linear and "fp8_scale" not in dict(model.qkv[1].named_buffers())
    assert isinstance(model.blocks[0].fc1, Float8Linear) and model.blocks[0].fc1.fp8_recipe.format == "e4m3"
    convert(model, mpx.get_policy("mixed_bfloat16_fp8"), op_table=mpx.OP_TABLE.replace(linear="float32"))
    assert not list(float8.float8_layers(model))  # linear not LOWER: no FP8 anywhere


def test_convert_leaves_subclasses_and_refuses_bad_input():
    class MyLinear(nn.Linear):
        pass

    model = nn.Sequential(MyLinear(4, 4), nn.Linear(4, 4))
    convert(model, "mixed_bfloat16_fp8")
    assert type(model[0]) is MyLinear and isinstance(model[1], Float8Linear)
    with pytest.raises(mpx.UnsupportedTypeError, match="model: expected a torch.nn.Module, got function"):
        convert(lambda x: x, "mixed_bfloat16_fp8")
    with pytest.raises(
        mpx.MPXError, match="gemm: 'cublas' is not allowed; allowed: auto, scaled_mm, emulate"
    ):
        convert(model, "mixed_bfloat16_fp8", gemm="cublas")
    with pytest.raises(mpx.PolicyError, match="fp8: 'e5m2' is not allowed"):
        convert(model, "mixed_bfloat16,fp8=e5m2")
    assert (
        model[1].fp8_gemm == "emulate"
    )  # auto on the CPU: the emulation (the CPU _scaled_mm is a slow reference)


def test_scaled_mm_is_reached_through_compat(monkeypatch):
    layer = convert(nn.Linear(4, 4), "float32,fp8=hybrid", gemm="scaled_mm")
    monkeypatch.delattr(torch, "_scaled_mm")
    with pytest.raises(mpx.FrameworkVersionError, match="torch._scaled_mm"):
        layer(torch.randn(2, 4))


# -- skipped steps, accumulation, the GradScaler ----------------------------------------------------
def test_a_skipped_step_leaves_parameters_optimizer_and_fp8_state_bit_identical():
    torch.manual_seed(0)
    model = convert(mpx_torch.prepare(Tiny(), "mixed_bfloat16_fp8"), "mixed_bfloat16_fp8")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = mpx_torch.GradScaler(mpx.ScalerConfig(init_scale=2.0**8))
    tokens = torch.randint(0, 32, (4, 8))

    def step(poison: bool) -> None:
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        scaler.scale(loss * (math.inf if poison else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        commit_float8(model, scaler)
        opt.zero_grad()

    for _ in range(3):
        step(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt_before = {k: {n: t.clone() for n, t in s.items()} for k, s in opt.state_dict()["state"].items()}
    assert any(v.abs().sum() > 0 for k, v in before.items() if k.endswith("fp8_amax_history"))
    step(True)
    assert scaler.state.skipped_steps == 1
    after = {k: v.clone() for k, v in model.state_dict().items()}
    for key, value in before.items():
        assert torch.equal(value.view(torch.uint8), after[key].view(torch.uint8)), key
    for k, s in opt.state_dict()["state"].items():
        for n, t in s.items():
            assert torch.equal(t, opt_before[k][n])
    assert all((m.fp8_amax == -1).all() for _, m in float8.float8_layers(model))  # the step's amaxes dropped
    step(False)  # the next finite step commits again
    assert not torch.equal(after["qkv.0.fp8_amax_history"], model.state_dict()["qkv.0.fp8_amax_history"])
    with pytest.raises(mpx.MPXError, match=r"scaler's update\(\) was not called since the last commit"):
        commit_float8(model, scaler)


def test_skipped_flags():
    layer = convert(nn.Linear(4, 4), "float32,fp8=hybrid,fp8_history=2")
    for flag, moves in ((torch.tensor(1.0), False), (torch.tensor([0]), True), (False, True), (True, False)):
        _step(layer, 3.0, 1.0, 1.0, k=4, n=4)
        before = layer.fp8_amax_history.clone()
        commit_float8(layer, flag)
        assert (not torch.equal(before, layer.fp8_amax_history)) == moves
    for bad in (1, "yes", torch.ones(2), None):
        with pytest.raises(mpx.UnsupportedTypeError, match="skipped: expected"):
            commit_float8(layer, bad)
    with pytest.raises(mpx.UnsupportedTypeError, match="model: expected a torch.nn.Module"):
        commit_float8([layer])


# -- torch.compile ------------------------------------------------------------------------------------
def test_compile_fullgraph_one_graph_and_the_eager_state():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    eager = convert(mpx_torch.prepare(Tiny(), "mixed_bfloat16_fp8"), "mixed_bfloat16_fp8")
    compiled_model = convert(mpx_torch.prepare(Tiny(), "mixed_bfloat16_fp8"), "mixed_bfloat16_fp8")
    compiled_model.load_state_dict(eager.state_dict())
    # AOTAutograd: the backward's write of the gradient's amax is functionalized
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(compiled_model, backend=counter, fullgraph=True)
    tokens = torch.randint(0, 32, (2, 8))
    for _ in range(3):
        for m, fn in ((eager, eager), (compiled_model, compiled)):
            fn(tokens).float().square().mean().backward()
            commit_float8(m)
    assert counter.frame_count == 1  # one graph, no recompile when the scales change
    for key, value in eager.state_dict().items():
        if "fp8" in key:
            assert torch.equal(value, compiled_model.state_dict()[key]), key


def test_compile_fullgraph_current_scaling():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    model = convert(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)), "float32,fp8=hybrid,fp8_scaling=current")
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    for _ in range(2):
        compiled(torch.randn(4, 16)).square().mean().backward()
        commit_float8(model)
    assert counter.frame_count == 1


@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_forward_backward_and_commit_read_nothing_on_the_host(scaling, host_reads):
    model = convert(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), f"float32,fp8=hybrid,fp8_scaling={scaling}")
    scaler = mpx_torch.GradScaler()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for bad in (False, True):
        opt.zero_grad()
        with host_reads() as rec:
            loss = scaler.scale(model(torch.randn(4, 8)).square().mean())
            loss.backward()
        if bad:
            model[0].weight.grad[0, 0] = math.inf
        scaler.step(opt)  # a plain optimizer: one host read here, as torch's GradScaler
        with host_reads() as rec2:
            scaler.update()
            commit_float8(model, scaler)
            commit_float8(model, torch.tensor(float(bad)))
        assert rec.syncs == rec2.syncs == []


# -- state dicts ----------------------------------------------------------------------------------------
def test_state_dicts_round_trip():
    torch.manual_seed(0)
    model = convert(Tiny(), "mixed_bfloat16,fp8=hybrid,fp8_history=8,@head={fp8=none}")
    tokens = torch.randint(0, 32, (2, 8))
    for _ in range(3):
        model(tokens).sum().backward()
        commit_float8(model)
    sd = model.state_dict()
    assert sd["qkv.0.fp8_scale"].shape == (3,) and sd["qkv.0.fp8_amax_history"].shape == (3, 8)
    assert not any(k.endswith("fp8_amax") for k in sd) and "head.fp8_scale" not in sd
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    fresh = convert(Tiny(), "mixed_bfloat16,fp8=hybrid,fp8_history=8,@head={fp8=none}")
    fresh.load_state_dict(torch.load(buf, weights_only=True))  # no pickle of Python objects
    neutral = json.loads(json.dumps(float8.float8_state_dict(model)))
    assert (
        neutral["format"] == "mpx.float8/1"
        and neutral["recipe"] == Float8Recipe(amax_history_len=8).to_dict()
    )
    _, state = core_load_state_dict(neutral)  # the core's loader
    paths = ["qkv.0", "qkv.1", "proj.0", "proj.1", *(f"blocks.{i}.fc{j}" for i in (0, 1) for j in (1, 2))]
    assert set(state.tensors) == {f"{p}.{r}" for p in paths for r in ROLES3}
    assert state.tensors["qkv.0.input"].amax_history[0] > 0
    other = convert(Tiny(), "mixed_bfloat16,fp8=hybrid,fp8_history=8,@head={fp8=none}")
    float8.load_float8_state_dict(other, neutral)
    assert float8.float8_state_dict(other) == neutral == float8.float8_state_dict(fresh)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d["recipe"].update(margin=1), "recipe: the state dict's .* differs from the model's"),
        (lambda d: d["tensors"].pop("qkv.0.grad"), r"missing \['qkv.0.grad'\]"),
        (lambda d: d["tensors"].update(extra=d["tensors"]["qkv.0.grad"]), r"unexpected \['extra'\]"),
        (lambda d: d["tensors"]["qkv.1.grad"].update(scale=-1.0), r"tensors\['qkv.1.grad'\].scale"),
        (
            lambda d: d["tensors"]["qkv.1.grad"].update(role="input"),
            r"tensors\['qkv.1.grad'\].role: expected 'grad'",
        ),
        (lambda d: d.update(format="mpx.scaler/1"), "format: expected 'mpx.float8/1'"),
    ],
)
def test_bad_state_dicts_change_nothing(mutate, match):
    model = convert(Tiny(layers=2), "mixed_bfloat16,fp8=hybrid,fp8_history=4")
    d = float8.float8_state_dict(model)
    for t in d["tensors"].values():
        t["scale"], t["amax_history"] = 2.0, [1.0, 0.0, 0.0, 0.0]
    mutate(d)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(mpx.StateDictError, match=match):
        float8.load_float8_state_dict(model, d)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_one_recipe_per_neutral_dict():
    model = convert(Tiny(), "mixed_bfloat16,fp8=hybrid,@head={fp8_margin=2}")
    with pytest.raises(mpx.StateDictError, match="use 2 different recipes"):
        float8.float8_state_dict(model)


# -- training -----------------------------------------------------------------------------------------
def test_a_small_transformer_trains_under_fp8_hybrid():
    torch.manual_seed(0)
    policy = "mixed_bfloat16,fp8=hybrid,fp8_history=16,@head={fp8=none}"
    model = convert(mpx_torch.prepare(Tiny(vocab=16, d=32), policy), policy)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.arange(16).repeat(8, 2)[:, :12].roll(1, 0)  # a learnable periodic sequence
    losses = []
    for _ in range(60):
        logits = model(data[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), data[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        commit_float8(model)
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses[::10]
    scales = model.blocks[0].fc1.fp8_scale.tolist()
    assert all(s != 1.0 for s in scales)  # every tensor's scale moved off its initial value


# -- replicas ---------------------------------------------------------------------------------------------
REPLICA_WORKER = r"""
import json, math, sys
import torch, torch.distributed as dist
from torch import nn
from mpx_torch import float8

rank, path, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + path, rank=rank, world_size=2)
layer = float8.convert(nn.Linear(4, 2, bias=False), "float32,fp8=hybrid,fp8_history=4")
steps = json.loads(sys.argv[4])[rank]
for a_in, a_g, called in steps:
    if called:
        with torch.no_grad():
            layer.weight.copy_(torch.full((2, 4), 0.5))
        x = torch.zeros(2, 4)
        x[0, 1] = a_in
        g = torch.zeros(2, 2)
        g[1, 0] = a_g
        (layer(x) * g).sum().backward()
    float8.commit_float8(layer)
with open(out, "w") as f:
    json.dump(float8.float8_state_dict(layer), f)
dist.destroy_process_group()
"""


def test_replicas_commit_the_same_scales_from_max_reduced_amaxes(tmp_path):
    import subprocess
    import sys

    steps = [
        [[2.0, 1.0, True], [3.0, math.nan, True], [0.5, 0.25, True], [0.0, 0.0, False]],
        [[5.0, 0.5, True], [1.0, 2.0, True], [0.25, 8.0, False], [7.0, 1.5, True]],
    ]
    script = tmp_path / "worker.py"
    script.write_text(REPLICA_WORKER)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(tmp_path / "init"), str(tmp_path / f"out{r}.json"),
             json.dumps(steps)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for r in (0, 1)
    ]  # fmt: skip
    for p in procs:
        output, _ = p.communicate(timeout=900)  # only catches a hang
        assert p.returncode == 0, output
    got = [json.loads((tmp_path / f"out{r}.json").read_text()) for r in (0, 1)]
    assert got[0] == got[1]  # every replica holds the same scales
    recipe = Float8Recipe(amax_history_len=4)
    state = float8_init(recipe, {r: r for r in ROLES3})
    for s0, s1 in zip(*steps, strict=True):
        per_rank = [{"input": s[0], "weight": 0.5, "grad": s[1]} if s[2] else {} for s in (s0, s1)]
        state = float8_update(recipe, state, mpx.float8.reduce_amaxes(per_rank))
    assert core_load_state_dict(got[0])[1] == state


def test_a_cast_of_the_model_is_caught_and_convert_restores_float32_state():
    model = convert(nn.Sequential(nn.Linear(8, 8)), "bfloat16,fp8=hybrid")
    model.to(torch.bfloat16)
    with pytest.raises(mpx.MPXError, match="FP8 state was cast to torch.bfloat16.*convert.*after casting"):
        model(torch.randn(2, 8, dtype=torch.bfloat16))
    convert(model, "bfloat16,fp8=hybrid")
    assert model[0].fp8_scale.dtype == torch.float32 and model[0].weight.dtype == torch.bfloat16
    assert model(torch.randn(2, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16
    # prepare first, then convert: the FP8 state is created after prepare's casts
    other = mpx_torch.prepare(nn.Sequential(nn.Linear(8, 8)), "bfloat16,fp8=hybrid")
    convert(other, "bfloat16,fp8=hybrid")
    assert other[0].fp8_scale.dtype == torch.float32 and other(torch.randn(2, 8)).dtype == torch.bfloat16


def test_a_tiny_hf_llama_trains_under_fp8_hybrid():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)  # random weights, no download
    policy = "mixed_bfloat16,fp8=hybrid,fp8_history=16,@lm_head={fp8=none}"
    convert(mpx_torch.prepare(model, policy), policy)
    names = [name for name, _ in float8.float8_layers(model)]
    assert len(names) == 14 and "model.layers.1.mlp.down_proj" in names and "lm_head" not in names
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.arange(32).repeat(4, 2)[:, :16]
    losses = []
    for _ in range(30):
        loss = model(input_ids=data, labels=data).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        commit_float8(model)
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < 0.5 * losses[0], losses[::5]
    json.dumps(float8.float8_state_dict(model))  # the neutral dict of a real model is JSON


def test_a_long_trace_with_a_grad_scaler_is_float8_update():
    """300 optimizer steps with spikes, zeros, infs and NaNs; the GradScaler's skips decide the commits.

    An inf or NaN input, or a loss poisoned with inf, poisons the FP8 GEMMs (the clip would otherwise hide an
    inf as +-448 / scale): the gradients are NaN, the scaler skips, nothing commits.
    """
    recipe = Float8Recipe(amax_history_len=16, margin=1)
    layer = convert(nn.Linear(8, 4, bias=False), mpx.Policy(fp8=recipe))
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    scaler = mpx_torch.GradScaler(mpx.ScalerConfig(init_scale=2.0**4, growth_interval=3))
    state = float8_init(recipe, {r: r for r in ROLES3})
    rng = np.random.default_rng(0)
    skips = 0
    for t in range(300):
        a_in = float(np.float32(rng.lognormal(0.0, 1.0)))
        if t % 37 == 5:
            a_in = 1e4  # a spike
        elif t % 23 == 7:
            a_in = 0.0
        elif t % 41 == 11:
            a_in = math.inf  # poisons the GEMM (mpx.float8.fp8_dot's rule): skipped
        elif t % 53 == 13:
            a_in = math.nan
        a_w, a_g = float(np.float32(rng.uniform(0.1, 2.0))), float(np.float32(rng.uniform(0.0, 3.0)))
        scale = scaler.get_scale()
        with torch.no_grad():
            w = torch.zeros(4, 8)
            w[0, 0] = a_w
            layer.weight.copy_(w)
        x = torch.zeros(3, 8)
        x[1, 2] = a_in
        g = torch.zeros(3, 4)
        g[2, 1] = a_g
        poison = t % 29 == 17
        scaler.scale((layer(x) * g).sum() * (math.inf if poison else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        commit_float8(layer, scaler)
        opt.zero_grad()
        skipped = not math.isfinite(a_in) or poison
        assert scaler.state.skipped_steps == skips + skipped, t
        skips += skipped
        grad = float(
            np.float32(a_g) * np.float32(scale)
        )  # the gradient the layer sees carries the loss scale
        state = float8_update(recipe, state, {"input": a_in, "weight": a_w, "grad": grad}, skipped=skipped)
        assert core_load_state_dict(float8.float8_state_dict(layer))[1] == state, t
    assert skips > 10


def test_an_eval_forward_records_no_amax():
    layer = convert(nn.Linear(4, 4), "float32,fp8=hybrid,fp8_history=2")
    _step(layer, 3.0, 1.0, 1.0, k=4, n=4)
    commit_float8(layer)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.eval()
    with torch.no_grad():
        layer(torch.full((2, 4), 100.0))
    commit_float8(layer)
    assert all(torch.equal(v, layer.state_dict()[k]) for k, v in before.items())
    layer.train()
    _step(layer, 100.0, 1.0, 1.0, k=4, n=4)
    commit_float8(layer)
    assert layer.fp8_amax_history[0].tolist() == [100.0, 3.0]


def test_the_docs_example_runs():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "fp8.md").read_text()
    block = text.split("```python\n", 1)[1].split("```", 1)[0]
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("body", nn.Linear(8, 8))
    model.add_module("lm_head", nn.Linear(8, 4))
    namespace = {
        "model": model,
        "opt": torch.optim.SGD(model.parameters(), lr=0.1),
        "data": [torch.randn(2, 8) for _ in range(3)],
        "loss_fn": lambda out: out.float().square().mean(),
    }
    exec(compile(block, "docs/fp8.md", "exec"), namespace)
    assert isinstance(model.body, Float8Linear) and type(model.lm_head) is nn.Linear
    assert model.body.fp8_amax_history[0, :3].gt(0).all()  # three steps committed


def test_prepare_converts_the_linears_an_fp8_policy_names():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
    mpx_torch.prepare(model, "mixed_bfloat16,fp8=hybrid,@2={fp8=none}")
    assert [type(m).__name__ for m in model] == ["Float8Linear", "LayerNorm", "Linear"]
    assert model(torch.randn(2, 8)).dtype == torch.float32
    mpx_torch.prepare(model, "mixed_bfloat16")  # re-prepared without FP8: plain Linears again
    assert [type(m).__name__ for m in model] == ["Linear", "LayerNorm", "Linear"]


def test_commit_reads_the_scalers_public_skip_flag():
    scaler = mpx_torch.GradScaler("mixed_float16")
    assert scaler.last_step_skipped() is None and scaler.updates == 0
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    for bad in (False, True):
        scaler.scale((w * (math.inf if bad else 1.0)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        assert bool(scaler.last_step_skipped()) is bad and scaler.updates == 1 + bad


@pytest.mark.parametrize("where", ["input", "weight", "grad"])
def test_a_non_finite_operand_poisons_the_gemm_as_the_core_does(where):
    """The core's rule (mpx.float8.fp8_dot): an inf operand would be clipped to fp8_max and hide an overflow
    from the loss scaler, so the FP8 GEMM returns NaN and the step is skipped."""
    x, w = np.ones((2, 4), np.float32), np.ones((3, 4), np.float32)
    if where == "input":
        x[0, 1] = np.inf
    elif where == "weight":
        w[2, 0] = np.inf
    assert np.isnan(fp8_dot(x, w.T, 1.0, 1.0)).all() == (where != "grad")
    layer = convert(nn.Linear(4, 3, bias=False), "mixed_bfloat16,fp8=hybrid,fp8_scaling=current")
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(w))
    xt = torch.from_numpy(x).requires_grad_()
    y = layer(xt)
    assert bool(torch.isnan(y).all()) == (where != "grad")
    g = torch.ones_like(y)
    if where == "grad":
        g[1, 1] = math.inf
    y.backward(g)
    assert bool(torch.isnan(xt.grad).all()) and bool(torch.isnan(layer.weight.grad).all())
