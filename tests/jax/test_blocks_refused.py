"""JAX does not run block-scaled recipes yet (#31): autocast and the Flax layers refuse them clearly."""

import jax.numpy as jnp
import pytest
from flax import nnx

import mpx
import mpx_jax
from mpx.blocks import PRESETS
from mpx_jax.float8_flax import Float8Linear
from mpx_jax.float8_linen import Float8Dense


@pytest.mark.parametrize("spec", ["mixed_bfloat16,fp8=mxfp8", "mixed_bfloat16,@head={fp4=nvfp4}"])
def test_autocast_refuses_a_block_recipe_naming_what_is_supported(spec):
    with pytest.raises(
        mpx.Float8Error, match=r"mpx_jax.autocast does not run block-scaled.*fp8=hybrid or fp8=e4m3"
    ):
        mpx_jax.autocast(lambda x: x @ x, spec)


def test_flax_layers_refuse_a_block_recipe():
    with pytest.raises(mpx.Float8Error, match="Flax layers does not run block-scaled recipes yet"):
        Float8Linear(2, 2, recipe=mpx.get_policy("mixed_bfloat16,fp8=fp8_blockwise"), rngs=nnx.Rngs(0))
    with pytest.raises(mpx.Float8Error, match="Float8Dense does not run block-scaled recipes yet"):
        Float8Dense(4, PRESETS["mxfp8"]).init({"params": __import__("jax").random.key(0)}, jnp.ones((1, 2)))
