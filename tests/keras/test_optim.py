"""mpx_keras.optim.PolicyOptimizer on this process's Keras backend: the core's reference trace (the one torch's and
optax's wrappers give), int8 Adam state equal to the numpy kernel, a skipped LossScaleOptimizer step, model.fit
(jit_compile on jax), errors."""

import os

import keras
import numpy as np
import optim_parity
import pytest
from hypothesis import given, settings

import mpx
import mpx_keras
from mpx.kernels import NUMPY_OPS, blockwise
from mpx_keras.optim import PolicyOptimizer

BACKEND = os.environ["KERAS_BACKEND"]
ops = keras.ops


def _bits(x):
    return np.asarray(ops.convert_to_numpy(ops.cast(x, "float32")), np.float32).view(np.int32)


def _trace(case, jit=False):
    ws = [keras.Variable(case["w0"][i], dtype="bfloat16", name=f"w{i}") for i in range(2)]
    inner = keras.optimizers.SGD(case["lr"], momentum=case.get("momentum", 0.0))
    opt = PolicyOptimizer(inner, optim_parity.policy_of(case), seed=case["seed"])
    opt.build(ws)
    step = None
    if jit:
        import jax

        step = jax.jit(opt.stateless_apply)
    out = []
    for grads in case["grads"]:
        g = [ops.cast(grads[i], "bfloat16") for i in range(2)]
        if step is None:
            opt.apply(g, ws)
        else:
            new_w, new_opt = step([v.value for v in opt.variables], g, [v.value for v in ws])
            for var, value in zip(ws + opt.variables, list(new_w) + list(new_opt), strict=True):
                var.assign(value)
        comps = [opt.state_of(i).get("kahan_comp") for i in range(2)]
        out.append(([_bits(w) for w in ws], [None if c is None else _bits(c) for c in comps]))
    return out, opt


def _check(case, got):
    for step, ((ws, cs), (want_w, want_c)) in enumerate(
        zip(got, optim_parity.reference_trace(case), strict=True)
    ):
        for i in range(2):
            assert np.array_equal(ws[i], want_w[i].view(np.int32)), (step, i)
            if case["update"] == "kahan":
                assert np.array_equal(cs[i], want_c[i].view(np.int32)), (step, i)


@settings(max_examples=8, deadline=None)
@given(optim_parity.traces())
def test_sgd_trace_is_the_core_reference(case):
    got, opt = _trace(case)
    _check(case, got)
    assert opt.policy_steps == len(case["grads"])


@settings(max_examples=8, deadline=None)
@given(optim_parity.momentum_traces())
def test_momentum_trace_with_stored_state_is_the_core_reference(case):
    """SGD momentum 0.5 with the buffer stored in float32, bfloat16 or int8 blocks: torch's and optax's bits."""
    _check(case, _trace(case)[0])


@pytest.mark.skipif(BACKEND != "jax", reason="jax.jit of stateless_apply is the jax trainer's path")
@settings(max_examples=3, deadline=None)
@given(optim_parity.momentum_traces())
def test_momentum_trace_under_jax_jit(case):
    _check(case, _trace(case, jit=True)[0])


@settings(max_examples=6, deadline=None)
@given(optim_parity.momentum_traces())
def test_neutral_checkpoint_is_the_reference_and_resumes_from_it(case):
    """After k steps the mpx.optim/1 dict equals the numpy reference's (the one torch and optax save too: Keras's
    SGD momentum, -lr * buf, converted); an optimizer that reads the reference's dict continues the trace."""
    k = (len(case["grads"]) + 1) // 2
    ws = [keras.Variable(case["w0"][i], dtype="bfloat16") for i in range(2)]
    opt = PolicyOptimizer(
        keras.optimizers.SGD(case["lr"], momentum=0.5), optim_parity.policy_of(case), seed=case["seed"]
    )
    for grads in case["grads"][:k]:
        opt.apply([ops.cast(grads[i], "bfloat16") for i in range(2)], ws)
    saved = optim_parity.reference_checkpoint(case, k)
    assert optim_parity.equal_checkpoints(opt.neutral_state_dict(), saved)
    trace = optim_parity.reference_trace(case)
    ws = [keras.Variable(trace[k - 1][0][i], dtype="bfloat16") for i in range(2)]
    opt = PolicyOptimizer(keras.optimizers.SGD(case["lr"], momentum=0.5), optim_parity.policy_of(case))
    opt.build(ws)
    opt.load_neutral_state_dict(saved)
    assert opt.seed == case["seed"] and opt.policy_steps == k
    for t in range(k, len(trace)):
        opt.apply([ops.cast(case["grads"][t][i], "bfloat16") for i in range(2)], ws)
        for i in range(2):
            assert np.array_equal(_bits(ws[i]), trace[t][0][i].view(np.int32)), (t, i)
            if case["update"] == "kahan":
                assert np.array_equal(_bits(opt.state_of(i)["kahan_comp"]), trace[t][1][i].view(np.int32))


