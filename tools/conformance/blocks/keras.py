"""The ``blocks`` group on Keras (the ``tf``, ``keras-jax`` and ``keras-torch`` columns): under mpx the
core's kernel with mpx_keras's table (mpx_tf's on the ``tf`` column), natively nothing: Keras 3 has no
block-scaled format (its ``quantize`` modes are int8, int4, float8 per tensor, GPTQ and AWQ), which each case
observes as ``{"missing": ...}``.
"""

from __future__ import annotations

import functools
import json

import numpy as np

from conformance.blocks import block_input, observe


def _table():
    import keras

    if keras.backend.backend() == "tensorflow":
        from mpx_tf._array_ops import TensorFlowOps

        return TensorFlowOps()
    from mpx_keras._array_ops import KerasOps

    return KerasOps()


def run_block_quantize(p: dict, mode: str) -> dict:
    """The case's input quantized under its preset (module docs), as :func:`conformance.blocks.observe`."""
    if mode == "native":
        import keras

        return {"missing": f"Keras {keras.__version__} has no block-scaled format (quantize modes: int8, int4, awq, "
                "float8 per tensor, gptq)"}  # fmt: skip
    o, run = _quantizer(json.dumps(p["recipe"], sort_keys=True), p["role"], p["axis"])
    codes, scales, ts = run(o.from_numpy(block_input(p["kind"], p["seed"])))
    recipe = p["recipe"]
    ts = None if ts is None else np.asarray(o.to_numpy(ts))
    return observe(o.to_numpy(codes), recipe["element"], o.to_numpy(scales), recipe["scale"], ts)


@functools.cache
def _quantizer(recipe_json: str, role: str, axis: int):
    """(table, the core's quantize with it): under ``jax.jit`` on Keras's jax backend (eager JAX compiles
    every op), eager elsewhere."""
    import keras

    from mpx.blocks import BlockRecipe
    from mpx.kernels import blocks as kb

    recipe, o = BlockRecipe.from_dict(json.loads(recipe_json)), _table()

    def run(x):
        q = kb.quantize(o, x, recipe, role, axis)
        return q.codes, q.scales, q.tensor_scale

    if keras.backend.backend() == "jax":
        import jax

        return o, jax.jit(run)
    return o, run
