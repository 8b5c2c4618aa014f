"""The policy spec grammar: a string (a preset, an ecosystem alias, the key form) read into a policy dict.

:func:`mpx.get_policy` reads strings through :func:`parse`, which returns the policy
in :meth:`mpx.Policy.to_dict` form (``Policy.from_dict`` builds it); this module holds
the grammar (the keys, their aliases, the FP8 recipe keys, ``@SELECTOR={SPEC}``
overrides), the preset names and every error message about a spec string.  It sits
below :mod:`mpx.policy` (which imports it), so it never builds a ``Policy`` itself.

>>> parse("mixed_bfloat16,reduce=bf16")["reduce_dtype"]
'bfloat16'
>>> parse("p=f32,c=bf16,@head={fp8=none}")["overrides"][0]["policy"]["compute_dtype"]
'bfloat16'
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from mpx.blocks import FP4_PRESETS, FP8_PRESETS, BlockRecipe
from mpx.blocks import PRESETS as BLOCK_PRESETS
from mpx.dtypes import FLOATING_DTYPES, HALF_DTYPES, canonical_dtype
from mpx.errors import DTypeError, PolicyError
from mpx.float8 import Float8Recipe, recipe_from_dict
from mpx.update_policy import UPDATE_KEYS, UPDATE_PRESETS, check_fields

__all__ = [
    "CATEGORIES",
    "FP8_KEYS",
    "FP8_PRESET_RECIPES",
    "GRAMMAR",
    "PRESET_ALIASES",
    "PRESET_DTYPES",
    "categories",
    "check_selector",
    "default_keep_fp32",
    "dtype",
    "parse",
]

#: Categories that a selector ``category:NAME`` and the ``keep_fp32`` key may name.
CATEGORIES: tuple[str, ...] = ("normalization", "softmax", "loss")

#: The preset names, each as (params, compute, output).
PRESET_DTYPES: dict[str, tuple[str, str, str]] = {
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

#: The FP8 presets: a dtype preset plus a :class:`mpx.Float8Recipe` (listed apart from the five dtype
#: presets every backend's conformance runs).  ``mixed_bfloat16_fp8`` is Transformer Engine's default
#: recipe (hybrid, delayed scaling, history 1024, max, margin 0); ``mixed_bfloat16_fp8_current`` is
#: torchao's (hybrid, current scaling: each tensor's own amax).
FP8_PRESET_RECIPES: dict[str, tuple[str, Float8Recipe]] = {
    "mixed_bfloat16_fp8": ("mixed_bfloat16", Float8Recipe()),
    "mixed_bfloat16_fp8_current": ("mixed_bfloat16", Float8Recipe(scaling="current")),
}

#: The FP8 keys of the spec grammar and the :class:`mpx.Float8Recipe` field each one sets
#: (``fp8`` itself sets ``format``, or ``none`` for no FP8).
FP8_KEYS: dict[str, str] = {
    "fp8": "format",
    "fp8_scaling": "scaling",
    "fp8_history": "amax_history_len",
    "fp8_amax": "amax_compute",
    "fp8_margin": "margin",
    "fp8_pow2": "power_of_two",
}
_FP8_DEFAULT = Float8Recipe()
_SELECTOR = re.compile(r"^[A-Za-z0-9_.*?\[\]!/\-]+$")


def default_keep_fp32(compute_dtype: str) -> tuple[str, ...]:
    """The categories kept in float32 when a policy names none: all for a half compute dtype, else none."""
    return CATEGORIES if compute_dtype in HALF_DTYPES else ()


def dtype(value: Any, field: str) -> str:
    """``value`` as a canonical floating dtype name (a PolicyError naming ``field`` otherwise)."""
    try:
        return canonical_dtype(value, field=field, allowed=FLOATING_DTYPES)
    except DTypeError as err:
        raise PolicyError(str(err)) from None


def categories(value: Any) -> tuple[str, ...]:
    """A ``keep_fp32`` sequence validated: known categories, each once, in :data:`CATEGORIES` order."""
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


def check_selector(selector: Any) -> str:
    """An override's selector validated: a module-path glob or ``category:NAME``."""
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


def _policy_dict(params: str, compute: str, output: str, **fields: Any) -> dict[str, Any]:
    """A policy in ``Policy.to_dict()`` form (``reduce_dtype``/``keep_fp32`` None: the defaults)."""
    return {
        "param_dtype": params,
        "compute_dtype": compute,
        "output_dtype": output,
        "reduce_dtype": fields.get("reduce_dtype"),
        "keep_fp32": fields.get("keep_fp32"),
        "overrides": fields.get("overrides", []),
        "fp8": fields.get("fp8"),
    } | {field: fields[field] for field in _UPDATE_FIELDS if fields.get(field) is not None}


