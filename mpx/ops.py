"""Which ops run in half precision, which stay in float32, and what they return.

>>> classify("softmax")
<OpClass.FLOAT32: 'float32'>
>>> result_dtype("matmul", "mixed_float16", ["float32", "float32"])
'float16'
>>> result_dtype("softmax", "mixed_float16", ["float16"])
'float32'
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from mpx.dtypes import canonical_dtype, widest_dtype
from mpx.errors import MPXError
from mpx.float8 import FP8_OPS
from mpx.policy import PolicySpec, get_policy

__all__ = ["OP_CATEGORIES", "OP_TABLE", "OpClass", "OpTable", "as_op_table", "classify", "fp8_applies", "result_dtype"]


class OpClass(str, enum.Enum):
    """How an op's result dtype is chosen under a lowering policy."""

    #: run in the policy's compute dtype
    LOWER = "lower"
    #: always float32 (float64 inputs stay float64)
    FLOAT32 = "float32"
    #: the widest floating input
    PROMOTE = "promote"
    #: the (first) input's dtype
    PASSTHROUGH = "passthrough"

    def __str__(self) -> str:
        return self.value


_DEFAULTS: dict[OpClass, tuple[str, ...]] = {
    OpClass.LOWER: ("matmul", "linear", "conv", "conv_transpose", "bmm", "einsum", "attention"),
    OpClass.FLOAT32: (
        "softmax", "log_softmax", "layer_norm", "batch_norm", "group_norm", "rms_norm",
        "cross_entropy", "nll_loss", "mse_loss", "bce_with_logits", "exp", "log", "pow",
        "sum", "mean", "cumsum", "prod", "logsumexp", "vector_norm",
    ),
    OpClass.PROMOTE: ("add", "mul", "cat", "stack", "where"),
    OpClass.PASSTHROUGH: ("relu", "gelu", "max_pool", "reshape", "transpose", "dropout", "embedding"),
}  # fmt: skip

#: The policy category of each op that has one: a policy that does not keep
#: that category in float32 (``keep_fp32``) runs the op in its compute dtype.
OP_CATEGORIES: dict[str, str] = {
    "softmax": "softmax",
    "log_softmax": "softmax",
    "layer_norm": "normalization",
    "batch_norm": "normalization",
    "group_norm": "normalization",
    "rms_norm": "normalization",
    "cross_entropy": "loss",
    "nll_loss": "loss",
    "mse_loss": "loss",
    "bce_with_logits": "loss",
}


