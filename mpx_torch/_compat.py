"""Every PyTorch internal mpx_torch uses, in one place, behind one version gate.

mpx_torch reaches a few of torch's private names: the AMP kernel its
``GradScaler`` unscales with (the one ``torch.amp.GradScaler`` runs), dynamo's skip
machinery (so compiled steps call the scaler eagerly, as they call torch's),
the default-device context dynamo traces, the private base classes of torch's
norms and losses, and the values of a sparse gradient.  Each is looked up here,
when it is used, and a torch without it raises the one
:class:`mpx.FrameworkVersionError` naming it (:func:`mpx.versions.missing_internal`),
never a silent change of behaviour.  Importing this module checks the torch
version first (:func:`mpx.versions.require_version`).

>>> import torch
>>> from mpx_torch import _compat
>>> _compat.norm_base().__name__, _compat.loss_base().__name__
('_NormBase', '_Loss')
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import CodeType
from typing import Any

import torch
from torch import nn

from mpx.categories import CATEGORY_CLASSES, resolve_categories
from mpx.versions import missing_internal, require_version

require_version("torch", torch.__version__)

__all__ = [
    "category_classes",
    "dynamo_skip",
    "dynamo_run_eagerly",
    "dynamo_skip_code",
    "eval_frame_callback_getter",
    "foreach_non_finite_check_and_unscale_",
    "fsdp2_mp_policy",
    "global_device_context",
    "internal",
    "loss_base",
    "norm_base",
    "scaled_mm",
    "sparse_values",
    "step_supports_amp_scaling",
    "tensor_version",
]

_MISSING = object()


def internal(owner: Any, name: str, qualname: str, used_for: str) -> Any:
    """``getattr(owner, name)``, or raise the :class:`mpx.FrameworkVersionError` naming ``qualname``."""
    value = getattr(owner, name, _MISSING)
    if value is _MISSING:
        raise missing_internal("torch", torch.__version__, qualname, used_for)
    return value


def _module(path: str, used_for: str) -> Any:
    try:
        return importlib.import_module(path)
    except ImportError:
        raise missing_internal("torch", torch.__version__, path, used_for) from None


# -- the AMP unscale kernel (torch.amp.GradScaler's) --------------------------------------------------------
def foreach_non_finite_check_and_unscale_(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> None:
    """``torch._amp_foreach_non_finite_check_and_unscale_``: multiply ``grads`` by ``inv_scale`` in place,
    setting ``found_inf`` to 1 where one is not finite (one kernel per device and dtype, no sync)."""
    kernel = internal(
        torch,
        "_amp_foreach_non_finite_check_and_unscale_",
        "torch._amp_foreach_non_finite_check_and_unscale_",
        "GradScaler.unscale_ and GradScaler.step (the gradients' inf/NaN check)",
    )
    kernel(grads, found_inf, inv_scale)


def step_supports_amp_scaling(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` takes torch's ``grad_scale``/``found_inf`` (or ``grad_scaler=``) step protocol.

    Torch marks such optimizers (``fused=True`` Adam, AdamW, SGD, Adagrad, and
    third-party ones) with ``_step_supports_amp_scaling = True``; an optimizer
    without the attribute takes the ordinary protocol, exactly as in
    ``torch.amp.GradScaler.step``.
    """
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def tensor_version(tensor: torch.Tensor) -> int:
    """``Tensor._version``: the counter of in-place changes (prepare recomputes no activation that changes its
    inputs in place)."""
    return internal(tensor, "_version", "torch.Tensor._version", "recomputing float32 activations in backward")


def sparse_values(grad: torch.Tensor) -> torch.Tensor:
    """The values of a sparse COO gradient, uncoalesced (``Tensor._values()``, as torch's GradScaler)."""
    return internal(grad, "_values", "torch.Tensor._values", "unscaling sparse gradients")()


def scaled_mm() -> Callable[..., torch.Tensor]:
    """``torch._scaled_mm``: the FP8 GEMM ``(a @ b) * scale_a * scale_b`` (mpx_torch.float8, ``gemm="scaled_mm"``)."""
    return internal(torch, "_scaled_mm", "torch._scaled_mm", "FP8 GEMMs (mpx_torch.float8, gemm='scaled_mm')")


# -- dynamo ----------------------------------------------------------------------------------------------
_DYNAMO_USE = "running GradScaler's methods eagerly from compiled code, as torch's GradScaler"


def eval_frame_callback_getter() -> Callable[[], Any]:
    """``torch._C._dynamo.eval_frame.get_eval_frame_callback`` (set while compiled code runs)."""
    eval_frame = _module("torch._C._dynamo.eval_frame", _DYNAMO_USE)
    return internal(
        eval_frame,
        "get_eval_frame_callback",
        "torch._C._dynamo.eval_frame.get_eval_frame_callback",
        _DYNAMO_USE,
    )


