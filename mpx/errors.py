"""The errors mpx raises for bad user input.

Every error derives from :class:`MPXError`, itself a :class:`ValueError`, so
``except ValueError`` keeps working for code that does not know mpx.  Each
message names the offending field or token and says what would be accepted.
"""

from __future__ import annotations

__all__ = [
    "DTypeError",
    "Float8Error",
    "FrameworkVersionError",
    "MPXError",
    "PolicyError",
    "ScalerConfigError",
    "ScalerFloorError",
    "ScalerStuckError",
    "ScalerStuckWarning",
    "StateDictError",
    "UnsupportedTypeError",
]


class MPXError(ValueError):
    """Base class of every user-facing mpx error."""


class DTypeError(MPXError):
    """A value could not be read as one of mpx's floating dtypes."""


class PolicyError(MPXError):
    """A policy spec (string, dict or fields) is malformed."""


class ScalerConfigError(MPXError):
    """A loss-scaler configuration value is out of its allowed range."""


class StateDictError(MPXError):
    """A scaler state dict is malformed, tampered with or of another format."""


class Float8Error(MPXError):
    """An FP8 recipe field, format or role is not allowed."""


class ScalerStuckError(MPXError):
    """A loss scaler skipped ``ScalerConfig.max_consecutive_skips`` steps in a row (see :mod:`mpx.stuck`)."""


class ScalerFloorError(MPXError):
    """A back-off was due while the scale was already at ``min_scale`` and the config says
    ``on_floor="raise"`` (DeepSpeed's rule; see :mod:`mpx.stuck`)."""


class ScalerStuckWarning(UserWarning):
    """What a stuck loss scaler warns with when ``ScalerConfig.on_stuck`` is ``"warn"``."""


class UnsupportedTypeError(MPXError, TypeError):
    """An argument is of a type the function does not take: a model, layer, optimizer or tensor of
    another kind or framework (every backend raises this one for the same misuse; it is also a
    :class:`TypeError`)."""


class FrameworkVersionError(MPXError, ImportError):
    """The installed framework is older than mpx supports, or a framework internal mpx relies on
    (reached only through the backend's ``_compat`` module) is missing or changed.  The message
    names the framework, its version, the internal and what mpx supports."""
