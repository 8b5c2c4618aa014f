"""The module walk that :func:`mpx_torch.float8.convert` and :func:`mpx_torch.blocks.convert` share.

Both turn ``nn.Linear`` modules into a subclass of their own in place (the same object, parameters and
hooks: only ``__class__`` and a few attributes change), pick the modules by the policy each one gets
(``policy.for_module(path, category)``, its ``fp8`` recipe where ``op_table`` classifies ``linear`` LOWER),
and turn a module of theirs whose policy no longer names their kind of recipe back into ``nn.Linear``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from mpx import OpTable, PolicySpec, UnsupportedTypeError, get_policy
from mpx.ops import as_op_table
from mpx_torch._categories import module_category

__all__ = ["check_model", "linear_recipes", "to_linear"]


def check_model(model: Any, caller: str) -> None:
    """Refuse a ``model`` that is not a ``torch.nn.Module`` (``caller``: the public function's name).

    Raises:
        mpx.UnsupportedTypeError: naming ``model`` and what it got.
    """
    if not isinstance(model, nn.Module):
        raise UnsupportedTypeError(
            f"model: expected a torch.nn.Module, got {type(model).__name__}; "
            f"{caller} changes a model's nn.Linear modules in place."
        )


def to_linear(module: nn.Module, attributes: Iterable[str]) -> None:
    """Turn a converted module back into a plain ``nn.Linear``, dropping its plain ``attributes``."""
    for name in attributes:
        module.__dict__.pop(name, None)
    module.__class__ = nn.Linear


def linear_recipes(
    model: nn.Module,
    policy: PolicySpec,
    op_table: OpTable | None,
    *,
    recipe_type: type,
    converted: type[nn.Linear],
    revert: Callable[[Any], None],
) -> list[tuple[str, nn.Linear, Any]]:
    """``(path, module, recipe)`` for each module of ``model`` (in ``named_modules`` order, shared ones once)
    whose class is exactly ``nn.Linear`` or ``converted`` and whose own policy's ``fp8`` recipe applies to
    ``linear`` under ``op_table`` (default :data:`mpx.OP_TABLE`) and is a ``recipe_type``.  A ``converted``
    module whose recipe is not (none, or another kind) is handed to ``revert`` on the way.

    Raises:
        mpx.PolicyError: for a bad policy spec.
    """
    root = get_policy(policy)
    found = []
    for path, sub in model.named_modules():
        if type(sub) is not nn.Linear and not isinstance(sub, converted):
            continue
        own = root.for_module(path, module_category(sub))
        recipe = own.fp8 if as_op_table(op_table).fp8_applies("linear", own) else None
        if isinstance(recipe, recipe_type):
            found.append((path, sub, recipe))
        elif isinstance(sub, converted):
            revert(sub)
    return found
