"""What mpx's jaxpr interpreters share (autocast, the loss-scaling skip, find_nonfinite): binding one
equation as JAX would, inside the context it was traced in."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

__all__ = ["bind", "eqn_context"]


def bind(eqn: Any, invals: Sequence[Any], params: dict[str, Any] | None = None) -> list[Any]:
    """Bind ``eqn``'s primitive to ``invals`` (with ``params`` in place of its own, if given); a list of outputs."""
    bp = eqn.primitive.get_bind_params(eqn.params if params is None else params)
    if isinstance(bp, tuple):  # jax < 0.7: (subfuns, params)
        subfuns, bp = bp
        out = eqn.primitive.bind(*subfuns, *invals, **bp)
    else:
        out = eqn.primitive.bind(*invals, **bp)
    return list(out) if eqn.primitive.multiple_results else [out]


def eqn_context(eqn: Any) -> Any:
    """The context manager ``eqn`` was traced under (a name scope, a mesh...), or a null context."""
    return getattr(getattr(eqn, "ctx", None), "manager", None) or contextlib.nullcontext()
