"""The Keras 3 adapter on the JAX backend (``KERAS_BACKEND=jax``): :mod:`conformance.adapters.keras`."""

from __future__ import annotations

import os

os.environ["KERAS_BACKEND"] = "jax"  # before Keras is imported: this column is Keras on JAX

import keras

from conformance.adapters.keras import KerasAdapter, export

if keras.backend.backend() != "jax":  # Keras was imported before, on another backend
    raise RuntimeError(
        f"conformance.adapters.keras_jax needs Keras on jax; this process runs it on "
        f"{keras.backend.backend()} (import the adapter before Keras, or set KERAS_BACKEND=jax)"
    )


class KerasJaxAdapter(KerasAdapter):
    name = "keras-jax"


export(KerasJaxAdapter(), globals())

# the fp8 group (issue 26): conformance/fp8/keras.py
from conformance.fp8.keras import run_fp8_matmul, run_fp8_quantize, run_fp8_trace  # noqa: E402, F401