@pytest.mark.parametrize("policy", ["bf16_kahan,opt_state=int8:32", "bf16_sr,opt_state=bf16"])
def test_neutral_checkpoint_of_adamw_round_trips_and_resumes(policy):
    rng = np.random.default_rng(3)
    w0 = [rng.standard_normal((4, 40)).astype(np.float32), np.zeros(40, np.float32)]
    g = [ops.cast(x * 0.5 + 0.25, "bfloat16") for x in w0]

    def make():
        ws = [keras.Variable(x, dtype="bfloat16") for x in w0]
        opt = PolicyOptimizer(keras.optimizers.AdamW(1e-2), policy, seed=9)
        opt.build(ws)
        return ws, opt

    ws, opt = make()
    for _ in range(2):
        opt.apply(g, ws)
    saved = opt.neutral_state_dict()
    ws2, opt2 = make()
    for v, w in zip(ws2, ws, strict=True):
        v.assign(w)
    opt2.load_neutral_state_dict(saved)
    assert optim_parity.equal_checkpoints(opt2.neutral_state_dict(), saved)
    opt.apply(g, ws)
    opt2.apply(g, ws2)
    for v, w in zip(ws2, ws, strict=True):
        assert np.array_equal(_bits(v), _bits(w))
    assert optim_parity.equal_checkpoints(opt2.neutral_state_dict(), opt.neutral_state_dict())
    with pytest.raises(mpx.StateDictError, match="policy"):
        other = PolicyOptimizer(keras.optimizers.AdamW(1e-2), "bf16_sr")
        other.build(ws2)
        other.load_neutral_state_dict(saved)


def test_int8_adam_state_is_the_numpy_kernel_of_the_float32_moments():
    rng = np.random.default_rng(0)
    w = keras.Variable(rng.standard_normal((5, 13)).astype(np.float32), dtype="float32")
    ref_w = keras.Variable(ops.convert_to_numpy(w), dtype="float32")
    opt = PolicyOptimizer(keras.optimizers.Adam(1e-2), "float32,opt_state=int8:32")
    ref = keras.optimizers.Adam(1e-2)
    g = ops.convert_to_tensor(rng.standard_normal((5, 13)).astype(np.float32))
    opt.apply([g], [w])
    ref.apply([g], [ref_w])
    assert np.array_equal(_bits(w), _bits(ref_w))  # the first step reads zero moments either way
    stored = [(q, a) for _, q, a in opt._stored]
    moments = [v for v in ref.variables if len(v.shape) == 2]
    assert len(stored) == len(moments) == 2
    for (q, a), m in zip(stored, moments, strict=True):
        want_q, want_a = blockwise.quantize(NUMPY_OPS, ops.convert_to_numpy(m).reshape(-1), 32)
        assert np.array_equal(ops.convert_to_numpy(q), want_q)
        assert np.array_equal(ops.convert_to_numpy(a).view(np.int32), want_a.view(np.int32))
        assert keras.backend.standardize_dtype(q.dtype) == "int8" and tuple(q.shape) == (3, 32)


def _model(policy_dtype="bfloat16"):
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, dtype=policy_dtype),
            keras.layers.Dense(2, dtype=policy_dtype),
        ]
    )


def _snapshot(model, opt):
    return [
        ops.convert_to_numpy(ops.cast(v, "float32")).copy()
        for v in model.weights + opt.variables
        if keras.backend.standardize_dtype(v.dtype) != "int8"
    ] + [
        ops.convert_to_numpy(v).copy()
        for v in opt.variables
        if keras.backend.standardize_dtype(v.dtype) == "int8"
    ]


