"""Float32 ops of half-precision inputs that save those inputs, not their float32 upcasts (issue 23, item 6).

Under a mixed policy the op table computes softmax, the norms, the losses, pow, exp... in float32,
so their half-precision inputs are cast up first.  Autograd would then keep, for backward, what the
float32 op saves: the float32 upcast of its input (twice the bytes of the half tensor), or its float32
output (softmax, exp), and for the norms their statistics.  :class:`Float32Recompute` runs the same
op in ``forward`` (the same upcast, the same kernel: bit-identical results), saves only the inputs as
they came (half precision), and in ``backward`` recomputes the upcast and the op and takes their
gradient: bit-identical gradients too, since the recomputed values are the same.  Native autocast
saves the half input (or output) of such an op, so mpx's saved bytes come down to autocast's.

Only ops whose backward needs their floating inputs or outputs take this path (:data:`RECOMPUTED`);
``sum``, ``mean``, ``cumsum`` and ``nll_loss`` need neither, and batch norm updates its running
statistics in place (a recompute would update them twice).  Compiled code never takes it (AOTAutograd
chooses what to save or recompute there).  Second derivatives (``create_graph=True``) differentiate
the recomputation, connected to the inputs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from mpx_torch import _compat
from mpx_torch._compile import compiling

__all__ = ["RECOMPUTED", "UPCASTS", "Float32Recompute", "RecomputedForward", "call", "count_upcast"]

#: Canonical ops whose half inputs are saved and whose float32 computation is redone in backward.
RECOMPUTED = frozenset(
    {
        "softmax", "log_softmax", "layer_norm", "group_norm", "rms_norm", "exp", "log", "pow", "prod",
        "logsumexp", "vector_norm", "cross_entropy", "mse_loss", "bce_with_logits",
    }
)  # fmt: skip

_HALF = (torch.float16, torch.bfloat16)
_Build = Callable[[list[torch.Tensor]], tuple[tuple, dict]]


def _split(args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], _Build]:
    """The tensors among ``args`` and ``kwargs`` (top level), and how to put others in their places."""
    tensors: list[torch.Tensor] = []
    slots: list[int | str] = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            tensors.append(a)
            slots.append(i)
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            slots.append(k)

    def build(values: list[torch.Tensor]) -> tuple[tuple, dict]:
        new_args, new_kwargs = list(args), dict(kwargs)
        for slot, value in zip(slots, values, strict=True):
            if isinstance(slot, int):
                new_args[slot] = value
            else:
                new_kwargs[slot] = value
        return tuple(new_args), new_kwargs

    return tensors, build


def _up(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return [t.to(torch.float32) if t.dtype in _HALF else t for t in tensors]


class Float32Recompute(torch.autograd.Function):
    """``func`` of the float32 upcast of ``tensors``, saving ``tensors`` as given (see the module docs)."""

    @staticmethod
    def forward(
        ctx: Any, func: Callable, build: _Build, off: Callable[[], Any], *tensors: torch.Tensor
    ) -> Any:
        ctx.func, ctx.build, ctx.off = func, build, off
        ctx.save_for_backward(*tensors)
        args, kwargs = build(_up(tensors))
        return func(*args, **kwargs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        need = ctx.needs_input_grad[3:]
        create = torch.is_grad_enabled()  # create_graph=True: the recompute stays differentiable
        leaves = [
            t if create else (t.detach().requires_grad_(True) if n and t.is_floating_point() else t.detach())
            for t, n in zip(ctx.saved_tensors, need, strict=True)
        ]
        with torch.enable_grad(), ctx.off():
            args, kwargs = ctx.build(_up(leaves))
            out = ctx.func(*args, **kwargs)
        wanted = [leaf for leaf, n in zip(leaves, need, strict=True) if n and leaf.requires_grad]
        got = iter(
            torch.autograd.grad(out, wanted, grads, allow_unused=True, create_graph=create) if wanted else ()
        )
        return (
            None,
            None,
            None,
            *[next(got) if n and leaf.requires_grad else None for leaf, n in zip(leaves, need, strict=True)],
        )


def call(func: Callable, args: tuple, kwargs: dict, off: Callable[[], Any]) -> Any:
    """``func(*args, **kwargs)`` with half tensors computed in float32: through :class:`Float32Recompute`
    when it saves bytes (a half input, and a tensor that requires grad, grad mode on), else directly
    (None: the caller does it).  ``off``: a context turning autocast off, for the recompute."""
    if not torch.is_grad_enabled():
        return None
    tensors, build = _split(args, kwargs)
    if not any(t.dtype in _HALF for t in tensors) or not any(t.requires_grad for t in tensors):
        return None
    return Float32Recompute.apply(func, build, off, *tensors)


# -- float32 islands: a module whose float32 compute spreads (GPT-2's NewGELU) ------------------------------
class _Counter(threading.local):
    def __init__(self) -> None:  # per thread; an instance attribute keeps dynamo's guards stable
        self.upcasts = 0


#: How many half inputs FLOAT32 ops have cast up in this thread (the autocast handlers count them).
UPCASTS = _Counter()


def count_upcast() -> None:
    UPCASTS.upcasts += 1


class RecomputedForward:
    """``forward`` of a parameter-free module (an activation) whose float32 compute is redone in backward.

    The op table computes some ops of half inputs in float32 (``pow`` in GPT-2's NewGELU activation);
    the ops after them promote to float32 too, so autograd keeps several float32 tensors where native
    autocast keeps half ones.  Once a call of the module has cast a half input up (counted by the
    autocast handlers, :data:`UPCASTS`) without changing its inputs in place (decided once, at the first
    call with grad on and a half input, by running it on copies of its inputs), calls with grad on and a
    half input that requires grad run under ``torch.utils.checkpoint`` (non-reentrant): only the inputs are saved,
    and backward recomputes the module under the same policy, so values and gradients are bit-identical.
    Compiled code and calls without grad run ``forward`` as it is.  ``__wrapped__`` is the class's
    bound ``forward``, so ``inspect.signature`` reads the original.
    """

    def __init__(self, module: torch.nn.Module, region: Any) -> None:
        self.module = module
        self.region = region  # a context manager entering the module's policy (an mpx_torch.autocast)
        self.state = "probe"  # "probe" until a call with a half input, then "on" or "off"

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        return type(self.module).forward.__get__(self.module)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        with self.region:
            return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = type(self.module).forward
        if self.state == "off" or compiling() or not torch.is_grad_enabled():
            return forward(self.module, *args, **kwargs)
        tensors = [
            t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.is_floating_point()
        ]
        half = [t for t in tensors if t.dtype in _HALF]
        if not half:
            return forward(self.module, *args, **kwargs)
        if self.state == "probe":
            self.state = self._probe(args, kwargs)
            if self.state == "off":
                return forward(self.module, *args, **kwargs)
        if not any(t.requires_grad for t in half):
            return forward(self.module, *args, **kwargs)
        return checkpoint(self._run, *args, use_reentrant=False, **kwargs)

    def _probe(self, args: tuple, kwargs: dict) -> str:
        """``"on"`` when the module, run once on copies of its inputs (no grad, the random state restored),
        casts a half input up for a float32 op and changes no input in place; else ``"off"``."""

        def copy(value: Any) -> Any:
            return value.detach().clone() if isinstance(value, torch.Tensor) else value

        args, kwargs = tuple(copy(a) for a in args), {k: copy(v) for k, v in kwargs.items()}
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
        versions = [_compat.tensor_version(t) for t in tensors]
        before = UPCASTS.upcasts
        with torch.no_grad(), torch.random.fork_rng(devices=devices), self.region:
            type(self.module).forward(self.module, *args, **kwargs)
        changed = versions != [_compat.tensor_version(t) for t in tensors]
        return "on" if UPCASTS.upcasts != before and not changed else "off"

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"<forward of {type(self.module).__name__}, float32 recomputed in backward ({self.state})>"
