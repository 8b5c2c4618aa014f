"""mpx_torch.optim.attach_policy and its wiring: a policy naming master/update/opt_state keys steps the optimizer
through the PolicyOptimizer in a real Accelerator, HF Trainer, Lightning Trainer and Fabric (1 process, CPU)."""

import copy

import pytest

torch = pytest.importorskip("torch")

import mpx  # noqa: E402
import mpx_torch  # noqa: E402
from mpx_torch.optim import PolicyOptimizer, attach_policy, attached_policy  # noqa: E402


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _batches(n=4):
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 8, generator=gen), torch.randn(8, 1, generator=gen)) for _ in range(n)]


def _comp_nonzero(wrapper, model):
    return any(bool(wrapper.state_of(p)["kahan_comp"].float().abs().sum() > 0) for p in model.parameters())


def test_attach_policy_steps_the_torch_optimizer_as_the_wrapper_does_and_checkpoints():
    policy = "bf16_kahan,opt_state=int8:32"

    def run(model, step, n, batches):
        for x, y in batches[:n]:
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x).float(), y).backward()
            step()

    a = mpx_torch.prepare(_net(), policy)
    opt = torch.optim.AdamW(a.parameters(), lr=1e-2)
    wrapper = attach_policy(opt, policy, seed=3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)  # made after: wraps the attached step
    assert isinstance(opt, torch.optim.Optimizer) and attached_policy(opt) is wrapper
    b = mpx_torch.prepare(_net(), policy)
    ref = PolicyOptimizer(torch.optim.AdamW(b.parameters(), lr=1e-2), policy, seed=3)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref.optimizer, lambda s: 0.5**s)
    batches = _batches()

    def step_a():
        opt.step()
        sched.step()

    def step_b():
        ref.step()
        ref_sched.step()

    run(a, step_a, 2, batches)
    run(b, step_b, 2, batches)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q)
    assert wrapper.steps == 2 and opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.25)
    saved = copy.deepcopy((a.state_dict(), opt.state_dict()))
    assert saved[1]["mpx"]["steps"] == 2 and "exp_avg.q" in saved[1]["mpx"]["tensors"]
    run(a, step_a, 4, batches[2:])
    c = mpx_torch.prepare(_net(), policy)
    c.load_state_dict(saved[0])
    opt_c = torch.optim.AdamW(c.parameters(), lr=1e-2)
    attach_policy(opt_c, policy)
    opt_c.load_state_dict(saved[1])
    sched_c = torch.optim.lr_scheduler.LambdaLR(opt_c, lambda s: 0.5 ** (s + 2))

    def step_c():
        opt_c.step()
        sched_c.step()

    run(c, step_c, 4, batches[2:])
    for p, q in zip(a.parameters(), c.parameters(), strict=True):
        assert torch.equal(p, q)
    with pytest.raises(mpx.StateDictError, match="no 'mpx' entry"):
        opt_c.load_state_dict(torch.optim.AdamW(c.parameters()).state_dict())
    with pytest.raises(mpx.MPXError, match="already attached"):
        attach_policy(opt_c, policy)


def test_accelerate_attach_steps_through_the_policy_optimizer():
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from mpx_torch.accelerate import attach

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        accelerator = Accelerator(cpu=True)
        attach(accelerator, "bf16_kahan,opt_state=int8:32")
        model = _net()
        model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        wrapper = attached_policy(opt.optimizer)
        assert wrapper is not None and str(wrapper.policy).endswith("update=kahan,opt_state=int8:32")
        for x, y in _batches():
            opt.zero_grad()
            accelerator.backward(torch.nn.functional.mse_loss(model(x).float(), y))
            opt.step()
        assert wrapper.steps == 4 and _comp_nonzero(wrapper, model)
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        assert all(wrapper.state_of(p)["exp_avg.q"].dtype == torch.int8 for p in model.parameters())
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_hf_trainer_steps_through_the_policy_optimizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    from accelerate.state import AcceleratorState, GradientState

    from mpx_torch.transformers import MPXTrainer

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0
        )
        model = transformers.GPT2LMHeadModel(config)
        gen = torch.Generator().manual_seed(0)
        rows = []
        for _ in range(8):
            ids = torch.randint(0, 64, (16,), generator=gen)
            rows.append({"input_ids": ids, "attention_mask": torch.ones(16, dtype=torch.long), "labels": ids})
        args = transformers.TrainingArguments(
            str(tmp_path), use_cpu=True, report_to="none", max_steps=3, logging_steps=1, save_strategy="no"
        )
        trainer = MPXTrainer(model=model, args=args, train_dataset=rows, policy="bf16_sr")
        trainer.train()
        wrapper = attached_policy(trainer.optimizer.optimizer)
        assert wrapper is not None and wrapper.policy.update == "stochastic" and wrapper.steps == 3
        assert model.transformer.h[0].attn.c_attn.weight.dtype == torch.bfloat16
        logs = [log for log in trainer.state.log_history if "loss" in log]
        assert len(logs) == 3 and all(log["loss"] == log["loss"] for log in logs)  # finite, logged
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_lightning_trainer_and_fabric_step_through_the_policy_optimizer():
    L = pytest.importorskip("lightning")
    from mpx_torch.lightning import MPXFabricPrecision, MPXPrecision

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self):
            self.opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            return self.opt

    model = Model()
    trainer = L.Trainer(
        plugins=[MPXPrecision("bf16_kahan,opt_state=int8:32")],
        accelerator="cpu",
        devices=1,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, torch.utils.data.DataLoader(_batches(), batch_size=None))
    wrapper = attached_policy(model.opt)
    assert wrapper is not None and wrapper.steps == 4 and _comp_nonzero(wrapper, model.net)
    assert "mpx" in trainer.strategy.optimizers[0].state_dict()

    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[MPXFabricPrecision("bf16_sr")])
    net = fabric.setup_module(_net())
    opt = fabric.setup_optimizers(torch.optim.SGD(net.parameters(), lr=0.1))
    for x, y in _batches(3):
        opt.zero_grad()
        fabric.backward(torch.nn.functional.mse_loss(net(x).float(), y))
        opt.step()
    assert attached_policy(opt.optimizer).steps == 3
    assert all(p.dtype == torch.bfloat16 for p in net.parameters())
    stepped = torch.optim.AdamW(_net().parameters())
    stepped.state[next(iter(stepped.param_groups[0]["params"]))] = {"step": torch.tensor(1.0)}
    with pytest.raises(mpx.MPXError, match="already holds state"):
        MPXFabricPrecision("bf16_sr")._attach_policy([stepped], late=True)
