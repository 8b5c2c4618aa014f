"""Moved to :mod:`mpx_keras.dtype_policy` (backend-neutral, #24); re-exported for existing imports."""

from mpx_keras.dtype_policy import (
    NAME_PREFIX,
    LayerChoices,
    cast_output,
    choices_of,
    mpx_name,
    parse_name,
)

__all__ = [
    "LayerChoices",
    "NAME_PREFIX",
    "cast_output",
    "choices_of",
    "mpx_name",
    "parse_name",
]
