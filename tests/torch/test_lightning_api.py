"""mpx_torch.lightning as a drop-in for Lightning's ``MixedPrecision`` API (issue #32 item 5), on real Lightning.

The attributes and behaviours code written against ``MixedPrecision`` reads: ``device``,
``autocast_context_manager()``, ``scaler is None`` without loss scaling, a scaler refused with
bf16, Fabric's ``convert_input``/``convert_output``.  Lightning's own tests, run against these
plugins, are tests/torch/test_lightning_vendored.py.
"""

import math

import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning")

import mpx  # noqa: E402
from mpx_torch import GradScaler  # noqa: E402
from mpx_torch.lightning import MPXFabricPrecision, MPXPrecision  # noqa: E402

PLUGINS = (MPXPrecision, MPXFabricPrecision)


@pytest.mark.parametrize("cls", PLUGINS)
def test_device_is_lightnings_attribute(cls):
    assert cls("mixed_float16", device="cpu").device == "cpu"
    assert cls("mixed_bfloat16", device=torch.device("cuda", 0)).device == "cuda:0"
    assert cls("mixed_bfloat16").device == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("cls", PLUGINS)
def test_device_errors_name_the_field(cls):
    with pytest.raises(mpx.MPXError, match=r"^device: 'gpu0' is not a torch device"):
        cls("mixed_float16", device="gpu0")
    with pytest.raises(mpx.MPXError, match=r"^device: pass either device= .* or device_type="):
        cls("mixed_float16", device="cpu", device_type="cpu")


@pytest.mark.parametrize("cls", PLUGINS)
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "bf16-mixed", "float32", "bf16-true"])
def test_no_scaler_without_loss_scaling(cls, policy):
    plugin = cls(policy)
    assert plugin.scaler is None
    assert plugin.state_dict() == {}
    plugin.load_state_dict({"format": "mpx.scaler/1"})  # nothing to load into: ignored, as Lightning's


@pytest.mark.parametrize("cls", PLUGINS)
def test_float16_has_the_mpx_scaler(cls):
    plugin = cls("16-mixed")
    assert isinstance(plugin.scaler, GradScaler)
    assert plugin.scaler.get_scale() == 2.0**16
    assert cls("mixed_bfloat16", config=mpx.ScalerConfig()).scaler.get_scale() == 2.0**16  # asked for


@pytest.mark.parametrize("cls", PLUGINS)
def test_a_given_scaler_is_used_and_refused_with_bf16(cls):
    scaler = GradScaler(mpx.ScalerConfig(init_scale=2.0**4))
    assert cls("mixed_float16", scaler=scaler).scaler is scaler
    with pytest.raises(mpx.MPXError, match=r"^scaler: precision='bf16-mixed' does not use a loss scaler"):
        cls("mixed_bfloat16", scaler=scaler)
    with pytest.raises(mpx.MPXError, match=r"^scaler: expected an mpx_torch.GradScaler .* got GradScaler"):
        cls("mixed_float16", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(mpx.MPXError, match=r"^scaler: pass either scaler= .* or config="):
        cls("mixed_float16", mpx.ScalerConfig(), scaler=scaler)


@pytest.mark.parametrize("cls", PLUGINS)
def test_autocast_context_manager_is_the_policy_without_the_cache(cls):
    plugin = cls("mixed_bfloat16", device="cpu")
    linear = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    with plugin.autocast_context_manager():
        assert torch.is_autocast_enabled("cpu") and not torch.is_autocast_cache_enabled()
        y = linear(x)
        probs = torch.softmax(y, -1)  # the op table: softmax stays in float32
        with torch.no_grad():
            linear(x)
        loss = linear(x).float().sum()
    assert (y.dtype, probs.dtype) == (torch.bfloat16, torch.float32)
    loss.backward()  # no_grad inside the region did not poison a cached weight cast
    assert x.grad is not None and linear.weight.grad.dtype == torch.float32


class _Probe(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.seen = []

    def forward(self, x, ids):
        self.seen.append((x.dtype, ids.dtype))
        return self.linear(x)


@pytest.mark.parametrize(("policy", "half"), [("mixed_bfloat16", torch.bfloat16), ("mixed_float16", torch.float16)])
def test_fabric_casts_inputs_to_compute_and_outputs_to_the_policys_output(policy, half):
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[MPXFabricPrecision(policy)])
    module = fabric.setup_module(_Probe())
    out = module(torch.randn(3, 4, dtype=torch.float64), torch.arange(3))
    assert module.module.seen == [(half, torch.int64)]  # floating inputs in the compute dtype, ints untouched
    assert out.dtype == torch.float32  # the policy's output dtype
    assert module.module.linear.weight.dtype == torch.float32  # float32 master weights


def test_sixteen_mixed_on_cpu_computes_in_float16():
    """Lightning's connector turns ``precision="16-mixed"`` on a CPU into bf16-mixed (with a warning);
    an mpx plugin keeps the policy it was given: float16 autocast, which torch supports on CPUs."""

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)
            self.dtypes = []

        def training_step(self, batch, batch_idx):
            out = self.net(batch)
            self.dtypes.append(out.dtype)
            return out.float().pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    plugin = MPXPrecision("16-mixed")
    trainer = L.Trainer(
        accelerator="cpu", devices=1, plugins=[plugin], max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    model = Model()
    trainer.fit(model, torch.utils.data.DataLoader(torch.randn(2, 4), batch_size=1))
    assert trainer.precision == "16-mixed" and plugin.device == "cpu"
    assert model.dtypes == [torch.float16, torch.float16]
    assert plugin.scaler.state.steps == 2 and math.isfinite(plugin.scaler.get_scale())
