"""FP8 in Keras (mpx_keras.float8) on this process's Keras backend (#26): quantize's bytes against
the core reference, the FP8 GEMMs against mpx.float8.fp8_dot, TE's lag, a skipped LossScaleOptimizer
step in fit that writes nothing, state dicts, save/load, and a small transformer that trains."""

from __future__ import annotations

import json

import keras
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mpx
import mpx_keras
from mpx import float8 as core
from mpx_keras import _compat, _float8_ops
from mpx_keras import float8 as kf8

BACKEND = keras.config.backend()
EPS32 = float(np.finfo(np.float32).eps)


def host(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


def same_fp8(ref: np.ndarray, got: np.ndarray) -> bool:
    """Equal FP8 values, NaN compared as NaN (backends' NaN bytes differ), signed zeros by their bits."""
    r, g = ref.astype(np.float32), got.astype(np.float32)
    return bool(np.all((np.isnan(r) & np.isnan(g)) | (r.view(np.int32) == g.view(np.int32))))


# -- quantize: bytes equal to the core's -------------------------------------------------------------

f32 = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)
special = st.sampled_from(
    [0.0, -0.0, 1e-45, -1e-45, 1.1754942e-38, 448.0, 449.0, 464.0, 57344.0, 61440.0, 3e38]
)
positive_scale = st.floats(
    min_value=float(np.finfo(np.float32).tiny), max_value=float(np.finfo(np.float32).max), width=32
)


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.one_of(f32, special), min_size=1, max_size=64),
    scale=st.one_of(positive_scale, st.sampled_from([1.0, 224.0, 2.0**-126, 2.0**127, 3.4028235e38])),
    fmt=st.sampled_from(["e4m3", "e5m2"]),
)
def test_quantize_bytes_equal_the_core(values, scale, fmt):
    x = np.asarray(values, np.float32)
    got = host(keras.ops.cast(kf8.quantize(x, scale, fmt), "float32"))
    assert same_fp8(core.quantize(x, scale, fmt), got)
    assert (
        keras.backend.standardize_dtype(kf8.quantize(x, scale, fmt).dtype) == _float8_ops.KERAS_FORMATS[fmt]
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_quantize_half_inputs_as_they_arrive(dtype):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(512) * 10.0 ** rng.integers(-8, 5, 512)).astype(np.float32)  # float16 range
    x = x.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16)
    for fmt in ("e4m3", "e5m2"):
        got = host(keras.ops.cast(kf8.quantize(keras.ops.convert_to_tensor(x, dtype), 3.5, fmt), "float32"))
        assert same_fp8(core.quantize(x.astype(np.float32), 3.5, fmt), got)


# -- the scale rules and the state machine: the core's kernels with the keras.ops table, checked against numpy
# by tests/keras/test_kernel_parity.py (compute_scale, update_tensor, abs_max) ----------------------------------


# -- the layers: GEMMs, lag, state ---------------------------------------------------------------------


def _dense_model(policy, units=(6, 3), in_dim=5, history=4):
    spec = f"{policy},fp8_history={history}" if "fp8=" in policy and "current" not in policy else policy
    with mpx_keras.policy_scope(spec):
        layers = [keras.Input((in_dim,))] + [
            keras.layers.Dense(u, name=f"fc{i + 1}") for i, u in enumerate(units)
        ]
        model = keras.Sequential(layers)
    return mpx_keras.apply_policy(model, spec), mpx.get_policy(spec)


def _gradients(model, x, c):
    """Gradients of sum(model(x) * c) for every trainable variable (FP8 state: its next values)."""
    x = keras.ops.convert_to_tensor(x)
    c = keras.ops.convert_to_tensor(c)
    variables = model.trainable_variables
    if BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = keras.ops.sum(keras.ops.cast(model(x, training=True), "float32") * c)
        return dict(zip([v.path for v in variables], tape.gradient(loss, variables), strict=True))
    if BACKEND == "jax":
        import jax

        values = [v.value for v in variables]
        rest = [v.value for v in model.non_trainable_variables]

        def loss_fn(tv):
            y, _ = model.stateless_call(tv, rest, x, training=True)
            return keras.ops.sum(keras.ops.cast(y, "float32") * c)

        return dict(zip([v.path for v in variables], jax.grad(loss_fn)(values), strict=True))
    for v in variables:
        v.value.grad = None
    loss = keras.ops.sum(keras.ops.cast(model(x, training=True), "float32") * c)
    loss.backward()
    return {v.path: v.value.grad.clone() for v in variables}


