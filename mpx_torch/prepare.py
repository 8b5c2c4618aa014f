"""``mpx_torch.prepare``: put a module under an mpx policy, in place.

>>> import torch
>>> import mpx_torch
>>> model = mpx_torch.prepare(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)), "mixed_bfloat16")
>>> model[0].weight.dtype, model(torch.randn(2, 4)).dtype
(torch.float32, torch.float32)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mpx import OpTable, Policy, PolicyError, PolicySpec, get_policy, warn_if_slow, widest_dtype
from mpx_torch.autocast import _HALF, autocast, to_torch_dtype

__all__ = ["module_category", "prepare"]

_NORMS: tuple[type, ...] = tuple(
    cls
    for cls in (
        nn.modules.batchnorm._NormBase,  # BatchNorm*, SyncBatchNorm, InstanceNorm*, their lazy forms
        nn.LayerNorm,
        nn.GroupNorm,
        getattr(nn, "RMSNorm", None),
        nn.LocalResponseNorm,
    )
    if cls is not None
)
_SOFTMAX: tuple[type, ...] = (nn.Softmax, nn.LogSoftmax, nn.Softmin, nn.Softmax2d)
_LOSS: tuple[type, ...] = (nn.modules.loss._Loss,)


def module_category(module: nn.Module) -> str | None:
    """The mpx category of a module: ``"normalization"``, ``"softmax"``, ``"loss"`` or None."""
    if isinstance(module, _NORMS):
        return "normalization"
    if isinstance(module, _SOFTMAX):
        return "softmax"
    if isinstance(module, _LOSS):
        return "loss"
    return None


def _cast_tree(value: Any, target: torch.dtype, sources: tuple[torch.dtype, ...]) -> Any:
    """``value`` with every tensor whose dtype is in ``sources`` cast to ``target`` (nested containers too)."""
    if isinstance(value, torch.Tensor):
        return value.to(target) if value.dtype in sources and value.dtype != target else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_cast_tree(v, target, sources) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_tree(v, target, sources) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _cast_tree(v, target, sources)) for k, v in value.items())
    return value


# floating outputs of 16 and 32 bits take the output dtype; float64 is left as computed
_OUTPUT_SOURCES = (*_HALF, torch.float32)


class _PolicyForward:
    """A module's ``forward`` run under a policy: inputs cast up for float32 compute, outputs cast."""

    def __init__(
        self,
        forward: Any,
        policy: Policy,
        device_type: str | Sequence[str] | None,
        op_table: OpTable | None,
        region: bool,
    ) -> None:
        self.forward = forward
        self.policy = policy
        self._context = autocast(policy, device_type, op_table=op_table)
        # a float32 region of its own (a submodule, or a root with half overrides) computes half inputs
        # in float32 even outside any autocast; a plain float32 root stays a no-op
        self._context._region = region
        self._compute = to_torch_dtype(policy.compute_dtype)
        self._output = to_torch_dtype(policy.output_dtype)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.policy.lowers_precision:
            args = _cast_tree(args, self._compute, _HALF)
            if kwargs:
                kwargs = _cast_tree(kwargs, self._compute, _HALF)
        frame = self._context._enter()
        try:
            out = self.forward(*args, **kwargs)
        finally:
            self._context._exit(frame)
        return _cast_tree(out, self._output, _OUTPUT_SOURCES)

    def __repr__(self) -> str:
        return f"<forward of {self.forward!r} under {self.policy!r}>"


def _unwrap(module: nn.Module) -> None:
    wrapped = module.__dict__.get("forward")
    if isinstance(wrapped, _PolicyForward):
        del module.__dict__["forward"]


def _store(module: nn.Module, param_dtype: torch.dtype, buffer_dtype: torch.dtype) -> None:
    """Floating parameters (in place, keeping their identity) and buffers of ``module`` itself."""
    with torch.no_grad():
        for param in module._parameters.values():
            if param is not None and param.is_floating_point() and param.dtype != param_dtype:
                param.data = param.data.to(param_dtype)
                if param.grad is not None:
                    param.grad = param.grad.to(param_dtype)
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_floating_point() and buf.dtype != buffer_dtype:
                module._buffers[name] = buf.to(buffer_dtype)


def prepare(
    module: nn.Module,
    policy: PolicySpec,
    *,
    device_type: str | Sequence[str] | None = None,
    op_table: OpTable | None = None,
) -> nn.Module:
    """Put ``module`` under ``policy``, in place, and return it.

    * Floating parameters are stored in each submodule's ``param_dtype`` (in
      place: the ``nn.Parameter`` objects, and so an optimizer built earlier,
      stay valid).  Floating buffers are stored in the wider of the
      submodule's param and compute dtypes, so BatchNorm running statistics
      stay float32 wherever the norm computes in float32, even under a pure
      ``bfloat16`` policy.
    * ``forward`` runs under :class:`mpx_torch.autocast` with the policy
      (``device_type`` and ``op_table`` are passed on).
    * Submodules whose policy differs from their parent's, from
      ``policy.for_module(path, category)``, run under their own policy: by
      default normalization (``nn.LayerNorm``, ``nn.BatchNorm*``,
      ``nn.GroupNorm``, ``nn.RMSNorm``, ...), softmax (``nn.Softmax``,
      ``nn.LogSoftmax``, ...) and loss modules compute in float32 with their
      half-precision inputs cast up.  Path overrides (``"@head={float32}"``)
      work the same way.
    * The outputs of ``module`` (and of every such submodule) are cast to its
      ``output_dtype``: floating tensors of 16 and 32 bits, in nested tuples,
      lists and dicts; float64 outputs are left as computed.  Inputs of the
      root are not cast (autocast semantics).

    Calling ``prepare`` again replaces the previous policy.  Forward hooks see
    a submodule's inputs before the cast up and its outputs after the cast.

    Raises:
        mpx.PolicyError: for a bad spec or a module that is not an ``nn.Module``.
    """
    if not isinstance(module, nn.Module):
        raise PolicyError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    root = get_policy(policy)
    first = next(iter(module.parameters()), None)
    warn_if_slow(
        "torch", root, first.device if first is not None else torch.get_default_device(), stacklevel=3
    )
    # each module's policy, and which ones start a region of their own
    entries: list[tuple[nn.Module, Policy, bool]] = []
    seen: dict[int, Policy] = {}
    effective: dict[str, Policy] = {}
    for path, sub in module.named_modules(remove_duplicate=False):
        own = root.for_module(path, module_category(sub))
        if id(sub) in seen:
            if seen[id(sub)] != own:
                raise PolicyError(
                    f"module {path!r}: this module is shared with another path that has a different policy "
                    f"({seen[id(sub)]} vs {own}); give both paths the same override"
                )
            continue
        seen[id(sub)] = own
        parent = effective.get(path.rpartition(".")[0]) if path else None
        effective[path] = own
        entries.append((sub, own, path == "" or own != parent))
    for sub, own, wraps in entries:
        _unwrap(sub)
        buffers = widest_dtype([own.param_dtype, own.compute_dtype])
        _store(sub, to_torch_dtype(own.param_dtype), to_torch_dtype(buffers))
        if wraps:
            region = sub is not module or any(rule.policy.lowers_precision for rule in own.rules())
            sub.forward = _PolicyForward(sub.forward, own, device_type, op_table, region)
    return module