_FP8_ALLOWED = {
    "fp8": f"hybrid, e4m3 or none, or a block preset ({', '.join(FP8_PRESETS)})",
    "fp8_scaling": "delayed or current",
    "fp8_history": "an int in [1, 2**31 - 1] (amaxes remembered by delayed scaling)",
    "fp8_amax": "max or most_recent",
    "fp8_margin": "an int in [0, 2**31 - 1] (the scale is divided by 2**margin)",
    "fp8_pow2": "true or false",
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
    **{key: key for key in FP8_KEYS},
    **{key: key for key in UPDATE_KEYS},
    "fp4": "fp4",
}
_GRAMMAR = (
    "params=DTYPE,compute=DTYPE,output=DTYPE[,reduce=DTYPE][,keep_fp32=CATS][,fp8=hybrid|e4m3|none]"
    "[,fp8_scaling=..,fp8_history=..,fp8_amax=..,fp8_margin=..,fp8_pow2=..][,fp4=nvfp4|nvfp4_te|mxfp4]"
    "[,master=DTYPE][,update=plain|kahan|stochastic][,opt_state=float32|bfloat16|int8:BLOCK][,@SELECTOR={SPEC}]"
)
#: The key form, as error messages show it.
GRAMMAR = _GRAMMAR


def _fp8_value(spec: str, key: str, raw: str) -> Any:
    """The recipe field value of ``key=raw`` (a PolicyError naming the key and what is allowed)."""
    bad = PolicyError(f"policy spec {spec!r}: {key}: {raw!r} is not allowed; allowed: {_FP8_ALLOWED[key]}")
    if key in ("fp8_history", "fp8_margin"):
        low = 1 if key == "fp8_history" else 0
        if not raw.isdigit() or not raw.isascii() or not low <= int(raw) <= 2**31 - 1:
            raise bad
        return int(raw)
    if key == "fp8_pow2":
        if raw not in ("true", "false"):
            raise bad
        return raw == "true"
    allowed = {"fp8": ("hybrid", "e4m3", "none", *FP8_PRESETS), "fp8_scaling": ("delayed", "current"),
               "fp8_amax": ("max", "most_recent")}[key]  # fmt: skip
    if raw not in allowed:
        raise bad
    return raw


def _block_recipe(spec: str, values: dict[str, str], base: Any) -> tuple[Any, bool]:
    """Block-scaled recipes (#31): ``fp8=<block preset>`` or ``fp4=<block preset>`` names a
    :class:`mpx.blocks.BlockRecipe`, which takes none of the per-tensor keys.  Returns the recipe (or
    ``base``) and whether the spec's keys named one."""
    fp4 = values.get("fp4")
    if fp4 is not None:
        if fp4 not in (*FP4_PRESETS, "none"):
            raise PolicyError(
                f"policy spec {spec!r}: fp4: {fp4!r} is not allowed; allowed: {', '.join(FP4_PRESETS)} or none"
            )
        if "fp8" in values:
            raise PolicyError(f"policy spec {spec!r}: fp4 and fp8 both name a recipe; give one of them")
    name = fp4 or values.get("fp8")
    if name in BLOCK_PRESETS:
        recipe = BLOCK_PRESETS[name]
    elif fp4 == "none":
        recipe = None
    elif name is None and isinstance(base, BlockRecipe):
        recipe = base
    else:  # a per-tensor format (or none) replaces a parent's block recipe
        return (None if isinstance(base, BlockRecipe) else base), False
    if isinstance(recipe, BlockRecipe):
        key = next((k for k in FP8_KEYS if k != "fp8" and k in values), None)
        if key is not None:
            raise PolicyError(
                f"policy spec {spec!r}: {key} is a per-tensor FP8 key and the block recipe "
                f"{recipe.name or 'of this policy'} has no such field; drop the key"
            )
    return recipe, True


def _fp8_recipe(spec: str, values: dict[str, str], base: Any) -> Any:
    """The recipe of a spec from its FP8 keys, starting from ``base`` (a preset's or the parent's)."""
    block, named = _block_recipe(spec, values, base)
    if named:
        return block
    recipe = base = block
    if "fp8" in values:
        fmt = _fp8_value(spec, "fp8", values["fp8"])
        recipe = None if fmt == "none" else dataclasses.replace(recipe or _FP8_DEFAULT, format=fmt)
    changes = {FP8_KEYS[k]: _fp8_value(spec, k, values[k]) for k in FP8_KEYS if k != "fp8" and k in values}
    if recipe is None and changes:
        key = next(k for k in FP8_KEYS if k != "fp8" and k in values)
        raise PolicyError(
            f"policy spec {spec!r}: {key} sets an FP8 recipe field, but this policy has no FP8; "
            "add fp8=hybrid or fp8=e4m3 (or drop the key)"
        )
    return dataclasses.replace(recipe, **changes) if changes else recipe  # values checked above


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
    return ", ".join([*PRESET_DTYPES, *FP8_PRESET_RECIPES, *UPDATE_PRESETS, *PRESET_ALIASES])


def _preset(name: str) -> dict[str, Any] | None:
    """The preset (or alias) ``name`` as a policy dict, or None."""
    if name in PRESET_ALIASES:
        name = PRESET_ALIASES[name]
    if name in PRESET_DTYPES:
        return _policy_dict(*PRESET_DTYPES[name])
    if name in FP8_PRESET_RECIPES:
        base, recipe = FP8_PRESET_RECIPES[name]
        return _policy_dict(*PRESET_DTYPES[base], fp8=recipe.to_dict())
    if name in UPDATE_PRESETS:
        base, fields = UPDATE_PRESETS[name]
        return _policy_dict(*PRESET_DTYPES[base], **fields)
    return None