def test_forward_and_backward_gemms_match_fp8_dot_and_state_is_te_lagged():
    model, policy = _dense_model("float32,fp8=hybrid", units=(4,), in_dim=8)
    layer = model.layers[0]
    assert isinstance(layer, kf8.Float8Dense) and layer.fp8_recipe == policy.fp8
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((6, 8)) * 3).astype(np.float32)
    c = (rng.standard_normal((6, 4)) * 1e-3).astype(np.float32)
    kernel = host(layer.kernel.value)
    bias = host(layer.bias.value)
    # step 1: every scale is still 1.0 (nothing observed yet)
    y = host(model(x))
    ref = core.fp8_dot(x, kernel, 1.0, 1.0) + bias
    bound = (4 * 8 + 4) * EPS32 * (np.abs(core.quantize(x, 1.0, "e4m3").astype(np.float32))
                                   @ np.abs(core.quantize(kernel, 1.0, "e4m3").astype(np.float32))) + EPS32 * np.abs(ref)  # fmt: skip
    assert np.all(np.abs(y - ref) <= bound)
    grads = _gradients(model, x, c)
    g = {k.rsplit("/", 1)[-1]: host(v) for k, v in grads.items()}
    dx_ref = core.fp8_dot(c, kernel.T, 1.0, 1.0, "e5m2", "e4m3")
    dw_ref = core.fp8_dot(x.T, c, 1.0, 1.0, "e4m3", "e5m2")
    assert np.allclose(g["kernel"], dw_ref, rtol=1e-5, atol=1e-6)
    assert np.allclose(g["bias"], c.sum(0), rtol=1e-6, atol=1e-7)
    # the FP8 variables' "gradients" are what the optimizer writes: the histories with this step's
    # amaxes and the scales this step used (1.0); the state then reads as float8_update's
    recipe = policy.fp8
    state = core.float8_update(
        recipe,
        core.float8_init(recipe, {"fc1.input": "input", "fc1.weight": "weight", "fc1.grad": "grad"}),
        {"fc1.input": np.abs(x).max(), "fc1.weight": np.abs(kernel).max(), "fc1.grad": np.abs(c).max()},
    )
    for role in core.ROLES:
        assert g[f"fp8_{role}_scale"] == np.float32(1.0)
        hist = np.asarray(state.tensors[f"fc1.{role}"].amax_history, np.float32)
        assert g[f"fp8_{role}_amax_history"].tobytes() == hist.tobytes()
    for role, kind, var in layer.fp8_variables():
        var.assign(g[f"fp8_{role}_{kind}"])
    assert kf8.float8_state_dict(model) == core.state_dict(recipe, state)
    del dx_ref  # dgrad is checked through the two-layer model below


def test_dgrad_matches_fp8_dot():
    model, _ = _dense_model("float32,fp8=hybrid", units=(4,), in_dim=8)
    layer = model.layers[0]
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, 8)).astype(np.float32)
    c = (rng.standard_normal((5, 4)) * 1e-2).astype(np.float32)
    kernel = host(layer.kernel.value)
    xt = keras.ops.convert_to_tensor(x)
    ct = keras.ops.convert_to_tensor(c)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            tape.watch(xt)
            loss = keras.ops.sum(model(xt, training=True) * ct)
        dx = host(tape.gradient(loss, xt))
    elif BACKEND == "jax":
        import jax

        tv = [v.value for v in model.trainable_variables]
        ntv = [v.value for v in model.non_trainable_variables]
        dx = host(
            jax.grad(lambda xx: keras.ops.sum(model.stateless_call(tv, ntv, xx, training=True)[0] * ct))(xt)
        )
    else:
        xt.requires_grad_(True)
        keras.ops.sum(model(xt, training=True) * ct).backward()
        dx = host(xt.grad)
    ref = core.fp8_dot(c, kernel.T, 1.0, 1.0, "e5m2", "e4m3")
    assert np.allclose(dx, ref, rtol=1e-5, atol=1e-6)


