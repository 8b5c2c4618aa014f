"""mpx_keras.watch and underflow_stats on this process's backend tensors (the mpx_tf checks were
isinstance(x, tf.Tensor): on jax and torch they checked nothing and reported "finite")."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mpx
import mpx_keras
from mpx.diagnostics import DiagnosticsError, underflow_reference
from mpx_keras.diagnostics import underflow_stats, watch

BACKEND = keras.config.backend()
REPORTED = {"tensorflow": "tf", "jax": "jax", "torch": "torch"}[BACKEND]


class Blowup(keras.layers.Layer):
    """Multiplies by ``factor`` in its compute dtype (float16 overflows past 65504)."""

    def __init__(self, factor, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        return x * keras.ops.cast(self.factor, x.dtype)


def model(factor):
    with mpx_keras.policy_scope("mixed_float16"):
        return keras.Sequential(
            [keras.Input((3,)), keras.layers.Dense(4, name="first"), Blowup(factor, name="blow"),
             keras.layers.Dense(1, name="last")]
        )  # fmt: skip


def test_forward_overflow_is_found_in_its_layer():
    m = model(1e5)
    with watch(m, backward=False, log=False) as w:
        m(np.full((2, 3), 10.0, np.float32))
    report = w.report()
    assert not report.finite and report.origin == "blow" and report.backend == REPORTED
    assert report.first.kind == "forward" and report.first.dtype == "float16"
    assert report.checked == 3  # three layers were actually checked, not zero


def test_a_finite_step_is_finite_and_checked():
    m = model(1.0)
    opt = mpx_keras.LossScaleOptimizer(keras.optimizers.SGD(), mpx.ScalerConfig(init_scale=8.0))
    with watch(m, scaler=opt, backward=False, log=False) as w:
        m(np.ones((2, 3), np.float32))
    report = w.report()
    assert report.finite and report.checked == 3 and report.scale == 8.0


@pytest.mark.skipif(BACKEND == "jax", reason="jax: gradients exist only inside traced functions")
def test_backward_overflow_is_found_where_the_gradient_enters_a_layer():
    m = model(1.0)
    x = np.ones((2, 3), np.float32)
    with watch(m, log=False) as w:
        if BACKEND == "torch":
            out = m(x)
            (keras.ops.sum(keras.ops.cast(out, "float32")) * 1e9).backward()  # float16 gradients overflow
        else:
            import tensorflow as tf

            with tf.GradientTape() as tape:
                out = m(x)
                loss = keras.ops.sum(keras.ops.cast(out, "float32")) * 1e9
            tape.gradient(loss, m.trainable_variables)
    report = w.report()
    assert not report.finite and report.first.kind == "backward"


@pytest.mark.skipif(BACKEND != "jax", reason="jax only")
def test_backward_on_jax_names_the_backend_and_a_traced_step_is_refused():
    import jax

    m = model(1.0)
    with pytest.raises(
        mpx.MPXError, match=r"watch\(backward=True\) is not supported on Keras's 'jax' backend"
    ):
        watch(m, backward=True)
    with watch(m, log=False) as w:  # default: backward=False on jax
        jax.jit(lambda x: m(x))(np.ones((2, 3), np.float32))
    with pytest.raises(DiagnosticsError, match="traced"):
        w.report()


def test_wrong_model_type():
    with pytest.raises(mpx.UnsupportedTypeError, match="model: expected a Keras model or layer"):
        watch("model")


@settings(max_examples=25, deadline=None)
@given(
    exps=st.lists(st.integers(-40, 20), min_size=1, max_size=12),
    zeros=st.integers(0, 3),
    scale_exp=st.integers(-4, 24),
    compute=st.sampled_from(["float16", "bfloat16"]),
    scaled=st.booleans(),
)
def test_underflow_matches_numpy(exps, zeros, scale_exp, compute, scaled):
    rng = np.random.default_rng(len(exps))
    g = (np.sign(rng.standard_normal(len(exps))) * 2.0 ** np.array(exps)).astype(np.float32)
    g[:zeros] = 0
    other = np.array([1e-8, 3e-5, 7.0], np.float32)
    scale = 2.0**scale_exp
    tensors = [keras.ops.convert_to_tensor(g), keras.ops.convert_to_tensor(other)]
    got = underflow_stats(tensors, scale, names=["a", "b"], compute_dtype=compute, scaled=scaled, log=False)
    want = underflow_reference({"a": g, "b": other}, scale=scale, compute_dtype=compute, scaled=scaled)
    assert got == type(got)(**{**want.__dict__, "backend": REPORTED})


def test_underflow_with_optimizer_scale():
    opt = mpx_keras.LossScaleOptimizer(keras.optimizers.SGD(), mpx.ScalerConfig(init_scale=1024.0))
    g = keras.ops.convert_to_tensor(np.array([0.0, 1e-6, 1e-8, 1.0, 2.0, 4.0, 1e-5, 2e-8], np.float32))
    report = underflow_stats([g], opt, names=["w"], log=False)
    (layer,) = report.layers
    assert report.scale == 1024.0
    assert (layer.zero_fraction, layer.subnormal_fraction, layer.lost_fraction) == (3 / 8, 2 / 8, 2 / 8)
