"""Keras does not run block-scaled recipes yet (#31): apply_policy refuses them clearly (every backend)."""

import keras
import pytest

import mpx
import mpx_keras


def test_apply_policy_refuses_a_block_recipe_naming_what_is_supported():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(2)])
    with pytest.raises(
        mpx.Float8Error, match=r"apply_policy does not run block-scaled.*fp8=hybrid or fp8=e4m3"
    ):
        mpx_keras.apply_policy(model, "mixed_bfloat16,fp8=mxfp8")
    mpx_keras.apply_policy(model, "mixed_bfloat16,fp8=mxfp8,@dense*={fp8=none}")  # no layer left with one
