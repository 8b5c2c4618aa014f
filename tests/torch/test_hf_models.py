"""Real models (issue 23): Hugging Face GPT-2, Llama, BERT, T5 and ViT from tiny configs under mpx_torch.prepare.

Item 1: the HF ``Trainer`` (default ``TrainingArguments``, CPU) on a prepared GPT-2 keeps the input columns
(it reads ``inspect.signature(model.forward)``) and the loss decreases; PEFT's LoRA wraps a prepared model,
and prepare takes a PEFT-wrapped one.  Item 5: per model, the measurements of the ``models`` conformance
group (conformance/models/torch.py), natively against mpx.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

import mpx
import mpx_torch

transformers = pytest.importorskip("transformers")
from mpx_tools.models import models_of  # noqa: E402
from mpx_tools.models import torch as MT  # noqa: E402

BF16, F32 = torch.bfloat16, torch.float32


class _Rows(torch.utils.data.Dataset):
    """A tiny language-modelling set built in code: repeated token patterns (learnable), one extra column."""

    def __init__(self, n: int = 32, seq: int = 16) -> None:
        gen = torch.Generator().manual_seed(0)
        self.rows = []
        for i in range(n):
            start = int(torch.randint(2, 10, (1,), generator=gen))
            ids = (torch.arange(seq) * start) % (MT.VOCAB - 2) + 2
            self.rows.append({"input_ids": ids, "attention_mask": torch.ones(seq, dtype=torch.long),
                              "labels": ids.clone(), "note": f"row {i}"})  # fmt: skip

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def _collate(rows: list[dict]) -> dict:
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0] if k != "note"}


def test_trainer_keeps_the_columns_and_the_loss_decreases(tmp_path):
    model, _ = MT.build("gpt2")
    model.train()
    mpx_torch.prepare(model, "mixed_bfloat16")
    seen: list[set[str]] = []

    def look(module, args, kwargs):
        seen.append(set(kwargs))

    model.register_forward_pre_hook(look, with_kwargs=True)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=24, learning_rate=3e-3,
        per_device_train_batch_size=8, logging_steps=4, save_strategy="no", seed=0,
    )  # fmt: skip
    assert args.remove_unused_columns  # the default that dropped every column before
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Rows(), data_collator=_collate)
    trainer.train()
    assert seen and all({"input_ids", "attention_mask", "labels"} <= keys for keys in seen), seen[:2]
    assert "input_ids" in trainer._signature_columns
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert len(losses) >= 4 and losses[-1] < 0.9 * losses[0] and losses == sorted(losses, reverse=True), (
        losses
    )
    assert model.transformer.h[0].mlp.c_fc.weight.dtype == F32  # float32 master weights


def _dtypes_seen(model: torch.nn.Module, names: tuple[str, ...]) -> dict[str, torch.dtype]:
    seen: dict[str, torch.dtype] = {}
    for path, sub in model.named_modules():
        if path.endswith(names):

            def keep(mod, args, out, path=path):
                seen[path.split(".")[-1]] = out.dtype

            sub.register_forward_hook(keep)
    return seen


@pytest.mark.parametrize("order", ["prepare_then_peft", "peft_then_prepare"])
def test_peft_lora_and_prepare_compose(order):
    peft = pytest.importorskip("peft")
    model, batch = MT.build("gpt2")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True,
                           task_type="CAUSAL_LM", lora_dropout=0.0)  # fmt: skip
    torch.manual_seed(3)
    if order == "prepare_then_peft":
        wrapped = peft.get_peft_model(mpx_torch.prepare(model, "mixed_bfloat16"), lora)
    else:
        wrapped = mpx_torch.prepare(peft.get_peft_model(model, lora), "mixed_bfloat16")
    seen = _dtypes_seen(wrapped, ("ln_1", "lora_B.default"))
    out = wrapped(**batch)
    assert out.logits.dtype == F32 and torch.isfinite(out.loss)
    assert seen == {"ln_1": F32, "default": BF16}  # the norm in float32, LoRA's matmul in half
    out.loss.backward()
    grads = {n: p.grad for n, p in wrapped.named_parameters() if p.requires_grad}
    assert grads and all("lora_" in n and g is not None and g.dtype == F32 for n, g in grads.items())
    sig = inspect.signature(wrapped.get_base_model().forward)
    assert "input_ids" in sig.parameters and "labels" in sig.parameters


# -- item 5: per model, natively and under mpx ------------------------------------------------------------
#: FLOAT32-class ops torch's CPU autocast computes in bfloat16 in each model (what the findings name).
NATIVE_VIOLATIONS = {"gpt2": ["pow"], "llama": [], "bert": ["layer_norm"], "t5": [], "vit": []}


@pytest.mark.parametrize("name", models_of("torch"))
def test_ops_follow_the_op_table(name):
    model, batch = MT.build(name)
    ours = MT.op_dtypes(MT.runner(model, "mpx"), batch)
    native = MT.op_dtypes(MT.runner(model, "native"), batch)
    assert ours["violations"] == []
    assert native["violations"] == NATIVE_VIOLATIONS[name]
    assert {"linear", "attention"} <= set(ours["half"]) and "cross_entropy" in ours["float32"]
    assert set(ours["half"]) <= set(native["half"])  # mpx lowers nothing torch keeps in float32
    for op in ("linear", "attention", "conv", "matmul"):  # the matmuls: half in both, as often
        assert ours["computed"].get(op) == native["computed"].get(op), op
    if name == "gpt2":  # NewGELU's pow (and what it feeds) in float32 under mpx
        assert ours["computed"]["pow"] == {"float32": 2} and native["computed"]["pow"] == {"bfloat16": 2}


@pytest.mark.parametrize("name", models_of("torch"))
def test_compile_fullgraph_gives_native_counts(name):
    model, batch = MT.build(name)
    batch.pop("labels")
    ours = MT.compile_counts(MT.runner(model, "mpx"), batch)
    native = MT.compile_counts(MT.runner(model, "native"), batch)
    assert (
        ours
        == native
        == {"graphs": 1, "breaks": 0, "fullgraph": True, "recompiles": 0, "same_as_eager": True}
    )


@pytest.mark.parametrize("name", models_of("torch"))
def test_float16_run_skips_the_injected_overflow(name):
    from mpx_tools import models as M

    got = MT.overflow_run(name, "mpx")
    scaler = mpx.LossScaler(mpx.ScalerConfig(**M.OVERFLOW_CONFIG))
    want = []
    for finite in M.OVERFLOW_FLAGS:
        scaler.update(finite)
        want.append(scaler.get_scale())
    assert got == {"scales": want, "skipped": [2], "unchanged_on_skip": True, "losses_finite": True}
    assert MT.overflow_run(name, "native")["scales"] == want  # torch's GradScaler agrees here


@pytest.mark.parametrize("name", models_of("torch"))
def test_logits_close_to_float32(name):
    ours, native = MT.logits_error(name, "mpx"), MT.logits_error(name, "native")
    assert ours["dtype"] == "float32" and native["dtype"] == "bfloat16"
    assert ours["within_tolerance"] and native["within_tolerance"]
    assert 0 < ours["max_abs_error"] <= 1.5 * native["max_abs_error"]


def test_prepared_model_copies_are_independent():
    model, batch = MT.build("llama")
    prepared = mpx_torch.prepare(copy.deepcopy(model), "mixed_bfloat16")
    with torch.no_grad():
        a = prepared(**batch).logits
        b = copy.deepcopy(prepared)(**batch).logits
    assert a.dtype == F32 and torch.equal(a, b)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_gradient_checkpointing_recomputes_under_the_policy(name, reentrant):
    """HF gradient checkpointing reruns each block in backward, outside the root's region: the block enters
    the policy again, so the recomputation matches the forward (torch checks) and the gradients are those
    of the same prepared model without checkpointing, bit for bit."""
    model, batch = MT.build(name)
    model.train()
    for sub in model.modules():
        if isinstance(sub, torch.nn.Dropout):
            sub.p = 0.0
    plain = mpx_torch.prepare(copy.deepcopy(model), "mixed_bfloat16")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    checkpointed = mpx_torch.prepare(copy.deepcopy(model), "mixed_bfloat16")
    grads = []
    for m in (checkpointed, plain):
        for _ in range(2):
            m.zero_grad(set_to_none=True)
            m(**batch).loss.backward()
        grads.append([p.grad for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
