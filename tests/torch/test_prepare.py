"""mpx_torch.prepare: storage dtypes, per-submodule compute dtypes (seen by forward hooks), outputs."""

import copy
import inspect
import pickle
import sys
import threading

import pytest
import torch
from torch import nn

import mpx
import mpx_torch

F32 = torch.float32

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
    with pytest.raises(mpx.UnsupportedTypeError, match="expected a torch.nn.Module, got function"):
        mpx_torch.prepare(lambda x: x, "mixed_bfloat16")
    shared = nn.Linear(2, 2)
    seq = nn.Sequential(shared, shared)
    mpx_torch.prepare(seq, "mixed_bfloat16")  # same policy on both paths: fine
    with pytest.raises(mpx.PolicyError, match="shared"):
        mpx_torch.prepare(seq, mpx.get_policy("mixed_bfloat16").with_overrides({"1": "float32"}))


# -- forward as libraries see it (issue 23, item 1) --------------------------------------------------
class Keywords(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.ln = nn.LayerNorm(4)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, scale: float = 1.0
    ):
        h = self.ln(self.fc(input_ids)) * scale
        return {"h": h, "mask": attention_mask}


def test_forward_is_the_class_method_with_its_signature():
    model = Keywords()
    want = inspect.signature(model.forward)
    mpx_torch.prepare(model, "mixed_bfloat16")
    assert inspect.signature(model.forward) == want
    assert list(inspect.signature(model.forward).parameters) == ["input_ids", "attention_mask", "scale"]
    assert inspect.ismethod(model.forward) and model.forward.__func__ is Keywords.forward
    assert model.forward.__self__ is model and "forward" not in model.__dict__
    assert model.ln.forward.__func__ is nn.LayerNorm.forward
    out = model(input_ids=torch.randn(2, 4), attention_mask=torch.ones(2, 4), scale=2.0)
    assert out["h"].dtype == torch.float32 and out["mask"].dtype == torch.float32


def test_region_follows_the_hooks_and_keyword_inputs_are_cast_up():
    """A float32 region casts half keyword inputs too; the hooks others register see the region."""
    seen = {}

    def keep(key, value):  # hooks return None: they only look
        seen[key] = value

    for recompute, ln_in in ((False, torch.float32), (True, torch.bfloat16)):
        model = mpx_torch.prepare(Keywords(), "mixed_bfloat16", recompute=recompute)
        model.ln.register_forward_pre_hook(lambda mod, args: keep("ln_in", args[0].dtype))
        model.ln.register_forward_hook(lambda mod, args, out: keep("ln_out", out.dtype))
        model.register_forward_pre_hook(
            lambda mod, args, kwargs: keep("autocast", torch.is_autocast_enabled("cpu")), with_kwargs=True
        )
        model.fc.register_forward_hook(lambda mod, args, out: keep("fc_out", out.dtype))
        model(input_ids=torch.randn(2, 4))
        # LayerNorm's region casts its input up front, or (recompute) lets F.layer_norm cast it
        assert seen == {"autocast": True, "fc_out": torch.bfloat16, "ln_in": ln_in, "ln_out": torch.float32}
        assert not torch.is_autocast_enabled("cpu")
    norm = mpx_torch.prepare(nn.LayerNorm(4), "mixed_bfloat16")
    assert norm(input=torch.randn(2, 4, dtype=torch.bfloat16)).dtype == torch.float32

    class Custom(nn.Module):  # not one of torch's one-op modules: its region casts keyword inputs up
        mpx_category = "normalization"

        def forward(self, x):
            return x * 2

    assert mpx_torch.prepare(Custom(), "mixed_bfloat16")(x=torch.ones(2, dtype=torch.bfloat16)).dtype == F32


