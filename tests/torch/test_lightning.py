"""mpx_torch.lightning: MPXPrecision in a real Lightning Trainer, MPXFabricPrecision in a real Fabric (CPU)."""

import copy
import math
import warnings

import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning")

from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

import mpx  # noqa: E402
from mpx_torch.lightning import (  # noqa: E402
    HalfParametersWarning,
    MPXFabricPrecision,
    MPXPrecision,
)

SMALL = mpx.ScalerConfig(init_scale=2.0**8, growth_interval=1000)


def _batches(n=4, inf_at=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 1, generator=gen)
        if i == inf_at:
            x[0, 0] = math.inf
        out.append((x, y))
    return torch.utils.data.DataLoader(out, batch_size=None)  # each item is one batch


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 1))


class Model(L.LightningModule):
    def __init__(self, clip_record=None, fused=False):
        super().__init__()
        self.fused = fused
        self.net = _net()
        self.linear_dtypes = []
        self.net[0].register_forward_hook(lambda m, i, o: self.linear_dtypes.append(o.dtype))
        self.clip_record = [] if clip_record is None else clip_record

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=self.fused)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        before = torch.nn.utils.get_total_norm(grads).item()
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.clip_record.append((before, torch.nn.utils.get_total_norm(grads).item()))


class Snapshots(L.Callback):
    """Parameters and optimizer state before and after each batch (deep copies)."""

    def __init__(self):
        self.before, self.after, self.scales = {}, {}, {}

    @staticmethod
    def _state(trainer, module):
        return copy.deepcopy((module.state_dict(), trainer.optimizers[0].state_dict()))

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.before[batch_idx] = self._state(trainer, module)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.after[batch_idx] = self._state(trainer, module)
        self.scales[batch_idx] = trainer.precision_plugin.scaler.get_scale()


