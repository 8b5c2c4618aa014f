"""mpx_jax.nnx.Optimizer: NNX's optimizer whose step counts applied steps only (issue 25, item 1)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpx
import mpx_jax

nnx = pytest.importorskip("flax.nnx")
from mpx_jax.nnx import Optimizer  # noqa: E402

FLAGS = [True, False, True, True, False, False, True, True]  # finite gradients or not, per step


class Weights(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.zeros(3))


def schedule(count):
    return 0.1 * (count + 1.0)  # a learning rate that names the step it is used at


def loss_fn(model, x):
    return jnp.sum(model.w[...] * x)  # gradient: x


def make(cls, accumulate=1):
    model = Weights()
    tx = mpx_jax.with_loss_scaling(
        optax.sgd(schedule), mpx.ScalerConfig(growth_interval=1000), accumulate=accumulate
    )
    return model, cls(model, tx, wrt=nnx.Param)


def run(cls, flags, accumulate=1):
    model, opt = make(cls, accumulate)
    traces = []

    @nnx.jit
    def train_step(model, opt, x):
        traces.append(1)
        scale = opt.loss_scale if isinstance(opt, Optimizer) else mpx_jax.get_loss_scale(opt)
        grads = nnx.grad(lambda m: scale.scale(loss_fn(m, x)))(model)
        opt.update(model, grads)

    ws, steps = [np.asarray(model.w[...])], []
    for finite in flags:
        train_step(model, opt, jnp.ones(3) if finite else jnp.full(3, jnp.inf, jnp.float32))
        ws.append(np.asarray(model.w[...]))
        steps.append(int(opt.step[...]))
    return model, opt, ws, steps, len(traces)


def test_step_counts_applied_steps_and_the_schedule_sees_them():
    _, opt, ws, steps, traces = run(Optimizer, FLAGS)
    applied = np.cumsum(FLAGS).tolist()
    assert steps == applied and opt.step[...].dtype == jnp.uint32
    assert traces == 1  # one compilation for finite and skipped steps alike
    # each applied step used the learning rate of its applied index: w -= lr(k) * 1
    k = 0
    for finite, before, after in zip(FLAGS, ws[:-1], ws[1:], strict=True):
        if finite:
            np.testing.assert_array_equal(after, before - np.float32(schedule(k)))
            k += 1
        else:
            assert np.array_equal(after.view(np.int32), before.view(np.int32))  # bit-identical
    inner = opt.opt_state.inner_state
    counts = [int(leaf[...]) for leaf in jax.tree_util.tree_leaves(inner, is_leaf=lambda x: isinstance(x, nnx.Variable))
              if isinstance(leaf, nnx.Variable) and leaf[...].dtype == jnp.int32]  # fmt: skip
    assert counts == [sum(FLAGS)]  # the schedule's own count: applied steps only
    state = opt.loss_scale.state
    assert (state.steps, state.skipped_steps) == (len(FLAGS), FLAGS.count(False))


def test_plain_nnx_optimizer_counts_skipped_steps_the_same_params():
    _, _, ws, steps, _ = run(nnx.Optimizer, FLAGS)
    assert steps == list(range(1, len(FLAGS) + 1))  # NNX's own step counts every update
    _, _, ws_mpx, _, _ = run(Optimizer, FLAGS)
    assert all(np.array_equal(a, b) for a, b in zip(ws, ws_mpx, strict=True))  # only step differs


def test_accumulation_counts_applied_windows():
    flags = [True, True, True, False, True, True]  # windows of 2: applied, skipped, applied
    _, opt, _, steps, _ = run(Optimizer, flags, accumulate=2)
    assert steps == [0, 1, 1, 1, 1, 2]
    assert opt.loss_scale.state.steps == 3


def test_loss_scale_property_and_errors():
    _, opt = make(Optimizer)
    assert isinstance(opt.loss_scale, mpx_jax.LossScale) and opt.loss_scale.get_scale() == 2.0**16
    with pytest.raises(mpx.UnsupportedTypeError, match="holds no loss scale.*nnx.Optimizer"):
        Optimizer(Weights(), optax.sgd(0.1), wrt=nnx.Param)
    assert isinstance(opt, nnx.Optimizer)
