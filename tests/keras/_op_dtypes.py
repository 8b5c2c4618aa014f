"""The dtypes a Keras model's forward pass computes its ops in, read from the backend Keras runs on (#24).

:func:`record` runs ``fn(*args)`` and returns its ops of :data:`KINDS`, in the order the backend runs them
(nested functions included), each as ``(kind, input dtypes)``:

- jax: the eqns of ``jax.make_jaxpr(fn)`` and of every jaxpr nested in them (``jit``, ``custom_jvp``...);
- torch: the aten ops a ``TorchDispatchMode`` sees while ``fn`` runs eagerly;
- tensorflow: the ops of ``tf.function(fn)``'s traced graph, in the order they were created.

Only floating inputs are listed (an integer index or a boolean mask is not what an op computes in).  The
backend's own op names are mapped to one vocabulary (:data:`KINDS`), so a test reads the same on every
backend; what a kind stands for differs where the backends differ (a softmax is one op on TensorFlow and
torch, ``reduce_max``/``exp``/``div`` on jax: its ``exp`` is the ``softmax`` kind there).

Not a test module (pytest collects ``test_*.py``); tests load it by its path, as the test directories are
not packages (``--import-mode=importlib``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import keras

__all__ = ["KINDS", "Op", "dtypes_of", "record"]

#: One recorded op: (kind, the dtypes of its floating inputs).
Op = tuple[str, tuple[str, ...]]

#: kind -> the backend's op names, per backend.
KINDS: dict[str, dict[str, tuple[str, ...]]] = {
    "matmul": {
        "jax": ("dot_general",),
        "torch": ("mm", "bmm", "addmm", "baddbmm", "matmul", "einsum"),
        "tensorflow": ("MatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"),
    },
    "softmax": {
        "jax": ("exp",),  # jax.nn.softmax is reduce_max, exp, sum, div: no other exp in these models
        "torch": ("_softmax", "_log_softmax", "exp"),
        "tensorflow": ("Softmax", "LogSoftmax", "Exp"),
    },
    # a fused attention kernel (torch's scaled_dot_product_attention on CPU): both its matmuls in its inputs' dtype
    "attention": {
        "jax": (),  # jax.nn.dot_product_attention's XLA implementation: dot_generals (matmul)
        "torch": (
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_attention_math",
        ),
        "tensorflow": (),
    },
    "rsqrt": {"jax": ("rsqrt",), "torch": ("rsqrt",), "tensorflow": ("Rsqrt",)},
    "layer_norm": {"jax": (), "torch": ("native_layer_norm",), "tensorflow": ()},
    "sin": {"jax": ("sin",), "torch": ("sin",), "tensorflow": ("Sin",)},
    "cos": {"jax": ("cos",), "torch": ("cos",), "tensorflow": ("Cos",)},
}


def _kind_of(backend: str) -> dict[str, str]:
    return {name: kind for kind, names in KINDS.items() for name in names[backend]}


def _float(dtypes: Iterable[str]) -> tuple[str, ...]:
    return tuple(d for d in dtypes if d in ("float16", "bfloat16", "float32", "float64"))


def _jax(fn: Callable[..., Any], args: tuple[Any, ...]) -> list[Op]:
    import jax

    kinds = _kind_of("jax")
    found: list[Op] = []

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            kind = kinds.get(eqn.primitive.name)
            if kind is not None:
                found.append((kind, _float(str(v.aval.dtype) for v in eqn.invars)))
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else (param,):
                    inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr holds its Jaxpr
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def _torch(fn: Callable[..., Any], args: tuple[Any, ...]) -> list[Op]:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    kinds = _kind_of("torch")
    found: list[Op] = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kind = kinds.get(func.overloadpacket.__name__)
            if kind is not None:
                tensors = [
                    a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)
                ]
                found.append((kind, _float(str(t.dtype).removeprefix("torch.") for t in tensors)))
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Recorder():
        fn(*args)
    return found


def _tensorflow(fn: Callable[..., Any], args: tuple[Any, ...]) -> list[Op]:
    import tensorflow as tf

    kinds = _kind_of("tensorflow")
    graph = tf.function(fn).get_concrete_function(*args).graph
    found: list[Op] = []
    for op in graph.get_operations():
        kind = kinds.get(op.type)
        if kind is not None:
            found.append((kind, _float(t.dtype.name for t in op.inputs)))
    return found


_RECORDERS = {"jax": _jax, "torch": _torch, "tensorflow": _tensorflow}


def record(fn: Callable[..., Any], *args: Any) -> list[Op]:
    """The ops of :data:`KINDS` that ``fn(*args)`` computes on this process's Keras backend, in order.

    On tensorflow, ``args`` are ``tf.TensorSpec``s or tensors (``fn`` is traced, not run); on jax, arrays
    or pytrees of them (traced); on torch, ``fn`` runs once under ``torch.no_grad``.
    """
    return _RECORDERS[keras.config.backend()](fn, args)


def dtypes_of(ops: Iterable[Op], kind: str) -> list[tuple[str, ...]]:
    """The input dtypes of the recorded ops of one kind, in order."""
    return [dtypes for k, dtypes in ops if k == kind]
