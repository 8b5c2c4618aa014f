"""mpx across replicas in torch: one skip decision per step, and the policy's dtypes for DDP and FSDP2.

* :class:`mpx_torch.GradScaler` combines its found-inf flag over the process
  group (:func:`agree_found_inf`, from :mod:`mpx_torch._process_group`: one
  all-reduce of one float32 flag per optimizer step, ``MAX``), so every rank
  skips, backs off and grows together.
* :func:`register_comm_hook` makes DDP all-reduce gradients in the policy's
  ``reduce_dtype`` (torch's bf16/fp16 compression hooks).
* :func:`fsdp_mixed_precision` maps a policy onto FSDP2's
  ``MixedPrecisionPolicy``; :func:`fully_shard` shards a module with the
  policy's per-module rules (float32-kept norms in units of their own).

>>> import mpx, mpx_torch
>>> mp = mpx_torch.fsdp_mixed_precision("params=float32,compute=bfloat16,output=float32,reduce=bfloat16")
>>> mp.param_dtype, mp.reduce_dtype, mp.output_dtype
(torch.bfloat16, torch.bfloat16, torch.float32)
>>> mpx_torch.fsdp_mixed_precision("mixed_bfloat16", root=False).output_dtype is None
True
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mpx import MPXError, Policy, PolicyError, PolicySpec, get_policy
from mpx_torch._compat import fsdp2_mp_policy
from mpx_torch._process_group import agree_found_inf, check_process_group, group_to_agree
from mpx_torch.autocast import to_torch_dtype
from mpx_torch.prepare import module_category, prepare, prepared_policy

__all__ = [
    "agree_found_inf",
    "bf16_reduce_hook",
    "check_fsdp_units",
    "check_process_group",
    "fsdp_mixed_precision",
    "fully_shard",
    "group_to_agree",
    "register_comm_hook",
    "torch_takes_bf16_hook",
]

_HALF_REDUCE = {"bfloat16": "bf16_compress_hook", "float16": "fp16_compress_hook"}


# -- DDP: the reduce dtype ------------------------------------------------------------------------------
def register_comm_hook(
    ddp_model: nn.parallel.DistributedDataParallel, policy: PolicySpec, *, process_group: Any = None
) -> Callable[..., Any] | None:
    """Make ``ddp_model`` all-reduce its gradients in ``policy.reduce_dtype``; returns the hook (or None).

    * ``reduce_dtype`` equal to the dtype of every gradient (the default: the
      param dtype): nothing is registered, DDP's own all-reduce runs.
    * ``reduce_dtype`` bfloat16 or float16 with float32 (or already that
      dtype) gradients: torch's ``bf16_compress_hook`` / ``fp16_compress_hook``
      (each bucket cast to the half dtype, divided by the world size, summed
      in that dtype, cast back).  Where torch refuses its bf16 hook (it
      requires CUDA with NCCL 2.10+ or XPU by name, so gloo on CPU:
      :func:`torch_takes_bf16_hook`), the same arithmetic runs as
      :func:`bf16_reduce_hook`.  This is decided before registering: an
      error from ``ddp_model.register_comm_hook`` propagates, for either dtype.
    * Anything else (a reduce dtype wider than the gradients, float64, float16
      for bfloat16 gradients) raises: DDP cannot honour it.

    ``process_group`` is passed to the hook (None: the world group, as DDP's).
    Call it once, before the first backward (DDP allows one hook).

    Raises:
        mpx.MPXError: for a model that is not a ``DistributedDataParallel``, or an unsupported combination.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if not isinstance(ddp_model, nn.parallel.DistributedDataParallel):
        raise MPXError(
            f"ddp_model: expected a torch.nn.parallel.DistributedDataParallel, got {type(ddp_model).__name__}."
        )
    pol = get_policy(policy)
    reduce = pol.reduce_dtype
    grads = {str(p.dtype).removeprefix("torch.") for p in ddp_model.parameters() if p.requires_grad}
    if grads <= {reduce}:
        return None
    if reduce in _HALF_REDUCE and grads <= {"float32", reduce}:
        hook = getattr(default_hooks, _HALF_REDUCE[reduce])
        if reduce == "bfloat16" and not torch_takes_bf16_hook():
            # torch refuses its bf16 hook by name unless CUDA with NCCL 2.10+ (or XPU) is there, though
            # gloo reduces bfloat16: the same arithmetic under another name.  Decided up front: an error
            # from registering a hook (either dtype) is the caller's, never a reason to swap hooks
            hook = bf16_reduce_hook
        ddp_model.register_comm_hook(process_group, hook)
        return hook
    raise MPXError(
        f"policy: reduce_dtype {reduce} cannot be honoured by DDP for gradients stored in "
        f"{', '.join(sorted(grads))}; DDP reduces in the gradients' dtype, or in bfloat16/float16 for float32 "
        f"gradients (torch's compression hooks). Use reduce={'+'.join(sorted(grads))} or keep params float32."
    )


def torch_takes_bf16_hook() -> bool:
    """Whether DDP accepts torch's ``bf16_compress_hook`` here: CUDA (or ROCm) with NCCL 2.10+, or XPU with
    XCCL (the condition ``DistributedDataParallel.register_comm_hook`` checks by the hook's name)."""
    if not dist.is_available():
        return False
    gpu_build = torch.version.cuda is not None or torch.version.hip is not None
    if gpu_build and dist.is_nccl_available() and torch.cuda.nccl.version() >= (2, 10):
        return True
    return bool(dist.is_xccl_available() and torch.xpu.is_available())


def bf16_reduce_hook(process_group, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations
    """torch's ``bf16_compress_hook`` arithmetic, for the backends torch's name check turns away (gloo).

    ``(process_group: ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]``
    (DDP compares the annotations with its own objects, which this module's
    postponed annotations are not, so they are left off).

    The bucket cast to bfloat16 and divided by the group size, summed in
    bfloat16 by one all-reduce, cast back into the bucket.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(group.size())

    def decompress(fut: torch.futures.Future[Any]) -> torch.Tensor:
        return buffer.copy_(fut.value()[0])

    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


# -- FSDP2 ------------------------------------------------------------------------------------------------
def fsdp_mixed_precision(
    policy: PolicySpec, root: bool = True, *, cast_forward_inputs: bool | None = None
) -> Any:
    """The FSDP2 ``torch.distributed.fsdp.MixedPrecisionPolicy`` of one unit under ``policy``.

    * ``param_dtype``: the policy's compute dtype (FSDP all-gathers the
      parameters in it; equal to the stored dtype it costs nothing), so a
      float32-kept module's policy (``policy.for_module(path, category)``)
      gives float32.
    * ``reduce_dtype``: ``policy.reduce_dtype`` (default: the param dtype).
    * ``output_dtype``: ``policy.output_dtype`` on the root (``root=True``, the
      default); None on inner units (torch's ``output_dtype`` on an inner unit
      fails on CPU: "mixed dtype (CPU)").
    * ``cast_forward_inputs``: None (the default) means True for a unit that
      computes in float32 (its half inputs are cast up, as mpx's float32
      region does) and False for a half-precision unit, whose ops mpx's
      autocast casts one by one (as :func:`mpx_torch.prepare` does).

    Use it with :func:`mpx_torch.prepare` (or :func:`mpx_torch.autocast`), or
    let :func:`fully_shard` do both.

    Raises:
        mpx.PolicyError: for a bad spec; mpx.MPXError when FSDP2 is missing.
    """
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy
    except ImportError:  # pragma: no cover - a torch without FSDP2
        raise MPXError(
            "fsdp_mixed_precision: this torch has no torch.distributed.fsdp.MixedPrecisionPolicy."
        ) from None
    pol = get_policy(policy)
    if cast_forward_inputs is None:
        cast_forward_inputs = not pol.lowers_precision
    return MixedPrecisionPolicy(
        param_dtype=to_torch_dtype(pol.compute_dtype),
        reduce_dtype=to_torch_dtype(pol.reduce_dtype),
        output_dtype=to_torch_dtype(pol.output_dtype) if root else None,
        cast_forward_inputs=bool(cast_forward_inputs),
    )


def _refuse_float8_all_gather_without_gpu(module: nn.Module, mesh: Any) -> None:
    """Raise for torchao Float8Linears with ``enable_fsdp_float8_all_gather`` sharded over a CPU mesh.

    FP8 all-gather sends float8 tensors through the collective.  gloo (torch's
    CPU backend) refuses them ("Invalid scalar type") whenever a unit's
    all-gather holds only float8 data (e.g. bias-free Linears); a unit that also
    holds float32 parameters is packed as bytes and passes, so whether it runs
    depends on how the model is cut into units.  The refusal comes here, before
    sharding, for every CPU mesh.
    """
    flagged = [
        path
        for path, sub in module.named_modules()
        if getattr(getattr(sub, "config", None), "enable_fsdp_float8_all_gather", False) is True
    ]
    if not flagged:
        return
    device_type = mesh.device_type if mesh is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cpu":
        raise MPXError(
            f"module {flagged[0] or 'root'!r}: torchao's enable_fsdp_float8_all_gather=True all-gathers float8 "
            "weights, which FSDP2 on a CPU mesh cannot do reliably: gloo refuses float8 tensors ('Invalid "
            "scalar type') for every unit whose parameters are all float8-cast weights. Convert with "
            "Float8LinearConfig(enable_fsdp_float8_all_gather=False) (weights all-gathered in the policy's "
            "compute dtype, then cast to float8), or shard over a CUDA mesh (NCCL)."
        )


def fully_shard(
    module: nn.Module,
    policy: PolicySpec,
    *,
    units: Iterable[type[nn.Module]] = (),
    **fully_shard_kwargs: Any,
) -> nn.Module:
    """Prepare ``module`` under ``policy`` and shard it with FSDP2, bottom-up, with the policy's per-module rules.

    Order: :func:`mpx_torch.prepare` first (parameters stored in each
    module's param dtype, forwards under the policy), then
    ``torch.distributed.fsdp.fully_shard``.  A module not prepared yet is
    prepared here; one prepared under another policy raises.

    Units, deepest first: every submodule with parameters whose policy differs
    from its parent's (by default normalization modules, kept in float32),
    with :func:`fsdp_mixed_precision` of its own policy, ``root=False`` (so a
    LayerNorm's weights reach its float32 region unrounded); every submodule
    that is an instance of one of ``units`` (e.g. your transformer block
    class), with its policy; then ``module`` itself, ``root=True`` (it returns
    ``output_dtype``).  Submodules already sharded are left as they are.
    ``fully_shard_kwargs`` (``mesh``, ``reshard_after_forward``...) go to every
    call; ``mp_policy`` is the policy's.  Returns ``module``.

    FP8: mpx's :class:`mpx_torch.float8.Float8Linear` all-gathers its weights in
    the unit's compute dtype and quantizes them in forward; its amaxes are
    reduced with MAX over the world group by :func:`mpx_torch.float8.commit_float8`.
    torchao's ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``
    (float8 all-gather, GPU only) is refused on a CPU mesh.

    Raises:
        mpx.PolicyError: for a bad spec, or a module prepared under a different policy.
        mpx.MPXError: for ``mp_policy`` in ``fully_shard_kwargs``, bad ``units``, or torchao
            Float8Linears with ``enable_fsdp_float8_all_gather=True`` on a CPU mesh.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    if not isinstance(module, nn.Module):
        raise PolicyError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    if "mp_policy" in fully_shard_kwargs:
        raise MPXError(
            "mp_policy: mpx_torch.fully_shard sets each unit's MixedPrecisionPolicy from the policy; "
            "drop mp_policy, or call torch.distributed.fsdp.fully_shard with fsdp_mixed_precision()."
        )
    unit_types = tuple(units)
    if not all(isinstance(t, type) and issubclass(t, nn.Module) for t in unit_types):
        raise MPXError(f"units: expected torch.nn.Module classes (e.g. units=(Block,)), got {units!r}.")
    _refuse_float8_all_gather_without_gpu(module, fully_shard_kwargs.get("mesh"))
    root = get_policy(policy)
    prepared = prepared_policy(module)
    if prepared is None:
        prepare(module, root)
    elif prepared != root:
        raise PolicyError(
            f"policy: the module was prepared under {prepared}, not {root}; "
            "call fully_shard with the policy given to prepare."
        )
    effective: dict[str, Policy] = {}
    chosen: list[tuple[nn.Module, Policy]] = []
    for path, sub in module.named_modules():
        own = root.for_module(path, module_category(sub))
        parent = effective.get(path.rpartition(".")[0]) if path else None
        effective[path] = own
        if not path or next(sub.parameters(), None) is None:
            continue
        if own != parent or isinstance(sub, unit_types):
            chosen.append((sub, own))
    for sub, own in reversed(chosen):  # pre-order reversed: every unit after the units inside it
        if not isinstance(sub, FSDPModule):
            torch_fully_shard(sub, mp_policy=fsdp_mixed_precision(own, root=False), **fully_shard_kwargs)
    return torch_fully_shard(module, mp_policy=fsdp_mixed_precision(root, root=True), **fully_shard_kwargs)


def check_fsdp_units(module: nn.Module, policy: PolicySpec) -> list[str]:
    """Check that the FSDP2 units inside ``module`` all-gather and reduce as ``policy`` allows.

    For every submodule holding parameters, with its policy
    ``policy.for_module(path, category)`` (float32 for the float32-kept norms),
    the unit that holds its parameters (the nearest ``FSDPModule`` at or above
    it) must all-gather them in that policy's compute dtype or in their stored
    dtype (no rounding on the way: a LayerNorm's float32 weights must not reach
    its float32 region as bfloat16), and every unit must reduce its gradients
    in its own policy's ``reduce_dtype``.  ``MixedPrecisionPolicy`` fields left
    ``None`` read as FSDP2 reads them (the stored dtype, then the param dtype).
    :func:`fully_shard` (norms in units of their own) always passes.  Returns
    the paths of the units checked (``""`` for ``module`` itself).

    Raises:
        mpx.MPXError: naming the first module or unit at fault, what it gets and what the policy asks.
    """
    from torch.distributed.fsdp import FSDPModule

    root = get_policy(policy)
    fix = (
        "Shard with mpx_torch.fully_shard(module, policy, mesh=...) (in Lightning's configure_model: "
        "mesh=self.device_mesh['data_parallel']), or give torch's fully_shard "
        "mp_policy=mpx_torch.fsdp_mixed_precision(policy.for_module(path))."
    )
    units: dict[str, tuple[torch.dtype | None, torch.dtype | None]] = {}
    for path, sub in module.named_modules():
        if isinstance(sub, FSDPModule):
            mp = fsdp2_mp_policy(sub)
            units[path] = (mp.param_dtype, mp.reduce_dtype)
    for path, sub in module.named_modules():
        own = root.for_module(path, module_category(sub))
        if path in units:
            first = next(sub.parameters(), None)
            gathered = units[path][0] or (first.dtype if first is not None else None)
            reduced = units[path][1] or gathered
            if gathered is not None and reduced != to_torch_dtype(own.reduce_dtype):
                raise MPXError(
                    f"module {path or 'root'!r}: this FSDP2 unit reduces its gradients in "
                    f"{str(reduced).removeprefix('torch.')}, but the policy {own} asks for {own.reduce_dtype}. {fix}"
                )
        enclosing = [u for u in units if not u or path == u or path.startswith(u + ".")]
        if not enclosing:
            continue
        unit = max(enclosing, key=len)
        for name, param in sub.named_parameters(recurse=False):
            gathered = units[unit][0] or param.dtype
            if gathered not in (param.dtype, to_torch_dtype(own.compute_dtype)):
                where = f"{path}.{name}" if path else name
                raise MPXError(
                    f"module {where!r}: the FSDP2 unit {unit or 'root'!r} all-gathers this "
                    f"{str(param.dtype).removeprefix('torch.')} parameter in {str(gathered).removeprefix('torch.')}, "
                    f"but here the policy {own} computes in {own.compute_dtype}: it would arrive rounded. {fix}"
                )
    return list(units)