def test_a_nonfinite_operand_poisons_the_gemm():
    model, _ = _dense_model("float32,fp8=hybrid", units=(3,), in_dim=4)
    x = np.ones((2, 4), np.float32)
    x[0, 1] = np.inf  # the clip would make it 448: the GEMM says NaN so the loss scaler skips
    assert np.isnan(host(model(x))).all()


def _fit_data(rows=32, in_dim=5, out=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, in_dim)).astype(np.float32)
    y = (x @ rng.standard_normal((in_dim, out)) * 0.5).astype(np.float32)
    return x, y


def _fp8_values(model):
    return {f"{path}.{role}.{kind}": host(var.value).copy() for path, layer in kf8.float8_layers(model)
            for role, kind, var in layer.fp8_variables()}  # fmt: skip


def test_fit_commits_with_te_lag_and_a_skipped_step_writes_nothing():
    """In fit (jax: stateless_apply; torch, TF: apply), with mpx's LossScaleOptimizer: a step commits the
    amaxes it observed; a step whose batch holds an inf is skipped and leaves weights, optimizer variables
    and FP8 variables bit-identical."""
    model, policy = _dense_model("mixed_bfloat16,fp8=hybrid")
    opt = mpx_keras.LossScaleOptimizer(
        keras.optimizers.Adam(1e-2), config={"kind": "dynamic", "init_scale": 256.0}
    )
    model.compile(opt, loss="mse")
    x, y = _fit_data(8)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    after_one = _fp8_values(model)
    # step 1 recorded the input's amax (bf16 input): step 2 quantizes with its scale
    a_in = float(np.abs(x.astype(ml_dtypes.bfloat16).astype(np.float32)).max())
    assert after_one["fc1.input.amax_history"][0] == np.float32(a_in)
    sd = kf8.float8_state_dict(model)["tensors"]
    assert sd["fc1.input"]["scale"] == core.compute_scale(policy.fp8, a_in, "e4m3")
    assert after_one["fc1.grad.amax_history"][0] > 0  # the scaled output gradient's amax
    weights = [host(v.value).copy() for v in model.variables]
    inner = [host(v.value).copy() for v in opt.inner_optimizer.variables]
    x_bad = x.copy()
    x_bad[0, 0] = np.inf
    model.fit(x_bad, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    assert opt.state.skipped_steps == 1 and opt.state.steps == 2
    for a, b in zip(weights, [host(v.value) for v in model.variables], strict=True):
        assert a.tobytes() == b.tobytes()
    for a, b in zip(inner, [host(v.value) for v in opt.inner_optimizer.variables], strict=True):
        assert a.tobytes() == b.tobytes()
    for name, value in _fp8_values(model).items():
        assert value.tobytes() == after_one[name].tobytes(), name
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)  # a good step commits again
    assert _fp8_values(model)["fc1.input.amax_history"][1] == np.float32(a_in)


def test_an_accumulation_window_commits_one_update_with_the_max_amax():
    """mpx's LossScaleOptimizer over an inner optimizer with gradient_accumulation_steps=2: the window's
    micro-batches observe different amaxes, the state moves once, as float8_update of their MAX; a
    window with a non-finite micro-batch is skipped whole and commits nothing."""
    model, policy = _dense_model("mixed_bfloat16,fp8=hybrid")
    inner = keras.optimizers.SGD(1e-2, gradient_accumulation_steps=2)
    opt = mpx_keras.LossScaleOptimizer(inner, config={"kind": "dynamic", "init_scale": 256.0})
    model.compile(opt, loss="mse")
    x, y = _fit_data(8)
    x[4:] *= 3.0  # the second micro-batch's input amax is larger
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)
    amaxes = [float(np.abs(x[i : i + 4].astype(ml_dtypes.bfloat16).astype(np.float32)).max()) for i in (0, 4)]
    sd = kf8.float8_state_dict(model)["tensors"]["fc1.input"]
    recipe = policy.fp8
    ref = core.float8_update(recipe, core.float8_init(recipe, {"t": "input"}), {"t": max(amaxes)})
    assert sd["amax_history"] == list(ref.tensors["t"].amax_history)
    assert sd["scale"] == ref.tensors["t"].scale
    before = _fp8_values(model)
    x_bad = x.copy()
    x_bad[5, 0] = np.inf
    model.fit(x_bad, y, batch_size=4, epochs=1, verbose=0, shuffle=False)
    assert opt.state.skipped_steps == 1
    for name, value in _fp8_values(model).items():
        assert value.tobytes() == before[name].tobytes(), name


