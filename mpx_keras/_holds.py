"""The reference-counted hold on the op table's dispatch (:mod:`mpx_keras.autocast`): the first hold installs
the wrappers, the last one given back puts Keras's functions back, under one lock so threads share one
install.  A leaf module: :mod:`mpx_keras.autocast` gives it the install and uninstall (:func:`set_install`).

Under ``torch.compile`` (Keras's torch backend) a trace takes its hold for real, outside the trace
(:func:`hold_for_compiled_code`), and keeps it: compiled code guards on the wrappers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from mpx.errors import MPXError
from mpx_keras import _compat

__all__ = ["acquire", "hold_for_compiled_code", "holds", "lock", "release", "release_compiled", "set_install"]

lock = threading.RLock()
_count = [0]
#: [install, uninstall] of mpx_keras.autocast
_INSTALL: list[Callable[[], None]] = []
#: Whether a dynamo trace took the hold compiled code keeps (:func:`release_compiled`).
_COMPILED = [False]


def set_install(install: Callable[[], None], uninstall: Callable[[], None]) -> None:
    """What the first hold runs (``install``) and the last release (``uninstall``); called once, by autocast."""
    _INSTALL[:] = [install, uninstall]


def acquire() -> None:
    """Take one hold on the op table's dispatch: the first hold installs it (thread-safe)."""
    with lock:
        if _count[0] == 0:
            _INSTALL[0]()
        _count[0] += 1


def release() -> None:
    """Give back one hold (:func:`acquire`): the last one puts every original function back.

    Raises:
        MPXError: when no hold is taken (a release without its acquire).
    """
    with lock:
        if _count[0] == 0:
            raise MPXError(
                "mpx_keras.autocast.release() without a matching acquire(): the op table holds none."
            )
        _count[0] -= 1
        if _count[0] == 0:
            _INSTALL[1]()


def holds() -> int:
    """How many holds keep the op table's dispatch installed now (0: every function is Keras's own)."""
    return _count[0]


@_compat.at_trace_time
def hold_for_compiled_code() -> bool:
    """Take, once and for real, the hold compiled code keeps, when nothing holds the dispatch while dynamo
    traces: dynamo reads ``keras.ops.softmax`` (the wrapper) and guards on it, so the dispatch stays
    installed for the compiled code's calls.  (Traced inside a scope that holds it, the code is compiled
    again once the scope is left: its guards fail, as for a step traced under another policy.)"""
    with lock:
        if not _COMPILED[0] and _count[0] == 0:
            acquire()
            _COMPILED[0] = True
    return True


def release_compiled() -> bool:
    """Give back the hold ``torch.compile`` took (:func:`hold_for_compiled_code`); True when there was one.

    Code compiled since then finds Keras's own functions in place of the wrappers: its guards fail and
    dynamo compiles it again (taking the hold again), so call ``torch._dynamo.reset()`` with it.
    """
    with lock:
        if not _COMPILED[0]:
            return False
        _COMPILED[0] = False
        release()
    return True
