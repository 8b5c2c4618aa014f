"""The ``blocks`` group on JAX: under mpx the core's kernel with mpx_jax's table (under ``jax.jit``), natively the block
quantizer of ``jax.nn.scaled_dot_general`` (JAX 0.10's ``jax._src.cudnn.scaled_matmul_stablehlo.quantize``
with ``jax.nn.get_scaled_dot_general_config``: ``mxfp8`` with the RCEIL rule only, ``nvfp4`` with a
global scale given; it runs on CPU).  JAX has no MXFP4, blockwise or rowwise FP8 recipe.
"""

from __future__ import annotations

import functools
import json

import numpy as np

from conformance.blocks import block_input, observe


@functools.cache
def _jax_quantize(mode: str):
    """JAX's quantizer under ``jax.jit`` (one compilation per mode; eager JAX compiles every op)."""
    import jax
    from jax import nn
    from jax._src.cudnn.scaled_matmul_stablehlo import quantize

    if mode == "mxfp8":
        return jax.jit(lambda x: quantize(x[None], nn.get_scaled_dot_general_config("mxfp8")))
    return jax.jit(
        lambda x, ts: quantize(x[None], nn.get_scaled_dot_general_config("nvfp4", global_scale=ts))
    )


@functools.cache
def _mpx_quantize(recipe_json: str):
    """The core's kernel with mpx_jax's table under ``jax.jit`` (what mpx_jax's layers run), per recipe."""
    import jax

    from mpx.blocks import BlockRecipe
    from mpx.kernels import blocks as kb
    from mpx_jax._array_ops import JaxOps

    recipe, o = BlockRecipe.from_dict(json.loads(recipe_json)), JaxOps()

    def run(x):
        q = kb.quantize(o, x, recipe, "input", 1)
        return q.codes, q.scales, q.tensor_scale

    return jax.jit(run)


def _native(p: dict, x: np.ndarray) -> dict:
    import jax.numpy as jnp

    name = p["preset"]
    if name in ("mxfp8", "mxfp8_rceil"):
        data, scales = _jax_quantize("mxfp8")(jnp.asarray(x))
        codes = np.asarray(data[0]).view(np.uint8)
        return observe(codes, "e4m3", np.asarray(scales[0]).view(np.uint8), "e8m0", None)
    if name == "nvfp4":  # the global scale torchao and mpx use: amax / (448 * 6)
        amax = np.float32(np.nanmax(np.abs(x))) if not np.isnan(x).any() else np.float32(np.nan)
        ts = np.float32(np.abs(x).max()) / np.float32(448.0 * 6.0) if np.isfinite(amax) else amax
        data, scales = _jax_quantize("nvfp4")(jnp.asarray(x), jnp.asarray([ts], jnp.float32))
        codes = np.asarray(data[0]).view(np.uint8).astype(np.int32) & 0xF
        return observe(codes, "e2m1", np.asarray(scales[0]).view(np.uint8), "e4m3_f32", ts)
    return {"missing": f"JAX {_version()} has block-scaled dots for mxfp8 and nvfp4 only "
            "(jax.nn.get_scaled_dot_general_config): no MXFP4, blockwise or rowwise FP8"}  # fmt: skip


def _version() -> str:
    import jax

    return jax.__version__


def run_block_quantize(p: dict, mode: str) -> dict:
    """The case's input quantized under its preset (module docs), as :func:`conformance.blocks.observe`."""
    x = block_input(p["kind"], p["seed"])
    if mode == "native":
        return _native(p, x)
    if (p["role"], p["axis"]) != ("input", 1):
        raise ValueError(
            f"the blocks cases quantize the forward input; got role {p['role']!r}, axis {p['axis']}"
        )
    codes, scales, ts = _mpx_quantize(json.dumps(p["recipe"], sort_keys=True))(x)
    recipe = p["recipe"]
    ts = None if ts is None else np.asarray(ts)
    return observe(np.asarray(codes), recipe["element"], np.asarray(scales), recipe["scale"], ts)
