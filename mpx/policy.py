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

FP8 (:mod:`mpx.float8`) is one more key: ``fp8=hybrid`` (or ``e4m3``) turns the
LOWER GEMMs (:data:`mpx.float8.FP8_OPS`: linear, matmul, einsum) into FP8 GEMMs
with a :class:`mpx.Float8Recipe`; every other op follows the compute dtype.
An override whose spec names no dtype starts from its parent, so
``@head={fp8=none}`` is "the parent policy without FP8":

>>> p = get_policy("mixed_bfloat16,fp8=hybrid,fp8_history=16,@head={fp8=none}")
>>> p.fp8.format, p.fp8.amax_history_len, p.for_module("head").fp8, p.for_module("head").compute_dtype
('hybrid', 16, None, 'bfloat16')
>>> str(p)
'params=float32,compute=bfloat16,output=float32,fp8=hybrid,fp8_history=16,@head={params=float32,compute=bfloat16,output=float32}'
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from mpx.blocks import BlockRecipe
from mpx.dtypes import HALF_DTYPES
from mpx.errors import Float8Error, PolicyError
from mpx.float8 import Float8Recipe, recipe_from_dict
from mpx.policy_spec import (
    CATEGORIES,
    FP8_KEYS,
    FP8_PRESET_RECIPES,
    PRESET_ALIASES,
    PRESET_DTYPES,
    categories,
    check_selector,
    default_keep_fp32,
    dtype,
    parse,
)
from mpx.update_policy import UPDATE_PRESETS, check_fields, update_text

__all__ = [
    "CATEGORIES",
    "FP8_KEYS",
    "FP8_PRESETS",
    "PRESETS",
    "PRESET_ALIASES",
    "MEMORY_PRESETS",
    "Override",
    "Policy",
    "PolicySpec",
    "get_policy",
]

