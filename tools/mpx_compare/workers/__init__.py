"""One module per backend (``torch``, ``tf``, ``jax``); each imports only its own framework."""