def test_current_scaling_records_the_steps_scale():
    model, policy = _dense_model("mixed_bfloat16_fp8_current", units=(3,))
    layer = model.layers[0]
    assert [k for _, k, _ in layer.fp8_variables()] == ["scale"] * 3
    model.compile(keras.optimizers.SGD(1e-2), loss="mse")
    x, y = _fit_data(8, out=3)
    kernel = host(layer.kernel.value)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    a_in = float(np.abs(x.astype(ml_dtypes.bfloat16).astype(np.float32)).max())
    assert host(layer.fp8_input_scale.value) == np.float32(core.compute_scale(policy.fp8, a_in, "e4m3"))
    assert host(layer.fp8_weight_scale.value) == np.float32(
        core.compute_scale(policy.fp8, np.abs(kernel).max(), "e4m3")
    )


def test_overrides_keep_layers_out_and_einsum_dense_converts():
    spec = "mixed_bfloat16,fp8=hybrid,@head={fp8=none}"
    with mpx_keras.policy_scope(spec):
        inp = keras.Input((4, 6))
        h = keras.layers.EinsumDense("abc,cd->abd", output_shape=(None, 8), bias_axes="d", name="proj")(inp)
        out = keras.layers.Dense(2, name="head")(h)
        model = keras.Model(inp, out)
    mpx_keras.apply_policy(model, spec)
    assert type(model.get_layer("proj")) is kf8.Float8EinsumDense
    assert type(model.get_layer("head")) is keras.layers.Dense
    assert model.get_layer("head").compute_dtype == "bfloat16"
    y = model(np.ones((2, 4, 6), np.float32))
    assert keras.backend.standardize_dtype(y.dtype) == "float32" and y.shape == (2, 4, 2)
    assert sorted(kf8.float8_state_dict(model)["tensors"]) == ["proj.grad", "proj.input", "proj.weight"]
    with pytest.raises(mpx.MPXError, match="cannot be removed"):
        mpx_keras.apply_policy(model, "mixed_bfloat16")  # a built FP8 layer cannot lose its state


def test_a_layer_converted_before_it_builds_gets_its_state_when_it_builds():
    spec = "mixed_bfloat16,fp8=hybrid,fp8_history=4"
    with mpx_keras.policy_scope(spec):
        model = keras.Sequential([keras.layers.Dense(6, name="a"), keras.layers.Dense(2, name="b")])
    mpx_keras.apply_policy(model, spec)
    assert [type(layer) for layer in model.layers] == [kf8.Float8Dense] * 2
    assert not any(layer.built for layer in model.layers)
    model.compile(keras.optimizers.SGD(1e-2), loss="mse")
    x = np.full((8, 5), 1.5, np.float32)
    model.fit(x, np.ones((8, 2), np.float32), batch_size=8, epochs=1, verbose=0)
    state = kf8.float8_state_dict(model)["tensors"]["a.input"]
    assert state == {
        "role": "input",
        "scale": float(np.float32(448.0 / 1.5)),
        "amax_history": [1.5, 0.0, 0.0, 0.0],
    }


def test_einsum_equations_fp8_cannot_run_raise():
    with pytest.raises(mpx.Float8Error, match="equation"):
        _float8_ops.contraction("abc,cd->ad", 3)  # b summed out of the input only
    assert _float8_ops.contraction("...b,bc->...c", 3) == ("adb,bc->adc", "adc,bc->adb", "adb,adc->bc")


