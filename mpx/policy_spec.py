"""The policy spec grammar: a string (a preset, an ecosystem alias, the key form) read into a Policy.

:func:`mpx.get_policy` reads strings through :func:`parse`; this module holds the
grammar (the keys, their aliases, the FP8 recipe keys, ``@SELECTOR={SPEC}``
overrides) and every error message about a spec string.

>>> str(parse("mixed_bfloat16,reduce=bf16"))
'params=float32,compute=bfloat16,output=float32,reduce=bfloat16'
>>> parse("p=f32,c=bf16,@head={fp8=none}").for_module("head").compute_dtype
'bfloat16'
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mpx.errors import PolicyError
from mpx.float8 import Float8Recipe
from mpx.policy import (
    _FP8_DEFAULT,
    _PRESET_DTYPES,
    CATEGORIES,
    FP8_KEYS,
    FP8_PRESETS,
    PRESET_ALIASES,
    PRESETS,
    Override,
    Policy,
    _categories,
    _check_selector,
    _default_keep_fp32,
    _dtype,
)

__all__ = ["GRAMMAR", "parse"]

_FP8_ALLOWED = {
    "fp8": "hybrid, e4m3 or none",
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
}
_GRAMMAR = (
    "params=DTYPE,compute=DTYPE,output=DTYPE[,reduce=DTYPE][,keep_fp32=CATS][,fp8=hybrid|e4m3|none]"
    "[,fp8_scaling=..,fp8_history=..,fp8_amax=..,fp8_margin=..,fp8_pow2=..][,@SELECTOR={SPEC}]"
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
    allowed = {"fp8": ("hybrid", "e4m3", "none"), "fp8_scaling": ("delayed", "current"),
               "fp8_amax": ("max", "most_recent")}[key]  # fmt: skip
    if raw not in allowed:
        raise bad
    return raw


def _fp8_recipe(spec: str, values: dict[str, str], base: Float8Recipe | None) -> Float8Recipe | None:
    """The recipe of a spec from its FP8 keys, starting from ``base`` (a preset's or the parent's)."""
    recipe = base
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
    return ", ".join([*_PRESET_DTYPES, *FP8_PRESETS, *PRESET_ALIASES])


def _preset(name: str) -> Policy | None:
    if name in _PRESET_DTYPES:
        return PRESETS[name]
    if name in FP8_PRESETS:
        return FP8_PRESETS[name]
    if name in PRESET_ALIASES:
        return PRESETS[PRESET_ALIASES[name]]
    return None


def _parse(text: str, *, nested: bool, parent: Policy | None = None) -> Policy:
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
            bodies.append((_check_selector(selector), body[1:-1]))
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
        base = dataclasses.replace(parent, overrides=())  # an override naming no dtype: the parent, then keys
    keep: tuple[str, ...] | None = None
    if base is not None:
        values = {
            "params": base.param_dtype,
            "compute": base.compute_dtype,
            "output": base.output_dtype,
        } | values
        if "reduce" not in values and base.reduce_dtype != base.param_dtype:
            values["reduce"] = base.reduce_dtype
        if base.keep_fp32 != _default_keep_fp32(base.compute_dtype):
            keep = base.keep_fp32
    params = _dtype(values.get("params", "float32"), "params")
    compute = _dtype(values.get("compute", params), "compute")
    output = _dtype(values.get("output", compute), "output")
    reduce = _dtype(values["reduce"], "reduce") if "reduce" in values else None
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
    recipe = _fp8_recipe(spec, values, None if base is None else base.fp8)
    policy = Policy(params, compute, output, keep_fp32=keep, reduce_dtype=reduce, fp8=recipe)
    if not bodies:
        return policy
    rules = tuple(Override(sel, _parse(body, nested=True, parent=policy)) for sel, body in bodies)
    return dataclasses.replace(policy, overrides=rules)


def parse(text: str) -> Policy:
    """The policy a spec string names (see :func:`mpx.get_policy` for the grammar).

    Raises:
        PolicyError: naming the bad token and what is allowed.
    """
    return _parse(text, nested=False)