@pytest.mark.parametrize(
    "policy", ["bf16_kahan", "bf16_sr", "bf16_kahan,opt_state=int8:32", "bf16_sr,opt_state=bf16"]
)
def test_a_skipped_loss_scale_step_leaves_everything_bit_identical(policy):
    model = _model()
    opt = mpx_keras.LossScaleOptimizer(
        PolicyOptimizer(keras.optimizers.AdamW(1e-2), policy, seed=7),
        mpx.ScalerConfig(kind="dynamic", init_scale=2.0**8),
    )
    x = np.random.default_rng(1).standard_normal((16, 4)).astype(np.float32)
    inner = opt.inner_optimizer

    def step(factor):
        grads = _grads(model, x, opt, factor)
        opt.apply(grads, model.trainable_variables)

    for _ in range(2):
        step(1.0)
    before = _snapshot(model, inner)
    assert inner.policy_steps == 2
    step(float("inf"))
    assert opt.state.skipped_steps == 1
    after = _snapshot(model, inner)
    assert len(before) == len(after)
    for a, b in zip(before, after, strict=True):
        assert a.tobytes() == b.tobytes()
    assert inner.policy_steps == 2
    step(1.0)
    assert inner.policy_steps == 3


def _grads(model, x, opt, factor):
    """Gradients of ``scale_loss(mean(model(x)**2) * factor)`` on this backend."""
    if BACKEND == "jax":
        import jax

        trainable = [v.value for v in model.trainable_variables]

        def pure(values):
            out, _ = model.stateless_call(values, [v.value for v in model.non_trainable_variables], x)
            return opt.scale_loss(ops.mean(ops.square(ops.cast(out, "float32"))) * factor)

        return jax.grad(pure)(trainable)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = opt.scale_loss(ops.mean(ops.square(ops.cast(model(x), "float32"))) * factor)
        return tape.gradient(loss, model.trainable_variables)
    import torch

    loss = opt.scale_loss(ops.mean(ops.square(ops.cast(model(x), "float32"))) * factor)
    params = [v.value for v in model.trainable_variables]
    return list(torch.autograd.grad(loss, params))


@pytest.mark.parametrize("jit_compile", [False, True], ids=["eager-or-graph", "jit_compile"])
def test_fit_trains_bfloat16_weights(jit_compile):
    if jit_compile and BACKEND != "jax":
        pytest.skip("jit_compile is tested on the jax backend (XLA); torch.compile and TF XLA are not")
    model = _model()
    opt = mpx_keras.LossScaleOptimizer(
        PolicyOptimizer(keras.optimizers.AdamW(1e-2), "bf16_kahan,opt_state=int8:32")
    )
    model.compile(optimizer=opt, loss="mse", jit_compile=jit_compile)
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((32, 4)).astype(np.float32), rng.standard_normal((32, 2)).astype(np.float32)
    before = [ops.convert_to_numpy(ops.cast(v, "float32")) for v in model.trainable_variables]
    hist = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert hist.history["loss"][-1] < hist.history["loss"][0]
    assert opt.inner_optimizer.policy_steps == 8
    ids = [id(v) for v in opt.variables]
    assert len(ids) == len(set(ids))
    for v, b in zip(model.trainable_variables, before, strict=True):
        assert keras.backend.standardize_dtype(v.dtype) == "bfloat16"
        assert not np.array_equal(ops.convert_to_numpy(ops.cast(v, "float32")), b)
    comps = [opt.inner_optimizer.state_of(i)["kahan_comp"] for i in range(4)]
    assert any(np.any(ops.convert_to_numpy(ops.cast(c, "float32")) != 0) for c in comps)


def test_bad_input_raises_mpx_errors():
    with pytest.raises(mpx.PolicyError, match="seed"):
        PolicyOptimizer(keras.optimizers.SGD(), "bf16_sr", seed=-1)
    with pytest.raises(mpx.UnsupportedTypeError, match="inner_optimizer"):
        PolicyOptimizer(mpx_keras.LossScaleOptimizer(keras.optimizers.SGD()), "bf16_sr")
    with pytest.raises(mpx.PolicyError, match="opt_state"):
        PolicyOptimizer(keras.optimizers.SGD(), "bfloat16,opt_state=int4")
    opt = PolicyOptimizer(keras.optimizers.SGD(), "bf16_kahan")
    with pytest.raises(mpx.PolicyError, match="update: kahan writes bfloat16 master weights"):
        opt.build([keras.Variable(np.ones(3, np.float32))])
    with pytest.raises(ValueError, match="apply\\(\\) without trainable_variables needs a built optimizer"):
        PolicyOptimizer(keras.optimizers.SGD(), "bf16_kahan").apply([keras.ops.ones(3, "bfloat16")])


def test_config_round_trips():
    opt = PolicyOptimizer(keras.optimizers.AdamW(3e-3), "bf16_sr", seed=5)
    again = PolicyOptimizer.from_config(opt.get_config())
    assert again.policy == opt.policy and again.seed == 5
    assert isinstance(again.inner_optimizer, keras.optimizers.AdamW)
    assert again.name == opt.name and again.learning_rate is again.inner_optimizer.learning_rate
