"""``torch.compile`` support shared by the mpx_torch modules.

Dynamo traces :mod:`mpx_torch.autocast` regions (``with`` blocks of
``torch.autocast`` and the mpx ``TorchFunctionMode``) into the graph, and runs
the loss-scaler's methods eagerly, as it does ``torch.amp.GradScaler``'s: so a
compiled step guards on no scaler state (the host step counter, the
per-optimizer dicts) and never recompiles when the scale changes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from mpx_torch import _compat

__all__ = ["compiling", "eager_under_dynamo", "frame_skipped", "make_eager"]

_F = TypeVar("_F", bound=Callable[..., Any])


def compiling() -> bool:
    """Whether dynamo is tracing the caller (``torch.compiler.is_compiling()``)."""
    return torch.compiler.is_compiling()


_EAGER: list[Callable[[], None]] = []  # makes each wrapper's disabled method (see make_eager)


def _no_callback() -> None:
    return None


def eager_under_dynamo(method: _F | None = None, *, recursive: bool = True) -> Any:
    """``method`` unchanged in eager code; called from compiled code, one graph break and an eager call.

    The same treatment dynamo gives ``torch.amp.GradScaler`` (whose module it
    skips): nothing in ``method`` is traced, so compiled code guards on none
    of the state it reads or changes.  :func:`make_eager` (which imports
    ``torch._dynamo``, as constructing a torch optimizer does anyway) marks
    the wrapper so that dynamo does not inline it; before that, traced calls
    still run eagerly, with a second graph break inside the wrapper.

    ``recursive=True`` (the default): nothing ``method`` calls is compiled
    either.  ``recursive=False`` (``GradScaler.step``): ``method``'s own frame
    is skipped, once and for all as dynamo's skipfiles are, and the frames it
    calls are compiled, as under torch's GradScaler: the optimizer's step
    compiles (its helpers here hold no per-step Python state to guard on).
    """
    if method is None:
        return functools.partial(eager_under_dynamo, recursive=recursive)
    eager: Callable[..., Any] | None = None
    frame_callback: Callable[[], Any] = _no_callback

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if eager is not None:  # the wrapper is never traced: a set callback means compiled code called it
            return method(*args, **kwargs) if frame_callback() is None else eager(*args, **kwargs)
        if torch.compiler.is_compiling():
            return torch.compiler.disable(method)(*args, **kwargs)
        return method(*args, **kwargs)

    def make() -> None:
        nonlocal eager, frame_callback
        frame_callback = _compat.eval_frame_callback_getter()
        if recursive:
            eager = torch.compiler.disable(method)
        else:
            _compat.dynamo_skip_code(method.__code__)
            eager = method
        _compat.dynamo_skip(wrapper)  # no inlining, and no frame of the wrapper's compiled

    _EAGER.append(make)
    return wrapper  # type: ignore[return-value]


def frame_skipped(function: _F) -> _F:
    """``function`` unchanged; once :func:`make_eager` ran, dynamo never compiles its frame (its callees it does).

    For the helpers of ``GradScaler.step`` (``recursive=False``): like the
    method's own frame, theirs hold per-step Python state (the optimizer's
    record) that a compiled frame would guard on, while the optimizer's step
    they call compiles.
    """
    _EAGER.append(lambda: _compat.dynamo_skip_code(function.__code__))
    return function


def make_eager() -> None:
    """Prepare every :func:`eager_under_dynamo` method for compiled callers (once; call it in eager code)."""
    if _EAGER and not compiling():
        for make in _EAGER:
            make()
        _EAGER.clear()
