"""``Skip``: a case or configuration that does not apply here (stdlib only: native workers import it)."""

from __future__ import annotations

__all__ = ["Skip"]


class Skip(Exception):
    """Raised when a case (conformance) or a configuration (``mpx bench``) does not apply to a framework
    in a mode: a missing optional package, a feature the framework lacks.  Its message is the reason."""