def dynamo_skip_code(code: CodeType) -> None:
    """``torch._dynamo.eval_frame.skip_code``: dynamo never compiles ``code``'s frames (its callees it does)."""
    eval_frame = _module("torch._dynamo.eval_frame", _DYNAMO_USE)
    internal(eval_frame, "skip_code", "torch._dynamo.eval_frame.skip_code", _DYNAMO_USE)(code)


_HOOKS_USE = (
    "running prepare's forward hooks eagerly when torch.compile(model) calls them as frames of their own"
)


def dynamo_run_eagerly(code: CodeType) -> None:
    """Dynamo runs ``code``'s frames, and all they call, eagerly when it meets them as frames of their own
    (``set_code_exec_strategy`` with ``FrameAction.SKIP`` twice); inlined into traced code, they are traced."""
    eval_frame = _module("torch._dynamo.eval_frame", _HOOKS_USE)
    types_ = _module("torch._dynamo.types", _HOOKS_USE)
    strategy = internal(types_, "FrameExecStrategy", "torch._dynamo.types.FrameExecStrategy", _HOOKS_USE)
    action = internal(types_, "FrameAction", "torch._dynamo.types.FrameAction", _HOOKS_USE)
    skip = internal(action, "SKIP", "torch._dynamo.types.FrameAction.SKIP", _HOOKS_USE)
    setter = internal(
        eval_frame, "set_code_exec_strategy", "torch._dynamo.eval_frame.set_code_exec_strategy", _HOOKS_USE
    )
    setter(code, strategy(skip, skip))


def dynamo_skip(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch._dynamo.decorators.skip``: dynamo neither inlines ``fn`` nor compiles its frame."""
    decorators = _module("torch._dynamo.decorators", _DYNAMO_USE)
    return internal(decorators, "skip", "torch._dynamo.decorators.skip", _DYNAMO_USE)(fn)


def global_device_context() -> Any:
    """``torch._GLOBAL_DEVICE_CONTEXT`` (what ``torch.set_default_device`` sets), which dynamo traces."""
    return internal(
        torch,
        "_GLOBAL_DEVICE_CONTEXT",
        "torch._GLOBAL_DEVICE_CONTEXT",
        "autocast's default device type under torch.compile",
    )


# -- torch.nn's private base classes (the category table) ---------------------------------------------
def norm_base() -> type:
    """``torch.nn.modules.batchnorm._NormBase``: BatchNorm*, SyncBatchNorm, InstanceNorm* and their lazy forms."""
    return internal(
        nn.modules.batchnorm,
        "_NormBase",
        "torch.nn.modules.batchnorm._NormBase",
        "the normalization category (prepare's overrides)",
    )


def loss_base() -> type:
    """``torch.nn.modules.loss._Loss``: the base of every torch.nn loss module."""
    return internal(
        nn.modules.loss, "_Loss", "torch.nn.modules.loss._Loss", "the loss category (prepare's overrides)"
    )


def category_classes() -> dict[str, tuple[type, ...]]:
    """The torch classes of each category (:data:`mpx.categories.CATEGORY_CLASSES` below ``torch.nn``).

    The table's private names (``modules.batchnorm._NormBase``, ``modules.loss._Loss``) must be there:
    a torch without one raises instead of silently leaving a category short.
    """
    for paths in CATEGORY_CLASSES["torch"].values():
        for path in paths:
            if "._" in path or path.startswith("_"):
                owner = nn
                *parents, name = path.split(".")
                for part in parents:
                    owner = internal(
                        owner, part, f"torch.nn.{path}", "the category table (prepare's overrides)"
                    )
                internal(owner, name, f"torch.nn.{path}", "the category table (prepare's overrides)")
    return resolve_categories("torch", nn)


# -- FSDP2's per-unit MixedPrecisionPolicy ------------------------------------------------------------------
def fsdp2_mp_policy(unit: nn.Module) -> Any:
    """The ``MixedPrecisionPolicy`` FSDP2's ``fully_shard`` gave ``unit`` (an ``FSDPModule``):
    ``unit._get_fsdp_state()._mp_policy`` (torch has no public accessor)."""
    used_for = "checking the FSDP2 units' mixed precision against the policy"
    get_state = internal(unit, "_get_fsdp_state", "FSDPModule._get_fsdp_state", used_for)
    return internal(get_state(), "_mp_policy", "torch.distributed.fsdp FSDPState._mp_policy", used_for)
