"""Block-scaled Linears on torch (#31 item 3): prepare converts, a tiny transformer trains under mxfp8
and nvfp4, a skipped step changes nothing, and the bytes and scales are the core's."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import mpx
import mpx_torch
from mpx.blocks import PRESETS
from mpx.kernels import blocks as kb
from mpx.kernels.array_ops import NUMPY_OPS
from mpx_torch import blocks
from mpx_torch.blocks import BlockLinear


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, -1)
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)
        x = x + self.out(a @ v)
        return x + self.down(torch.relu(self.up(self.norm2(x))))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 16, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(Block(d), Block(d))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def _batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 16, (8, 9), generator=gen)
    return tokens[:, :-1], (tokens[:, :-1] + 1) % 16  # learn "the next token id" of each token


@pytest.mark.parametrize(
    "spec", ["mixed_bfloat16,fp8=mxfp8", "mixed_bfloat16,fp4=nvfp4", "mixed_bfloat16,fp4=nvfp4_te"]
)
def test_a_two_block_transformer_trains_with_falling_loss(spec: str) -> None:
    torch.manual_seed(0)
    model = mpx_torch.prepare(TinyTransformer(), spec)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 9 and all(type(m) is BlockLinear for m in linears)
    assert all(m.block_recipe == mpx.get_policy(spec).fp8 and m.block_gemm == "emulate" for m in linears)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(12):
        x, y = _batch(gen)
        loss = nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert np.mean(losses[-3:]) < 0.7 * np.mean(losses[:3]), losses


def test_a_skipped_step_changes_nothing() -> None:
    torch.manual_seed(0)
    model = mpx_torch.prepare(TinyTransformer(), "mixed_bfloat16,fp8=mxfp8")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = mpx_torch.GradScaler(mpx.ScalerConfig(init_scale=2.0**8))
    x, y = _batch(torch.Generator().manual_seed(2))

    def step(poison: bool) -> None:
        loss = nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        scaler.scale(loss * (math.inf if poison else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    step(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt_before = {k: {n: t.clone() for n, t in s.items()} for k, s in opt.state_dict()["state"].items()}
    step(True)
    assert scaler.state.skipped_steps == 1
    for key, value in model.state_dict().items():
        assert torch.equal(value.view(torch.uint8), before[key].view(torch.uint8)), key
    for k, s in opt.state_dict()["state"].items():
        for n, t in s.items():
            assert torch.equal(t, opt_before[k][n])


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4", "fp8_blockwise", "mxfp8_rceil"])
def test_bytes_scales_and_gemms_equal_the_core(name: str) -> None:
    recipe = PRESETS[name]
    torch.manual_seed(3)
    layer = blocks.convert(
        nn.Linear(40, 24), f"float32,{'fp4' if recipe.element == 'e2m1' else 'fp8'}={name}"
    )
    x = (torch.randn(6, 40) * 3).requires_grad_()
    for t, role, axis in (
        (x, "input", 1),
        (layer.weight, "weight", 1),
        (layer.weight, "weight", 0),
        (x, "input", 0),
    ):
        got = blocks.quantize(t, recipe, role, axis)
        want = kb.quantize(NUMPY_OPS, t.detach().numpy(), recipe, role, axis)
        assert np.array_equal(got.codes.numpy(), want.codes) and np.array_equal(
            got.scales.numpy().view(np.int32), np.asarray(want.scales).view(np.int32)
        )
    y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy)

    def dq(a: np.ndarray, role: str, axis: int) -> np.ndarray:
        return kb.dequantize(NUMPY_OPS, kb.quantize(NUMPY_OPS, a, recipe, role, axis), recipe, role, axis)

    xn, wn, dyn = x.detach().numpy(), layer.weight.detach().numpy(), dy.numpy()
    np.testing.assert_allclose(y.detach().numpy(), dq(xn, "input", 1) @ dq(wn, "weight", 1).T
                               + layer.bias.detach().numpy(), rtol=1e-5, atol=1e-5)  # fmt: skip
    np.testing.assert_allclose(x.grad.numpy(), dq(dyn, "grad", 1) @ dq(wn, "weight", 0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layer.weight.grad.numpy(), dq(dyn, "grad", 0).T @ dq(xn, "input", 0),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_nvfp4_te_rounds_gradients_stochastically_and_transforms_wgrad_as_the_core() -> None:
    recipe = PRESETS["nvfp4_te"]
    torch.manual_seed(4)
    model = blocks.convert(
        nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 8)), "float32,fp4=nvfp4_te", seed=77
    )
    layer = model[1]
    assert (layer.block_seed, layer.block_index, layer.block_step) == (77, 1, 0)
    x = torch.randn(20, 32)  # M = 20: the Hadamard transform pads it to 32
    grads = []
    for step in range(2):
        h = model[0](x).detach().requires_grad_()
        y = layer(h)
        dy = torch.randn_like(y)
        y.backward(dy)
        assert layer.block_step == step + 1
        hn, wn, dyn = h.detach().numpy(), layer.weight.detach().numpy(), dy.numpy()

        def dq(a: np.ndarray, role: str, axis: int, index: int = 0, step: int = step) -> np.ndarray:
            q = kb.quantize(NUMPY_OPS, a, recipe, role, axis, seed=77, step=step, index=index)
            return kb.dequantize(NUMPY_OPS, q, recipe, role, axis)

        dx = dq(dyn, "grad", 1, 2) @ dq(wn, "weight", 0)
        dw = dq(dyn, "grad", 0, 3).T @ dq(hn, "input", 0)
        np.testing.assert_allclose(h.grad.numpy(), dx, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(layer.weight.grad.numpy(), dw, rtol=1e-5, atol=1e-6)
        other = dq(dyn, "grad", 0, 3, step + 1).T @ dq(hn, "input", 0, step=step + 1)
        assert not np.allclose(dw, other, rtol=1e-5, atol=1e-6)  # the step moves the random bits
        grads.append(layer.weight.grad.clone())
        layer.weight.grad = None
    # still an estimate of the float32 weight gradient (the RHT and the rounding keep the product)
    exact = dy.T @ h.detach()
    assert (grads[-1] - exact).abs().max() < 0.6 * exact.abs().max()
    with torch.no_grad():
        layer(model[0](x))
    assert layer.block_step == 2  # only gradient-enabled calls advance the step
    with pytest.raises(mpx.MPXError, match="seed"):
        blocks.convert(nn.Linear(4, 4), "float32,fp4=nvfp4_te", seed=1.5)


def test_overrides_keep_modules_out_and_reconvert() -> None:
    model = mpx_torch.prepare(TinyTransformer(), "mixed_bfloat16,fp8=mxfp8,@head={fp8=none}")
    assert type(model.head) is nn.Linear and type(model.blocks[0].qkv) is BlockLinear
    blocks.convert(model, "mixed_bfloat16")
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    with pytest.raises(mpx.UnsupportedTypeError, match="torch.nn.Module"):
        blocks.convert("model", "mixed_bfloat16,fp8=mxfp8")


def test_float8_state_dict_of_a_block_model_is_stateless_and_round_trips() -> None:
    from mpx_torch.float8 import float8_state_dict, load_float8_state_dict

    model = mpx_torch.prepare(TinyTransformer(), "mixed_bfloat16,fp4=nvfp4")
    d = float8_state_dict(model)
    assert d["recipe"]["stateless"] is True and d["tensors"] == {} and d["recipe"]["element"] == "e2m1"
    load_float8_state_dict(model, d)
    other = mpx_torch.prepare(TinyTransformer(), "mixed_bfloat16,fp8=mxfp8")
    with pytest.raises(mpx.StateDictError, match="block recipe"):
        load_float8_state_dict(other, d)
