"""Which framework classes belong to the op table's categories: one table for every backend.

A policy's overrides and ``keep_fp32`` name *categories* (``normalization``,
``softmax``, ``loss``, :data:`mpx.CATEGORIES`); each backend must decide which of
its modules or layers belong to each.  That decision is written once, here, as
attribute paths below a root object each backend passes in (``torch.nn``,
``keras.layers``, ``flax.nnx``, ``flax.linen``), so the core never imports a
framework.  Names this version of a framework does not have are left out.

Two rules hold in every backend (:func:`category_of`):

* a class (or instance) with an ``mpx_category`` attribute names its own category,
  for example a custom module that computes a loss; a value that is not a
  category raises :class:`mpx.PolicyError`;
* otherwise the first category whose classes the object is an instance of.

>>> import types
>>> class Norm: pass
>>> root = types.SimpleNamespace(LayerNorm=Norm)
>>> classes = resolve_categories({"normalization": ("LayerNorm", "RMSNorm"), "softmax": (), "loss": ()}, root)
>>> classes["normalization"] == (Norm,)
True
>>> category_of(Norm(), classes)
'normalization'
>>> class MyLoss:
...     mpx_category = "loss"
>>> category_of(MyLoss(), classes)
'loss'
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mpx.errors import PolicyError
from mpx.policy import CATEGORIES

__all__ = ["CATEGORY_CLASSES", "category_of", "resolve_categories"]

#: Per backend, per category: attribute paths (below the backend's root object) of the classes
#: in that category.  Flax has no softmax or loss modules (they are functions there): a Flax
#: module declares those with ``mpx_category``.  Keras's ``Activation("softmax" | "log_softmax")``
#: is a softmax too (the Keras backend adds that rule: it depends on the instance, not the class).
CATEGORY_CLASSES: dict[str, dict[str, tuple[str, ...]]] = {
    "torch": {  # root: torch.nn
        "normalization": (
            "modules.batchnorm._NormBase",  # BatchNorm*, SyncBatchNorm, InstanceNorm*, their lazy forms
            "LayerNorm",
            "GroupNorm",
            "RMSNorm",
            "LocalResponseNorm",
        ),
        "softmax": ("Softmax", "LogSoftmax", "Softmin", "Softmax2d", "AdaptiveLogSoftmaxWithLoss"),
        "loss": ("modules.loss._Loss",),
    },
    "keras": {  # root: keras.layers
        "normalization": (
            "LayerNormalization",
            "BatchNormalization",
            "GroupNormalization",
            "UnitNormalization",
            "RMSNormalization",
            "Normalization",
        ),
        "softmax": ("Softmax",),
        "loss": (),
    },
    "flax.nnx": {  # root: flax.nnx
        "normalization": ("LayerNorm", "BatchNorm", "RMSNorm", "GroupNorm", "InstanceNorm"),
        "softmax": (),
        "loss": (),
    },
    "flax.linen": {  # root: flax.linen
        "normalization": ("LayerNorm", "BatchNorm", "RMSNorm", "GroupNorm", "InstanceNorm"),
        "softmax": (),
        "loss": (),
    },
}


def _lookup(root: Any, path: str) -> Any:
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def resolve_categories(table: Mapping[str, tuple[str, ...]] | str, root: Any) -> dict[str, tuple[type, ...]]:
    """The classes of each category below ``root`` (``table``: a backend name of
    :data:`CATEGORY_CLASSES`, or a table of the same shape); missing names are left out."""
    if isinstance(table, str):
        table = CATEGORY_CLASSES[table]
    resolved: dict[str, tuple[type, ...]] = {}
    for category in CATEGORIES:
        found = (_lookup(root, path) for path in table.get(category, ()))
        resolved[category] = tuple(cls for cls in found if isinstance(cls, type))
    return resolved


def category_of(obj: Any, classes: Mapping[str, tuple[type, ...]]) -> str | None:
    """The category of a module or layer (``obj``), or None; see the module docs for the two rules."""
    own = getattr(obj, "mpx_category", None)
    if own is not None:
        if not isinstance(own, str) or own not in CATEGORIES:
            name = getattr(obj, "name", None) or type(obj).__name__
            raise PolicyError(
                f"{name}: mpx_category {own!r} is not a category; allowed: {', '.join(CATEGORIES)}"
            )
        return own
    for category in CATEGORIES:
        if classes.get(category) and isinstance(obj, classes[category]):
            return category
    return None