def _trainer(plugin, max_steps, **kwargs):
    return L.Trainer(
        plugins=[plugin],
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def _assert_same(a, b):
    """Bit-identical nested state (tensors compared with torch.equal, NaN-free here)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def test_precision_strings_follow_the_policy():
    for policy, expected in [
        ("mixed_float16", "16-mixed"),
        ("mixed_bfloat16", "bf16-mixed"),
        ("bfloat16", "bf16-true"),
        ("float16", "16-true"),
        ("float32", "32-true"),
    ]:
        assert _trainer(MPXPrecision(policy), 1).precision == expected


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_fit_skips_an_inf_batch_bit_identically(fused):
    snaps, model = Snapshots(), Model(fused=fused)
    plugin = MPXPrecision("mixed_float16", SMALL)
    _trainer(plugin, 4, callbacks=[snaps]).fit(model, _batches(4, inf_at=2))
    assert set(model.linear_dtypes) == {torch.float16}  # the forward ran under the policy
    assert model.net[0].weight.dtype == torch.float32  # float32 master weights
    _assert_same(snaps.before[2], snaps.after[2])  # parameters and optimizer state (step counts too)
    with pytest.raises(AssertionError):
        _assert_same(snaps.before[1], snaps.after[1])  # a finite step moves them
    state = plugin.scaler.state
    assert (state.steps, state.skipped_steps) == (4, 1)
    assert [snaps.scales[i] for i in range(4)] == [256.0, 256.0, 128.0, 128.0]


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_gradient_clip_val_clips_the_unscaled_norm(fused):
    record = []
    model = Model(clip_record=record, fused=fused)
    reference = copy.deepcopy(model.net)  # float32, no scaling: the norm clipping must see
    batch = next(iter(_batches(1)))
    torch.nn.functional.mse_loss(reference(batch[0]), batch[1]).backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]).item()
    _trainer(MPXPrecision("mixed_float16", SMALL), 1, gradient_clip_val=0.05).fit(model, _batches(1))
    ((before, after),) = record
    assert before == pytest.approx(expected, rel=2e-2)  # float16 compute against float32: not 256x
    assert after == pytest.approx(0.05, rel=1e-4)


def test_checkpoint_resume_restores_the_scale(tmp_path):
    grow = mpx.ScalerConfig(init_scale=2.0**4, growth_interval=1)
    plugin = MPXPrecision("mixed_float16", grow)
    trainer = _trainer(plugin, 3)
    trainer.fit(Model(), _batches(3))
    assert plugin.scaler.get_scale() == 2.0**7
    path = tmp_path / "mpx.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)
    assert saved["MPXPrecision"]["format"] == "mpx.scaler/1"

    snaps = Snapshots()
    resumed = MPXPrecision("mixed_float16")  # the default config: init_scale 2**16
    _trainer(resumed, 4, callbacks=[snaps]).fit(Model(), _batches(4), ckpt_path=path)
    assert resumed.scaler.config == grow
    assert snaps.scales == {3: 2.0**8}  # the fourth step grew the restored 2**7
    assert resumed.scaler.state.steps == 4


def test_a_native_mixed_precision_checkpoint_loads_its_scale(tmp_path):
    native = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**5))
    trainer = _trainer(native, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's float16 autocast on CPU warns about speed, nothing else
        trainer.fit(Model(), _batches(2))
    path = tmp_path / "native.ckpt"
    trainer.save_checkpoint(path)
    assert "MixedPrecision" in torch.load(path, weights_only=False)

    snaps = Snapshots()
    plugin = MPXPrecision("mixed_float16")
    _trainer(plugin, 3, callbacks=[snaps]).fit(Model(), _batches(3), ckpt_path=path)
    assert snaps.scales == {2: 2.0**5}
    assert plugin.scaler.config.min_scale is None  # torch's semantics come with torch's dict


def test_bfloat16_fit_without_scaling_and_a_native_checkpoint(tmp_path):
    native = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**5))
    trainer = _trainer(native, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's float16 autocast on CPU warns about speed, nothing else
        trainer.fit(Model(), _batches(1))
    trainer.save_checkpoint(tmp_path / "native.ckpt")

    model, plugin = Model(), MPXPrecision("mixed_bfloat16")
    trainer = _trainer(plugin, 3, accumulate_grad_batches=2)
    trainer.fit(model, _batches(6), ckpt_path=tmp_path / "native.ckpt")
    assert set(model.linear_dtypes) == {torch.bfloat16}
    assert model.net[0].weight.dtype == torch.float32
    assert trainer.global_step == 3
    assert plugin.scaler is None and plugin.state_dict() == {}  # the float16 scale ignored
    assert trainer.precision == "bf16-mixed"


class Manual(Model):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.clipped = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        self.clipped.append(torch.nn.utils.get_total_norm([p.grad for p in self.parameters()]).item())
        opt.step()


def test_manual_optimization_clips_unscaled_and_skips():
    snaps, model = Snapshots(), Manual()
    plugin = MPXPrecision("mixed_float16", SMALL)
    _trainer(plugin, 3, callbacks=[snaps]).fit(model, _batches(3, inf_at=1))
    assert model.clipped[0] == pytest.approx(0.05, rel=1e-4)
    assert model.clipped[2] == pytest.approx(0.05, rel=1e-4)
    _assert_same(snaps.before[1], snaps.after[1])
    assert (plugin.scaler.state.steps, plugin.scaler.state.skipped_steps) == (3, 1)


def test_half_parameters_warn_when_upcast():
    plugin = MPXPrecision("mixed_float16")
    with pytest.warns(HalfParametersWarning, match=r"528 float16 values.*upcast to float32"):
        module = plugin.convert_module(torch.nn.Linear(32, 16).half())
    assert module.weight.dtype == torch.float32
    with warnings.catch_warnings():
        warnings.simplefilter("error", HalfParametersWarning)
        MPXPrecision("bfloat16").convert_module(torch.nn.Linear(4, 4).bfloat16())  # half by policy


def test_fabric_skips_clips_unscaled_and_saves(tmp_path):
    plugin = MPXFabricPrecision("mixed_float16", SMALL)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = fabric.setup_module(_net())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    for i, (x, y) in enumerate(_batches(3, inf_at=1)):
        before = copy.deepcopy(model.state_dict())
        optimizer.zero_grad()
        out = model(x)
        fabric.backward(torch.nn.functional.mse_loss(out, y))
        norm = fabric.clip_gradients(model, optimizer, max_norm=0.05, error_if_nonfinite=False).item()
        assert not math.isfinite(norm) if i == 1 else 0.05 < norm < 10  # unscaled (scaled: 256x)
        optimizer.step()
        if i == 1:
            _assert_same(before, model.state_dict())
    assert (plugin.scaler.state.steps, plugin.scaler.state.skipped_steps) == (3, 1)
    fabric.save(tmp_path / "state", {"model": model, "precision": plugin})
    restored = MPXFabricPrecision("mixed_float16")
    fabric.load(tmp_path / "state", {"model": model, "precision": restored})
    assert restored.scaler.state == plugin.scaler.state



def test_the_docs_examples_run(run_example):
    assert run_example("torch-lightning").splitlines()[-1] == "16-mixed 4 4"
    assert run_example("torch-fabric").splitlines()[-1] == "16-mixed 4"


def test_a_missing_lightning_internal_is_one_clear_error(monkeypatch):
    from lightning.pytorch.plugins.precision import Precision

    monkeypatch.delattr(Precision, "_after_closure")
    with pytest.raises(mpx.FrameworkVersionError, match=r"lightning 2\.\S+ has no Precision\._after_closure"):
        _trainer(MPXPrecision("mixed_float16", SMALL), 1).fit(Model(), _batches(1))


def test_a_lightning_below_the_floor_is_refused(monkeypatch):
    from mpx_torch._integrations import require_library

    monkeypatch.setitem(mpx.versions.MINIMUM_VERSIONS, "lightning", "99.0")
    with pytest.raises(mpx.FrameworkVersionError, match=r"lightning 2\.\S+ is older than mpx supports"):
        require_library("lightning")
