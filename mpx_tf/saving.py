"""Loading Keras models with mpx's classes in place of Keras's: ``mpx_tf.load_model``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import keras

from mpx_tf import _compat
from mpx_tf.loss_scale_optimizer import LossScaleOptimizer

__all__ = ["load_model"]

_KERAS_LSO = "keras.optimizers.LossScaleOptimizer"


@contextlib.contextmanager
def _keras_lso_as_mpx() -> Iterator[None]:
    # Keras resolves its own classes by their public name, before custom_objects are asked.
    names = _compat.REGISTERED_NAMES_TO_OBJS
    previous = names.get(_KERAS_LSO)
    names[_KERAS_LSO] = LossScaleOptimizer
    try:
        yield
    finally:
        if previous is None:
            names.pop(_KERAS_LSO, None)
        else:
            names[_KERAS_LSO] = previous


def load_model(filepath: str | os.PathLike, *, loss_scale_optimizer: str = "mpx", **kwargs: Any) -> Any:
    """``keras.models.load_model``, with a saved Keras ``LossScaleOptimizer`` loaded as mpx's.

    Keras's own class is found by its public name before ``custom_objects``
    are asked, so ``custom_objects={"LossScaleOptimizer": ...}`` cannot
    replace it; this does (for the duration of the call).  Its config
    (``initial_scale``, ``dynamic_growth_steps``) maps onto an
    :class:`mpx.ScalerConfig`.  The scaler state of a Keras LSO (its
    ``dynamic_scale`` and ``step_counter`` variables) is not carried over:
    the mpx optimizer starts from its config (Keras's warning about the
    optimizer variables it skipped says so).  Models saved with mpx's
    optimizer load with plain ``keras.models.load_model``.

    Args:
        filepath: the ``.keras`` file.
        loss_scale_optimizer: ``"mpx"`` (default) or ``"keras"`` (plain ``keras.models.load_model``).
        **kwargs: passed to ``keras.models.load_model``.

    Raises:
        MPXError: for another ``loss_scale_optimizer`` value.
    """
    from mpx.errors import MPXError

    if loss_scale_optimizer == "keras":
        return keras.models.load_model(filepath, **kwargs)
    if loss_scale_optimizer != "mpx":
        raise MPXError(f"loss_scale_optimizer: expected 'mpx' or 'keras', got {loss_scale_optimizer!r}")
    with _keras_lso_as_mpx():
        return keras.models.load_model(filepath, **kwargs)
