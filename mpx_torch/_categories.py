"""The mpx category of a torch module (a leaf module: :mod:`mpx_torch.prepare` and :mod:`mpx_torch.float8`
both read it, neither through the other).

>>> import torch
>>> module_category(torch.nn.LayerNorm(4)), module_category(torch.nn.Linear(2, 2))
('normalization', None)
"""

from __future__ import annotations

from torch import nn

from mpx import category_of
from mpx_torch import _compat

__all__ = ["module_category"]

_CATEGORIES: dict[str, tuple[type, ...]] = _compat.category_classes()


def module_category(module: nn.Module) -> str | None:
    """The mpx category of a module: ``"normalization"``, ``"softmax"``, ``"loss"`` or None.

    The core's table (:data:`mpx.categories.CATEGORY_CLASSES` below ``torch.nn``) decides, and an
    ``mpx_category`` attribute on the module or its class names its own category (for example
    ``LlamaRMSNorm.mpx_category = "normalization"`` for a model library's own norm class).

    Raises:
        mpx.PolicyError: for an ``mpx_category`` that is not a category.
    """
    return category_of(module, _CATEGORIES)
