"""The core's kernels (mpx.kernels) run with mpx_tf's TensorFlow table give the numpy table's bits, eagerly and
inside ``tf.function`` (the tensors traced, a traced ``skipped``/``when`` flag included).

The cases are :mod:`kernel_parity`'s (hypothesis-drawn subnormals, infs, NaNs, huge and tiny scales, every
format, recipe and scaler config), shared by every backend; the table's flags are what these tests prove.
"""

from __future__ import annotations

import kernel_parity
import numpy as np
import tensorflow as tf

from mpx_tf._array_ops import TF_ARRAY_OPS as OPS

globals().update(kernel_parity.make_tests(lambda: OPS))


globals().update(kernel_parity.make_tests(lambda: OPS, 25, compile_with=tf.function, suffix="_in_tf_function"))


def test_the_flags_are_tensorflows_arithmetic():
    """TensorFlow flushes a subnormal float32 product to zero (so the kernels work on the bits) and has float64."""
    product = float(tf.constant(np.float32(2.0**-140)) * tf.constant(np.float32(0.5)))
    assert product == 0.0 and not OPS.exact_float32
    assert OPS.float64 and tf.constant(1.0, tf.float64).dtype == tf.float64
