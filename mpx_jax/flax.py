"""Flax integration: mpx policies for NNX modules (in place) and linen modules (an apply function).

Imported on its own (``import mpx_jax.flax``) so that the rest of mpx_jax
does not need Flax.

Submodules get the policy ``policy.for_module(path, category)`` with their
dotted path from the root (``"encoder.layers.0.norm"``) and their category
from the core's one table (:mod:`mpx.categories`, ``"flax.nnx"`` and
``"flax.linen"``): ``"normalization"`` for ``LayerNorm``, ``BatchNorm``,
``RMSNorm``, ``GroupNorm`` and ``InstanceNorm``; Flax has no softmax or loss
module classes (they are functions), so a module of your own declares those
with a class (or instance) attribute ``mpx_category = "softmax"`` or
``"loss"``.  The mixed presets keep all three categories in float32, and path
overrides (``policy.with_overrides({"head": "float32"})``) apply.

The model's own inputs are not cast (as torch's ``prepare``): code in the
root module's body, such as an input normalization ``(x - mean) / std``, runs
on the inputs as you pass them, and the first layer casts to its compute
dtype, exactly as Flax's own ``dtype="bfloat16"`` does.

NNX training state (an optimizer step that counts applied steps) is in
:mod:`mpx_jax.nnx`, linen's ``TrainState`` and Flax's ``DynamicScale`` in
:mod:`mpx_jax.linen`, checkpoints in :mod:`mpx_jax.orbax`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import mpx
import mpx.categories
from mpx.policy import PolicySpec
from mpx.versions import require_version
from mpx_jax.casting import cast_to_output, cast_tree, is_floating_array

require_version("flax", flax.__version__)  # mpx_jax.nnx and mpx_jax.linen import this module

__all__ = ["apply_policy", "float32_softmax_attention", "policy_apply", "step_applied"]

_NNX_CATEGORIES = mpx.categories.resolve_categories("flax.nnx", nnx)
_LINEN_CATEGORIES = mpx.categories.resolve_categories("flax.linen", nn)
#: Modules whose op is PASSTHROUGH in the op table (``embedding``): they compute and return in their
#: parameters' dtype, as ``torch.nn.Embedding`` does under ``torch.autocast``.
_NNX_PASSTHROUGH: tuple[type, ...] = (nnx.Embed,)
_LINEN_PASSTHROUGH: tuple[type, ...] = (nn.Embed,)


def step_applied(before: Any, after: Any) -> jax.Array:
    """Whether the optimizer step that moved the loss scale from ``before`` to ``after`` was applied.

    Both are :class:`mpx_jax.LossScale` values (or anything
    :func:`mpx_jax.get_loss_scale` reads them from: an optax state, an
    ``nnx.Optimizer``), read just before and just after one
    ``with_loss_scaling`` update.  A step is applied when the loss scale made
    its transition (``steps`` moved: with ``accumulate=k`` only the window's
    last micro-step moves it) and did not count it as skipped.  Returns a
    boolean scalar array (jit-safe, no host sync).  The counters saturate at
    2**31 - 1 steps, after which every step reads as not applied.

    :class:`mpx_jax.nnx.Optimizer` and :class:`mpx_jax.linen.TrainState` use
    it to count applied steps only.
    """
    from mpx_jax import get_loss_scale

    b, a = get_loss_scale(before), get_loss_scale(after)
    return jnp.logical_and(a.steps != b.steps, a.skipped_steps == b.skipped_steps)


def _jnp_dtype(name: str) -> Any:
    return jnp.dtype(mpx.numpy_dtype(name))


def _path(keys: tuple[Any, ...]) -> str:
    return ".".join(str(k) for k in keys)


# -- NNX ------------------------------------------------------------------------------
def float32_softmax_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: nnx.Module | None = None,
    promote_dtype: Callable[..., Any] | None = None,
    is_causal: bool = False,
) -> jax.Array:
    """``nnx.dot_product_attention`` with its softmax in float32 (the op table's softmax is FLOAT32).

    The two matmuls (queries with keys, weights with values) run in the
    computation dtype; the logits are cast to float32 before the bias, the mask
    (masked logits get float32's lowest value) and the softmax; the weights
    (sown as ``attention_weights`` when ``module`` is given) and the dropout are
    float32, then cast back for the second matmul.  Arguments are
    ``nnx.dot_product_attention``'s; grouped-query attention (fewer key/value
    heads) repeats the key and value heads as Flax does.  :func:`apply_policy`
    sets it as the ``attention_fn`` of every ``nnx.MultiHeadAttention`` that uses
    Flax's default and whose softmax the policy keeps in float32 (NNX has no
    float32-softmax switch; linen's is ``force_fp32_for_softmax``).
    """
    promote = promote_dtype or _flax_promote_dtype
    query, key, value = promote((query, key, value), dtype=dtype)
    dtype = query.dtype
    heads = query.shape[-2]
    for name in ("key", "value"):
        arr = key if name == "key" else value
        if heads % arr.shape[-2]:
            raise ValueError(
                f"{name}: query heads ({heads}) must be a multiple of {name} heads ({arr.shape[-2]})."
            )
    key = jnp.repeat(key, heads // key.shape[-2], axis=-2)
    value = jnp.repeat(value, heads // value.shape[-2], axis=-2)
    query = query / jnp.sqrt(query.shape[-1]).astype(dtype)
    logits = jnp.einsum("...qhd,...khd->...hqk", query, key, precision=precision).astype(jnp.float32)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if mask is not None or is_causal:
        masks = [mask] if mask is not None else []
        if is_causal:
            causal = jnp.tril(jnp.ones(logits.shape[-2:], jnp.bool_))
            masks.append(jnp.broadcast_to(causal, mask.shape if mask is not None else logits.shape))
        combined = nnx.combine_masks(*masks, dtype=jnp.bool_)
        logits = jnp.where(combined, logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits)
    if module is not None:
        module.sow(nnx.Intermediate, "attention_weights", weights)
    if not deterministic and dropout_rate > 0.0:
        keep_prob = 1.0 - dropout_rate
        shape = (*(1,) * (key.ndim - 2), *weights.shape[-2:]) if broadcast_dropout else weights.shape
        keep = jax.random.bernoulli(dropout_rng, keep_prob, shape)
        weights = weights * (keep.astype(jnp.float32) / jnp.float32(keep_prob))
    return jnp.einsum("...hqk,...khd->...qhd", weights.astype(dtype), value, precision=precision)


def _flax_promote_dtype(arrays: tuple[Any, ...], *, dtype: Any = None) -> tuple[Any, ...]:
    """Flax's default ``promote_dtype``: every array in ``dtype``, or in their common dtype when None."""
    if dtype is None:
        dtype = jnp.result_type(*arrays)
    return tuple(jnp.asarray(x, dtype) for x in arrays)


def apply_policy(module: nnx.Module, policy: PolicySpec) -> nnx.Module:
    """Apply ``policy`` to an NNX module in place and return it.

    For every submodule (the root included) with its dotted path and category:

    * a ``dtype`` attribute (``Linear``, ``Conv``, ``Embed``, ``LinearGeneral``,
      ``MultiHeadAttention``, the norms...) is set to the compute dtype, so the
      module computes (and returns) in it; norms (and your modules marked
      ``mpx_category = "softmax"`` or ``"loss"``) under a mixed preset get float32;
      ``Embed`` gets the parameter dtype (the op table's ``embedding`` is
      PASSTHROUGH, as ``torch.nn.Embedding`` under autocast: float32 masters give
      a float32 residual stream, which also keeps an ``nnx.scan`` carry's dtype
      fixed when each layer ends in a float32 norm; ``Embed.attend``, a tied
      output layer, then runs in that dtype too);
    * a ``param_dtype`` attribute is set to the parameter dtype, and every
      floating ``nnx.Param`` is cast to it (``BatchStat`` and other variables
      keep their dtype).

    NNX has no method interception: a module computes in its ``dtype``
    attribute.  A module of your own with an ``mpx_category`` whose policy
    differs from the root's must therefore have a ``dtype`` attribute (and
    compute in it); without one this raises ``PolicyError`` rather than
    ignoring the category.  Stacked layers (``nnx.vmap`` at construction,
    ``nnx.scan`` over them in ``__call__``) and ``nnx.remat`` work: the
    stacked module is one module whose parameters have a leading layer axis.

    An ``nnx.MultiHeadAttention`` using Flax's default ``attention_fn`` gets
    :func:`float32_softmax_attention` when its softmax is kept in float32 (the
    mixed presets): matmuls in the compute dtype, softmax in float32.  A custom
    ``attention_fn`` is left as it is.

    The module's outputs are not cast: use :func:`mpx_jax.cast_to_output` on
    them.

    Warns:
        mpx.SlowPolicyWarning: once per process, when the compute dtype is
            measured slow on ``jax.default_backend()`` (see :mod:`mpx.advice`).

    Raises:
        mpx.UnsupportedTypeError: when ``module`` is not an ``nnx.Module``.
        mpx.PolicyError: for a bad policy, a bad ``mpx_category``, or a module
            with an ``mpx_category`` that needs its own compute dtype but has no
            ``dtype`` attribute.
    """
    if not isinstance(module, nnx.Module):
        raise mpx.UnsupportedTypeError(
            f"module: expected a flax.nnx.Module, got {type(module).__name__}; for a linen module use "
            "mpx_jax.flax.policy_apply."
        )
    pol = mpx.get_policy(policy)
    mpx.warn_if_slow("jax", pol, jax.default_backend(), stacklevel=3)
    modules: dict[tuple[Any, ...], mpx.Policy] = {}
    params: list[tuple[tuple[Any, ...], nnx.Param]] = []
    for keys, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Module):
            path = _path(keys)
            category = mpx.category_of(node, _NNX_CATEGORIES)
            sub = pol.for_module(path, category)
            modules[tuple(keys)] = sub
            attrs = vars(node)
            if "dtype" in attrs:
                own = sub.param_dtype if isinstance(node, _NNX_PASSTHROUGH) else sub.compute_dtype
                node.dtype = _jnp_dtype(own)
            elif getattr(node, "mpx_category", None) is not None and sub.compute_dtype != pol.compute_dtype:
                raise mpx.PolicyError(
                    f"{path or type(node).__name__}: mpx_category {category!r} asks for compute dtype "
                    f"{sub.compute_dtype}, but this {type(node).__name__} has no dtype attribute for "
                    "apply_policy to set (NNX modules compute in their dtype attribute); give it one, "
                    "e.g. self.dtype = None in __init__, and compute in it."
                )
            if "param_dtype" in attrs:
                node.param_dtype = _jnp_dtype(sub.param_dtype)
            if isinstance(node, nnx.MultiHeadAttention):
                softmax32 = (
                    sub.lowers_precision and pol.for_module(path, "softmax").compute_dtype == "float32"
                )
                if softmax32 and node.attention_fn is nnx.dot_product_attention:
                    node.attention_fn = float32_softmax_attention
                elif not softmax32 and node.attention_fn is float32_softmax_attention:
                    node.attention_fn = nnx.dot_product_attention
        elif isinstance(node, nnx.Param):
            params.append((tuple(keys), node))
    for keys, var in params:
        owner = max((k for k in modules if keys[: len(k)] == k), key=len)
        value = var.get_value()
        if is_floating_array(value):
            var.set_value(value.astype(_jnp_dtype(modules[owner].param_dtype)))
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
    it (``Embed``'s to the parameter dtype: the op table's ``embedding`` is
    PASSTHROUGH; the root module's own arguments are left as they are, so code in its
    body, an input normalization for example, runs on the inputs you pass), so ``Dense``/``Conv``/``Embed``/attention compute in the compute dtype
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

    A module of your own with a class attribute ``mpx_category = "softmax"``
    or ``"loss"`` gets that category's policy (float32 under the mixed
    presets): its arguments are cast to float32 and its ``dtype`` field, if it
    has one, set to float32.

    Raises:
        mpx.UnsupportedTypeError: when ``module`` is not a linen Module.
        mpx.PolicyError: for a bad policy or a bad ``mpx_category``.
    """
    if not isinstance(module, nn.Module):
        raise mpx.UnsupportedTypeError(
            f"module: expected a flax.linen.Module, got {type(module).__name__}; for an NNX module use "
            "mpx_jax.flax.apply_policy."
        )
    pol = mpx.get_policy(policy)
    mpx.warn_if_slow("jax", pol, jax.default_backend(), stacklevel=3)

    def interceptor(
        next_fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], context: Any
    ) -> Any:
        name = context.method_name
        if name == "setup" or (name.startswith("_") and name != "__call__"):
            return next_fun(*args, **kwargs)
        mod = context.module
        keys = tuple(mod.path)
        path = _path(keys)
        sub = pol.for_module(path, mpx.category_of(mod, _LINEN_CATEGORIES))
        compute = _jnp_dtype(sub.compute_dtype)
        if keys:  # the root's inputs are the model's inputs: left alone, as torch's prepare does
            args, kwargs = cast_tree((args, kwargs), sub.compute_dtype)
        changes: dict[str, Any] = {}
        fields = _fields(mod)
        if "dtype" in fields:
            changes["dtype"] = _jnp_dtype(sub.param_dtype) if isinstance(mod, _LINEN_PASSTHROUGH) else compute
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
