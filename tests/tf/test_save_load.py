"""keras.models.load_model restores a model saved after apply_policy exactly, without apply_policy again."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import mpx
import mpx_tf
from mpx_tf.dtype_policy import choices_of, mpx_name, parse_name

L = keras.layers


@keras.saving.register_keras_serializable("mpx_tests")
class Scores(L.Layer):
    """keras.ops inside a custom layer: matmul in half, softmax and log in float32 under mpx."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], shape[-1]), initializer="glorot_uniform")

    def call(self, x):
        return keras.ops.log(keras.ops.softmax(keras.ops.matmul(x, self.w), axis=-1) + 1e-3)


def _sequential():
    return keras.Sequential(
        [
            keras.Input((8,)),
            L.Dense(16, name="d1"),
            L.LayerNormalization(name="ln"),
            L.Activation("gelu", name="gelu"),
            Scores(name="scores"),
            L.Dense(4, name="d2"),
        ]
    )


def _functional():
    inp = keras.Input((8,))
    h = L.Dense(16, name="d1")(inp)
    a = L.LayerNormalization(name="ln")(h)
    b = L.Activation("gelu", name="gelu")(h)
    h = L.Add(name="add")([a, b])
    h = Scores(name="scores")(h)
    return keras.Model(inp, [L.Dense(4, name="d2")(h), L.Softmax(name="probs")(h)])


BUILDERS = {"sequential": _sequential, "functional": _functional}


def _outputs(model, x):
    return [t.numpy() for t in keras.tree.flatten(model(x))]


@pytest.mark.parametrize("kind", list(BUILDERS))
@pytest.mark.parametrize("spec", ["mixed_float16", "mixed_bfloat16"])
def test_saved_and_loaded_models_compute_bit_identically(kind, spec, tmp_path):
    keras.utils.set_random_seed(0)
    with mpx_tf.policy_scope(spec):
        model = BUILDERS[kind]()
    mpx_tf.apply_policy(model, spec)
    x = np.random.default_rng(0).standard_normal((5, 8)).astype("float32") * 3
    want = _outputs(model, x)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)  # no apply_policy
    got = _outputs(loaded, x)
    assert [a.dtype for a in got] == [a.dtype for a in want] == [np.float32] * len(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    for layer in model.layers:
        if isinstance(layer, L.InputLayer):  # Keras saves an input layer's dtype, not its policy
            continue
        other = loaded.get_layer(layer.name)
        assert (other.dtype_policy.name, other.compute_dtype, other.autocast) == (
            layer.dtype_policy.name,
            layer.compute_dtype,
            layer.autocast,
        )
    # predict and a traced call agree too
    np.testing.assert_array_equal(keras.tree.flatten(loaded.predict(x, verbose=0))[0], want[0])
    traced = keras.tree.flatten(tf.function(loaded)(x))
    np.testing.assert_array_equal(traced[0].numpy(), want[0])


def test_without_mpx_names_keras_loses_the_choices(tmp_path):
    """What the names fix: Keras alone reloads LayerNormalization with autocast off, GELU with it on."""
    with mpx_tf.policy_scope("mixed_float16"):
        model = _sequential()
    mpx_tf.apply_policy(model, "mixed_float16")
    ln, gelu = model.get_layer("ln"), model.get_layer("gelu")
    assert (ln.autocast, gelu.autocast) == (True, False)
    config = ln.get_config()
    assert "autocast" not in config  # Keras does not save the flag
    assert choices_of(ln.dtype_policy).autocast is True and choices_of(gelu.dtype_policy).autocast is False
    fresh = L.LayerNormalization.from_config(config)
    assert fresh.autocast is False  # Keras's constructor turns it off again
    fresh.build((None, 16))
    fresh(tf.ones((2, 16), "float16"))  # the mpx name puts the flag back on the first call
    assert fresh.autocast is True


def test_policy_names_round_trip_and_reject_bad_parts():
    name = mpx_name("mixed_bfloat16", autocast=False, output="float32", model_output="bfloat16")
    assert name == "mpx:params=float32,compute=bfloat16,output=float32;autocast=off;output=float32;model_output=bfloat16"
    choices = parse_name(name)
    assert choices == (mpx.get_policy("mixed_bfloat16"), False, "float32", "bfloat16")
    kp = keras.DTypePolicy(name)
    assert (kp.compute_dtype, kp.variable_dtype) == ("bfloat16", "float32")
    with pytest.raises(mpx.PolicyError, match="'colour=red' is not understood"):
        keras.DTypePolicy("mpx:mixed_float16;colour=red")
    with pytest.raises(mpx.PolicyError, match="output"):
        keras.DTypePolicy("mpx:mixed_float16;output=float17")
    assert choices_of(keras.DTypePolicy("mixed_float16")) is None