class OpTable(Mapping[str, OpClass]):
    """An immutable map from canonical op names to :class:`OpClass`.

    >>> table = OP_TABLE.replace(softmax=OpClass.LOWER, gelu="float32")
    >>> table["softmax"], table["gelu"], OP_TABLE["softmax"]
    (<OpClass.LOWER: 'lower'>, <OpClass.FLOAT32: 'float32'>, <OpClass.FLOAT32: 'float32'>)
    """

    def __init__(self, classes: Mapping[str, OpClass | str]) -> None:
        table: dict[str, OpClass] = {}
        for op, cls in classes.items():
            if not isinstance(op, str) or not op:
                raise MPXError(f"op: expected a non-empty op name, got {op!r}")
            table[op] = _op_class(cls, op)
        self._table = table

    def __getitem__(self, op: str) -> OpClass:
        try:
            return self._table[op]
        except KeyError:
            raise MPXError(
                f"op: {op!r} is not in the op table; known ops: {', '.join(sorted(self._table))}"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, op: object) -> bool:
        return op in self._table

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OpTable) and self._table == other._table

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._table.items())))

    def __repr__(self) -> str:
        return f"OpTable({len(self)} ops)"

    def replace(self, changes: Mapping[str, OpClass | str] | None = None, **kw: OpClass | str) -> OpTable:
        """A copy with ops added or reclassified (``changes`` and keywords)."""
        return OpTable({**self._table, **(changes or {}), **kw})

    def without(self, *ops: str) -> OpTable:
        """A copy without ``ops`` (each must be present)."""
        for op in ops:
            self[op]
        return OpTable({k: v for k, v in self._table.items() if k not in ops})

    def ops(self, cls: OpClass | str) -> tuple[str, ...]:
        """The ops of one class, in table order."""
        cls = _op_class(cls, "cls")
        return tuple(op for op, c in self._table.items() if c is cls)

    def classify(self, op: str, policy: PolicySpec | None = None) -> OpClass:
        """The class of ``op``; with a policy, after its ``keep_fp32`` choice.

        An op in a category the policy does not keep in float32
        (``keep_fp32=none``, say) is LOWER under that policy.
        """
        cls = self[op]
        if policy is not None and cls is OpClass.FLOAT32 and op in OP_CATEGORIES:
            if OP_CATEGORIES[op] not in get_policy(policy).keep_fp32:
                return OpClass.LOWER
        return cls

    def fp8_applies(self, op: str, policy: PolicySpec) -> bool:
        """Whether ``op`` runs as an FP8 GEMM under ``policy``.

        True when the policy has an ``fp8`` recipe, ``op`` is one of
        :data:`mpx.float8.FP8_OPS` (linear, matmul, einsum) and this table
        classifies it LOWER under the policy.  Everything else follows the
        compute dtype.

        >>> OP_TABLE.fp8_applies("linear", "mixed_bfloat16_fp8"), OP_TABLE.fp8_applies("softmax", "mixed_bfloat16_fp8")
        (True, False)
        """
        pol = get_policy(policy)
        if pol.fp8 is None or op not in FP8_OPS:
            return False
        return self.classify(op, pol) is OpClass.LOWER

    def result_dtype(self, op: str, policy: PolicySpec, input_dtypes: Iterable[Any] | str) -> str:
        """The dtype ``op`` returns under ``policy`` for floating inputs of ``input_dtypes``.

        Under a policy whose compute dtype is not half precision nothing is
        lowered or raised: every op returns the widest input (a no-op autocast).
        """
        pol = get_policy(policy)
        names = [input_dtypes] if isinstance(input_dtypes, str) else list(input_dtypes)
        names = [canonical_dtype(d, field="input_dtypes") for d in names]
        widest = widest_dtype(names)
        if not pol.lowers_precision:
            return widest
        cls = self.classify(op, pol)
        if cls is OpClass.LOWER:
            return pol.compute_dtype
        if cls is OpClass.FLOAT32:
            return "float64" if widest == "float64" else "float32"
        if cls is OpClass.PROMOTE:
            return widest
        return names[0]


def _op_class(value: Any, field: str) -> OpClass:
    try:
        return OpClass(value)
    except ValueError:
        raise MPXError(
            f"{field}: {value!r} is not an op class; allowed: {', '.join(c.value for c in OpClass)}"
        ) from None


#: The default op table (after the seed recommendation and torch's CUDA lists).
OP_TABLE = OpTable({op: cls for cls, ops in _DEFAULTS.items() for op in ops})


def as_op_table(op_table: Any) -> OpTable:
    """``op_table`` as every backend's ``op_table=`` argument reads it: an :class:`OpTable`, or None for
    :data:`OP_TABLE`.

    Raises:
        MPXError: for anything else, naming the type.

    >>> as_op_table(None) is OP_TABLE
    True
    """
    if op_table is None:
        return OP_TABLE
    if not isinstance(op_table, OpTable):
        raise MPXError(f"op_table: expected an mpx.OpTable or None, got {type(op_table).__name__}.")
    return op_table


def classify(op: str, policy: PolicySpec | None = None) -> OpClass:
    """The class of ``op`` in :data:`OP_TABLE` (see :meth:`OpTable.classify`)."""
    return OP_TABLE.classify(op, policy)


def fp8_applies(op: str, policy: PolicySpec, op_table: OpTable | None = None) -> bool:
    """Whether ``op`` runs as an FP8 GEMM under ``policy`` (see :meth:`OpTable.fp8_applies`; ``op_table``
    default :data:`OP_TABLE`)."""
    return as_op_table(op_table).fp8_applies(op, policy)


def result_dtype(op: str, policy: PolicySpec, input_dtypes: Iterable[Any] | str) -> str:
    """The dtype ``op`` returns under ``policy`` (see :meth:`OpTable.result_dtype`)."""
    return OP_TABLE.result_dtype(op, policy, input_dtypes)
