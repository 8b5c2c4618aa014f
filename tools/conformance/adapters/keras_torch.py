"""The Keras 3 adapter on the PyTorch backend (``KERAS_BACKEND=torch``): :mod:`conformance.adapters.keras`."""

from conformance.adapters._keras_column import keras_column

keras_column("keras-torch", "torch", globals())
