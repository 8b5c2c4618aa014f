"""What the tools that run one worker process per framework share (stdlib only).

``mpx conformance``, ``mpx bench``/``mpx doctor`` and ``mpx compare`` each start
one Python process per backend, so that no process imports two frameworks.  This
module holds the backend names, the worker environment, the worker runner, the
JSON-lines writer a worker answers with and the progress line they have in common;
it imports no framework and nothing of mpx (a native conformance worker imports it
with mpx blocked).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO

#: The frameworks' own backends (what ``mpx bench``, ``mpx doctor`` and ``mpx compare`` run): name -> module.
FRAMEWORKS: dict[str, str] = {"torch": "torch", "tf": "tensorflow", "jax": "jax"}
#: The Keras 3 columns of ``mpx conformance``: name -> the ``KERAS_BACKEND`` their worker runs Keras on
#: (``tf`` is Keras on TensorFlow, with TensorFlow's own ops and ``tf.distribute``).
KERAS_BACKENDS: dict[str, str] = {"tf": "tensorflow", "keras-jax": "jax", "keras-torch": "torch"}
#: backend name -> the module it needs (what ``is_installed`` looks for): the frameworks, then Keras on
#: JAX and on PyTorch (each needs its framework; Keras itself comes with TensorFlow's extra and theirs).
BACKENDS: dict[str, str] = {**FRAMEWORKS, "keras-jax": "jax", "keras-torch": "torch"}
#: The folder holding ``mpx_tools``, ``conformance``, ``mpx_bench`` and ``mpx_compare`` (``tools/`` in a
#: checkout, ``site-packages`` in an install); workers run there, whatever the caller's folder.
ROOT = Path(__file__).resolve().parents[1]


def is_installed(backend: str) -> bool:
    """Whether the framework of ``backend`` can be imported (found without importing it)."""
    return importlib.util.find_spec(BACKENDS[backend]) is not None


def backend_names(names: Iterable[str] | None, known: Iterable[str] | None = None) -> list[str]:
    """``names`` without repeats, or every backend of ``known`` (default :data:`BACKENDS`) for None.

    Raises:
        ValueError: naming the first unknown backend and the known ones.
    """
    known = list(known if known is not None else BACKENDS)
    chosen = list(dict.fromkeys(names or known))
    unknown = [b for b in chosen if b not in known]
    if unknown:
        raise ValueError(f"unknown backend {unknown[0]!r}; available: {', '.join(known)}")
    return chosen


def unwritable(folder: Path) -> str | None:
    """Why the report folder ``folder`` cannot be written, or None when it can.

    Creates the folder's parent if needed and a probe file beside it (then removes it), so a
    read-only or virtual file system (``/proc``) is found before a long run, not after.
    """
    import tempfile

    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        return f"{folder} exists and is not a folder"
    try:
        parent = folder.absolute().parent
        parent.mkdir(parents=True, exist_ok=True)
        for target in (parent, folder) if folder.exists() else (parent,):
            fd, probe = tempfile.mkstemp(prefix=".mpx-probe-", dir=target)
            os.close(fd)
            os.unlink(probe)
    except OSError as err:
        return f"cannot write {folder}: {err.strerror or err}"
    return None


def worker_env(backend: str | None = None) -> dict[str, str]:
    """The environment of ``backend``'s worker: quiet TF logs, ``ROOT`` importable, and Keras's backend.

    ``KERAS_BACKEND`` is the one a Keras column runs on (:data:`KERAS_BACKENDS`: ``tf`` tensorflow,
    ``keras-jax`` jax, ``keras-torch`` torch), whatever the caller's environment says; for another
    backend (or None) it stays as it is, tensorflow when unset.
    """
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if backend in KERAS_BACKENDS:
        env["KERAS_BACKEND"] = KERAS_BACKENDS[backend]
    else:
        env.setdefault("KERAS_BACKEND", "tensorflow")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_worker(
    module: str,
    args: Sequence[str],
    on_row: Callable[[dict[str, Any]], None] | None = None,
    timeout_s: float | None = None,
    backend: str | None = None,
) -> tuple[list[dict[str, Any]], int, str]:
    """Run ``python -m MODULE ARGS`` in :data:`ROOT` with ``worker_env(backend)``, reading its JSON lines.

    Each stdout line that parses as JSON is kept (others are ignored) and handed to
    ``on_row`` as it arrives.  stderr is read on a thread of its own, so a worker that
    writes much of it never blocks.  A worker still running after ``timeout_s`` seconds
    (None: no limit) is killed.

    Returns:
        The rows, the exit status, and the last 20 lines of stderr (after a line saying
        so when the worker was killed for the timeout).
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args], cwd=ROOT, env=worker_env(backend),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr or []), daemon=True)
    reader.start()
    killed = threading.Event()

    def kill() -> None:
        killed.set()
        proc.kill()

    timer = threading.Timer(timeout_s, kill) if timeout_s else None
    if timer is not None:
        timer.start()
    rows: list[dict[str, Any]] = []
    assert proc.stdout is not None
    for raw in proc.stdout:
        try:
            row = json.loads(raw)
        except json.JSONDecodeError:
            continue
        rows.append(row)
        if on_row is not None:
            on_row(row)
    code = proc.wait()
    if timer is not None:
        timer.cancel()
    reader.join(timeout=5)
    tail = "".join(err[-20:]).strip()
    if killed.is_set():
        tail = f"killed after the {timeout_s:g} s per-backend timeout (--timeout)\n" + tail
    return rows, code, tail


class Emitter:
    """Writes one JSON object per line: a worker's side of :func:`run_worker` (the rows it reads)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout

    def __call__(self, kind: str, **fields: Any) -> None:
        self.stream.write(json.dumps({"type": kind, **fields}, default=str) + "\n")
        self.stream.flush()


class Progress:
    """One status line on a terminal (rewritten in place), a line every 5 s otherwise; nothing when quiet."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self.last = 0.0

    def show(self, text: str, force: bool = False) -> None:
        """The current status; off a terminal it is printed when ``force`` or 5 s after the last."""
        if self.quiet:
            return
        now = time.monotonic()
        if self.tty:
            sys.stderr.write("\r" + text[:100].ljust(100))
        elif force or now - self.last > 5:
            sys.stderr.write(text + "\n")
            self.last = now
        sys.stderr.flush()

    def note(self, text: str) -> None:
        """A line that stays (clears the status line first)."""
        if not self.quiet:
            sys.stderr.write(("\r" + " " * 100 + "\r" if self.tty else "") + text + "\n")
            sys.stderr.flush()