_FP8_DEFAULT = Float8Recipe()


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
        check_selector(self.selector)
        if not isinstance(self.policy, Policy):
            raise PolicyError(
                f"override {self.selector!r}: policy must be an mpx.Policy, got {type(self.policy).__name__}"
            )
        if self.policy.overrides:
            raise PolicyError(
                f"override {self.selector!r}: an override's policy cannot have overrides of its own"
            )
        if update_text(
            self.policy.param_dtype, self.policy.master_dtype, self.policy.update, self.policy.opt_state
        ):
            raise PolicyError(
                f"override {self.selector!r}: master, update and opt_state are whole-model keys (the "
                "optimizer's); an override's policy keeps their defaults"
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
        fp8: keyword only; the :class:`mpx.Float8Recipe` of the FP8 GEMMs (the
            LOWER ops of :data:`mpx.float8.FP8_OPS`), or ``None`` (the default)
            for none.  Allowed with a float32, bfloat16 or float16 compute dtype
            (an FP8 GEMM returns the compute dtype); not with float64.  The
            float32 rules of ``keep_fp32`` (norms, softmax, losses) never use FP8.
        master_dtype: keyword only; the dtype of the weights the optimizer updates:
            ``None`` (the default) the param dtype, or ``"float32"`` over narrower params
            (:mod:`mpx.update_policy`).
        update: keyword only; ``"plain"`` (the default), ``"kahan"`` or ``"stochastic"``:
            how a float32 update reaches a bfloat16 master (the last two need
            ``master_dtype="bfloat16"``).
        opt_state: keyword only; the optimizer state's storage between steps:
            ``"float32"`` (the default), ``"bfloat16"`` or ``"int8:BLOCK"``.

    Dtypes accept every alias (``"bf16"``, ``"half"``, numpy dtypes...) and are
    stored under their canonical names.
    """

    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    output_dtype: str = "float32"
    keep_fp32: tuple[str, ...] | None = None
    overrides: tuple[Override, ...] = ()
    reduce_dtype: str | None = dataclasses.field(default=None, kw_only=True)
    fp8: Float8Recipe | BlockRecipe | None = dataclasses.field(default=None, kw_only=True)
    master_dtype: str | None = dataclasses.field(default=None, kw_only=True)
    update: str = dataclasses.field(default="plain", kw_only=True)
    opt_state: str = dataclasses.field(default="float32", kw_only=True)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "param_dtype", dtype(self.param_dtype, "params"))
        set_(self, "compute_dtype", dtype(self.compute_dtype, "compute"))
        set_(self, "output_dtype", dtype(self.output_dtype, "output"))
        reduce = self.param_dtype if self.reduce_dtype is None else dtype(self.reduce_dtype, "reduce")
        set_(self, "reduce_dtype", reduce)
        keep = default_keep_fp32(self.compute_dtype) if self.keep_fp32 is None else categories(self.keep_fp32)
        set_(self, "keep_fp32", keep)
        if isinstance(self.overrides, (str, Mapping)):
            raise PolicyError("overrides: expected a sequence of Override rules or (selector, spec) pairs")
        set_(self, "overrides", tuple(_as_override(rule) for rule in self.overrides))
        if self.fp8 is not None:
            if not isinstance(self.fp8, (Float8Recipe, BlockRecipe)):
                raise PolicyError(
                    f"fp8: expected an mpx.Float8Recipe or None, got {type(self.fp8).__name__} "
                    "(or an mpx.blocks.BlockRecipe); "
                    "in a spec write fp8=hybrid, fp8=e4m3 or fp8=none"
                )
            if self.compute_dtype == "float64":
                raise PolicyError(
                    "fp8: FP8 GEMMs need a compute dtype of float32, bfloat16 or float16 "
                    "(the GEMM returns the compute dtype), got float64"
                )
        memory = check_fields(self.param_dtype, self.master_dtype, self.update, self.opt_state)
        for field, value in zip(("master_dtype", "update", "opt_state"), memory, strict=True):
            set_(self, field, value)

    @property
    def _memory_default(self) -> bool:
        return not update_text(self.param_dtype, self.master_dtype, self.update, self.opt_state)

    # -- derived, read-only ---------------------------------------------------
    @property
    def name(self) -> str | None:
        """The preset name of this policy (``"mixed_float16"``, ``"mixed_bfloat16_fp8"``...), or None."""
        for name, dtypes in PRESET_DTYPES.items():
            if (self.param_dtype, self.compute_dtype, self.output_dtype) == dtypes and (
                self.keep_fp32 == default_keep_fp32(self.compute_dtype)
                and not self.overrides
                and self.reduce_dtype == self.param_dtype
                and self.fp8 is None
                and self._memory_default
            ):
                return name
        for name, policy in (FP8_PRESETS | MEMORY_PRESETS).items():
            if self == policy:
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
            "fp8": None if self.fp8 is None else self.fp8.to_dict(),
        } | self._memory_dict()

    def _memory_dict(self) -> dict[str, str]:
        """The memory fields that differ from the defaults (a default policy's dict is as before them)."""
        return {
            k: v
            for k, v, default in (
                ("master_dtype", self.master_dtype, self.param_dtype),
                ("update", self.update, "plain"),
                ("opt_state", self.opt_state, "float32"),
            )
            if v != default
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Policy:
        """Read a :meth:`to_dict` dict back, validating every key (``fp8`` and ``reduce_dtype`` may be missing)."""
        if not isinstance(data, Mapping):
            raise PolicyError(f"policy dict: expected a mapping, got {type(data).__name__}")
        required = ("param_dtype", "compute_dtype", "output_dtype")
        allowed = (
            *required,
            "reduce_dtype",
            "keep_fp32",
            "overrides",
            "fp8",
            "master_dtype",
            "update",
            "opt_state",
        )
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
            rules.append(Override(check_selector(rule["selector"]), cls.from_dict(inner)))
        recipe = data.get("fp8")
        if recipe is not None:
            try:
                recipe = recipe_from_dict(recipe)
            except Float8Error as err:
                raise PolicyError(f"policy dict: fp8: {err}") from None
        return cls(
            data["param_dtype"],
            data["compute_dtype"],
            data["output_dtype"],
            keep_fp32=data.get("keep_fp32"),
            overrides=tuple(rules),
            reduce_dtype=data.get("reduce_dtype"),
            fp8=recipe,
            master_dtype=data.get("master_dtype"),
            update=data.get("update", "plain"),
            opt_state=data.get("opt_state", "float32"),
        )

    def __str__(self) -> str:
        text = f"params={self.param_dtype},compute={self.compute_dtype},output={self.output_dtype}"
        if self.reduce_dtype != self.param_dtype:
            text += f",reduce={self.reduce_dtype}"
        if self.keep_fp32 != default_keep_fp32(self.compute_dtype):
            text += ",keep_fp32=" + ("+".join(self.keep_fp32) or "none")
        if self.fp8 is not None:
            text += _fp8_text(self.fp8)
        text += update_text(self.param_dtype, self.master_dtype, self.update, self.opt_state)
        for rule in self.overrides:
            text += f",@{rule.selector}={{{rule.policy}}}"
        return text

    def __repr__(self) -> str:
        return f'<Policy "{self.name or self}">'


PolicySpec = Policy | str | Mapping[str, Any]

#: The preset policies by name.
PRESETS: dict[str, Policy] = {name: Policy(*dts) for name, dts in PRESET_DTYPES.items()}
#: The FP8 preset policies by name (see :data:`mpx.policy_spec.FP8_PRESET_RECIPES`): readable wherever a preset is.
FP8_PRESETS: dict[str, Policy] = {
    name: dataclasses.replace(PRESETS[base], fp8=recipe)
    for name, (base, recipe) in FP8_PRESET_RECIPES.items()
}
#: The memory preset policies by name (see :data:`mpx.update_policy.UPDATE_PRESETS`): ``bf16_kahan``,
#: ``bf16_sr``, ``mixed_bfloat16_8bit_adam``.
MEMORY_PRESETS: dict[str, Policy] = {
    name: dataclasses.replace(PRESETS[base], **fields) for name, (base, fields) in UPDATE_PRESETS.items()
}


def _fp8_text(recipe: Float8Recipe | BlockRecipe) -> str:
    """``,fp8=FORMAT`` and every recipe key that differs from the default, in :data:`FP8_KEYS` order."""
    if isinstance(recipe, BlockRecipe):  # a preset's name; a custom block recipe has no spec spelling
        key = "fp4" if recipe.element == "e2m1" else "fp8"
        return f",{key}={recipe.name or 'custom_block_recipe'}"
    text = f",fp8={recipe.format}"
    for key, field in FP8_KEYS.items():
        value = getattr(recipe, field)
        if key != "fp8" and value != getattr(_FP8_DEFAULT, field):
            text += f",{key}={str(value).lower() if isinstance(value, bool) else value}"
    return text


def _as_override(rule: Any) -> Override:
    if isinstance(rule, Override):
        return rule
    if isinstance(rule, tuple) and len(rule) == 2:
        selector, spec = rule
        return Override(check_selector(selector), get_policy(spec))
    raise PolicyError(f"overrides: expected an Override or a (selector, spec) pair, got {rule!r}")


def get_policy(spec: PolicySpec) -> Policy:
    """Read a policy from a :class:`Policy`, a ``to_dict()`` dict or a string.

    Strings are a preset (``float32``, ``mixed_float16``, ``mixed_bfloat16``,
    ``float16``, ``bfloat16``; the FP8 presets ``mixed_bfloat16_fp8`` and
    ``mixed_bfloat16_fp8_current``), an ecosystem name (``32-true``, ``16-mixed``,
    ``bf16-mixed``, ``16-true``, ``bf16-true``, ``no``, ``fp16``, ``bf16``) or
    the key form ``params=...,compute=...,output=...`` (keys ``p c o r`` or
    ``params compute output reduce``, plus ``keep_fp32``, the FP8 keys and
    ``@SELECTOR={SPEC}`` override rules), optionally after a preset (``mixed_bfloat16,reduce=bf16``:
    the preset's dtypes, then the keys).  A missing params defaults to float32,
    a missing compute to params, a missing output to compute, a missing reduce
    (the dtype of the gradient all-reduce across replicas) to params.

    FP8 keys (:data:`FP8_KEYS`; written by ``str()`` only when set, recipe keys
    only when they differ from :class:`mpx.Float8Recipe`'s defaults):
    ``fp8=hybrid|e4m3|none`` (the recipe's format, or no FP8),
    ``fp8_scaling=delayed|current``, ``fp8_history=N`` (amax history length,
    >= 1), ``fp8_amax=max|most_recent``, ``fp8_margin=N`` (>= 0),
    ``fp8_pow2=true|false`` (power-of-two scales).  A recipe key needs FP8 on
    (from ``fp8=`` or an FP8 preset).  An override's spec that names no dtype
    (no preset and none of params, compute, output, reduce) starts from its
    parent policy and changes only the keys it names: ``@head={fp8=none}``.

    Memory keys (:mod:`mpx.update_policy`; whole-model, not in an override): ``master=DTYPE``
    (the optimizer's weights: the params or a float32 copy), ``update=plain|kahan|stochastic``
    (kahan and stochastic need ``master=bfloat16``), ``opt_state=float32|bfloat16|int8:BLOCK``;
    the presets ``bf16_kahan``, ``bf16_sr`` and ``mixed_bfloat16_8bit_adam``.

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
        name = spec.strip()
        name = PRESET_ALIASES.get(name, name)
        preset = PRESETS.get(name) or FP8_PRESETS.get(name) or MEMORY_PRESETS.get(name)
        return preset if preset is not None else Policy.from_dict(parse(spec))
    if isinstance(spec, Mapping):
        return Policy.from_dict(spec)
    raise PolicyError(f"policy: expected an mpx.Policy, a spec string or a dict, got {type(spec).__name__}")
