"""mpx_tf.LossScaleOptimizer accepts what Keras's LossScaleOptimizer accepts, checked against Keras's class."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import mpx
import mpx_tf

L = keras.layers


def _sgd() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(0.1)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"initial_scale": 2.0**10}, {"dynamic_growth_steps": 7}, {"initial_scale": 4.0, "dynamic_growth_steps": 3}],
)
def test_keras_arguments_map_onto_the_config(kwargs):
    keras_lso = keras.optimizers.LossScaleOptimizer(_sgd(), dynamic=True, **kwargs)
    ours = mpx_tf.LossScaleOptimizer(_sgd(), dynamic=True, **kwargs)
    # a given argument gives the same value as in Keras's class
    assert ours.config.growth_interval == keras_lso.dynamic_growth_steps  # both default to 2000
    if "initial_scale" in kwargs:
        assert ours.config.init_scale == ours.get_scale() == keras_lso.initial_scale
    else:  # an argument not given keeps each class's own default: Keras 2**15, mpx 2**16
        assert (keras_lso.initial_scale, ours.get_scale()) == (2.0**15, 2.0**16)
    assert ours.config.kind == "dynamic"


def test_keras_arguments_change_only_their_fields_of_a_config():
    cfg = mpx.ScalerConfig(init_scale=8.0, growth_interval=5, hysteresis=2)
    ours = mpx_tf.LossScaleOptimizer(_sgd(), cfg, dynamic_growth_steps=9)
    assert ours.config == mpx.ScalerConfig(init_scale=8.0, growth_interval=9, hysteresis=2)
    with pytest.raises(mpx.ScalerConfigError, match="config.kind is 'static'"):
        mpx_tf.LossScaleOptimizer(_sgd(), mpx.ScalerConfig(kind="static"), initial_scale=4.0)
    with pytest.raises(mpx.ScalerConfigError):
        mpx_tf.LossScaleOptimizer(_sgd(), initial_scale=0.0)  # below min_scale: the config rejects it


def test_dynamic_false_is_refused_like_keras():
    with pytest.raises(ValueError, match="dynamic=False"):
        keras.optimizers.LossScaleOptimizer(_sgd(), dynamic=False)
    with pytest.raises(mpx.MPXError, match="dynamic: only True"):
        mpx_tf.LossScaleOptimizer(_sgd(), dynamic=False)


def test_unknown_keyword_arguments_are_named():
    with pytest.raises(ValueError, match="does not support arguments: `foo`, `bar`"):
        keras.optimizers.LossScaleOptimizer(_sgd(), foo=1, bar=2)
    with pytest.raises(ValueError, match="unknown arguments 'foo', 'bar'"):
        mpx_tf.LossScaleOptimizer(_sgd(), foo=1, bar=2)


@pytest.mark.parametrize(
    "arg, value, default",
    [("gradient_accumulation_steps", 4, None), ("clipnorm", 1.0, None), ("use_ema", True, False)],
)
def test_inner_optimizer_arguments_get_keras_advice(arg, value, default):
    advice = f"set `{arg}` on the `inner_optimizer`"
    with pytest.raises(ValueError, match=advice):
        keras.optimizers.LossScaleOptimizer(_sgd(), **{arg: value})
    with pytest.raises(mpx.MPXError, match=advice):
        mpx_tf.LossScaleOptimizer(_sgd(), **{arg: value})
    # at their defaults (older saved configs carry them) both accept them
    keras.optimizers.LossScaleOptimizer(_sgd(), **{arg: default})
    assert mpx_tf.LossScaleOptimizer(_sgd(), **{arg: default}).get_scale() == 2.0**16


def test_from_config_reads_keras_format():
    keras_lso = keras.optimizers.LossScaleOptimizer(_sgd(), initial_scale=512.0, dynamic_growth_steps=11, name="lso")
    config = keras_lso.get_config()
    assert set(config) == {"name", "inner_optimizer", "initial_scale", "dynamic_growth_steps"}
    ours = mpx_tf.LossScaleOptimizer.from_config(config)
    assert type(ours) is mpx_tf.LossScaleOptimizer and ours.name == "lso"
    assert (ours.get_scale(), ours.config.growth_interval) == (512.0, 11)
    assert type(ours.inner_optimizer) is keras.optimizers.SGD
    assert ours.inner_optimizer.learning_rate.numpy() == np.float32(0.1)
    # mpx's own format still round-trips
    again = mpx_tf.LossScaleOptimizer.from_config(ours.get_config())
    assert again.config == ours.config


def test_a_model_saved_with_keras_lso_loads_with_mpx_lso(tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), L.Dense(2)])
    model.compile(
        optimizer=keras.optimizers.LossScaleOptimizer(_sgd(), initial_scale=256.0, dynamic_growth_steps=5),
        loss="mse",
    )
    x, y = np.ones((8, 4), "float32"), np.zeros((8, 2), "float32")
    model.fit(x, y, epochs=1, verbose=0)
    path = tmp_path / "keras_lso.keras"
    model.save(path)
    assert type(keras.models.load_model(path).optimizer) is keras.optimizers.LossScaleOptimizer
    loaded = mpx_tf.load_model(path)
    opt = loaded.optimizer
    assert type(opt) is mpx_tf.LossScaleOptimizer
    assert opt.config.growth_interval == 5
    for a, b in zip(loaded.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert opt.get_scale() == 256.0  # from the config: Keras's scaler state is not carried over
    loaded.fit(x, y, epochs=1, verbose=0)  # trains on with mpx's scaler
    assert opt.state.steps == 1
    # and the registry is restored: Keras's class loads again afterwards
    assert type(keras.models.load_model(path).optimizer) is keras.optimizers.LossScaleOptimizer
