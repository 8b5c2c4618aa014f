"""mpx_torch.accelerate.attach with a real accelerate.Accelerator (CPU)."""

import copy
import math
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

import mpx  # noqa: E402
from mpx_torch.accelerate import HalfParametersWarning, attach  # noqa: E402

SMALL = mpx.ScalerConfig(init_scale=2.0**8, growth_interval=1000)


@pytest.fixture(autouse=True)
def fresh_state():
    """Accelerate's process-wide state singletons, forgotten around each test."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 1))


def _batch(i, inf=False):
    gen = torch.Generator().manual_seed(i)
    x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 1, generator=gen)
    if inf:
        x[0, 0] = math.inf
    return x, y


def _prepare(accelerator, net, fused=False):
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, fused=fused)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    return accelerator.prepare(net, optimizer, scheduler)


def _state(model, optimizer):
    return copy.deepcopy((model.state_dict(), optimizer.state_dict()))


def _assert_same(a, b):
    ta, tb = torch.utils._pytree.tree_flatten(a), torch.utils._pytree.tree_flatten(b)
    assert ta[1] == tb[1]
    for x, y in zip(ta[0], tb[0], strict=True):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def _reference_norm(i):
    net = _net()
    x, y = _batch(i)
    torch.nn.functional.mse_loss(net(x), y).backward()
    return torch.nn.utils.get_total_norm([p.grad for p in net.parameters()]).item()


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_clip_after_an_inf_is_unscaled_and_the_step_is_skipped(fused):
    accelerator = Accelerator(cpu=True)
    scaler = attach(accelerator, "mixed_float16", SMALL)
    net = _net()
    dtypes = []
    net[0].register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    model, optimizer, scheduler = _prepare(accelerator, net, fused)

    norms, lrs = [], []
    for i, inf in enumerate([False, True, False]):
        x, y = _batch(i, inf)
        before = _state(model, optimizer)
        optimizer.zero_grad()
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        norms.append(accelerator.clip_grad_norm_(model.parameters(), 0.05).item())
        if not inf:
            clipped = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
            assert clipped == pytest.approx(0.05, rel=1e-4)
        optimizer.step()
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
        assert accelerator.optimizer_step_was_skipped is inf
        if inf:
            _assert_same(before, _state(model, optimizer))
    assert set(dtypes) == {torch.float16}
    assert norms[0] == pytest.approx(_reference_norm(0), rel=2e-2)  # scaled, it would be 256x
    assert not math.isfinite(norms[1])
    assert norms[2] < 10
    assert lrs == pytest.approx(
        [1e-2 / 2, 1e-2 / 2, 1e-2 / 3], rel=1e-12
    )  # the skipped step did not advance the scheduler
    state = scaler.state
    assert (state.scale, state.steps, state.skipped_steps) == (128.0, 3, 1)


def test_clipping_twice_in_one_step_unscales_once():
    accelerator = Accelerator(cpu=True)
    attach(accelerator, "mixed_float16", SMALL)
    model, _, _ = _prepare(accelerator, _net())
    x, y = _batch(0)
    accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
    first = accelerator.clip_grad_norm_(model.parameters(), math.inf).item()
    second = accelerator.clip_grad_norm_(model.parameters(), math.inf).item()
    assert first == second == pytest.approx(_reference_norm(0), rel=2e-2)


def test_save_state_and_load_state_restore_the_scale(tmp_path):
    accelerator = Accelerator(cpu=True)
    scaler = attach(
        accelerator, mpx.get_policy("mixed_float16"), mpx.ScalerConfig(init_scale=4.0, growth_interval=1)
    )
    model, optimizer, _ = _prepare(accelerator, _net())
    for i in range(3):
        optimizer.zero_grad()
        x, y = _batch(i)
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
    assert scaler.get_scale() == 32.0
    accelerator.save_state(tmp_path / "mpx")

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    restored_accelerator = Accelerator(cpu=True)
    restored = attach(restored_accelerator, "mixed_float16")
    _prepare(restored_accelerator, _net())
    restored_accelerator.load_state(tmp_path / "mpx")
    assert restored.state == scaler.state
    assert restored.config == scaler.config

    native = torch.amp.GradScaler("cpu", init_scale=2.0**5, growth_interval=7)
    native.scale(torch.ones(()))  # the scale tensor exists: state_dict() holds it
    torch.save(native.state_dict(), tmp_path / "mpx" / "scaler.pt")
    restored_accelerator.load_state(tmp_path / "mpx")
    assert restored.get_scale() == 32.0
    assert restored.config.growth_interval == 7


def test_fp16_on_a_cpu_is_an_error_not_silent_float32():
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    assert accelerator.scaler is None  # what Accelerate alone does: float32, without a word
    with pytest.raises(mpx.MPXError, match=r"mixed_precision='fp16'.*train in float32.*mixed_precision='no'"):
        attach(accelerator, "mixed_float16")


def test_misuse_is_refused():
    with pytest.raises(mpx.UnsupportedTypeError, match="accelerate.Accelerator"):
        attach(object(), "mixed_float16")
    accelerator = Accelerator(cpu=True)
    attach(accelerator, "mixed_bfloat16")
    with pytest.raises(mpx.MPXError, match="already attached"):
        attach(accelerator, "mixed_bfloat16")
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    late = Accelerator(cpu=True)
    late.prepare(torch.optim.SGD(_net().parameters(), lr=0.1))
    with pytest.raises(mpx.MPXError, match=r"before accelerator.prepare"):
        attach(late, "mixed_float16")
    with pytest.raises(mpx.PolicyError):
        attach(Accelerator(cpu=True), "mixed_float17")


def test_half_parameters_warn_when_upcast():
    accelerator = Accelerator(cpu=True)
    attach(accelerator, "mixed_bfloat16")
    with pytest.warns(HalfParametersWarning, match=r"bfloat16 values.*upcast to float32"):
        model = accelerator.prepare(_net().bfloat16())
    assert {p.dtype for p in model.parameters()} == {torch.float32}



def test_the_docs_example_runs(run_example):
    lines = run_example("torch-accelerate").splitlines()
    assert len(lines) == 4 and all(line.startswith("norm ") for line in lines)


def test_importing_mpx_torch_imports_no_training_library():
    code = (
        "import sys, mpx_torch; print(sorted({'accelerate', 'lightning', 'transformers'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_missing_accelerate_internal_is_one_clear_error(monkeypatch):
    accelerator = Accelerator(cpu=True)
    monkeypatch.delattr(accelerator, "_models")
    with pytest.raises(mpx.FrameworkVersionError, match=r"accelerate 1\.\S+ has no Accelerator\._models"):
        attach(accelerator, "mixed_float16")
