"""Native conformance runs in a process where nothing of mpx is loaded (standard library only).

A native worker (``python -m conformance.worker BACKEND --mode native --cases FILE``) and a native
replica script install :class:`MpxBlocker` on ``sys.meta_path`` before they import anything else of
the harness: from then on an import of ``mpx`` or of any ``mpx_*`` package (the library's
``mpx_torch``, ``mpx_keras``, ``mpx_tf``, ``mpx_jax``, and the other tools ``mpx_bench``,
``mpx_compare``...) raises :class:`MpxImportBlocked`, an ``ImportError``.  ``mpx_tools``, what the
tools share, is the harness's: it is let through, and the parts a native worker imports import
nothing of mpx.  The worker judges a case whose run raised it an ``error`` of the harness (an
adapter's native path imported mpx), and its rows report the mpx modules loaded
(:func:`mpx_modules`, none) and every import refused (:attr:`MpxBlocker.blocked`), so an adapter
that swallowed the ``ImportError`` is still caught by the runner.

This module imports nothing but the standard library, so installing it loads nothing of mpx.

>>> [is_mpx_name(n) for n in ("mpx", "mpx.policy", "mpx_torch", "mpx_jax.flax", "mpx_tools.workers", "mpxx")]
[True, True, True, True, False, False]
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

#: The environment variable a replica script reads for the modes it runs (``native``, ``mpx`` or both).
MODES_ENV = "MPX_CONFORMANCE_MODES"
#: The one ``mpx_*`` package a native process may import: what the tools share (it imports no mpx there).
TOOLS_SHARED = "mpx_tools"


def is_mpx_name(name: str) -> bool:
    """Whether module ``name`` is mpx's: ``mpx``, ``mpx.*``, ``mpx_*`` (any top-level ``mpx_`` package:
    the library's backends, and the tools ``mpx_bench``, ``mpx_compare``), except :data:`TOOLS_SHARED`."""
    top = name.partition(".")[0]
    return top == "mpx" or (top.startswith("mpx_") and top != TOOLS_SHARED)


def mpx_modules() -> list[str]:
    """The names of mpx's modules in ``sys.modules`` now, sorted (empty in a native process)."""
    return sorted(name for name in list(sys.modules) if is_mpx_name(name))


class MpxImportBlocked(ImportError):
    """An import of mpx in a process that runs the frameworks natively (a harness bug, never a finding)."""


class MpxBlocker(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder that refuses every mpx module and records each refusal.

    Attributes:
        blocked: the module names refused so far, in order (repeats kept once).
    """

    def __init__(self) -> None:
        self.blocked: list[str] = []
        self._lock = threading.Lock()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> None:
        """Raise :class:`MpxImportBlocked` for an mpx module; None (not mine) for every other module."""
        if not is_mpx_name(fullname):
            return None
        with self._lock:
            if fullname not in self.blocked:
                self.blocked.append(fullname)
        raise MpxImportBlocked(
            f"import of {fullname!r} refused: this process runs the framework natively, and native "
            "conformance code paths must not import mpx (import it inside the mpx path, see "
            "conformance/isolation.py)",
            name=fullname,
        )


_INSTALLED: MpxBlocker | None = None


def install() -> MpxBlocker:
    """Put the blocker first on ``sys.meta_path`` (once per process) and return it.

    Raises:
        RuntimeError: when an mpx module is already loaded (the blocker would come too late).
    """
    global _INSTALLED
    if _INSTALLED is None:
        loaded = mpx_modules()
        if loaded:
            raise RuntimeError(
                f"mpx is already loaded in this process ({', '.join(loaded)}): the native run cannot be mpx-free; "
                "install the blocker before importing anything of the harness"
            )
        _INSTALLED = MpxBlocker()
        sys.meta_path.insert(0, _INSTALLED)
    return _INSTALLED


@functools.cache
def library_folder() -> Path | None:
    """The folder that holds the ``mpx`` package (a checkout's root, or ``site-packages``), or None.

    Found as an import would find it, but without importing it and past the blocker (which would
    refuse the lookup and record it), so a native worker can tell mpx's frames from the framework's.
    """
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        if isinstance(finder, MpxBlocker) or find_spec is None:
            continue
        try:
            spec = find_spec("mpx", None)
        except (ImportError, ValueError, TypeError):  # a finder that cannot look up a top-level name so
            continue
        if spec is not None and spec.origin:
            return Path(spec.origin).resolve().parents[1]
    return None


def installed() -> MpxBlocker | None:
    """The blocker of this process, or None when none was installed."""
    return _INSTALLED


def blocked_by(err: BaseException) -> MpxImportBlocked | None:
    """The :class:`MpxImportBlocked` that ``err`` is or was raised from (its cause/context chain), if any."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, MpxImportBlocked):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def report() -> dict[str, list[str]]:
    """``{"mpx_modules": [...], "blocked": [...]}``: what a row reports about this process's isolation."""
    return {"mpx_modules": mpx_modules(), "blocked": list(_INSTALLED.blocked) if _INSTALLED else []}


def modes_from_env(default: Sequence[str] = ("native", "mpx")) -> tuple[str, ...]:
    """The modes a replica script runs: :data:`MODES_ENV` (comma-separated), else ``default``.

    When ``mpx`` is not among them the blocker is installed (:func:`install`), so native replicas
    run mpx-free too.

    Raises:
        ValueError: when the variable names a mode other than ``native`` and ``mpx``.
    """
    import os

    raw = os.environ.get(MODES_ENV, "")
    modes = tuple(m.strip() for m in raw.split(",") if m.strip()) or tuple(default)
    unknown = [m for m in modes if m not in ("native", "mpx")]
    if unknown:
        raise ValueError(f"{MODES_ENV}={raw!r}: unknown mode {unknown[0]!r}; modes: native, mpx")
    if "mpx" not in modes:
        install()
    return modes
