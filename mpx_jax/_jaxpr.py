"""What mpx's jaxpr interpreters share (autocast, the loss-scaling skip, find_nonfinite): binding one
equation as JAX would, inside the context it was traced in.  The JAX internals they touch are looked up
in :mod:`mpx_jax._compat`."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from mpx_jax._compat import bind_params, eqn_context_manager

__all__ = ["bind", "eqn_context"]


def bind(eqn: Any, invals: Sequence[Any], params: dict[str, Any] | None = None) -> list[Any]:
    """Bind ``eqn``'s primitive to ``invals`` (with ``params`` in place of its own, if given); a list of outputs."""
    out = eqn.primitive.bind(*invals, **bind_params(eqn, eqn.params if params is None else params))
    return list(out) if eqn.primitive.multiple_results else [out]


def eqn_context(eqn: Any) -> Any:
    """The context manager ``eqn`` was traced under (a name scope, a mesh...), or a null context."""
    return eqn_context_manager(eqn) or contextlib.nullcontext()
