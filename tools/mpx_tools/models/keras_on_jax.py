"""keras-hub's GPT2 backbone in the ``jax`` column: a Keras model on JAX run through ``mpx_jax.autocast``.

``mpx_jax.autocast`` transforms any JAX function, and a Keras 3 model on the JAX backend is one through
``model.stateless_call``: under mpx the float32 backbone's ``stateless_call`` is wrapped by
``mpx_jax.autocast(fn, policy)`` (no mpx_keras); natively the same backbone is built under Keras's own
``mixed_bfloat16``/``mixed_float16`` dtype policy.  :class:`KerasSubject` is a
:class:`mpx_tools.models.flax.Subject` (the same ``forward``/``loss``/``params`` shape), so every aspect of
the jax column reads it as it reads the Flax models: the jaxpr's op dtypes, ``jax.jit`` traces, the
float16 run (``mpx_jax.with_loss_scaling`` under mpx, Flax's ``DynamicScale`` natively), the logits' error
and ``jax.vjp``'s residual bytes.  The backbone is called with ``training=False`` (dropout off), so its
non-trainable state (``extra``) never changes.

Keras reads ``KERAS_BACKEND`` once, at its import: this module sets ``jax`` before importing it (the jax
column's worker imports no Keras before, whatever its ``KERAS_BACKEND`` says), and refuses a process whose Keras runs another backend.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from mpx_tools.skip import Skip

#: the model id of the jax column (mpx_tools.models.MODELS) -> the keras-hub backbone of mpx_tools.models.keras
BACKBONE = {"keras_gpt2": "gpt2"}


def _keras_models() -> Any:
    """mpx_tools.models.keras, with Keras on the JAX backend."""
    if "keras" not in sys.modules:  # the jax column's worker: its environment says tensorflow (the default)
        os.environ["KERAS_BACKEND"] = "jax"
    import keras

    if keras.config.backend() != "jax":
        raise Skip(f"this process runs Keras on {keras.config.backend()!r}: keras-hub in the jax column needs "
                   "KERAS_BACKEND=jax before Keras is imported")  # fmt: skip
    return importlib.import_module("mpx_tools.models.keras")


class KerasSubject:
    """keras-hub's backbone in one mode (``native``, ``mpx`` or ``float32``), as the jax column's aspects
    read a model: ``forward(params, extra, train)`` -> (sequence output, extra), ``loss``, ``labels``."""

    def __init__(self, name: str, mode: str, policy: str | None, compute: str) -> None:
        import jax.numpy as jnp
        import optax

        K = _keras_models()
        backbone = BACKBONE[name]
        reference = K.reference(backbone)
        model = reference if mode != "native" else K.build(
            backbone, "native", f"mixed_{compute}", reference.get_weights()
        )  # fmt: skip
        x = {k: jnp.asarray(v) for k, v in K.inputs(backbone).items()}

        def call(params: Any, extra: Any) -> Any:
            return K.sequence_output(model.stateless_call(params, extra, x, training=False)[0])

        fn = importlib.import_module("mpx_jax").autocast(call, policy) if mode == "mpx" else call
        self.params = [v.value for v in model.trainable_variables]
        self.extra = [v.value for v in model.non_trainable_variables]
        self.inputs = x
        self.labels = x["token_ids"]  # the sequence output's width is the vocabulary's: a next-token-like loss
        self.forward = lambda params, extra, train: (fn(params, extra), extra)
        self.jitted: Any = None
        self._xent = optax.softmax_cross_entropy_with_integer_labels

    def loss(self, params: Any, extra: Any) -> tuple[Any, Any]:
        out, new_extra = self.forward(params, extra, True)
        return self._xent(out.astype("float32"), self.labels).mean(), new_extra
