"""Which calls the op table applies to: user code, told from library code by the caller's module (#24).

A call is user code when the first frame above the op, looking through at most
:data:`MAX_TRACING_FRAMES` frames of a framework's tracing machinery
(TensorFlow's AutoGraph and ``tf.function``, torch's dynamo), runs in a module
that belongs to no installed library: not a module of :data:`LIBRARY_PACKAGES`,
not a file under a ``site-packages`` / ``dist-packages`` directory or the
standard library, and not mpx's own packages.  Code typed in (``<stdin>``,
doctests, notebooks) is user code.  Each module's kind is decided once and
cached: the check is one frame lookup per call, plus the tracing frames inside
``tf.function`` (``from_user_code(0)``: 0.33 us per call on each Keras backend,
``timeit`` of 2000 calls, best of 5, on a loaded 2-core CPU).

The rule is the same on every Keras backend: a JAX trace (``jax.jit``, the jax
trainer's step) runs the user's Python as written, so its frames are the
user's; under torch's dynamo (``torch.compile``) the frames of the traced
code are not Python's: :func:`file_is_user_code` reads the file of the frame
dynamo traces above the op, at trace time.  Only module names are compared
here: no framework is imported.
"""

from __future__ import annotations

import importlib.util
import os
import site
import sys
import sysconfig
from typing import Any

__all__ = ["LIBRARY_PACKAGES", "MAX_TRACING_FRAMES", "file_is_user_code", "from_user_code"]

# Where the op table applies: "user code" (see the module docs).  A frame's kind is decided once per file.
_USER, _LIBRARY, _TRACING = 0, 1, 2
#: Top-level packages whose calls pass through wherever they are installed (a source checkout too).
LIBRARY_PACKAGES: frozenset[str] = frozenset(
    {
        "keras",
        "tensorflow",
        "tf_keras",
        "keras_hub",
        "keras_nlp",
        "keras_cv",
        "keras_rs",
        "tensorflow_probability",
        "jax",
        "flax",
        "optax",
        "torch",
    }
)
# The frameworks' tracing machinery between a caller and a wrapper: looked through
_TRACING_MODULES = (
    "tensorflow.python.autograph",
    "tensorflow.python.eager",
    "tensorflow.python.framework",
    "tensorflow.python.util",
    "torch._dynamo",
)
#: At most this many frames of tracing machinery are looked through above an op;
#: a call with more (none is known) passes through.
MAX_TRACING_FRAMES = 24


def _library_dirs() -> tuple[str, ...]:
    """Directories whose files are library code: installed distributions, the standard library, mpx."""
    dirs = {*site.getsitepackages(), sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]}
    dirs |= {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    user_site = site.getusersitepackages() if site.ENABLE_USER_SITE else None
    if user_site:
        dirs.add(user_site)
    for package in ("mpx", "mpx_tf", "mpx_keras"):
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.submodule_search_locations:
            dirs.update(spec.submodule_search_locations)
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs if d)


_LIBRARY_DIRS = _library_dirs()
_KINDS: dict[str, int] = {}


def _kind(frame: Any) -> int:
    """USER, LIBRARY or TRACING: the kind of the module a frame runs in, decided once per module file.

    Keyed by the module's ``__file__`` (not the code's file): AutoGraph runs a converted function as
    generated code in a temporary file, shared by functions with the same source, but with the
    original module's globals.
    """
    code_file = frame.f_code.co_filename
    if code_file.startswith("<"):  # typed in: <stdin>, <string>, <doctest ...>
        return _USER
    module_globals = frame.f_globals
    key = module_globals.get("__file__") or code_file
    kind = _KINDS.get(key)
    if kind is None:
        module = module_globals.get("__name__") or ""
        if module.startswith(_TRACING_MODULES):
            kind = _TRACING
        elif module.partition(".")[0] in LIBRARY_PACKAGES:
            kind = _LIBRARY
        else:
            kind = _LIBRARY if os.path.realpath(key).startswith(_LIBRARY_DIRS) else _USER
        _KINDS[key] = kind
    return kind


def from_user_code(depth: int = 1) -> bool:
    """Whether the call ``depth`` frames above this one comes from user code (see the module docs).

    Tracing frames (AutoGraph, ``tf.function``, dynamo) are looked through, at most
    :data:`MAX_TRACING_FRAMES` of them; each file's kind is decided once and cached.
    """
    frame = sys._getframe(depth + 1)
    for _ in range(MAX_TRACING_FRAMES):
        kind = _kind(frame)
        if kind != _TRACING:
            return kind == _USER
        frame = frame.f_back
        if frame is None:
            return False
    return False


def file_is_user_code(filename: str) -> bool:
    """Whether code of the source file ``filename`` is user code, told by the file alone: what dynamo shows of
    the frames it traces (no module globals: a library run from a source checkout outside ``site-packages``
    counts as user code there; every installed library is told apart as eagerly)."""
    if filename.startswith("<"):
        return True
    kind = _KINDS.get(filename)
    if kind is None:
        kind = _KINDS[filename] = _LIBRARY if os.path.realpath(filename).startswith(_LIBRARY_DIRS) else _USER
    return kind == _USER
