"""The Keras 3 adapter on the PyTorch backend (``KERAS_BACKEND=torch``): :mod:`conformance.adapters.keras`."""

from __future__ import annotations

import os

os.environ["KERAS_BACKEND"] = "torch"  # before Keras is imported: this column is Keras on PyTorch

import keras

from conformance.adapters.keras import KerasAdapter, export

if keras.backend.backend() != "torch":  # Keras was imported before, on another backend
    raise RuntimeError(
        f"conformance.adapters.keras_torch needs Keras on torch; this process runs it on "
        f"{keras.backend.backend()} (import the adapter before Keras, or set KERAS_BACKEND=torch)"
    )


class KerasTorchAdapter(KerasAdapter):
    name = "keras-torch"


export(KerasTorchAdapter(), globals())

# the fp8 group (issue 26): conformance/fp8/keras.py
from conformance.fp8.keras import run_fp8_matmul, run_fp8_quantize, run_fp8_trace  # noqa: E402, F401
