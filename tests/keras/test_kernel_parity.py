"""The core's kernels (mpx.kernels) run with mpx_keras's ``keras.ops`` table give the numpy table's bits, on the
Keras backend this suite runs on: eagerly and inside that backend's compiled function (``tf.function`` on
TensorFlow, ``jax.jit`` on JAX; torch runs the table eagerly, as Keras's torch trainer does without
``jit_compile``).

The cases are :mod:`kernel_parity`'s (hypothesis-drawn subnormals, infs, NaNs, huge and tiny scales, every
format, recipe and scaler config), shared by every backend; the table's flags are what these tests prove.
"""

from __future__ import annotations

from typing import Any

import keras
import kernel_parity
import numpy as np

from mpx_keras._array_ops import KERAS_ARRAY_OPS, KerasOps

BACKEND = keras.config.backend()
OPS = KERAS_ARRAY_OPS

globals().update(kernel_parity.make_tests(lambda: OPS))


def _compiler() -> Any:
    """The compiler of Keras's backend for the compiled variant: tf.function or jax.jit (torch runs eagerly:
    one torch.compile takes about 14 s, too slow to repeat for hypothesis)."""
    if BACKEND == "tensorflow":
        import functools

        import tensorflow as tf

        # no autograph: the kernels have no Python branch on a traced value, and autograph's conversion
        # cache handed one kernel's converted code to another here (tf___elements called with 7 arguments)
        return functools.partial(tf.function, autograph=False)
    import jax

    return jax.jit


if BACKEND != "torch":
    globals().update(kernel_parity.make_tests(lambda: OPS, 25, compile_with=_compiler(), suffix="_compiled"))


def test_the_flags_are_the_backends_arithmetic():
    """A subnormal float32 product survives on torch only; float64 exists on torch and TensorFlow (on JAX
    only with x64, which the table does not rely on)."""
    tiny = keras.ops.convert_to_tensor(np.float32(2.0**-140))
    product = float(keras.ops.convert_to_numpy(keras.ops.multiply(tiny, np.float32(0.5))))
    assert OPS.exact_float32 is (product == 2.0**-141) is (BACKEND == "torch")
    assert OPS.float64 is (BACKEND != "jax")
    assert (KerasOps("jax").exact_float32, KerasOps("jax").float64) == (False, False)


def test_fp8_tensors_come_back_with_their_bytes():
    x = np.asarray([1.0, -448.0, np.nan, 2.0**-9], np.float32)
    q = OPS.cast(OPS.from_numpy(x), "float8_e4m3fn")
    got = OPS.to_numpy(q)
    assert got.dtype.name == "float8_e4m3fn"
    np.testing.assert_array_equal(got.astype(np.float32)[[0, 1, 3]], x[[0, 1, 3]])
    assert np.isnan(got.astype(np.float32)[2])


def test_add_broadcasts_as_numpy_where_keras_tensorflow_would_run_bias_add():
    """Keras's TensorFlow ``ops.add`` adds a (32, 1, 1) operand to (32, 1, 32) along the last axis
    (``tf.nn.bias_add``): the table's ``add`` broadcasts as numpy, so a (32, 8) operand blocked along
    its 8 columns gets the core's codes (each of its 32 rows its own scale)."""
    rng = np.random.default_rng(0)
    a = rng.integers(-50, 50, (32, 1, 32)).astype(np.int32)
    b = rng.integers(-50, 50, (32, 1, 1)).astype(np.int32)
    for x, y in ((a, b), (a.astype(np.float32), b.astype(np.float32)), (b, a)):
        got = OPS.to_numpy(OPS.add(OPS.from_numpy(x), OPS.from_numpy(y)))
        np.testing.assert_array_equal(got, x + y)
    from mpx.blocks import PRESETS
    from mpx.kernels import blocks as kb
    from mpx.kernels.array_ops import NUMPY_OPS

    w = rng.standard_normal((32, 8)).astype(np.float32)
    got = kb.quantize(OPS, OPS.from_numpy(w), PRESETS["mxfp4"], "weight", 1)
    want = kb.quantize(NUMPY_OPS, w, PRESETS["mxfp4"], "weight", 1)
    np.testing.assert_array_equal(OPS.to_numpy(got.codes), want.codes)
