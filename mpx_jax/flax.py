"""Flax integration: mpx policies for NNX modules (in place) and linen modules (an apply function).

Imported on its own (``import mpx_jax.flax``) so that the rest of mpx_jax
does not need Flax.

Submodules get the policy ``policy.for_module(path, category)`` with their
dotted path from the root (``"encoder.layers.0.norm"``) and the category
``"normalization"`` for ``LayerNorm``, ``BatchNorm``, ``RMSNorm``,
``GroupNorm`` and ``InstanceNorm``, so the mixed presets keep every norm in
float32 and path overrides (``policy.with_overrides({"head": "float32"})``)
apply.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import mpx
from mpx.policy import PolicySpec
from mpx_jax.casting import cast_to_output, cast_tree, is_floating_array

__all__ = ["apply_policy", "policy_apply"]

_NNX_NORMS: tuple[type, ...] = tuple(
    getattr(nnx, name)
    for name in ("LayerNorm", "BatchNorm", "RMSNorm", "GroupNorm", "InstanceNorm")
    if hasattr(nnx, name)
)
_LINEN_NORMS: tuple[type, ...] = tuple(
    getattr(nn, name)
    for name in ("LayerNorm", "BatchNorm", "RMSNorm", "GroupNorm", "InstanceNorm")
    if hasattr(nn, name)
)


def _jnp_dtype(name: str) -> Any:
    return jnp.dtype(mpx.numpy_dtype(name))


def _path(keys: tuple[Any, ...]) -> str:
    return ".".join(str(k) for k in keys)


# -- NNX ------------------------------------------------------------------------------
def apply_policy(module: nnx.Module, policy: PolicySpec) -> nnx.Module:
    """Apply ``policy`` to an NNX module in place and return it.

    For every submodule (the root included) with its dotted path and category:

    * a ``dtype`` attribute (``Linear``, ``Conv``, ``Embed``, ``LinearGeneral``,
      ``MultiHeadAttention``, the norms...) is set to the compute dtype, so the
      module computes (and returns) in it; norms under a mixed preset get float32;
    * a ``param_dtype`` attribute is set to the parameter dtype, and every
      floating ``nnx.Param`` is cast to it (``BatchStat`` and other variables
      keep their dtype).

    The module's outputs are not cast: use :func:`mpx_jax.cast_to_output` on
    them.  Attention weights in ``nnx.MultiHeadAttention`` follow its dtype
    (NNX has no float32-softmax switch); give the attention module's path a
    float32 override to keep them in float32.

    Warns:
        mpx.SlowPolicyWarning: once per process, when the compute dtype is
            measured slow on ``jax.default_backend()`` (see :mod:`mpx.advice`).

    Raises:
        TypeError: when ``module`` is not an ``nnx.Module``.
    """
    if not isinstance(module, nnx.Module):
        raise TypeError(f"module: expected a flax.nnx.Module, got {type(module).__name__}.")
    pol = mpx.get_policy(policy)
    mpx.warn_if_slow("jax", pol, jax.default_backend(), stacklevel=3)
    modules: dict[tuple[Any, ...], mpx.Policy] = {}
    params: list[tuple[tuple[Any, ...], nnx.Param]] = []
    for keys, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Module):
            category = "normalization" if isinstance(node, _NNX_NORMS) else None
            sub = pol.for_module(_path(keys), category)
            modules[tuple(keys)] = sub
            attrs = vars(node)
            if "dtype" in attrs:
                node.dtype = _jnp_dtype(sub.compute_dtype)
            if "param_dtype" in attrs:
                node.param_dtype = _jnp_dtype(sub.param_dtype)
        elif isinstance(node, nnx.Param):
            params.append((tuple(keys), node))
    for keys, var in params:
        owner = max((k for k in modules if keys[: len(k)] == k), key=len)
        value = var.get_value() if hasattr(var, "get_value") else var.value
        if is_floating_array(value):
            new = value.astype(_jnp_dtype(modules[owner].param_dtype))
            if hasattr(var, "set_value"):
                var.set_value(new)
            else:  # pragma: no cover - older flax
                var.value = new
    return module


# -- linen ------------------------------------------------------------------------------
def _fields(module: nn.Module) -> dict[str, Any]:
    return getattr(type(module), "__dataclass_fields__", {})


def policy_apply(module: nn.Module, policy: PolicySpec) -> Callable[..., Any]:
    """An ``apply(variables, *args, **kwargs)`` that runs a linen module under ``policy``.

    ``kwargs`` go to ``module.apply`` (``rngs``, ``mutable``, ``method``...).
    Inside, every module method call (``__call__`` and public methods; the
    root included) is intercepted with ``flax.linen.intercept_methods``: its
    floating arguments are cast to the compute dtype of that submodule's
    policy and, for the duration of the call, its ``dtype`` field is set to
    it, so ``Dense``/``Conv``/``Embed``/attention compute in the compute dtype
    and the norms in float32 under the mixed presets.  A ``MultiHeadDotProductAttention``
    whose softmax category is kept in float32 gets ``force_fp32_for_softmax``.

    The ``params`` collection is cast to each module's ``param_dtype`` on the
    way in (other collections, such as ``batch_stats``, are left alone);
    gradients with respect to the variables you pass keep those variables'
    dtype (float32 masters get float32 gradients).  The output (the first
    element with ``mutable``) is cast to ``output_dtype``.

    Warns:
        mpx.SlowPolicyWarning: once per process, when the compute dtype is
            measured slow on ``jax.default_backend()`` (see :mod:`mpx.advice`).

    Raises:
        TypeError: when ``module`` is not a linen Module.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected a flax.linen.Module, got {type(module).__name__}.")
    pol = mpx.get_policy(policy)
    mpx.warn_if_slow("jax", pol, jax.default_backend(), stacklevel=3)

    def interceptor(
        next_fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], context: Any
    ) -> Any:
        name = context.method_name
        if name == "setup" or (name.startswith("_") and name != "__call__"):
            return next_fun(*args, **kwargs)
        mod = context.module
        path = _path(tuple(mod.path))
        category = "normalization" if isinstance(mod, _LINEN_NORMS) else None
        sub = pol.for_module(path, category)
        compute = _jnp_dtype(sub.compute_dtype)
        args, kwargs = cast_tree((args, kwargs), sub.compute_dtype)
        changes: dict[str, Any] = {}
        fields = _fields(mod)
        if "dtype" in fields:
            changes["dtype"] = compute
        if "force_fp32_for_softmax" in fields and sub.lowers_precision:
            changes["force_fp32_for_softmax"] = pol.for_module(path, "softmax").compute_dtype == "float32"
        saved = {k: getattr(mod, k) for k in changes}
        # linen modules are frozen dataclasses, rebuilt on every apply: the change lasts for this call only
        for key, value in changes.items():
            object.__setattr__(mod, key, value)
        try:
            return next_fun(*args, **kwargs)
        finally:
            for key, value in saved.items():
                object.__setattr__(mod, key, value)

    def cast_params(tree: Any, prefix: tuple[Any, ...] = ()) -> Any:
        if isinstance(tree, Mapping):
            return {k: cast_params(v, (*prefix, k)) for k, v in tree.items()}
        if is_floating_array(tree):
            return tree.astype(_jnp_dtype(pol.for_module(_path(prefix[:-1])).param_dtype))
        return tree

    def apply(variables: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(variables, Mapping) and "params" in variables:
            variables = {**variables, "params": cast_params(variables["params"])}
        with nn.intercept_methods(interceptor):
            out = module.apply(variables, *args, **kwargs)
        if kwargs.get("mutable"):
            value, state = out
            return cast_to_output(pol, value), state
        return cast_to_output(pol, out)

    return apply