def test_state_dict_round_trip_and_errors():
    model, policy = _dense_model("mixed_bfloat16,fp8=hybrid")
    model.compile(keras.optimizers.SGD(1e-2), loss="mse")
    x, y = _fit_data(8)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    sd = kf8.float8_state_dict(model)
    assert json.loads(json.dumps(sd)) == sd and sd["recipe"] == policy.fp8.to_dict()
    other, _ = _dense_model("mixed_bfloat16,fp8=hybrid")
    kf8.load_float8_state_dict(other, json.loads(json.dumps(sd)))
    assert kf8.float8_state_dict(other) == sd
    before = kf8.float8_state_dict(other)
    bad = json.loads(json.dumps(sd))
    bad["tensors"]["fc2.grad"]["scale"] = -1.0
    with pytest.raises(mpx.StateDictError, match="fc2.grad"):
        kf8.load_float8_state_dict(other, bad)
    bad = json.loads(json.dumps(sd))
    del bad["tensors"]["fc1.input"]
    with pytest.raises(mpx.StateDictError, match="missing"):
        kf8.load_float8_state_dict(other, bad)
    bad = json.loads(json.dumps(sd))
    bad["recipe"]["margin"] = 2
    with pytest.raises(mpx.StateDictError, match="margin"):
        kf8.load_float8_state_dict(other, bad)
    assert kf8.float8_state_dict(other) == before  # all or nothing
    with pytest.raises(mpx.UnsupportedTypeError, match="Keras model or layer"):
        kf8.float8_state_dict({"fc1": None})


def test_saved_with_the_model(tmp_path):
    model, _ = _dense_model("mixed_bfloat16,fp8=hybrid")
    model.compile(keras.optimizers.SGD(1e-2), loss="mse")
    x, y = _fit_data(8)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert [type(layer) for layer in loaded.layers] == [kf8.Float8Dense, kf8.Float8Dense]
    assert kf8.float8_state_dict(loaded) == kf8.float8_state_dict(model)
    assert np.array_equal(host(loaded(x)), host(model(x)))
    weights = tmp_path / "w.weights.h5"
    model.save_weights(weights)
    again, _ = _dense_model("mixed_bfloat16,fp8=hybrid")
    again.load_weights(weights)
    assert kf8.float8_state_dict(again) == kf8.float8_state_dict(model)


def test_a_keras_without_the_layer_tracker_raises_the_version_error():
    """The one private name FP8 layers use to add state to a built layer, gone: one clear error."""
    with pytest.raises(mpx.FrameworkVersionError, match="_tracker"):
        with _compat.unlocked(object()):
            pass


# -- a small transformer trains under fp8=hybrid --------------------------------------------------------


def _transformer(vocab=32, seq=8, dim=16, heads=2, blocks=2):
    inp = keras.Input((seq,), dtype="int32")
    h = keras.layers.Embedding(vocab, dim, name="embed")(inp)
    for i in range(blocks):
        a = keras.layers.LayerNormalization(name=f"b{i}_ln1")(h)
        a = keras.layers.MultiHeadAttention(heads, dim // heads, name=f"b{i}_attn")(
            a, a, use_causal_mask=True
        )
        h = keras.layers.Add()([h, a])
        m = keras.layers.LayerNormalization(name=f"b{i}_ln2")(h)
        m = keras.layers.Dense(4 * dim, activation="gelu", name=f"b{i}_mlp_in")(m)
        m = keras.layers.Dense(dim, name=f"b{i}_mlp_out")(m)
        h = keras.layers.Add()([h, m])
    h = keras.layers.LayerNormalization(name="ln_f")(h)
    out = keras.layers.Dense(vocab, name="head")(h)
    return keras.Model(inp, out)


def test_small_transformer_trains_under_fp8_hybrid():
    keras.utils.set_random_seed(0)
    spec = "mixed_bfloat16,fp8=hybrid,fp8_history=16,@head={fp8=none}"
    with mpx_keras.policy_scope(spec):
        model = _transformer()
    mpx_keras.apply_policy(model, spec)
    layers = dict(kf8.float8_layers(model))
    assert "b0_mlp_in" in layers and "head" not in layers
    assert sum(isinstance(layer, kf8.Float8EinsumDense) for layer in layers.values()) == 8  # q, k, v, o x 2
    opt = mpx_keras.LossScaleOptimizer(keras.optimizers.Adam(3e-3))
    model.compile(opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    start = rng.integers(0, 32, (64, 1))
    seqs = (start + np.arange(9)) % 32  # next token = token + 1
    x, y = seqs[:, :-1].astype("int32"), seqs[:, 1:].astype("int32")
    history = model.fit(x, y, batch_size=16, epochs=6, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < 0.8 * losses[0], losses
    sd = kf8.float8_state_dict(model)
    assert sd["tensors"]["b1_attn.query.weight"]["scale"] != 1.0 and opt.state.skipped_steps == 0
