"""Diagnostics for PyTorch: where non-finite values first appeared (:func:`watch`) and gradient underflow.

Both are opt-in and free when unused: nothing is registered on a model
outside a ``watch`` block, and neither changes a value the model computes.

>>> import torch, mpx_torch
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
>>> with mpx_torch.watch(model) as w:
...     model(torch.ones(3, 4)).sum().backward()
>>> w.report().finite
True
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from mpx.diagnostics import (
    NonfiniteReport,
    NonfiniteSite,
    UnderflowReport,
    build_underflow_report,
    check_scale,
    nonfinite_report,
)
from mpx.dtypes import canonical_dtype, dtype_info
from mpx.errors import UnsupportedTypeError

__all__ = ["Watch", "underflow_stats", "watch"]

_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                 "float64": torch.float64}  # fmt: skip


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _row(t: torch.Tensor) -> torch.Tensor:
    """``[finite, max|x| (NaN ignored unless all NaN), NaN count, inf count]`` on the tensor's device."""
    with torch.no_grad():
        x = t.detach()
        a = x.abs()
        nan = torch.isnan(x)
        top = torch.where(nan, torch.zeros((), dtype=a.dtype, device=a.device), a).amax() if a.numel() else (
            torch.zeros((), dtype=a.dtype, device=a.device))  # fmt: skip
        n_nan = nan.sum()
        n_inf = torch.isinf(x).sum()
        return torch.stack([(n_nan + n_inf == 0).double(), top.double(), n_nan.double(), n_inf.double()])


def _scale_of(scaler: Any) -> float | None:
    if scaler is None:
        return None
    if hasattr(scaler, "get_scale"):
        return float(scaler.get_scale())
    return check_scale(scaler)


