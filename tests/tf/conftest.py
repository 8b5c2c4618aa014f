"""Keras 3 / TensorFlow backend tests: skipped where TensorFlow is not installed."""

import os

os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
# The slow-policy warning (float16 on CPU) is tested on its own in test_slow_warning.py.
os.environ.setdefault("MPX_NO_SLOW_WARNING", "1")

import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")
tf.get_logger().setLevel("ERROR")  # the property tests trace one small function per example


@pytest.fixture(autouse=True)
def _float32_global_policy():
    """Every test starts and ends with Keras's default float32 global policy."""
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")
