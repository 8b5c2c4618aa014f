"""The memory part of a policy: where the master weights live, how an update reaches them, and the
optimizer state's storage.

Three keys of the spec grammar (:mod:`mpx.policy_spec`), three fields of :class:`mpx.Policy`:

* ``master=DTYPE`` (``master_dtype``): the dtype of the weights the optimizer updates.  The param
  dtype (the default: the optimizer updates the parameters themselves, as today) or ``float32``
  over narrower params (the optimizer keeps a float32 copy and writes each step back rounded to
  nearest).
* ``update=plain|kahan|stochastic`` (``update``): how a float32 update reaches a bfloat16 master.
  ``plain`` rounds to nearest; ``kahan`` keeps a bfloat16 compensation buffer (optimi's Kahan
  summation); ``stochastic`` rounds stochastically with counter-based random bits
  (:mod:`mpx.kernels.rounding`), the same bits in every framework.  ``kahan`` and ``stochastic``
  need ``master=bfloat16``.
* ``opt_state=float32|bfloat16|int8:BLOCK`` (``opt_state``): the dtype the optimizer's state (Adam's
  moments) is stored in between steps; ``int8:BLOCK`` is 8-bit linear absmax quantization in
  blocks of ``BLOCK`` elements (a power of two from 32 to 4096; ``int8`` alone is ``int8:256``).
  The update is always computed in float32.

>>> check_fields("bfloat16", "bfloat16", "kahan", "bfloat16")
('bfloat16', 'kahan', 'bfloat16')
>>> opt_state_value("int8")
'int8:256'
>>> check_fields("float32", "float32", "kahan", "float32")
Traceback (most recent call last):
...
mpx.errors.PolicyError: update: 'kahan' needs master=bfloat16 (a bfloat16 master weight), got master=float32; use update=plain or master=bfloat16 with params=bfloat16
"""

from __future__ import annotations

from typing import Any

from mpx.dtypes import FLOATING_DTYPES, canonical_dtype
from mpx.errors import DTypeError, PolicyError

__all__ = [
    "DEFAULT_BLOCK",
    "OPT_STATES",
    "UPDATES",
    "UPDATE_KEYS",
    "UPDATE_PRESETS",
    "check_fields",
    "int8_block",
    "needs_policy_optimizer",
    "opt_state_value",
    "update_text",
]

#: The update rules: round to nearest, Kahan-compensated, stochastically rounded.
UPDATES: tuple[str, ...] = ("plain", "kahan", "stochastic")
#: The optimizer-state storage forms (``int8`` takes a block size: ``int8:256``).
OPT_STATES: tuple[str, ...] = ("float32", "bfloat16", "int8")
#: The block size of ``opt_state=int8`` when none is named.
DEFAULT_BLOCK = 256
#: The spec keys of this part of a policy and the :class:`mpx.Policy` field each one sets.
UPDATE_KEYS: dict[str, str] = {"master": "master_dtype", "update": "update", "opt_state": "opt_state"}
#: The memory presets: a dtype preset plus these fields.
UPDATE_PRESETS: dict[str, tuple[str, dict[str, str]]] = {
    "bf16_kahan": ("bfloat16", {"master_dtype": "bfloat16", "update": "kahan"}),
    "bf16_sr": ("bfloat16", {"master_dtype": "bfloat16", "update": "stochastic"}),
    "mixed_bfloat16_8bit_adam": ("mixed_bfloat16", {"opt_state": f"int8:{DEFAULT_BLOCK}"}),
}
_OPT_ALLOWED = (
    "float32, bfloat16 or int8:BLOCK (BLOCK a power of two from 32 to 4096; int8 alone is int8:256)"
)


def opt_state_value(value: Any) -> str:
    """``value`` as a canonical ``opt_state`` (``"float32"``, ``"bfloat16"`` or ``"int8:BLOCK"``).

    Raises:
        PolicyError: naming ``opt_state`` and what is allowed.
    """
    bad = PolicyError(f"opt_state: {value!r} is not allowed; allowed: {_OPT_ALLOWED}")
    if not isinstance(value, str):
        raise bad
    kind, sep, block = value.strip().partition(":")
    if kind == "int8":
        if not sep:
            return f"int8:{DEFAULT_BLOCK}"
        if not (block.isascii() and block.isdigit()) or int(block) not in [2**k for k in range(5, 13)]:
            raise bad
        return f"int8:{int(block)}"
    if sep:
        raise bad
    try:
        name = canonical_dtype(kind, field="opt_state", allowed=FLOATING_DTYPES)
    except DTypeError:
        raise bad from None
    if name not in ("float32", "bfloat16"):
        raise bad
    return name


def int8_block(opt_state: str) -> int | None:
    """The block size of an ``int8:BLOCK`` state, or None for a float state."""
    return int(opt_state.split(":")[1]) if opt_state.startswith("int8:") else None


def check_fields(param_dtype: str, master: Any, update: Any, opt_state: Any) -> tuple[str, str, str]:
    """The canonical ``(master_dtype, update, opt_state)`` of a policy whose params are ``param_dtype``
    (``master`` None: the param dtype).

    Raises:
        PolicyError: naming the key (``master``, ``update`` or ``opt_state``) and what is allowed.
    """
    if master is None:
        master = param_dtype
    else:
        try:
            master = canonical_dtype(master, field="master", allowed=FLOATING_DTYPES)
        except DTypeError as err:
            raise PolicyError(str(err)) from None
        if master != param_dtype and master != "float32":
            raise PolicyError(
                f"master: {master!r} with params={param_dtype} is not allowed; the master weights are the "
                f"params ({param_dtype}) or a float32 copy of narrower params"
            )
        if master == "float32" and param_dtype == "float64":
            raise PolicyError("master: float32 is narrower than params=float64; allowed: master=float64")
    if update not in UPDATES:
        raise PolicyError(f"update: {update!r} is not allowed; allowed: {', '.join(UPDATES)}")
    if update != "plain" and master != "bfloat16":
        raise PolicyError(
            f"update: {update!r} needs master=bfloat16 (a bfloat16 master weight), got master={master}; "
            "use update=plain or master=bfloat16 with params=bfloat16"
        )
    return master, update, opt_state_value(opt_state)


def update_text(param_dtype: str, master: str, update: str, opt_state: str) -> str:
    """The spec keys of these fields that differ from the defaults (``,master=..``), for ``str(policy)``."""
    text = "" if master == param_dtype else f",master={master}"
    if update != "plain":
        text += f",update={update}"
    if opt_state != "float32":
        text += f",opt_state={opt_state}"
    return text


def needs_policy_optimizer(policy: Any) -> bool:
    """Whether ``policy`` (an :class:`mpx.Policy`) names a memory key that only a policy optimizer honours: a
    float32 master over narrower params, ``update=kahan|stochastic``, or an ``opt_state`` other than float32."""
    return (
        policy.master_dtype != policy.param_dtype or policy.update != "plain" or policy.opt_state != "float32"
    )
