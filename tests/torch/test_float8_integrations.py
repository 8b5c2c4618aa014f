"""FP8 in the torch training stacks: Lightning (Trainer and Fabric), Accelerate and the HF Trainer commit the
FP8 state after each optimizer step, so it moves exactly when the optimizer state does (CPU, emulated GEMMs).

Each test checks the FP8 buffers against what the step outcomes say: a skipped step leaves them (and the
parameters and optimizer state) bit-identical, an applied step records one amax per tensor, an accumulation
window records one, and the buffers are in the checkpoints.
"""

import copy
import math

import pytest

torch = pytest.importorskip("torch")

import mpx  # noqa: E402
from mpx_torch import float8  # noqa: E402

SMALL = mpx.ScalerConfig(init_scale=2.0**8, growth_interval=1000)
FP16_FP8 = "mixed_float16,fp8=hybrid,fp8_history=16"
BF16_FP8 = "mixed_bfloat16_fp8,fp8_history=16"


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 1))


def _batch(i, inf=False):
    gen = torch.Generator().manual_seed(i)
    x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 1, generator=gen)
    if inf:
        x[0, 0] = math.inf
    return x, y


def _fp8_state(model):
    """Every FP8 buffer that is saved (scales and amax histories), cloned."""
    return {k: v.clone() for k, v in model.state_dict().items() if k.rsplit(".", 1)[-1].startswith("fp8_")}


def _recorded(model):
    """Per FP8 module: how many amaxes its input row recorded (delayed scaling, positive amaxes)."""
    return {path: int((m.fp8_amax_history[0] > 0).sum()) for path, m in float8.float8_layers(model)}


def _assert_same(a, b):
    ta, tb = torch.utils._pytree.tree_flatten(a), torch.utils._pytree.tree_flatten(b)
    assert ta[1] == tb[1]
    for x, y in zip(ta[0], tb[0], strict=True):
        assert (torch.equal(x, y) and x.dtype == y.dtype) if isinstance(x, torch.Tensor) else x == y


# -- Lightning ------------------------------------------------------------------------------------------


def _lightning():
    return pytest.importorskip("lightning")


def _loader(n, inf_at=None):
    return torch.utils.data.DataLoader([_batch(i, i == inf_at) for i in range(n)], batch_size=None)


def _lightning_module():
    L = _lightning()

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _net()
            self.before, self.after = {}, {}

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def on_train_batch_start(self, batch, batch_idx):
            self.before[batch_idx] = copy.deepcopy(
                (self.state_dict(), self.trainer.optimizers[0].state_dict())
            )

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.after[batch_idx] = copy.deepcopy(
                (self.state_dict(), self.trainer.optimizers[0].state_dict())
            )

    return Model()