def _parse(text: str, *, nested: bool, parent: dict[str, Any] | None = None) -> dict[str, Any]:
    """Parse a spec; ``parent``: the policy an override's spec (``nested``) starts from when it names no
    dtype (``@head={fp8=none}`` is the parent without FP8)."""
    spec = text.strip()
    if not spec:
        raise PolicyError(f"policy spec is empty; allowed: a preset ({_names()}) or the key form {_GRAMMAR}")
    preset = _preset(spec)
    if preset is not None:
        return preset
    if "=" not in spec:
        raise PolicyError(f"unknown policy name {spec!r}; allowed: {_names()}, or the key form {_GRAMMAR}")
    values: dict[str, str] = {}
    spelled: dict[str, str] = {}
    bodies: list[tuple[str, str]] = []
    segments = _split_segments(spec)
    base = _preset(segments[0].strip())  # "mixed_bfloat16,reduce=bf16": a preset, then keys
    if base is not None:
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
            bodies.append((check_selector(selector), body[1:-1]))
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
        if parent is None:
            raise PolicyError(
                f"policy spec {spec!r}: names no dtype; give at least one of params, compute, output, reduce"
                + (" (only an override's spec starts from its parent)" if values.keys() & FP8_KEYS else "")
            )
        # an override naming no dtype: the parent (less the whole-model memory keys), then keys
        base = {k: v for k, v in parent.items() if k not in _UPDATE_FIELDS} | {"overrides": []}
    keep: tuple[str, ...] | None = None
    if base is not None:
        values = {
            "params": base["param_dtype"],
            "compute": base["compute_dtype"],
            "output": base["output_dtype"],
        } | values
        if "reduce" not in values and base["reduce_dtype"] not in (None, base["param_dtype"]):
            values["reduce"] = base["reduce_dtype"]
        if base["keep_fp32"] is not None and tuple(base["keep_fp32"]) != default_keep_fp32(
            base["compute_dtype"]
        ):
            keep = tuple(base["keep_fp32"])
    params = dtype(values.get("params", "float32"), "params")
    compute = dtype(values.get("compute", params), "compute")
    output = dtype(values.get("output", compute), "output")
    reduce = dtype(values["reduce"], "reduce") if "reduce" in values else None
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
            keep = categories([part.strip() for part in parts])
    base_recipe = None if base is None or base["fp8"] is None else recipe_from_dict(base["fp8"])
    recipe = _fp8_recipe(spec, values, base_recipe)
    if recipe is not None and compute == "float64":
        raise PolicyError(
            "fp8: FP8 GEMMs need a compute dtype of float32, bfloat16 or float16 "
            "(the GEMM returns the compute dtype), got float64"
        )
    policy = _policy_dict(
        params, compute, output,
        reduce_dtype=reduce, keep_fp32=None if keep is None else list(keep),
        fp8=None if recipe is None else recipe.to_dict(),
        **_update_fields(spec, values, base, params, nested),
    )  # fmt: skip
    rules = [{"selector": sel, "policy": _parse(body, nested=True, parent=policy)} for sel, body in bodies]
    return {**policy, "overrides": rules}


# -- the memory keys (master, update, opt_state: mpx.update_policy) ------------------------------------------
_UPDATE_FIELDS = tuple(UPDATE_KEYS.values())


def _update_fields(
    spec: str, values: dict[str, str], base: dict[str, Any] | None, params: str, nested: bool
) -> dict[str, str]:
    """The memory fields a spec sets (its keys over its preset's), validated; only those not at the default."""
    named = [key for key in UPDATE_KEYS if key in values]
    if nested and named:
        raise PolicyError(
            f"policy spec {spec!r}: {named[0]} is a whole-model key (the optimizer's); an override cannot set it"
        )
    fields = {field: (base or {}).get(field) for field in _UPDATE_FIELDS}
    fields |= {UPDATE_KEYS[key]: values[key] for key in named}
    if fields["master_dtype"] is not None and base is not None and "master" not in values:
        if base["param_dtype"] != params:  # the preset's master followed its params: follow the new ones
            fields["master_dtype"] = None
    if not any(v is not None for v in fields.values()):
        return {}
    master, update, opt_state = check_fields(
        params, fields["master_dtype"], fields["update"] or "plain", fields["opt_state"] or "float32"
    )
    defaults = {"master_dtype": params, "update": "plain", "opt_state": "float32"}
    out = {"master_dtype": master, "update": update, "opt_state": opt_state}
    return {k: v for k, v in out.items() if v != defaults[k]}


def parse(text: str) -> dict[str, Any]:
    """The policy a spec string names, in :meth:`mpx.Policy.to_dict` form (see :func:`mpx.get_policy` for
    the grammar); ``reduce_dtype`` and ``keep_fp32`` are None where the spec leaves them to the defaults.

    Raises:
        PolicyError: naming the bad token and what is allowed.
    """
    return _parse(text, nested=False)