class Watch:
    """The handle a ``watch`` block returns; :meth:`report` reads what it saw (one transfer)."""

    def __init__(self, model: nn.Module, *, scaler: Any = None, backward: bool = True,
                 gradients: bool = True, log: bool = True) -> None:  # fmt: skip
        if not isinstance(model, nn.Module):
            raise UnsupportedTypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}.")
        self.model = model
        self.scaler = scaler
        self.backward = backward
        self.gradients = gradients
        self.log = log
        self._handles: list[Any] = []
        self._rows: list[tuple[str, str, str, torch.Tensor]] = []  # (kind, module, dtype, row)
        self._report: NonfiniteReport | None = None
        self._warnings: Any = None

    # -- hooks --------------------------------------------------------------------------------------
    def _forward_hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            for t in _tensors(output):
                self._rows.append(("forward", name, str(t.dtype).replace("torch.", ""), _row(t)))

        return hook

    def _backward_hook(self, name: str) -> Any:
        def hook(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
            for t in _tensors(grad_input):
                self._rows.append(("backward", name, str(t.dtype).replace("torch.", ""), _row(t)))

        return hook

    def _grad_hook(self, name: str) -> Any:
        def hook(param: torch.Tensor) -> None:
            if param.grad is not None:
                self._rows.append(("gradient", name, str(param.grad.dtype).replace("torch.", ""),
                                   _row(param.grad)))  # fmt: skip

        return hook

    def __enter__(self) -> Watch:
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        # a first layer's input needs no gradient: its hook then sees only the output gradient (expected here)
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        for name, module in self.model.named_modules():
            label = name or type(module).__name__
            self._handles.append(module.register_forward_hook(self._forward_hook(label)))
            if self.backward and not any(True for _ in module.children()):
                self._handles.append(module.register_full_backward_hook(self._backward_hook(label)))
        if self.gradients:
            for name, param in self.model.named_parameters():
                if param.requires_grad:
                    self._handles.append(param.register_post_accumulate_grad_hook(self._grad_hook(name)))
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if exc[0] is None and self._report is None:
                self.report()
        finally:
            self.close()

    def close(self) -> None:
        """Remove every hook (``__exit__`` does)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._warnings is not None:
            self._warnings.__exit__(None, None, None)
            self._warnings = None

    def reset(self) -> None:
        """Forget what was seen (to watch the next step in the same block)."""
        self._rows.clear()
        self._report = None

    # -- the report ---------------------------------------------------------------------------------
    def report(self) -> NonfiniteReport:
        """Where non-finite values first appeared: forward outputs, then input gradients, then parameters.

        Parameter gradients are read as they are now (call it after
        ``backward()`` and before ``zero_grad()``); every figure comes back in
        one transfer.  Logs one line on ``mpx.diagnostics``.  After the block it
        returns the report its exit made.
        """
        if self._report is not None and not self._handles:  # after the block: what its exit reported
            return self._report
        rows = list(self._rows)
        if self.gradients:  # gradients made outside the block (no hook saw them) are read as they are now
            seen = {r[1] for r in rows if r[0] == "gradient"}
            rows += [("gradient", n, str(p.grad.dtype).replace("torch.", ""), _row(p.grad))
                     for n, p in self.model.named_parameters() if p.grad is not None and n not in seen]  # fmt: skip
        stacked = [r[3] for r in rows]
        if not stacked:
            host: list[list[float]] = []
        elif len({t.device for t in stacked}) == 1:
            host = torch.stack(stacked).cpu().tolist()  # the one transfer
        else:  # a model split over devices
            host = torch.stack([t.cpu() for t in stacked]).tolist()
        sites = [NonfiniteSite(kind, name, top, int(nan), int(inf), dtype)
                 for (kind, name, dtype, _), (finite, top, nan, inf) in zip(rows, host, strict=True) if not finite]  # fmt: skip
        checked = len({(r[0] == "gradient", r[1]) for r in rows})
        self._report = nonfinite_report("torch", sites, checked=checked, scale=_scale_of(self.scaler),
                                        log=self.log)  # fmt: skip
        return self._report


def watch(model: nn.Module, *, scaler: Any = None, backward: bool = True, gradients: bool = True,
          log: bool = True) -> Watch:  # fmt: skip
    """A context manager that finds where non-finite values first appear in ``model``'s step.

    Inside the block every module's forward output is checked (forward
    hooks), every leaf module's input gradients too when ``backward`` (full
    backward hooks; a model that modifies a hooked module's output in place,
    e.g. ``ReLU(inplace=True)``, needs ``backward=False``), and at
    :meth:`Watch.report` (called on exit when you have not) every parameter's
    gradient when ``gradients``.  The figures stay on the device until the
    report reads them, in one transfer.  ``scaler`` (an ``mpx_torch.GradScaler``,
    torch's, or a number) adds the loss scale to the report.  Values are never
    changed; the hooks are removed on exit.

    Returns:
        a :class:`Watch`; ``watch.report()`` gives an :class:`mpx.diagnostics.NonfiniteReport`
        whose ``origin`` names the module (or parameter) and ``first`` says
        forward/backward/gradient, the max |value|, NaN and inf counts.
    """
    return Watch(model, scaler=scaler, backward=backward, gradients=gradients, log=log)


def _named_grads(source: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(source, nn.Module):
        return [(n, p.grad) for n, p in source.named_parameters() if p.grad is not None]
    items = source.items() if isinstance(source, dict) else source
    out = []
    for i, item in enumerate(items):
        name, g = item if isinstance(item, tuple) else (str(i), item)
        if isinstance(g, nn.Parameter):
            g = g.grad
        if g is not None:
            out.append((str(name), g))
    return out


def underflow_stats(
    source: nn.Module | dict[str, torch.Tensor] | Iterable[Any],
    scale: Any,
    *,
    compute_dtype: Any = "float16",
    scaled: bool = True,
    log: bool = True,
) -> UnderflowReport:
    """Per parameter: the fraction of gradient elements zero or subnormal in ``compute_dtype`` at ``scale``.

    ``source`` is a module (its parameters' ``.grad``), a dict of name ->
    gradient, or ``(name, gradient)`` pairs.  ``scale`` is the loss scale (a
    number or a GradScaler: its ``get_scale()``); the gradients are taken as
    already multiplied by it (``scaled=True``, as after ``scaler.scale(loss).backward()``
    and before ``unscale_``) or are multiplied by it here (float32).  Each
    scaled value is cast to ``compute_dtype`` (default float16) and classified
    there; everything is computed on the gradients' device and read back in
    one transfer.  See :mod:`mpx.diagnostics` for the definitions and the advice.
    """
    value = check_scale(scale.get_scale() if hasattr(scale, "get_scale") else scale)
    compute = canonical_dtype(compute_dtype, field="compute_dtype")
    tdt = _TORCH_DTYPES[compute]
    tiny = dtype_info(compute).smallest_normal
    named = _named_grads(source)
    rows = []
    with torch.no_grad():
        for _, g in named:
            s = g.detach().float()
            if not scaled:
                s = s * torch.tensor(value, dtype=torch.float32, device=s.device)
            c = s.to(tdt).float().abs()
            zero = c == 0
            top = s.abs().amax() if s.numel() else torch.zeros((), device=s.device)
            rows.append(torch.stack([zero.sum().double(), ((c > 0) & (c < tiny)).sum().double(),
                                     (zero & (s != 0)).sum().double(), top.double()]))  # fmt: skip
        counts = torch.stack(rows).cpu().numpy() if rows else None
    return build_underflow_report("torch", [n for n, _ in named], [g.numel() for _, g in named],
                                  counts if counts is not None else [], scale=value, compute_dtype=compute,
                                  log=log)  # fmt: skip
