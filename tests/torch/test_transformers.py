"""mpx_torch.transformers.MPXTrainer: a real HF Trainer on a tiny GPT-2 (random weights, CPU)."""

import copy
import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from accelerate.state import AcceleratorState, GradientState  # noqa: E402

import mpx  # noqa: E402
from mpx_torch.transformers import HalfParametersWarning, MPXTrainer  # noqa: E402

SMALL = mpx.ScalerConfig(init_scale=2.0**8, growth_interval=1000)
SEQ = 16


@pytest.fixture(autouse=True)
def fresh_state():
    """Accelerate's process-wide state singletons, forgotten around each test."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _gpt2(dtype=torch.float32):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=SEQ, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config).to(dtype)


def _dataset():
    """8 rows (one batch at the default batch size 8), with a column the model does not take."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(8):
        ids = torch.randint(0, 64, (SEQ,), generator=gen)
        rows.append(
            {"input_ids": ids, "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": ids, "row": i}
        )
    return rows


def _args(tmp_path, max_steps, **kwargs):
    # default TrainingArguments apart from the CPU, no reporting, the output folder and step counts
    return transformers.TrainingArguments(
        str(tmp_path), use_cpu=True, report_to="none", max_steps=max_steps, logging_steps=1, **kwargs
    )


def _train_logs(trainer):
    return [log for log in trainer.state.log_history if "loss" in log]


def _reference_grad_norm():
    model = _gpt2()
    batch = transformers.default_data_collator(
        [{k: v for k, v in r.items() if k != "row"} for r in _dataset()]
    )
    model(**batch).loss.backward()
    return torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]).item()


class InfAt(transformers.TrainerCallback):
    """Makes the gradients of step ``step`` (0-based) non-finite, and snapshots that step's state."""

    def __init__(self, model, step):
        self.step, self.armed = step, False
        model.transformer.wte.weight.register_hook(lambda g: g * math.inf if self.armed else g)

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.armed = state.global_step == self.step
        if self.armed:
            self.before = copy.deepcopy((model.state_dict(), optimizer.state_dict()))

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.armed:
            self.after = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
        self.armed = False


def test_trainer_trains_keeps_columns_and_logs_the_unscaled_grad_norm(tmp_path):
    model = _gpt2()
    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(sorted(kw)), with_kwargs=True)
    trainer = MPXTrainer(
        model=model,
        args=_args(tmp_path, 12),
        train_dataset=_dataset(),
        policy="mixed_float16",
        scaler_config=SMALL,
    )
    trainer.train()
    logs = _train_logs(trainer)
    assert {"attention_mask", "input_ids", "labels"} <= set(seen[0])  # kept
    assert "row" not in seen[0]  # dropped, as without mpx
    assert logs[-1]["loss"] < logs[0]["loss"] - 0.01
    assert logs[0]["grad_norm"] == pytest.approx(_reference_grad_norm(), rel=5e-2)  # scaled: 256x
    assert [log["loss_scale"] for log in logs] == [256.0] * 12
    assert [log["skipped_steps"] for log in logs] == [0] * 12
    assert model.transformer.h[0].attn.c_attn.weight.dtype == torch.float32
    assert math.isfinite(trainer.evaluate(_dataset())["eval_loss"])  # evaluation runs under the policy too


def test_a_skipped_step_holds_the_parameters_and_the_scheduler(tmp_path):
    # the default optimizer, adamw_torch_fused, skips inside its kernel: Accelerate alone reports the step as taken
    model = _gpt2()
    trainer = MPXTrainer(
        model=model,
        args=_args(tmp_path, 5),
        train_dataset=_dataset(),
        policy="mixed_float16",
        scaler_config=SMALL,
    )
    inf = InfAt(model, step=2)
    trainer.add_callback(inf)
    trainer.train()
    logs = _train_logs(trainer)
    before, after = inf.before, inf.after
    for key, value in before[0].items():
        assert torch.equal(value, after[0][key]), key
    assert before[1]["state"].keys() == after[1]["state"].keys()
    for index, state in before[1]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, after[1]["state"][index][name]), (index, name)
    assert [log["skipped_steps"] for log in logs] == [0, 0, 1, 1, 1]
    assert [log["loss_scale"] for log in logs] == [256.0, 256.0, 128.0, 128.0, 128.0]
    lrs = [log["learning_rate"] for log in logs]  # read before each step's scheduler step
    assert lrs[3] == lrs[2] > lrs[4] and lrs[1] > lrs[2]
    assert trainer.lr_scheduler.last_epoch == 4  # five steps, one skipped
    assert not math.isfinite(logs[2]["grad_norm"])


