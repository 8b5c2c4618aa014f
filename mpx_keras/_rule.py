"""The op-table rule and the global policy's rule of this thread: what :mod:`mpx_keras.autocast` reads and
:mod:`mpx_keras.policy` sets (a leaf module: both import it, it imports neither)."""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import keras

import mpx
from mpx.ops import OpTable, as_op_table

__all__ = ["GLOBAL", "Rule", "active_global_policy", "active_global_rule", "check_op_table"]


class Rule(NamedTuple):
    """A policy with its op table, and whether it forces float32 (a float32 scope nested in a mixed one)."""

    policy: mpx.Policy
    table: OpTable
    forced: bool = False


#: ``op_table`` as an OpTable (None: mpx.OP_TABLE); the core's one reading of every ``op_table=`` argument.
check_op_table = as_op_table

#: This thread's global policy: ``GLOBAL.current`` is ``(rule, the Keras DTypePolicy set with it)`` or
#: absent, ``GLOBAL.release`` the release of the op table's hold it takes (Keras keeps its global dtype
#: policy per thread; mpx's rule rides along, remembered with the Keras object it set).
GLOBAL: Any = threading.local()


def active_global_rule() -> Rule | None:
    """The op-table rule of the policy :func:`mpx_keras.set_global_policy` (or :func:`mpx_keras.policy_scope`)
    set, while Keras's global policy is still the one it set; else None.

    This is what :mod:`mpx_keras.autocast`'s op table falls back on outside any ``autocast`` scope.
    """
    current = getattr(GLOBAL, "current", None)
    if current is not None and current[1] is keras.config.dtype_policy():
        return current[0]
    return None


def active_global_policy() -> mpx.Policy | None:
    """The policy of :func:`active_global_rule`, or None."""
    rule = active_global_rule()
    return None if rule is None else rule.policy
