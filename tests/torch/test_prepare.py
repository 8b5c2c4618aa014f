"""mpx_torch.prepare: storage dtypes, per-submodule compute dtypes (seen by forward hooks), outputs."""

import pickle

import pytest
import torch
from torch import nn

import mpx
import mpx_torch

NAMES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm1d(4)
        self.flat = nn.Flatten()
        self.fc = nn.Linear(32, 16)
        self.ln = nn.LayerNorm(16)
        self.gn = nn.GroupNorm(2, 16)
        self.head = nn.Linear(16, 5)
        self.softmax = nn.LogSoftmax(-1)

    def forward(self, x):
        h = self.flat(torch.relu(self.bn(self.conv(x))))
        h = self.ln(self.fc(h))
        h = self.gn(h)
        return self.softmax(self.head(h))


def _record(model):
    seen = {}

    def hook(name):
        def fn(mod, args, out):
            seen[name] = (NAMES[args[0].dtype], NAMES[out.dtype])

        return fn

    for name, mod in model.named_modules():
        if name:
            mod.register_forward_hook(hook(name))
    return seen


CATEGORY = {"bn": "normalization", "ln": "normalization", "gn": "normalization", "softmax": "softmax"}


@pytest.mark.parametrize("spec", ["mixed_float16", "mixed_bfloat16", "float16", "bfloat16", "float32"])
def test_dtypes_per_submodule(spec, device):
    policy = mpx.get_policy(spec)
    model = mpx_torch.prepare(Net().to(device), policy)
    seen = _record(model)
    x = torch.randn(3, 2, 8, device=device)
    out = model(x)
    assert NAMES[out.dtype] == policy.output_dtype
    for name, mod in model.named_modules():
        if not name or name == "flat":
            continue
        own = policy.for_module(name, mpx_torch.module_category(mod))
        assert own.compute_dtype == (
            "float32" if name in CATEGORY and policy.lowers_precision else policy.compute_dtype
        )
        for p in mod.parameters(recurse=False):
            assert NAMES[p.dtype] == own.param_dtype, name
        for b in mod.buffers(recurse=False):
            if b.is_floating_point():
                assert NAMES[b.dtype] == mpx.widest_dtype([own.param_dtype, own.compute_dtype]), name
        if name in CATEGORY:
            # computes in float32 with its inputs cast up: the output is float32
            assert (
                seen[name][1]
                == own.output_dtype
                == ("float32" if policy.lowers_precision else policy.output_dtype)
            )
        else:  # linear and conv layers return the compute dtype
            assert seen[name][1] == policy.compute_dtype, (name, seen[name])
    assert torch.isfinite(out).all()


def test_mixed_policy_keeps_batchnorm_stats_float32_and_updates_them():
    model = mpx_torch.prepare(Net(), "mixed_bfloat16")
    before = model.bn.running_mean.clone()
    model(torch.randn(3, 2, 8))
    assert model.bn.running_mean.dtype == torch.float32
    assert not torch.equal(before, model.bn.running_mean)


def test_pure_bfloat16_norm_params_half_stats_float32():
    model = mpx_torch.prepare(Net(), "bfloat16")
    assert model.bn.weight.dtype == torch.bfloat16  # the policy's param dtype
    assert model.bn.running_mean.dtype == torch.float32  # the norm computes in float32
    before = model.bn.running_var.clone()
    out = model(torch.randn(3, 2, 8))
    assert out.dtype == torch.bfloat16
    assert not torch.equal(before, model.bn.running_var)
    out.float().sum().backward()
    assert model.bn.weight.grad.dtype == torch.bfloat16 and model.fc.weight.grad.dtype == torch.bfloat16


def test_path_override_and_keep_fp32_none():
    policy = mpx.get_policy("mixed_bfloat16").with_overrides({"head": "float32"})
    model = mpx_torch.prepare(Net(), policy)
    seen = _record(model)
    model(torch.randn(3, 2, 8))
    assert seen["head"] == ("float32", "float32")
    assert seen["fc"][1] == "bfloat16"

    model = mpx_torch.prepare(Net(), "params=float32,compute=bfloat16,output=float32,keep_fp32=none")
    seen = _record(model)
    out = model(torch.randn(3, 2, 8))
    assert seen["ln"][1] == seen["gn"][1] == seen["softmax"][1] == "bfloat16"
    assert out.dtype == torch.float32


def test_half_override_inside_float32_model():
    model = mpx_torch.prepare(Net(), "params=float32,compute=float32,@fc={c=bf16}")
    seen = _record(model)
    out = model(torch.randn(3, 2, 8))
    assert seen["conv"][1] == "float32"
    assert seen["fc"] == ("float32", "bfloat16")
    assert seen["ln"][1] == "float32"  # LayerNorm outside the override: float32 (promotes the bf16 input)
    assert out.dtype == torch.float32


def test_in_place_keeps_parameter_identity_and_returns_module():
    net = Net()
    params = list(net.parameters())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    assert mpx_torch.prepare(net, "bfloat16") is net
    assert all(a is b for a, b in zip(params, net.parameters(), strict=True))
    assert opt.param_groups[0]["params"][0] is net.conv.weight
    assert net.conv.weight.dtype == torch.bfloat16


def test_prepare_again_replaces_the_policy():
    net = mpx_torch.prepare(Net(), "mixed_bfloat16")
    mpx_torch.prepare(net, "mixed_float16")
    seen = _record(net)
    net(torch.randn(3, 2, 8))
    assert seen["fc"][1] == "float16"
    mpx_torch.prepare(net, "float32")
    seen = _record(net)
    net(torch.randn(3, 2, 8))
    assert seen["fc"][1] == "float32"


def test_loss_module_computes_float32():
    loss_fn = mpx_torch.prepare(nn.CrossEntropyLoss(), "mixed_float16")
    logits = torch.randn(4, 5, dtype=torch.float16)
    assert loss_fn(logits, torch.tensor([0, 1, 2, 3])).dtype == torch.float32


def test_nested_outputs_cast_and_float64_left():
    class Multi(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            return {"h": h, "pair": (h, x.double()), "n": 3}

    out = mpx_torch.prepare(Multi(), "params=float32,compute=bfloat16,output=float16")(torch.randn(2, 4))
    assert out["h"].dtype == torch.float16 and out["pair"][0].dtype == torch.float16
    assert out["pair"][1].dtype == torch.float64 and out["n"] == 3


def test_prepared_module_pickles():
    net = mpx_torch.prepare(Net(), "mixed_bfloat16")
    clone = pickle.loads(pickle.dumps(net))
    assert clone(torch.randn(3, 2, 8)).dtype == torch.float32


def test_errors():
    with pytest.raises(mpx.PolicyError):
        mpx_torch.prepare(Net(), "mixed_float17")
    with pytest.raises(mpx.PolicyError, match="nn.Module"):
        mpx_torch.prepare(lambda x: x, "mixed_bfloat16")
    shared = nn.Linear(2, 2)
    seq = nn.Sequential(shared, shared)
    mpx_torch.prepare(seq, "mixed_bfloat16")  # same policy on both paths: fine
    with pytest.raises(mpx.PolicyError, match="shared"):
        mpx_torch.prepare(seq, mpx.get_policy("mixed_bfloat16").with_overrides({"1": "float32"}))
