"""mpx_jax.find_nonfinite and mpx_jax.underflow_stats on real JAX/Flax code.

An overflow is injected in one named Flax layer, in the forward pass or only in the backward pass; the
report must name that layer and its source line.  Underflow figures must match the numpy reference.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mpx
import mpx_jax
from mpx.diagnostics import DiagnosticsError, underflow_reference

flax = pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8, name="embed", dtype=jnp.float16)(x)
        x = nn.Dense(8, name="boom", dtype=jnp.float16)(x)
        return nn.Dense(1, name="head", dtype=jnp.float16)(x)


def _params(boom, embed=None, head=None):
    model = Net()
    params = model.init(jax.random.key(0), jnp.ones((2, 4)))["params"]
    params = jax.tree_util.tree_map(lambda p: p, params)
    params["boom"]["kernel"] = jnp.full_like(params["boom"]["kernel"], boom)
    if embed is not None:
        params["embed"]["kernel"] = jnp.full_like(params["embed"]["kernel"], embed)
        params["embed"]["bias"] = jnp.full_like(params["embed"]["bias"], embed)
    if head is not None:
        params["head"]["kernel"] = jnp.full_like(params["head"]["kernel"], head)
    return model, params


def _scaled_loss(model, scale):
    def loss(params, x):
        return model.apply({"params": params}, x).astype(jnp.float32).mean() * scale

    return loss


def test_forward_overflow_is_named():
    model, params = _params(1e4)
    x = jnp.full((2, 4), 10.0)
    report = mpx_jax.find_nonfinite(jax.grad(_scaled_loss(model, 2.0**16)), params, x, log=False)
    assert not report.finite
    assert report.origin == "Net/boom"
    assert report.first.detail == "dot_general, forward"
    assert report.first.dtype == "float16" and report.first.inf > 0
    assert "linear.py" in report.first.source  # flax's Dense, where the dot_general is written


def test_backward_overflow_is_named():
    # forward finite everywhere; boom's input gradient g @ W^T (W = 1e3, g carrying 2**10) overflows float16
    model, params = _params(1e3, embed=1e-4, head=1.0)
    x = jnp.ones((2, 4))
    loss = _scaled_loss(model, 2.0**10)
    assert np.isfinite(np.asarray(loss(params, x)))
    report = mpx_jax.find_nonfinite(jax.grad(loss), params, x, log=False)
    assert report.origin == "Net/boom"
    assert report.first.detail == "dot_general, backward"
    assert all(s.detail.endswith("backward") for s in report.sites)


def test_named_scope_and_input_and_result_unchanged(caplog):
    def f(x):
        with jax.named_scope("softplus_layer"):
            y = jnp.exp(x)
        return jnp.log1p(y)

    x = jnp.array([1.0, 200.0], jnp.float32)
    with caplog.at_level(logging.INFO, logger="mpx.diagnostics"):
        report = mpx_jax.find_nonfinite(f, x)
    assert report.origin == "softplus_layer" and report.first.detail == "exp, forward"
    assert report.first.source and "test_diagnostics.py" in report.first.source
    lines = [r for r in caplog.records if r.name == "mpx.diagnostics"]
    assert len(lines) == 1 and "softplus_layer" in lines[0].getMessage()
    bad = mpx_jax.find_nonfinite(f, jnp.array([jnp.nan]), log=False)
    assert bad.origin == "input"
    fine = mpx_jax.find_nonfinite(jax.jit(f), jnp.array([1.0]), log=False)
    assert fine.finite and fine.checked >= 2
    with pytest.raises(DiagnosticsError, match="fn"):
        mpx_jax.find_nonfinite(3, x)


@settings(max_examples=25, deadline=None)
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
    grads = {"a": jnp.asarray(g), "b": {"c": jnp.asarray(other)}}
    got = mpx_jax.underflow_stats(grads, scale, compute_dtype=compute, scaled=scaled, log=False)
    want = underflow_reference({"['a']": g, "['b']['c']": other}, scale=scale, compute_dtype=compute,
                               scaled=scaled)  # fmt: skip
    assert got == type(got)(**{**want.__dict__, "backend": "jax"})


def test_underflow_with_loss_scale():
    ls = mpx_jax.LossScale.create(mpx.ScalerConfig(init_scale=1024.0))
    grads = {"w": jnp.array([0.0, 1e-6, 1e-8, 1.0, 2.0, 4.0, 1e-5, 2e-8], jnp.float32)}
    report = mpx_jax.underflow_stats(grads, ls, log=False)
    (layer,) = report.layers
    assert report.scale == 1024.0
    assert (layer.zero_fraction, layer.subnormal_fraction, layer.lost_fraction) == (3 / 8, 2 / 8, 2 / 8)
    assert "too low" in report.advice


def test_find_nonfinite_takes_the_scaler_keyword_like_watch():
    ls = mpx_jax.LossScale.create(mpx.ScalerConfig(init_scale=2.0**10))
    for scaler, want in ((ls, 1024.0), (512.0, 512.0), (jnp.float32(8.0), 8.0), (None, None)):
        report = mpx_jax.find_nonfinite(
            lambda x: jnp.log(x), jnp.array([0.0, -1.0]), scaler=scaler, log=False
        )
        assert report.scale == want and report.first.detail == "log, forward"
    with pytest.raises(mpx.diagnostics.DiagnosticsError, match="scale: expected a positive"):
        mpx_jax.find_nonfinite(jnp.exp, jnp.ones(2), scaler=-1.0, log=False)
    grads = {"w": jnp.full((4,), 2.0**-20)}
    by_object = mpx_jax.underflow_stats(grads, ls, scaled=False, log=False)
    assert by_object.scale == 1024.0
    assert by_object == mpx_jax.underflow_stats(grads, 1024.0, scaled=False, log=False)


def test_source_lines_and_bind_need_their_jax_internals(monkeypatch):
    """Mutation: find_nonfinite reaches JAX's source info only through mpx_jax._compat."""
    from jax._src import source_info_util

    monkeypatch.delattr(source_info_util, "summarize")
    with pytest.raises(mpx.FrameworkVersionError, match="source_info_util.summarize.*find_nonfinite"):
        mpx_jax.find_nonfinite(lambda x: jnp.log(x), jnp.array([-1.0]), log=False)