def _fit(policy, n, inf_at=None, **kwargs):
    L = _lightning()
    from mpx_torch.lightning import MPXPrecision

    module = _lightning_module()
    trainer = L.Trainer(
        plugins=[MPXPrecision(policy, SMALL if policy.startswith("mixed_float16") else None)],
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
    trainer.fit(module, _loader(n, inf_at))
    return trainer, module


def _manual(policy, n, inf_at=None):
    """The same training as a hand-written loop: prepare, GradScaler, commit after each update."""
    import mpx_torch

    net = mpx_torch.prepare(_net(), policy)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    scaler = mpx_torch.GradScaler(SMALL)
    for i in range(n):
        x, y = _batch(i, i == inf_at)
        with mpx_torch.autocast(policy):
            loss = torch.nn.functional.mse_loss(net(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        float8.commit_float8(net, scaler)
        opt.zero_grad()
    return net


def test_lightning_trainer_commits_after_each_step_and_never_on_a_skipped_one(tmp_path):
    trainer, module = _fit(FP16_FP8, 5, inf_at=2)
    assert [p for p, _ in float8.float8_layers(module)] == ["net.0", "net.2"]
    assert trainer.precision_plugin.scaler.state.skipped_steps == 1
    _assert_same(module.before[2], module.after[2])  # parameters, AdamW state and FP8 buffers
    fp8 = _fp8_state(module)
    for i in (0, 1, 3):
        assert not all(torch.equal(module.before[i][0][k], module.after[i][0][k]) for k in fp8)
    assert set(_recorded(module).values()) == {4}  # five steps, one skipped
    # the same as the hand-written loop, bit for bit
    reference = _manual(FP16_FP8, 5, inf_at=2)
    after = {f"net.{k}": v for k, v in reference.state_dict().items()}
    _assert_same(dict(module.state_dict()), after)
    # the FP8 buffers are in the checkpoint, loadable without pickle
    trainer.save_checkpoint(tmp_path / "fp8.ckpt")
    saved = torch.load(tmp_path / "fp8.ckpt", weights_only=True)["state_dict"]
    _assert_same({k: saved[k] for k in fp8}, fp8)


def test_lightning_accumulation_commits_once_per_window():
    _, module = _fit(FP16_FP8, 6, accumulate_grad_batches=3)
    assert set(_recorded(module).values()) == {2}  # six micro-batches, two optimizer steps


def test_lightning_bfloat16_fp8_without_a_scaler_commits_each_step():
    trainer, module = _fit(BF16_FP8, 4)
    assert trainer.precision_plugin.scaler is None  # bf16: no loss scaler, as Lightning's bf16-mixed
    assert set(_recorded(module).values()) == {4}
    assert float(module.net[0].fp8_scale[0]) != 1.0  # the delayed scale moved from its initial 1.0


def test_fabric_commits_after_each_step_and_saves_the_fp8_state(tmp_path):
    L = _lightning()
    from mpx_torch.lightning import MPXFabricPrecision

    plugin = MPXFabricPrecision(FP16_FP8, SMALL)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = fabric.setup_module(_net())
    opt = fabric.setup_optimizers(torch.optim.AdamW(net.parameters(), lr=1e-2))
    for i in range(4):
        x, y = _batch(i, inf=i == 1)
        before = copy.deepcopy(net.state_dict())
        fabric.backward(torch.nn.functional.mse_loss(net(x), y))
        opt.step()
        opt.zero_grad()
        if i == 1:
            _assert_same(before, net.state_dict())
    assert plugin.scaler.state.skipped_steps == 1
    assert set(_recorded(net).values()) == {3}
    fabric.save(tmp_path / "state.ckpt", {"model": net, "precision": plugin})
    saved = torch.load(tmp_path / "state.ckpt", weights_only=True)["model"]
    assert torch.equal(saved["0.fp8_amax_history"], net.module[0].fp8_amax_history)


# -- Accelerate -----------------------------------------------------------------------------------------


@pytest.fixture
def fresh_accelerate():
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_accelerate_skips_commit_nothing_and_accumulation_commits_per_window(
    fresh_accelerate, tmp_path, fused
):
    from accelerate import Accelerator

    from mpx_torch.accelerate import attach

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    scaler = attach(accelerator, FP16_FP8, SMALL)
    net = _net()
    model, opt = accelerator.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2, fused=fused))
    windows = []
    for i in range(8):  # four windows of two micro-batches; the third window holds an inf
        if i % 2 == 0:
            windows.append(copy.deepcopy((model.state_dict(), opt.state_dict())))
        with accelerator.accumulate(model):
            x, y = _batch(i, inf=i == 5)
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
        if i == 5:
            assert accelerator.optimizer_step_was_skipped
            _assert_same(windows[2], (model.state_dict(), opt.state_dict()))
    assert scaler.state.skipped_steps == 1 and scaler.state.steps == 4
    assert set(_recorded(model).values()) == {3}  # three applied windows
    accelerator.save_state(tmp_path / "state")
    saved = _fp8_state(model)
    float8.commit_float8(model)  # nothing observed since the last step: commits change nothing
    for m in model.modules():
        if isinstance(m, float8.Float8Linear):
            m.fp8_scale.fill_(1.0)
    accelerator.load_state(tmp_path / "state")
    _assert_same(_fp8_state(model), saved)


# -- HF Trainer -----------------------------------------------------------------------------------------


def _llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def test_hf_trainer_commits_per_applied_step_and_checkpoints_the_fp8_state(fresh_accelerate, tmp_path):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from mpx_torch.transformers import MPXTrainer

    model = _llama()
    data = torch.arange(32).repeat(8, 2)[:, :16]
    rows = [{"input_ids": r, "labels": r} for r in data]
    args = transformers.TrainingArguments(
        str(tmp_path), use_cpu=True, report_to="none", max_steps=6, logging_steps=1, learning_rate=3e-3,
        save_steps=6, per_device_train_batch_size=4, gradient_accumulation_steps=2,
    )  # fmt: skip
    policy = FP16_FP8 + ",@lm_head={fp8=none}"
    trainer = MPXTrainer(model=model, args=args, train_dataset=rows, policy=policy, scaler_config=SMALL)

    class InfAt(transformers.TrainerCallback):
        """Step 3's gradients non-finite; the state before and after it."""

        armed = False

        def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            self.armed = state.global_step == 3
            if self.armed:
                self.before = copy.deepcopy((model.state_dict(), optimizer.state_dict()))

        def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
            if self.armed:
                self.after = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
            self.armed = False

    inf = InfAt()
    model.model.embed_tokens.weight.register_hook(lambda g: g * math.inf if inf.armed else g)
    trainer.add_callback(inf)
    trainer.train()
    names = [p for p, _ in float8.float8_layers(model)]
    assert len(names) == 14 and "lm_head" not in names
    _assert_same(inf.before, inf.after)  # parameters, AdamW state, FP8 buffers
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert [log["skipped_steps"] for log in logs] == [0, 0, 0, 1, 1, 1]
    assert set(_recorded(model).values()) == {5}  # six windows of two micro-batches, one skipped
    assert logs[-1]["loss"] < logs[0]["loss"]
    saved = load_file(tmp_path / "checkpoint-6" / "model.safetensors")
    for key, value in _fp8_state(model).items():
        assert torch.equal(saved[key], value), key
