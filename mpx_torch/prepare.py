"""``mpx_torch.prepare``: put a module under an mpx policy, in place.

>>> import torch
>>> import mpx_torch
>>> model = mpx_torch.prepare(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)), "mixed_bfloat16")
>>> model[0].weight.dtype, model(torch.randn(2, 4)).dtype
(torch.float32, torch.float32)
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from mpx import (
    OpTable,
    Policy,
    PolicyError,
    PolicySpec,
    UnsupportedTypeError,
    get_policy,
    warn_if_slow,
    widest_dtype,
)
from mpx_torch import _compat, blocks, float8
from mpx_torch._categories import module_category
from mpx_torch._compile import compiling
from mpx_torch._recompute import RecomputedForward
from mpx_torch.autocast import _HALF, autocast, region_active, to_torch_dtype

__all__ = ["module_category", "prepare", "prepared_policy"]


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
_ATTRIBUTE = "_mpx_policy_hooks"  # the module's _PolicyHooks, in its __dict__


class _Frames(threading.local):
    """The regions a module's hooks entered and not yet exited, per thread (a module may recurse)."""

    def __init__(self) -> None:
        self.stack: list[tuple | None] = []


class _PolicyHooks:
    """A module's forward run under a policy, by two forward hooks (``forward`` itself is untouched).

    The pre-hook casts half inputs up for a float32 region and enters the
    policy's :class:`mpx_torch.autocast` region; the post-hook (``always_call``:
    it runs when ``forward`` raises too) exits the region and casts the outputs.
    """

    def __init__(
        self,
        policy: Policy,
        device_type: str | Sequence[str] | None,
        op_table: OpTable | None,
        region: bool,
        cast_inputs: bool = True,
        recompute: bool = True,
    ) -> None:
        self.policy = policy
        self.cast_inputs = cast_inputs and not policy.lowers_precision
        self._context = autocast(policy, device_type, op_table=op_table, recompute=recompute)
        # a float32 region of its own (a submodule, or a root with half overrides) computes half inputs
        # in float32 even outside any autocast; a plain float32 root stays a no-op
        self._context._region = region
        self._compute = to_torch_dtype(policy.compute_dtype)
        self._output = to_torch_dtype(policy.output_dtype)
        self._frames = _Frames()
        self.handles: tuple[RemovableHandle, ...] = ()

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        changed = None
        if self.cast_inputs:
            args = _cast_tree(args, self._compute, _HALF)
            if kwargs:
                kwargs = _cast_tree(kwargs, self._compute, _HALF)
            changed = (args, kwargs)
        self._frames.stack.append(self._context._enter())
        return changed

    def exit(self, module: nn.Module, args: tuple, output: Any) -> Any:
        stack = self._frames.stack
        if stack:  # empty only when a hook before ours raised (the post-hook is always called)
            self._context._exit(stack.pop())
        return _cast_tree(output, self._output, _OUTPUT_SOURCES)

    def __getstate__(self) -> dict[str, Any]:  # per-thread frames are not state (pickle, deepcopy)
        return {k: v for k, v in self.__dict__.items() if k != "_frames"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._frames = _Frames()

    def __repr__(self) -> str:
        return f"<mpx policy hooks: {self.policy}>"


class _ReentryHooks(_PolicyHooks):
    """A block's policy, entered only when no mpx region is active: a block that activation checkpointing
    (``torch.utils.checkpoint``, Hugging Face's ``gradient_checkpointing_enable``) runs again in
    backward, outside the root's region, recomputes under the same policy (torch's checkpoint restores
    autocast, not the op table's function mode); inside a region (every forward) it does nothing."""

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if compiling() or region_active():
            self._frames.stack.append(None)
            return None
        return super().enter(module, args, kwargs)

    def exit(self, module: nn.Module, args: tuple, output: Any) -> Any:
        stack = self._frames.stack
        if stack:
            frame = stack.pop()
            if frame is not None:
                self._context._exit(frame)
        return None


_EAGER_TOP_LEVEL: list[bool] = []


def _hooks_run_eagerly_as_top_level_frames() -> None:
    """Dynamo runs the hooks eagerly when it meets them as frames of their own, and traces them inline.

    ``torch.compile(model)`` calls a module's hooks outside the graph of its
    ``forward`` (each hook is a frame of its own): entered eagerly, the region is
    the ambient autocast state the forward's graph is traced under, as with
    ``with torch.autocast(...): compiled(x)``.  A prepared submodule called from
    traced code has its hooks inlined: its region is in the graph.  Either way
    the graph count is torch.autocast's.
    """
    if not _EAGER_TOP_LEVEL:
        for hook in (_PolicyHooks.enter, _PolicyHooks.exit, _ReentryHooks.enter, _ReentryHooks.exit):
            _compat.dynamo_run_eagerly(hook.__code__)
        _EAGER_TOP_LEVEL.append(True)


def prepared_policy(module: nn.Module) -> Policy | None:
    """The policy :func:`prepare` put ``module`` under (its own region's), or None when it has none."""
    hooks = module.__dict__.get(_ATTRIBUTE)
    return hooks.policy if isinstance(hooks, _PolicyHooks) and not isinstance(hooks, _ReentryHooks) else None


def _unwrap(module: nn.Module) -> None:
    hooks = module.__dict__.pop(_ATTRIBUTE, None)
    if isinstance(hooks, _PolicyHooks):
        for handle in hooks.handles:
            handle.remove()
    if isinstance(module.__dict__.get("forward"), RecomputedForward):
        del module.__dict__["forward"]


#: torch.nn modules whose forward is one op of the table on their inputs: their float32 region casts
#: nothing up front; the op casts its half inputs and saves them, not their upcasts (mpx_torch._recompute)
_ONE_OP: tuple[type, ...] = (
    nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.Softmax, nn.LogSoftmax, nn.CrossEntropyLoss, nn.NLLLoss,
    nn.MSELoss, nn.BCEWithLogitsLoss,
)  # fmt: skip


def _recomputable(module: nn.Module) -> bool:
    """A parameter-free leaf module from outside torch.nn (a model library's activation): its float32
    compute, if any, is redone in backward (:class:`mpx_torch._recompute.RecomputedForward`)."""
    return (
        not type(module).__module__.startswith("torch.")
        and next(module.children(), None) is None
        and next(module.parameters(), None) is None
        and next(module.buffers(), None) is None
        and "forward" not in module.__dict__
    )


def _store(module: nn.Module, param_dtype: torch.dtype, buffer_dtype: torch.dtype) -> None:
    """Floating parameters (in place, keeping their identity) and buffers of ``module`` itself."""
    with torch.no_grad():
        for param in module.parameters(recurse=False):
            if param.is_floating_point() and param.dtype != param_dtype:
                param.data = param.data.to(param_dtype)
                if param.grad is not None:
                    param.grad = param.grad.to(param_dtype)
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf.is_floating_point() and buf.dtype != buffer_dtype:
                setattr(module, name, buf.to(buffer_dtype))  # stays a buffer (persistent or not)


def prepare(
    module: nn.Module,
    policy: PolicySpec,
    *,
    device_type: str | Sequence[str] | None = None,
    op_table: OpTable | None = None,
    recompute: bool = True,
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
    * ``recompute`` (default True) keeps the activation memory at native
      autocast's while those float32 computations stay bit for bit as the op
      table says: a float32 op of half inputs saves the half inputs for
      backward, not their float32 upcasts, and is recomputed there
      (:class:`mpx_torch.autocast`'s ``recompute``); torch's one-op modules
      (``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.RMSNorm``, ``nn.Softmax``,
      ``nn.LogSoftmax`` and the table's losses) let their op cast the inputs;
      and a parameter-free module from outside ``torch.nn`` (a model
      library's activation, e.g. GPT-2's NewGELU, whose ``pow`` computes in
      float32 and promotes what follows) that casts a half input up runs under
      non-reentrant ``torch.utils.checkpoint``: only its inputs are saved.
      ``recompute=False`` keeps what autograd saves for the float32 ops.
    * The outputs of ``module`` (and of every such submodule) are cast to its
      ``output_dtype``: floating tensors of 16 and 32 bits, in nested tuples,
      lists and dicts; float64 outputs are left as computed.  Inputs of the
      root are not cast (autocast semantics).

    ``forward`` itself is left as it is, so that libraries which read it (the
    Hugging Face ``Trainer`` keeps the batch columns named in
    ``inspect.signature(model.forward)``) see the class's method: each region
    is a pair of module forward hooks, registered first (``prepend=True``), the
    post-hook with ``always_call=True``.  So the region covers every call of the
    module (``module(...)``), not a direct call of ``module.forward(...)``;
    forward pre-hooks registered by others run inside it and see the inputs
    after the cast up (torch's one-op modules above: as given), and forward
    hooks see the outputs after the cast.  (The activations recomputed in
    backward are the exception: their ``forward`` is an object whose
    ``__wrapped__`` is the class's method.)
    Wrapping a prepared model (PEFT's ``get_peft_model``, DDP, FSDP) and
    preparing a wrapped one both work.  Calling ``prepare`` again replaces the
    previous policy.  Under ``torch.compile`` a prepared model gives the graphs
    ``torch.autocast`` gives (``fullgraph=True`` works): hooks met as frames of
    their own run eagerly around the forward's graph, hooks of submodules called
    from traced code are traced into it.

    Raises:
        mpx.UnsupportedTypeError: for a ``module`` that is not a ``torch.nn.Module``.
        mpx.PolicyError: for a bad spec, a bad ``mpx_category``, or a shared submodule given two policies.
    """
    if not isinstance(module, nn.Module):
        raise UnsupportedTypeError(
            f"module: expected a torch.nn.Module, got {type(module).__name__}; "
            "prepare converts a model in place (wrap plain functions in mpx_torch.autocast instead)."
        )
    root = get_policy(policy)
    _hooks_run_eagerly_as_top_level_frames()
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
            cast_inputs = not recompute or type(sub) not in _ONE_OP
            hooks = _PolicyHooks(own, device_type, op_table, region, cast_inputs, recompute)
            hooks.handles = (
                sub.register_forward_pre_hook(hooks.enter, prepend=True, with_kwargs=True),
                sub.register_forward_hook(hooks.exit, prepend=True, always_call=True),
            )
            sub.__dict__[_ATTRIBUTE] = hooks
        elif recompute and own.lowers_precision and _recomputable(sub):
            sub.forward = RecomputedForward(sub, autocast(own, device_type, op_table=op_table))
        elif next(sub.children(), None) is not None:  # a block: its policy again when checkpointing reruns it
            hooks = _ReentryHooks(own, device_type, op_table, True, False, recompute)
            hooks.handles = (
                sub.register_forward_pre_hook(hooks.enter, prepend=True, with_kwargs=True),
                sub.register_forward_hook(hooks.exit, prepend=True, always_call=True),
            )
            sub.__dict__[_ATTRIBUTE] = hooks
    blocks.convert(module, root, op_table=op_table)  # block-scaled Linears (fp8=mxfp8, fp4=nvfp4...; #31)
    float8.convert(module, root, op_table=op_table)  # FP8 Linears where the policy says fp8=; else nothing
    return module