def test_a_forward_that_raises_leaves_no_region_behind():
    class Fails(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            self.fc(x)
            raise KeyError("inside")

    model = mpx_torch.prepare(Fails(), "mixed_bfloat16")
    for _ in range(2):
        with pytest.raises(KeyError, match="inside"):
            model(torch.randn(2, 4))
        assert not torch.is_autocast_enabled("cpu")
        assert (torch.randn(2, 2) @ torch.randn(2, 2)).dtype == torch.float32  # no mode left behind
        assert torch.softmax(torch.randn(2, dtype=torch.bfloat16), -1).dtype == torch.bfloat16


def test_prepare_again_and_copies_keep_one_pair_of_hooks():
    model = Net()
    for spec in ("mixed_bfloat16", "mixed_float16", "mixed_bfloat16"):
        mpx_torch.prepare(model, spec)
    assert len(model._forward_pre_hooks) == len(model._forward_hooks) == 1
    assert len(model.ln._forward_pre_hooks) == 1
    assert mpx_torch.prepare(nn.Linear(2, 2), "float32")._forward_pre_hooks  # a float32 root: a no-op region
    x = torch.randn(3, 2, 8)
    model.eval()
    want = model(x)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert torch.equal(clone(x), want)
        mpx_torch.prepare(clone, "float32")  # the copy's hooks are its own: replaced, the original keeps its
        assert len(clone._forward_pre_hooks) == 1 and clone(x).dtype == torch.float32
        assert torch.equal(model(x), want)  # the original keeps its policy


def test_regions_are_per_thread():
    model = mpx_torch.prepare(Net(), "mixed_bfloat16").eval()
    x = torch.randn(3, 2, 8)
    want = model(x)
    results, barrier = [], threading.Barrier(4)

    def run():
        barrier.wait()
        for _ in range(5):
            results.append(torch.equal(model(x), want))

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert results == [True] * 20


def test_prepared_policy():
    from mpx_torch.prepare import prepared_policy

    model = mpx_torch.prepare(Net(), "mixed_float16")
    assert prepared_policy(model) == mpx.get_policy("mixed_float16")
    assert prepared_policy(model.ln).compute_dtype == "float32"
    assert prepared_policy(model.fc) is None and prepared_policy(Net()) is None


# -- the core's category table (issue 22) -------------------------------------------------------------
def test_categories_come_from_the_core_table():
    from mpx.categories import CATEGORY_CLASSES, resolve_categories

    classes = resolve_categories("torch", nn)
    for category, paths in CATEGORY_CLASSES["torch"].items():
        assert len(classes[category]) == len(paths)  # every name exists in this torch
    assert mpx_torch.module_category(nn.AdaptiveLogSoftmaxWithLoss(8, 10, [4])) == "softmax"
    assert mpx_torch.module_category(nn.InstanceNorm1d(3)) == "normalization"
    assert mpx_torch.module_category(nn.SmoothL1Loss()) == "loss"
    assert mpx_torch.module_category(nn.Linear(2, 2)) is None


def test_mpx_category_names_a_modules_own_category():
    class ScaleNorm(nn.Module):  # a library's own norm (e.g. LlamaRMSNorm): not in torch.nn
        mpx_category = "normalization"

        def __init__(self):
            super().__init__()
            self.g = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return self.g * x / x.norm(dim=-1, keepdim=True)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.norm, self.head = nn.Linear(4, 4), ScaleNorm(), nn.Linear(4, 4)

        def forward(self, x):
            return self.head(self.norm(self.fc(x)))

    seen = {}
    model = mpx_torch.prepare(Model(), "mixed_bfloat16")
    model.norm.register_forward_hook(lambda mod, args, out: seen.update(norm=(args[0].dtype, out.dtype)))
    model.head.register_forward_hook(lambda mod, args, out: seen.update(head=out.dtype))
    model(torch.randn(2, 4))
    assert seen == {"norm": (torch.float32, torch.float32), "head": torch.bfloat16}
    instance = nn.Linear(4, 4)
    instance.mpx_category = "loss"
    assert mpx_torch.module_category(instance) == "loss"
    instance.mpx_category = "norm"
    with pytest.raises(mpx.PolicyError, match="mpx_category 'norm' is not a category"):
        mpx_torch.prepare(instance, "mixed_bfloat16")


def test_missing_dynamo_internal_gives_the_one_error(monkeypatch):
    """prepare reaches dynamo's frame strategy through mpx_torch._compat: a torch without it raises
    mpx.FrameworkVersionError naming it (#22), never a silent change."""
    import torch._dynamo.eval_frame as eval_frame

    prepare_module = sys.modules["mpx_torch.prepare"]  # (mpx_torch.prepare is the function)
    monkeypatch.setattr(prepare_module, "_EAGER_TOP_LEVEL", [])
    monkeypatch.delattr(eval_frame, "set_code_exec_strategy")
    with pytest.raises(mpx.FrameworkVersionError, match="torch._dynamo.eval_frame.set_code_exec_strategy"):
        mpx_torch.prepare(Net(), "mixed_bfloat16")