def test_resume_from_checkpoint_restores_the_scale(tmp_path):
    grow = mpx.ScalerConfig(init_scale=2.0**4, growth_interval=1)
    full = MPXTrainer(
        model=_gpt2(),
        args=_args(tmp_path / "full", 4, save_steps=2),
        train_dataset=_dataset(),
        policy="mixed_float16",
        scaler_config=grow,
    )
    full.train()
    scales = [log["loss_scale"] for log in _train_logs(full)]
    assert scales == [32.0, 64.0, 128.0, 256.0]
    checkpoint = tmp_path / "full" / "checkpoint-2"
    assert torch.load(checkpoint / "scaler.pt", weights_only=True)["format"] == "mpx.scaler/1"

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    resumed = MPXTrainer(
        model=_gpt2(), args=_args(tmp_path / "resumed", 4), train_dataset=_dataset(), policy="mixed_float16"
    )
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert [log["loss_scale"] for log in _train_logs(resumed) if log["step"] > 2] == scales[2:]
    assert resumed.scaler.config == grow

    native = torch.amp.GradScaler("cpu", init_scale=2.0**5)
    native.scale(torch.ones(()))  # the scale tensor exists: state_dict() holds it
    torch.save(native.state_dict(), checkpoint / "scaler.pt")
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    from_native = MPXTrainer(
        model=_gpt2(), args=_args(tmp_path / "native", 4), train_dataset=_dataset(), policy="mixed_float16"
    )
    from_native.train(resume_from_checkpoint=str(checkpoint))
    assert [log["loss_scale"] for log in _train_logs(from_native) if log["step"] > 2] == [32.0, 32.0]


def test_a_peft_model_trains(tmp_path):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True)
    model = peft.get_peft_model(_gpt2(), config)
    seen = []
    model.get_base_model().register_forward_pre_hook(
        lambda m, a, kw: seen.append(sorted(kw)), with_kwargs=True
    )
    trainer = MPXTrainer(
        model=model,
        args=_args(tmp_path, 3),
        train_dataset=_dataset(),
        policy="mixed_float16",
        scaler_config=SMALL,
    )
    frozen = model.get_base_model().transformer.h[0].attn.c_attn.base_layer.weight.clone()
    trainer.train()
    assert {"attention_mask", "input_ids", "labels"} <= set(seen[0])
    assert [log["skipped_steps"] for log in _train_logs(trainer)] == [0, 0, 0]
    lora = [p for name, p in model.named_parameters() if "lora_" in name]
    assert lora and all(p.dtype == torch.float32 and p.requires_grad for p in lora)
    assert torch.equal(model.get_base_model().transformer.h[0].attn.c_attn.base_layer.weight, frozen)


def test_fp16_or_bf16_arguments_are_errors(tmp_path):
    with pytest.raises(mpx.MPXError, match=r"fp16=True \(on a CPU.*train in float32\).*leave both False"):
        MPXTrainer(model=_gpt2(), args=_args(tmp_path, 1, fp16=True), policy="mixed_float16")
    with pytest.raises(mpx.MPXError, match=r"bf16=True; the mpx policy replaces"):
        MPXTrainer(model=_gpt2(), args=_args(tmp_path, 1, bf16=True), policy="mixed_bfloat16")


def test_half_parameters_warn_when_upcast(tmp_path):
    model = _gpt2(torch.float16)  # as from_pretrained(dtype="auto") loads a float16 checkpoint
    with pytest.warns(HalfParametersWarning, match=r"float16 values.*upcast to float32"):
        MPXTrainer(model=model, args=_args(tmp_path, 1), policy="mixed_float16")
    assert {p.dtype for p in model.parameters()} == {torch.float32}



def test_the_docs_example_runs(run_example):
    assert (
        run_example("torch-transformers").splitlines()[-1] == "[(65536.0, 0), (65536.0, 0)]"
    )
