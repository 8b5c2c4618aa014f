"""mpx_tf.watch and mpx_tf.underflow_stats on real Keras 3 models.

An overflow is injected in one named layer, in the forward pass or only in the backward pass, and the
report must name that layer; the statistics must match the numpy reference in mpx.diagnostics exactly.
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import mpx
import mpx_tf
from mpx.diagnostics import DiagnosticsError, underflow_reference


def _model(boom, embed=None, head=None):
    keras.utils.set_random_seed(0)
    with mpx_tf.policy_scope("mixed_float16"):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="embed"),
                                  keras.layers.Dense(8, name="boom"), keras.layers.Dense(1, name="head")])  # fmt: skip
    model = mpx_tf.apply_policy(model, "mixed_float16")
    layer = model.get_layer("boom")
    layer.kernel.assign(tf.fill(layer.kernel.shape, boom))
    if embed is not None:
        e = model.get_layer("embed")
        e.kernel.assign(tf.fill(e.kernel.shape, embed))
        e.bias.assign(tf.fill(e.bias.shape, embed))
    if head is not None:
        h = model.get_layer("head")
        h.kernel.assign(tf.fill(h.kernel.shape, head))
    return model


def _step(model, x, scale, w=None):
    opt = mpx_tf.LossScaleOptimizer(keras.optimizers.SGD(0.1), mpx.ScalerConfig(init_scale=scale))
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.cast(model(x), tf.float32))
        scaled = opt.scale_loss(loss)
    grads = tape.gradient(scaled, model.trainable_variables)
    if w is not None:
        w.check_gradients(grads)
    return grads


def test_forward_overflow_is_named():
    model = _model(1e4)
    x = tf.fill((2, 4), 10.0)
    with mpx_tf.watch(model) as w:
        _step(model, x, 2.0**16, w)
    report = w.report()
    assert report.first.kind == "forward"
    assert report.origin == "boom"
    assert report.first.dtype == "float16" and report.first.max_abs == float("inf")
    assert "call" not in model.get_layer("boom").__dict__  # restored on exit


def test_backward_overflow_is_named():
    model = _model(1e3, embed=1e-4, head=1.0)
    x = tf.ones((2, 4))
    opt = mpx_tf.LossScaleOptimizer(keras.optimizers.SGD(0.1), mpx.ScalerConfig(init_scale=2.0**10))
    with mpx_tf.watch(model, scaler=opt) as w:  # the optimizer's get_scale(); a number works too
        grads = _step(model, x, 2.0**10, w)
    report = w.report()
    assert [s for s in report.sites if s.kind == "forward"] == []
    assert report.first.kind == "backward"
    assert report.origin == "boom"
    assert report.scale == 2.0**10
    names = {s.name for s in report.gradient_sites}
    assert names and all(n.startswith("sequential") and "embed" in n for n in names), names
    assert np.isfinite(grads[2].numpy()).all()  # boom's kernel gradient is finite


def test_finite_step_result_unchanged(caplog):
    x = tf.random.stateless_normal((3, 4), seed=(1, 2))
    plain = _step(_model(0.1), x, 2.0**10)
    model = _model(0.1)
    with caplog.at_level(logging.INFO, logger="mpx.diagnostics"), mpx_tf.watch(model) as w:
        watched = _step(model, x, 2.0**10, w)
        report = w.report()
    assert report.finite
    for a, b in zip(plain, watched, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    lines = [r for r in caplog.records if r.name == "mpx.diagnostics"]
    assert len(lines) == 1 and "all finite" in lines[0].getMessage()
    with pytest.raises(mpx.UnsupportedTypeError, match="model: expected a Keras model or layer"):
        mpx_tf.watch(object())


@settings(max_examples=20, deadline=None)
@given(
    exps=st.lists(st.floats(-40, 10), min_size=1, max_size=64),
    zeros=st.integers(0, 5),
    scale_exp=st.integers(0, 24),
    compute=st.sampled_from(["float16", "bfloat16"]),
    scaled=st.booleans(),
)
def test_underflow_matches_numpy(exps, zeros, scale_exp, compute, scaled):
    rng = np.random.default_rng(len(exps))
    g = (np.sign(rng.standard_normal(len(exps))) * 2.0 ** np.array(exps)).astype(np.float32)
    g[:zeros] = 0
    other = np.array([1e-8, 3e-5, 7.0], np.float32)
    scale = 2.0**scale_exp
    got = mpx_tf.underflow_stats([tf.constant(g), tf.constant(other)], scale, names=["a", "b"],
                                 compute_dtype=compute, scaled=scaled, log=False)  # fmt: skip
    want = underflow_reference({"a": g, "b": other}, scale=scale, compute_dtype=compute, scaled=scaled)
    assert got == type(got)(**{**want.__dict__, "backend": "tf"})


def test_underflow_with_optimizer_scale():
    opt = mpx_tf.LossScaleOptimizer(keras.optimizers.SGD(), mpx.ScalerConfig(init_scale=1024.0))
    g = tf.constant([0.0, 1e-6, 1e-8, 1.0, 2.0, 4.0, 1e-5, 2e-8])
    report = mpx_tf.underflow_stats([g], opt, names=["w"], log=False)
    (layer,) = report.layers
    assert report.scale == 1024.0
    assert (layer.zero_fraction, layer.subnormal_fraction, layer.lost_fraction) == (3 / 8, 2 / 8, 2 / 8)
    with pytest.raises(DiagnosticsError, match="names"):
        mpx_tf.underflow_stats([g], 1.0, names=["a", "b"])


def test_graph_mode_step_is_refused_not_reported_finite():
    model = _model(0.1)
    with mpx_tf.watch(model) as w:
        tf.function(lambda x: model(x))(tf.ones((2, 4)))
    with pytest.raises(DiagnosticsError, match="tf.function"):
        w.report()
