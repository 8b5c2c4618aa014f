"""What the ``keras-jax`` and ``keras-torch`` adapters share: Keras 3 on one backend, set before Keras loads."""

from __future__ import annotations

import os


def keras_column(column: str, backend: str, namespace: dict) -> None:
    """Make ``namespace`` (a module's globals) the adapter of ``column``: Keras on ``backend``.

    Sets ``KERAS_BACKEND`` before Keras is imported, refuses a process whose Keras already runs on
    another backend, and binds :class:`conformance.adapters.keras.KerasAdapter`'s functions and the
    fp8 group's (:mod:`conformance.fp8.keras`) into ``namespace``.
    """
    os.environ["KERAS_BACKEND"] = backend  # before Keras is imported: this column is Keras on `backend`
    import keras

    if keras.backend.backend() != backend:  # Keras was imported before, on another backend
        raise RuntimeError(
            f"the {column} adapter needs Keras on {backend}; this process runs it on "
            f"{keras.backend.backend()} (import the adapter before Keras, or set KERAS_BACKEND={backend})"
        )
    from conformance.adapters.keras import KerasAdapter, export
    from conformance.blocks.keras import run_block_quantize
    from conformance.fp8.keras import run_fp8_matmul, run_fp8_quantize, run_fp8_trace

    export(type("KerasColumnAdapter", (KerasAdapter,), {"name": column})(), namespace)
    namespace.update(run_fp8_matmul=run_fp8_matmul, run_fp8_quantize=run_fp8_quantize,
                     run_fp8_trace=run_fp8_trace, run_block_quantize=run_block_quantize)  # fmt: skip
