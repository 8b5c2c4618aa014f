"""Mixed-precision policies: which dtype parameters, computation and outputs use.

A :class:`Policy` names three dtypes and a list of override rules.  Policies
come from :func:`get_policy`, which reads a preset name, an ecosystem alias,
the key grammar, a ``Policy.to_dict()`` dict or a ``Policy``:

>>> p = get_policy("mixed_float16")
>>> p.param_dtype, p.compute_dtype, p.output_dtype
('float32', 'float16', 'float32')
>>> str(p)
'params=float32,compute=float16,output=float32'
>>> get_policy("p=bf16") == get_policy("bf16-true")
True
>>> p.for_module("encoder.0.norm", category="normalization").compute_dtype
'float32'
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from mpx.dtypes import FLOATING_DTYPES, HALF_DTYPES, canonical_dtype
from mpx.errors import DTypeError, PolicyError

__all__ = [
    "CATEGORIES",
    "PRESETS",
    "PRESET_ALIASES",
    "Override",
    "Policy",
    "PolicySpec",
    "get_policy",
]

#: Categories that a selector ``category:NAME`` and the ``keep_fp32`` key may name.
CATEGORIES: tuple[str, ...] = ("normalization", "softmax", "loss")

#: The preset names, each as (params, compute, output).
_PRESET_DTYPES: dict[str, tuple[str, str, str]] = {
    "float32": ("float32", "float32", "float32"),
    "mixed_float16": ("float32", "float16", "float32"),
    "mixed_bfloat16": ("float32", "bfloat16", "float32"),
    "float16": ("float16", "float16", "float16"),
    "bfloat16": ("bfloat16", "bfloat16", "bfloat16"),
}

#: The ecosystem's names for the presets: Lightning's ``precision=`` and Accelerate's ``mixed_precision=``.
PRESET_ALIASES: dict[str, str] = {
    "32-true": "float32",
    "16-mixed": "mixed_float16",
    "bf16-mixed": "mixed_bfloat16",
    "16-true": "float16",
    "bf16-true": "bfloat16",
    "no": "float32",
    "fp16": "mixed_float16",
    "bf16": "mixed_bfloat16",
}

_KEYS: dict[str, str] = {
    "p": "params",
    "params": "params",
    "c": "compute",
    "compute": "compute",
    "o": "output",
    "output": "output",
    "r": "reduce",
    "reduce": "reduce",
    "keep_fp32": "keep_fp32",
}
_SELECTOR = re.compile(r"^[A-Za-z0-9_.*?\[\]!/\-]+$")
_GRAMMAR = "params=DTYPE,compute=DTYPE,output=DTYPE[,reduce=DTYPE][,keep_fp32=CATS][,@SELECTOR={SPEC}]"


def _default_keep_fp32(compute_dtype: str) -> tuple[str, ...]:
    return CATEGORIES if compute_dtype in HALF_DTYPES else ()


def _dtype(value: Any, field: str) -> str:
    try:
        return canonical_dtype(value, field=field, allowed=FLOATING_DTYPES)
    except DTypeError as err:
        raise PolicyError(str(err)) from None


def _categories(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        raise PolicyError(
            f"keep_fp32: expected a sequence of categories, got the string {value!r}; "
            f"write ({value!r},) or use the spec form keep_fp32=a+b"
        )
    try:
        items = list(value)
    except TypeError:
        raise PolicyError(
            f"keep_fp32: expected a sequence of categories ({', '.join(CATEGORIES)}), got {value!r}"
        ) from None
    seen: set[str] = set()
    for item in items:
        if not isinstance(item, str) or item not in CATEGORIES:
            shown = repr(item) if len(repr(item)) <= 60 else f"a {type(item).__name__}"
            raise PolicyError(f"keep_fp32: unknown category {shown}; allowed: {', '.join(CATEGORIES)}")
        if item in seen:
            raise PolicyError(f"keep_fp32: category {item!r} is named twice")
        seen.add(item)
    return tuple(c for c in CATEGORIES if c in seen)


def _check_selector(selector: Any) -> str:
    if not isinstance(selector, str) or not selector:
        raise PolicyError(f"selector: expected a module-path glob or 'category:NAME', got {selector!r}")
    if selector.startswith("category:"):
        name = selector[len("category:") :]
        if name not in CATEGORIES:
            raise PolicyError(
                f"selector: unknown category {name!r} in {selector!r}; "
                f"allowed: {', '.join('category:' + c for c in CATEGORIES)}"
            )
        return selector
    if not _SELECTOR.match(selector):
        raise PolicyError(
            f"selector: {selector!r} is not a module-path glob; allowed characters are "
            "letters, digits and _ . / - * ? [ ] !"
        )
    return selector


@dataclass(frozen=True)
class Override:
    """One override rule: submodules matched by ``selector`` use ``policy``.

    ``selector`` is a module-path glob (``"encoder.*.norm"``, matched with
    :func:`fnmatch.fnmatchcase` against the whole dotted path) or a category
    (``"category:normalization"``).
    """

    selector: str
    policy: Policy

    def __post_init__(self) -> None:
        _check_selector(self.selector)
        if not isinstance(self.policy, Policy):
            raise PolicyError(
                f"override {self.selector!r}: policy must be an mpx.Policy, got {type(self.policy).__name__}"
            )
        if self.policy.overrides:
            raise PolicyError(
                f"override {self.selector!r}: an override's policy cannot have overrides of its own"
            )

    @property
    def category(self) -> str | None:
        """The category this rule selects, or None for a path glob."""
        if self.selector.startswith("category:"):
            return self.selector[len("category:") :]
        return None

    def matches(self, path: str, category: str | None = None) -> bool:
        """Whether this rule applies to the submodule at ``path`` of ``category``."""
        if self.category is not None:
            return self.category == category
        return fnmatch.fnmatchcase(path, self.selector)


@dataclass(frozen=True, repr=False)
class Policy:
    """A mixed-precision policy: frozen, hashable, comparable.

    Args:
        param_dtype: dtype parameters are stored in (default ``"float32"``).
        compute_dtype: dtype layers and lowered ops compute in (default ``"float32"``).
        output_dtype: dtype a prepared model returns (default ``"float32"``).
        keep_fp32: categories computed in float32 whatever the compute dtype;
            ``None`` (the default) means all of :data:`CATEGORIES` when the
            compute dtype is float16 or bfloat16, none otherwise.
        overrides: ordered :class:`Override` rules (or ``(selector, spec)`` pairs).
        reduce_dtype: keyword only; the dtype gradients are all-reduced in across
            replicas (DDP's comm hook, FSDP2's ``reduce_dtype``); ``None`` (the
            default) means the param dtype.

    Dtypes accept every alias (``"bf16"``, ``"half"``, numpy dtypes...) and are
    stored under their canonical names.
    """

    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    output_dtype: str = "float32"
    keep_fp32: tuple[str, ...] | None = None
    overrides: tuple[Override, ...] = ()
    reduce_dtype: str | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "param_dtype", _dtype(self.param_dtype, "params"))
        set_(self, "compute_dtype", _dtype(self.compute_dtype, "compute"))
        set_(self, "output_dtype", _dtype(self.output_dtype, "output"))
        reduce = self.param_dtype if self.reduce_dtype is None else _dtype(self.reduce_dtype, "reduce")
        set_(self, "reduce_dtype", reduce)
        keep = (
            _default_keep_fp32(self.compute_dtype) if self.keep_fp32 is None else _categories(self.keep_fp32)
        )
        set_(self, "keep_fp32", keep)
        if isinstance(self.overrides, (str, Mapping)):
            raise PolicyError("overrides: expected a sequence of Override rules or (selector, spec) pairs")
        set_(self, "overrides", tuple(_as_override(rule) for rule in self.overrides))

    # -- derived, read-only ---------------------------------------------------
    @property
    def name(self) -> str | None:
        """The preset name of this policy (``"mixed_float16"``...), or None."""
        for name, dtypes in _PRESET_DTYPES.items():
            if (self.param_dtype, self.compute_dtype, self.output_dtype) == dtypes and (
                self.keep_fp32 == _default_keep_fp32(self.compute_dtype)
                and not self.overrides
                and self.reduce_dtype == self.param_dtype
            ):
                return name
        return None

    @property
    def lowers_precision(self) -> bool:
        """True when the compute dtype is float16 or bfloat16 (autocast is active)."""
        return self.compute_dtype in HALF_DTYPES

    @property
    def is_mixed(self) -> bool:
        """True when parameters are stored in a wider dtype than the computation."""
        return self.param_dtype != self.compute_dtype

    # -- rules -----------------------------------------------------------------
    def rules(self) -> tuple[Override, ...]:
        """Every rule in the order :meth:`for_module` applies them: keep_fp32 first, then overrides."""
        if self.keep_fp32:
            fp32 = Policy(
                self.param_dtype, "float32", "float32", keep_fp32=(), reduce_dtype=self.reduce_dtype
            )
            kept = tuple(Override(f"category:{c}", fp32) for c in self.keep_fp32)
        else:
            kept = ()
        return kept + self.overrides

    def for_module(self, path: str, category: str | None = None) -> Policy:
        """The policy for the submodule at dotted ``path`` of ``category``.

        The last matching rule wins; with no match this policy itself applies.

        Args:
            path: the module's dotted path from the root (``""`` for the root).
            category: one of :data:`CATEGORIES`, or None for other modules.
        """
        if not isinstance(path, str):
            raise PolicyError(f"path: expected a dotted module path string, got {path!r}")
        if category is not None and category not in CATEGORIES:
            raise PolicyError(
                f"category: unknown category {category!r}; allowed: {', '.join(CATEGORIES)} or None"
            )
        chosen = self
        for rule in self.rules():
            if rule.matches(path, category):
                chosen = rule.policy
        return chosen

    def with_overrides(
        self, rules: Mapping[str, PolicySpec] | Iterable[Override | tuple[str, PolicySpec]]
    ) -> Policy:
        """A copy with ``rules`` appended (later rules win over earlier ones).

        >>> p = get_policy("mixed_bfloat16").with_overrides({"head": "float32"})
        >>> p.for_module("head").compute_dtype
        'float32'
        """
        items = rules.items() if isinstance(rules, Mapping) else rules
        return dataclasses.replace(self, overrides=self.overrides + tuple(items))

    # -- serialization -----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict that :meth:`from_dict` (and :func:`get_policy`) reads back."""
        return {
            "param_dtype": self.param_dtype,
            "compute_dtype": self.compute_dtype,
            "output_dtype": self.output_dtype,
            "reduce_dtype": self.reduce_dtype,
            "keep_fp32": list(self.keep_fp32),
            "overrides": [{"selector": r.selector, "policy": r.policy.to_dict()} for r in self.overrides],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Policy:
        """Read a :meth:`to_dict` dict back, validating every key."""
        if not isinstance(data, Mapping):
            raise PolicyError(f"policy dict: expected a mapping, got {type(data).__name__}")
        required = ("param_dtype", "compute_dtype", "output_dtype")
        allowed = (*required, "reduce_dtype", "keep_fp32", "overrides")
        for key in data:
            if key not in allowed:
                raise PolicyError(f"policy dict: unknown key {key!r}; allowed: {', '.join(allowed)}")
        for key in required:
            if key not in data:
                raise PolicyError(f"policy dict: missing key {key!r}")
        overrides = data.get("overrides", [])
        if not isinstance(overrides, (list, tuple)):
            raise PolicyError("policy dict: 'overrides' must be a list of {selector, policy} dicts")
        rules = []
        for rule in overrides:
            if not isinstance(rule, Mapping) or set(rule) != {"selector", "policy"}:
                raise PolicyError(
                    f"policy dict: each override must be a dict with keys 'selector' and 'policy', got {rule!r}"
                )
            inner = rule["policy"]
            nested = inner.get("overrides") if isinstance(inner, Mapping) else None
            if nested is not None and not (
                isinstance(nested, (list, tuple)) and not nested
            ):  # no deep recursion
                raise PolicyError(
                    f"override {rule['selector']!r}: an override's policy cannot have overrides of its own"
                )
            rules.append(Override(_check_selector(rule["selector"]), cls.from_dict(inner)))
        return cls(
            data["param_dtype"],
            data["compute_dtype"],
            data["output_dtype"],
            keep_fp32=data.get("keep_fp32"),
            overrides=tuple(rules),
            reduce_dtype=data.get("reduce_dtype"),
        )

    def __str__(self) -> str:
        text = f"params={self.param_dtype},compute={self.compute_dtype},output={self.output_dtype}"
        if self.reduce_dtype != self.param_dtype:
            text += f",reduce={self.reduce_dtype}"
        if self.keep_fp32 != _default_keep_fp32(self.compute_dtype):
            text += ",keep_fp32=" + ("+".join(self.keep_fp32) or "none")
        for rule in self.overrides:
            text += f",@{rule.selector}={{{rule.policy}}}"
        return text

    def __repr__(self) -> str:
        return f'<Policy "{self.name or self}">'


PolicySpec = Policy | str | Mapping[str, Any]

#: The preset policies by name.
PRESETS: dict[str, Policy] = {name: Policy(*dts) for name, dts in _PRESET_DTYPES.items()}


def _as_override(rule: Any) -> Override:
    if isinstance(rule, Override):
        return rule
    if isinstance(rule, tuple) and len(rule) == 2:
        selector, spec = rule
        return Override(_check_selector(selector), get_policy(spec))
    raise PolicyError(f"overrides: expected an Override or a (selector, spec) pair, got {rule!r}")


def _split_segments(text: str) -> list[str]:
    """Split on commas outside braces; braces must balance."""
    segments, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth < 0:
                raise PolicyError(f"policy spec {text!r}: unmatched '}}' at position {i}")
        elif ch == "," and depth == 0:
            segments.append(text[start:i])
            start = i + 1
    if depth:
        raise PolicyError(f"policy spec {text!r}: unmatched '{{'")
    segments.append(text[start:])
    return segments


def _names() -> str:
    return ", ".join([*_PRESET_DTYPES, *PRESET_ALIASES])


def _parse(text: str, *, nested: bool) -> Policy:
    spec = text.strip()
    if not spec:
        raise PolicyError(f"policy spec is empty; allowed: a preset ({_names()}) or the key form {_GRAMMAR}")
    if spec in _PRESET_DTYPES:
        return PRESETS[spec]
    if spec in PRESET_ALIASES:
        return PRESETS[PRESET_ALIASES[spec]]
    if "=" not in spec:
        raise PolicyError(f"unknown policy name {spec!r}; allowed: {_names()}, or the key form {_GRAMMAR}")
    values: dict[str, str] = {}
    spelled: dict[str, str] = {}
    rules: list[Override] = []
    segments = _split_segments(spec)
    base: Policy | None = None
    head = segments[0].strip()
    if head in _PRESET_DTYPES or head in PRESET_ALIASES:  # "mixed_bfloat16,reduce=bf16": a preset, then keys
        base = PRESETS[PRESET_ALIASES.get(head, head)]
        segments = segments[1:]
    for index, raw in enumerate(segments, start=0 if base is None else 1):
        segment = raw.strip()
        if not segment:
            raise PolicyError(
                f"policy spec {spec!r}: segment {index + 1} is empty (a stray ','); "
                f"expected KEY=VALUE as in {_GRAMMAR}"
            )
        if segment.startswith("@"):
            if nested:
                raise PolicyError(
                    f"policy spec {spec!r}: an override's policy cannot have overrides ({segment!r})"
                )
            selector, sep, body = segment[1:].partition("=")
            selector, body = selector.strip(), body.strip()
            if not sep or not (body.startswith("{") and body.endswith("}")):
                raise PolicyError(f"policy spec {spec!r}: override {segment!r} must read @SELECTOR={{SPEC}}")
            rules.append(Override(_check_selector(selector), _parse(body[1:-1], nested=True)))
            continue
        key, sep, value = segment.partition("=")
        key, value = key.strip(), value.strip()
        if not sep:
            raise PolicyError(
                f"policy spec {spec!r}: segment {segment!r} is not KEY=VALUE; keys: {', '.join(_KEYS)}"
            )
        if not key:
            raise PolicyError(f"policy spec {spec!r}: segment {segment!r} has no key before '='")
        if "=" in value or "{" in value or "}" in value:
            raise PolicyError(
                f"policy spec {spec!r}: segment {segment!r} has a stray '=' or brace; separate keys with ','"
            )
        if not value:
            raise PolicyError(f"policy spec {spec!r}: key {key!r} has no value")
        canon = _KEYS.get(key)
        if canon is None:
            raise PolicyError(f"policy spec {spec!r}: unknown key {key!r}; allowed: {', '.join(_KEYS)}")
        if canon in values:
            raise PolicyError(
                f"policy spec {spec!r}: key {key!r} repeats {spelled[canon]!r} "
                f"(both set {canon}); give each key once"
            )
        values[canon] = value
        spelled[canon] = key
    if base is None and not {"params", "compute", "output", "reduce"} & values.keys():
        raise PolicyError(
            f"policy spec {spec!r}: names no dtype; give at least one of params, compute, output, reduce"
        )
    if base is not None:
        values = {
            "params": base.param_dtype,
            "compute": base.compute_dtype,
            "output": base.output_dtype,
        } | values
    params = _dtype(values.get("params", "float32"), "params")
    compute = _dtype(values.get("compute", params), "compute")
    output = _dtype(values.get("output", compute), "output")
    reduce = _dtype(values["reduce"], "reduce") if "reduce" in values else None
    keep: tuple[str, ...] | None = None
    if "keep_fp32" in values:
        raw_keep = values["keep_fp32"]
        if raw_keep == "none":
            keep = ()
        else:
            parts = raw_keep.split("+")
            if any(not part.strip() for part in parts):
                raise PolicyError(
                    f"keep_fp32: {raw_keep!r} has an empty name; write categories joined by '+' "
                    f"({'+'.join(CATEGORIES)}) or 'none'"
                )
            keep = _categories([part.strip() for part in parts])
    return Policy(params, compute, output, keep_fp32=keep, overrides=tuple(rules), reduce_dtype=reduce)


def get_policy(spec: PolicySpec) -> Policy:
    """Read a policy from a :class:`Policy`, a ``to_dict()`` dict or a string.

    Strings are a preset (``float32``, ``mixed_float16``, ``mixed_bfloat16``,
    ``float16``, ``bfloat16``), an ecosystem name (``32-true``, ``16-mixed``,
    ``bf16-mixed``, ``16-true``, ``bf16-true``, ``no``, ``fp16``, ``bf16``) or
    the key form ``params=...,compute=...,output=...`` (keys ``p c o r`` or
    ``params compute output reduce``, plus ``keep_fp32`` and ``@SELECTOR={SPEC}``
    override rules), optionally after a preset (``mixed_bfloat16,reduce=bf16``:
    the preset's dtypes, then the keys).  A missing params defaults to float32,
    a missing compute to params, a missing output to compute, a missing reduce
    (the dtype of the gradient all-reduce across replicas) to params.

    Raises:
        PolicyError: naming the bad token and what is allowed.

    >>> str(get_policy("p=f32, c=bf16"))
    'params=float32,compute=bfloat16,output=bfloat16'
    >>> get_policy("params=float32,compute=bfloat16,output=float32,reduce=bf16").reduce_dtype
    'bfloat16'
    >>> str(get_policy("mixed_bfloat16,reduce=bf16"))
    'params=float32,compute=bfloat16,output=float32,reduce=bfloat16'
    >>> get_policy("compute=int8")
    Traceback (most recent call last):
    ...
    mpx.errors.PolicyError: compute: 'int8' is not a floating dtype; allowed: float16, bfloat16, float32, float64
    """
    if isinstance(spec, Policy):
        return spec
    if isinstance(spec, str):
        return _parse(spec, nested=False)
    if isinstance(spec, Mapping):
        return Policy.from_dict(spec)
    raise PolicyError(f"policy: expected an mpx.Policy, a spec string or a dict, got {type(spec).__name__}")
