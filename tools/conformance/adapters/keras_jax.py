"""The Keras 3 adapter on the JAX backend (``KERAS_BACKEND=jax``): :mod:`conformance.adapters.keras`."""

from conformance.adapters._keras_column import keras_column

keras_column("keras-jax", "jax", globals())
