"""FP8 GEMMs for PyTorch: the core's recipe (:mod:`mpx.float8`) on ``nn.Linear`` modules.

:func:`convert` turns every ``nn.Linear`` whose policy has an ``fp8`` recipe
(``mixed_bfloat16,fp8=hybrid``; overrides such as ``@head={fp8=none}`` keep
modules out) into a :class:`Float8Linear`, in place: the same object, the same
parameters (an optimizer built earlier stays valid), hooks kept, plus its FP8
state in buffers that ``state_dict()`` saves.  Its forward quantizes the input
and the weight to e4m3 and runs one FP8 GEMM; its backward quantizes the
gradient (e5m2 under ``hybrid``) and runs both backward GEMMs in FP8.  GEMMs go
through ``torch._scaled_mm`` on CUDA devices that support FP8 and are emulated
exactly elsewhere (FP8 operands dequantized to float32, a float32 GEMM).

Under delayed scaling (Transformer Engine's lag) step t quantizes with the
scales computed from the amaxes of steps <= t-1: the amaxes a step observes
(forward and backward, max-combined over micro-batches and repeated calls) are
committed by :func:`commit_float8` once per optimizer step, and not on a step the
loss scaler skips.  Every number (quantize, ``max(|x|)``, the MAX of a step's amaxes,
the amax history and the scales) is the core's kernel (:mod:`mpx.kernels.float8`) run
with the torch table; the GEMMs are torch's:

>>> import torch, mpx_torch
>>> from mpx_torch import float8
>>> model = float8.convert(torch.nn.Sequential(torch.nn.Linear(16, 16)), "mixed_bfloat16,fp8=hybrid,fp8_history=4")
>>> type(model[0]).__name__, model[0].fp8_scale.tolist()
('Float8Linear', [1.0, 1.0, 1.0])
>>> x = torch.full((2, 16), 2.0)
>>> model(x).sum().backward()
>>> float8.commit_float8(model)     # after optimizer.step(); with a GradScaler: commit_float8(model, scaler)
>>> model[0].fp8_scale[0].item()    # the input's scale for the next step: 448 / 2
224.0
>>> float8.float8_state_dict(model)["tensors"]["0.input"]["amax_history"]
[2.0, 0.0, 0.0, 0.0]
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from mpx import (
    Float8Recipe,
    MPXError,
    OpTable,
    PolicySpec,
    StateDictError,
    UnsupportedTypeError,
)
from mpx.blocks import BlockRecipe
from mpx.float8 import ROLES, Float8State, TensorScale, check_model_state, one_recipe, tensor_key
from mpx.float8 import load_state_dict as _core_load
from mpx.float8 import state_dict as _core_state_dict
from mpx.kernels import float8 as kernel
from mpx_torch import _float8_ops, blocks
from mpx_torch._array_ops import ops_for
from mpx_torch._convert import check_model, linear_recipes, to_linear
from mpx_torch._float8_ops import quantize as quantize
from mpx_torch._process_group import check_process_group, group_to_agree
from mpx_torch.grad_scaler import GradScaler

__all__ = [
    "GEMMS",
    "Float8Linear",
    "commit_float8",
    "convert",
    "float8_layers",
    "float8_state_dict",
    "load_float8_state_dict",
    "quantize",
]

#: ``convert``'s ``gemm=`` choices: ``auto`` (``torch._scaled_mm`` on a CUDA device that runs it,
#: else the emulation), ``scaled_mm`` (always, the CPU's slow reference kernel included) and ``emulate``.
GEMMS = ("auto", "scaled_mm", "emulate")
_INPUT, _WEIGHT, _GRAD = range(3)


class Float8Linear(nn.Linear):
    """An ``nn.Linear`` whose three GEMMs run in FP8 (made by :func:`convert`, never constructed directly).

    Buffers (in ``state_dict()``; rows ``input``, ``weight``, ``grad``):
    ``fp8_scale`` (3,) float32, the scales the next step quantizes with
    (multiply; the GEMM uses the inverse) and ``fp8_amax_history`` (3, L)
    float32, most recent first (L = ``amax_history_len`` under delayed scaling,
    0 under current scaling).  ``fp8_amax`` (3,), not saved, holds the amaxes
    observed since the last :func:`commit_float8` (-1: none); a forward in eval mode
    (``model.eval()``) records none.  ``fp8_recipe`` and
    ``fp8_gemm`` are plain attributes.

    The result has the autocast dtype when autocast is on for the input's
    device (a prepared model's compute dtype), else the input's dtype.
    """

    fp8_recipe: Float8Recipe
    fp8_gemm: str
    fp8_scale: torch.Tensor
    fp8_amax_history: torch.Tensor
    fp8_amax: torch.Tensor

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        recipe = self.fp8_recipe
        if self.fp8_scale.dtype != torch.float32 or self.fp8_amax.dtype != torch.float32:
            raise MPXError(
                f"Float8Linear: its FP8 state was cast to {self.fp8_scale.dtype} (model.to(dtype), .half() or "
                "prepare with half buffers after convert); FP8 scales are float32. Call "
                "mpx_torch.float8.convert(model, policy) after casting the model."
            )
        device_type = input.device.type
        if torch.is_autocast_enabled(device_type):
            out_dtype = torch.get_autocast_dtype(device_type)
        else:
            out_dtype = input.dtype
        pending = self.fp8_amax
        amaxes = torch.stack([_float8_ops.amax(input), _float8_ops.amax(self.weight)])
        if self.training:  # an eval forward (model.eval()) quantizes with the scales and records nothing
            _float8_ops.observe(pending[:2], amaxes)
        if recipe.scaling == "current":
            scales = _float8_ops.scales(recipe, amaxes, recipe.format_of("input"))
            x_scale, w_scale = scales[0], scales[1]
        else:
            x_scale, w_scale = self.fp8_scale[_INPUT], self.fp8_scale[_WEIGHT]
        config = (recipe, self.fp8_gemm == "scaled_mm", out_dtype)
        return _float8_ops.Float8LinearFunction.apply(
            input,
            self.weight,
            self.bias,
            x_scale,
            w_scale,
            self.fp8_scale[_GRAD],
            pending[_GRAD:],
            config,
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.fp8_recipe}, gemm={self.fp8_gemm}"


def _format_runs(recipe: Float8Recipe) -> list[tuple[str, slice]]:
    """The roles (columns of the FP8 buffers) in runs of one format: ``[(role, columns)]``."""
    runs: list[tuple[str, slice]] = []
    for i, role in enumerate(ROLES):
        if runs and recipe.format_of(runs[-1][0]) == recipe.format_of(role):
            runs[-1] = (runs[-1][0], slice(runs[-1][1].start, i + 1))
        else:
            runs.append((role, slice(i, i + 1)))
    return runs


@torch.no_grad()
def _commit_batch(recipe: Float8Recipe, modules: list[Float8Linear], skipped: torch.Tensor) -> None:
    """One step of :func:`mpx.float8.float8_update` for the modules of one recipe on one device.

    The kernel (:func:`mpx.kernels.float8.update_tensor`) is written for one tensor; ``torch.vmap``
    maps it over every tensor of one format at once.  A tensor whose pending amax is -1 (none
    observed since the last commit) or a skipped step keeps its scale and history.
    """
    o = ops_for(skipped.device)
    pending = torch.stack([m.fp8_amax for m in modules])  # (modules, roles)
    scale = torch.stack([m.fp8_scale for m in modules])
    history = torch.stack([m.fp8_amax_history for m in modules])  # (modules, roles, amax_history_len)
    keep = torch.logical_or(torch.lt(pending, 0.0), skipped)
    length = history.shape[-1]
    new_scales, new_histories = [], []
    for role, cols in _format_runs(recipe):

        def step(s: torch.Tensor, h: torch.Tensor, a: torch.Tensor, k: torch.Tensor, role: str = role) -> Any:
            return kernel.update_tensor(o, recipe, role, s, h, a, k)

        width = cols.stop - cols.start
        n = len(modules) * width
        s, h = torch.vmap(step)(
            scale[:, cols].reshape(n),
            history[:, cols].reshape(n, length),
            pending[:, cols].reshape(n),
            keep[:, cols].reshape(n),
        )
        new_scales.append(s.reshape(len(modules), width))
        new_histories.append(h.reshape(len(modules), width, length))
    scale, history = torch.cat(new_scales, 1), torch.cat(new_histories, 1)
    for i, module in enumerate(modules):
        module.fp8_scale.copy_(scale[i])
        if length:
            module.fp8_amax_history.copy_(history[i])
        module.fp8_amax.fill_(-1.0)


def _drop_buffers(module: nn.Module) -> None:
    own = {name for name, _ in module.named_buffers(recurse=False)}
    for name in ("fp8_scale", "fp8_amax_history", "fp8_amax"):
        if name in own:
            delattr(module, name)


def _init_state(module: Float8Linear, recipe: Float8Recipe) -> None:
    device = module.weight.device
    length = recipe.amax_history_len if recipe.scaling == "delayed" else 0
    _drop_buffers(module)
    module.register_buffer("fp8_scale", torch.ones(3, dtype=torch.float32, device=device))
    module.register_buffer("fp8_amax_history", torch.zeros(3, length, dtype=torch.float32, device=device))
    module.register_buffer(
        "fp8_amax", torch.full((3,), -1.0, dtype=torch.float32, device=device), persistent=False
    )
    module.fp8_recipe = recipe


def _revert(module: Float8Linear) -> None:
    _drop_buffers(module)
    to_linear(module, ("fp8_recipe", "fp8_gemm"))


def convert(
    model: nn.Module,
    policy: PolicySpec,
    *,
    op_table: OpTable | None = None,
    gemm: str = "auto",
) -> nn.Module:
    """Run the ``nn.Linear`` modules of ``model`` whose policy has FP8 as :class:`Float8Linear`, in place.

    A module at ``path`` gets FP8 when ``policy.for_module(path, category)``
    has an ``fp8`` recipe and classifies ``linear`` LOWER (``op_table``, default
    :data:`mpx.OP_TABLE`); so ``@head={fp8=none}`` (the parent policy without
    FP8) keeps ``head`` in the compute dtype.  Only modules whose class is
    exactly ``nn.Linear`` are converted (a subclass may compute differently).
    The module object, its parameters and its hooks stay; its class becomes
    :class:`Float8Linear` and it gains fresh FP8 state (scale 1.0, a zero
    history).  Calling ``convert`` again keeps the state of modules whose
    recipe is unchanged, re-initializes the others, and turns modules whose
    policy no longer has FP8 back into ``nn.Linear``.  Convert after moving
    the model to its device (``gemm="auto"`` looks at the weight's device).

    ``convert`` does not set dtypes: use it with :func:`mpx_torch.prepare`
    (either order), whose autocast region gives each FP8 GEMM its output dtype.

    Args:
        gemm: one of :data:`GEMMS` (default ``"auto"``).

    Raises:
        mpx.UnsupportedTypeError: for a ``model`` that is not a ``torch.nn.Module``.
        mpx.PolicyError: for a bad policy spec; mpx.MPXError for a bad ``gemm``.
    """
    check_model(model, "mpx_torch.float8.convert")
    if gemm not in GEMMS:
        raise MPXError(f"gemm: {gemm!r} is not allowed; allowed: {', '.join(GEMMS)}")
    # a module whose recipe is none or a block recipe (mpx_torch.blocks converts those) is reverted
    found = linear_recipes(
        model, policy, op_table, recipe_type=Float8Recipe, converted=Float8Linear, revert=_revert
    )
    for _, sub, recipe in found:
        if not isinstance(sub, Float8Linear) or sub.fp8_recipe != recipe:
            sub.__class__ = Float8Linear
            _init_state(sub, recipe)  # type: ignore[arg-type]
        else:  # kept state: back to float32 if a cast of the model narrowed it
            for name in ("fp8_scale", "fp8_amax_history", "fp8_amax"):
                buf = getattr(sub, name)
                if buf.dtype != torch.float32:
                    setattr(sub, name, buf.to(torch.float32))
        if gemm == "auto":
            sub.fp8_gemm = "scaled_mm" if _float8_ops.scaled_mm_available(sub.weight.device) else "emulate"
        else:
            sub.fp8_gemm = gemm
    return model


def float8_layers(model: nn.Module) -> Iterator[tuple[str, Float8Linear]]:
    """``(path, module)`` for every :class:`Float8Linear` in ``model`` (shared modules once)."""
    for path, sub in model.named_modules():
        if isinstance(sub, Float8Linear):
            yield path, sub


def _skip_flag(skipped: Any, device: torch.device) -> torch.Tensor:
    """The skip decision as a bool scalar tensor on ``device`` (no host sync for tensors and scalers)."""
    if isinstance(skipped, GradScaler):
        flag = skipped.last_step_skipped()  # None before the scaler's first scale()
        return torch.zeros((), dtype=torch.bool, device=device) if flag is None else flag.to(device)
    if isinstance(skipped, torch.Tensor):
        if skipped.numel() != 1 or skipped.requires_grad:
            raise UnsupportedTypeError(
                "skipped: expected a one-element tensor (nonzero: the step was skipped, as a found_inf flag)."
            )
        return (skipped.reshape(()) != 0).to(device)
    if isinstance(skipped, bool):
        return torch.tensor(skipped, device=device)
    raise UnsupportedTypeError(
        f"skipped: expected a bool, a one-element tensor or an mpx_torch.GradScaler, got {type(skipped).__name__}."
    )


#: per GradScaler, per model id: the scaler's step count at the model's last commit
_SCALER_STEPS: weakref.WeakKeyDictionary[Any, dict[int, int]] = weakref.WeakKeyDictionary()


def _reduce_amaxes(modules: list[Float8Linear], group: Any) -> None:
    """All-reduce the pending amaxes with MAX over ``group`` (:func:`mpx.float8.reduce_amaxes`): one
    collective per device for all modules; NaN is sent as inf (both are non-finite, and a MAX all-reduce
    need not propagate NaN), -1 (not observed here) loses to any observed amax."""
    import torch.distributed as dist

    by_device: dict[torch.device, list[Float8Linear]] = {}
    for module in modules:
        by_device.setdefault(module.fp8_amax.device, []).append(module)
    with torch.no_grad():
        for group_modules in by_device.values():
            flat = torch.cat([m.fp8_amax for m in group_modules])
            flat = torch.where(torch.isnan(flat), torch.inf, flat)
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
            for m, part in zip(group_modules, flat.split(3), strict=True):
                m.fp8_amax.copy_(part)


def commit_float8(model: nn.Module, skipped: Any = False, *, process_group: Any = None) -> None:
    """Commit the amaxes ``model``'s FP8 modules observed since the last commit: once per optimizer step.

    Each :class:`Float8Linear` moves one step of :func:`mpx.float8.float8_update`
    (:func:`mpx.kernels.float8.update_tensor`, mapped with ``torch.vmap`` over every tensor of
    one format, recipe and device at once):
    delayed scaling records each finite amax and computes the scales the next
    step quantizes with; current scaling records the scale of the step's amax.
    A module not called since the last commit is unchanged.  ``skipped``: the
    loss scaler skipped this optimizer step, so nothing is committed (the
    observed amaxes are dropped), and the FP8 state moves exactly when the
    optimizer state does.  It is a bool, a one-element tensor (nonzero:
    skipped, a ``found_inf`` flag; read on the device, no host sync) or an
    :class:`mpx_torch.GradScaler` after its ``update()`` for this step (the
    step was skipped when it was not finite and the scaler skips non-finite
    steps).  Call it after ``optimizer.step()`` (and ``scaler.update()``),
    also in gradient accumulation: once per window.

    Replicas: first the observed amaxes are all-reduced with MAX over
    ``process_group`` (None, the default: the world group once
    ``torch.distributed`` is initialized, as :class:`mpx_torch.GradScaler`;
    nothing for one rank), so every replica commits the same scales.  Every
    rank must call ``commit_float8`` (it is a collective).

    Raises:
        mpx.UnsupportedTypeError: for a ``model`` that is not a Module or a bad ``skipped``.
        mpx.MPXError: for a GradScaler whose ``update()`` was not called since the last commit.
    """
    if not isinstance(model, nn.Module):
        raise UnsupportedTypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}.")
    if isinstance(skipped, GradScaler):
        if skipped.last_step_skipped() is not None and skipped.is_enabled():
            seen = _SCALER_STEPS.setdefault(skipped, {})
            if seen.get(id(model)) == skipped.updates:
                raise MPXError(
                    "commit_float8(model, scaler): the scaler's update() was not called since the last "
                    "commit; call scaler.update() first, then commit_float8 once per optimizer step."
                )
            seen[id(model)] = skipped.updates
    modules = [module for _, module in float8_layers(model)]
    group = group_to_agree(check_process_group(process_group))
    if group is not None and modules:
        _reduce_amaxes(modules, group)
    flags: dict[torch.device, torch.Tensor] = {}
    batches: dict[tuple[torch.device, Float8Recipe], list[Float8Linear]] = {}
    for module in modules:
        device = module.fp8_scale.device
        if device not in flags:
            flags[device] = _skip_flag(skipped, device)
        batches.setdefault((device, module.fp8_recipe), []).append(module)
    for (device, recipe), batch in batches.items():
        _commit_batch(recipe, batch, flags[device])
    if not flags:
        _skip_flag(skipped, torch.device("cpu"))  # validates ``skipped`` for a model with no FP8 module


def _recipe_of(model: nn.Module) -> tuple[Float8Recipe, list[tuple[str, Float8Linear]]]:
    modules = list(float8_layers(model))
    return one_recipe((module.fp8_recipe for _, module in modules), "FP8 modules"), modules


def float8_state_dict(model: nn.Module) -> dict[str, Any]:
    """``model``'s FP8 state as the neutral JSON-safe ``mpx.float8/1`` dict (one host read).

    Tensor names are ``"<module path>.input"``, ``".weight"`` and ``".grad"`` (the
    roles alone for a root module); :func:`mpx.float8.load_state_dict` and every
    backend's ``load_float8_state_dict(model, state_dict)`` read it.

    Raises:
        mpx.StateDictError: when the model's FP8 modules use different recipes.
    """
    recipe, modules = _recipe_of(model)
    block = blocks.block_recipe_of(model)
    if block is not None and not modules:  # block-scaled layers only: the recipe, stateless (#31)
        return _core_state_dict(block, Float8State({}))
    tensors = {}
    for path, module in modules:
        scales = module.fp8_scale.tolist()
        histories = module.fp8_amax_history.tolist()
        for i, role in enumerate(ROLES):
            tensors[tensor_key(path, role)] = TensorScale(role, scales[i], tuple(histories[i]))
    return _core_state_dict(recipe, Float8State(tensors))


def load_float8_state_dict(model: nn.Module, state_dict: Mapping[str, Any]) -> None:
    """Load an ``mpx.float8/1`` dict into ``model``'s FP8 modules, in place (all or nothing).

    Every field is validated (:func:`mpx.float8.load_state_dict`), the recipe
    must equal the modules' and the tensor names must be exactly theirs.

    Raises:
        mpx.StateDictError: naming the bad field; nothing changes.
    """
    recipe, state = _core_load(state_dict)
    own, modules = _recipe_of(model)
    if isinstance(recipe, BlockRecipe) or (blocks.block_recipe_of(model) is not None and not modules):
        if recipe != blocks.block_recipe_of(model):
            raise StateDictError("recipe: the state dict's recipe differs from the model's block recipe")
        return  # stateless: nothing to load
    check_model_state(recipe, state, own if modules else None, [path for path, _ in modules])
    expected = {
        tensor_key(path, role): (module, i) for path, module in modules for i, role in enumerate(ROLES)
    }
    with torch.no_grad():
        for name, (module, i) in expected.items():
            ts = state.tensors[name]
            module.fp8_scale[i] = ts.scale
            if ts.amax_history:
                module.fp8_amax_history[i].copy_(torch.tensor(ts.amax_history, dtype=torch.float32))
            module.fp8_amax[i] = -1.0
