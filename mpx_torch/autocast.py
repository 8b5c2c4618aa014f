"""``mpx_torch.autocast``: ``torch.autocast`` that follows the mpx op table.

Under a half-precision policy the context enters ``torch.autocast`` with the
policy's compute dtype and adds a ``TorchFunctionMode`` that enforces the op
table where torch's own cast lists disagree (on the CPU they leave softmax,
layer_norm, exp, sum... in half precision when the input is half):

>>> import torch
>>> import mpx_torch
>>> x = torch.randn(4, 8, dtype=torch.bfloat16)
>>> with torch.autocast("cpu", dtype=torch.bfloat16):
...     torch.softmax(x, -1).dtype
torch.bfloat16
>>> with mpx_torch.autocast("mixed_bfloat16", "cpu"):
...     torch.softmax(x, -1).dtype, (x @ x.T).dtype
(torch.float32, torch.bfloat16)

Functions torch already classifies as mpx does cost the mode one dict
look-up; only the ops the policy must change get a handler.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from mpx import (
    MPXError,
    OpClass,
    OpTable,
    Policy,
    PolicySpec,
    canonical_dtype,
    get_policy,
    warn_if_slow,
    widest_dtype,
)
from mpx.ops import as_op_table
from mpx_torch import _compat, _recompute
from mpx_torch._compile import compiling as _compiling
from mpx_torch._ops import FUNCTIONS, PROMOTE_EXCEPT_HALF_MIX, RUNNING_STATS

__all__ = ["autocast", "candidate_device_types", "to_torch_dtype"]

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
_HALF = (torch.float16, torch.bfloat16)
_Handler = Callable[[Callable, tuple, dict], Any]


def to_torch_dtype(name: Any) -> torch.dtype:
    """The torch dtype of an mpx dtype name, alias or dtype object (``"bf16"`` -> ``torch.bfloat16``)."""
    return _TORCH_DTYPES[canonical_dtype(name)]


def _default_device_type() -> str:
    """``torch.get_default_device().type``, in a form dynamo traces (no scan of the mode stack)."""
    if _compiling():
        context = getattr(_compat.global_device_context(), "device_context", None)
        return "cpu" if context is None else torch.device(context.device).type
    return torch.get_default_device().type


def candidate_device_types() -> tuple[str, ...]:
    """The device types ``device_type=None`` autocasts: the CPU, the default device, CUDA if available."""
    types = ["cpu"]
    default = _default_device_type()
    if default not in types:
        types.append(default)
    if "cuda" not in types and torch.cuda.is_available():
        types.append("cuda")
    return tuple(types)


def _device_types(device_type: str | torch.device | Sequence[str] | None) -> tuple[str, ...]:
    if device_type is None:
        return candidate_device_types()
    names = [device_type] if isinstance(device_type, (str, torch.device)) else list(device_type)
    out: list[str] = []
    for name in names:
        try:
            kind = torch.device(name).type
        except (RuntimeError, TypeError):
            raise MPXError(
                f"device_type: {name!r} is not a torch device type; use 'cpu', 'cuda', another "
                "torch.device type, or None for the CPU, the default device and CUDA"
            ) from None
        if kind not in out:
            out.append(kind)
    if not out:
        raise MPXError("device_type: the sequence is empty; name at least one device type, or pass None")
    return tuple(out)


def _autocast_enabled(device_type: str) -> bool:
    return bool(torch.is_autocast_enabled(device_type))


def _set_autocast_enabled(device_type: str, enabled: bool) -> None:
    torch.set_autocast_enabled(device_type, enabled)


@contextlib.contextmanager
def _autocast_all(devices: tuple[str, ...], **kwargs: Any) -> Iterator[None]:
    """``torch.autocast(device, **kwargs)`` for every device, nested (the form dynamo traces natively)."""
    if not devices:
        yield
        return
    with torch.autocast(devices[0], **kwargs), _autocast_all(devices[1:], **kwargs):
        yield


def _autocast_off(devices: tuple[str, ...]) -> Any:
    """A context that turns autocast off on ``devices``: the flag in eager mode, ``torch.autocast`` compiled."""
    if _compiling():
        return _autocast_all(devices, enabled=False)
    return _no_autocast(devices)


class _no_autocast:
    """Autocast off on ``devices`` for a block (the flag only: cheaper than ``torch.autocast(enabled=False)``)."""

    __slots__ = ("devices", "off")

    def __init__(self, devices: tuple[str, ...]) -> None:
        self.devices = devices

    def __enter__(self) -> None:
        self.off = [dev for dev in self.devices if _autocast_enabled(dev)]
        for dev in self.off:
            _set_autocast_enabled(dev, False)

    def __exit__(self, *exc: object) -> None:
        for dev in self.off:
            _set_autocast_enabled(dev, True)


# -- handlers -------------------------------------------------------------------------


def _leave_alone(args: tuple, kwargs: dict) -> bool:
    """An explicit ``dtype=`` or ``out=`` fixes the result: the op is left to torch."""
    if kwargs and (kwargs.get("dtype") is not None or kwargs.get("out") is not None):
        return True
    return any(type(a) is torch.dtype for a in args)


def _cast(value: Any, pick: Callable[[torch.Tensor], torch.dtype | None]) -> Any:
    if isinstance(value, torch.Tensor):
        target = pick(value)
        return value if target is None else value.to(target)
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        return type(value)(_cast(v, pick) for v in value)
    return value


def _floating(args: Iterable[Any]) -> Iterable[torch.Tensor]:
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.is_floating_point():
                yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor) and b.is_floating_point():
                    yield b


def _up(t: torch.Tensor) -> torch.dtype | None:
    if t.dtype in _HALF:
        if not _compiling():
            _recompute.count_upcast()
        return torch.float32
    return None


def _call_cast(
    func: Callable,
    args: tuple,
    kwargs: dict,
    pick: Callable[[torch.Tensor], torch.dtype | None],
    devices: tuple[str, ...] | None,
) -> Any:
    """Call ``func`` with its tensors cast by ``pick``; batch-norm running stats are written back."""
    new_args = tuple(_cast(a, pick) for a in args)
    new_kwargs = {k: _cast(v, pick) for k, v in kwargs.items()} if kwargs else kwargs
    write_back = []
    for pos, name in RUNNING_STATS.get(func, ()):
        if pos < len(args):
            old, new = args[pos], new_args[pos]
        elif name in kwargs:
            old, new = kwargs[name], new_kwargs[name]
        else:
            continue
        if isinstance(old, torch.Tensor) and new is not old:
            write_back.append((old, new))
    if devices:
        with _autocast_off(devices):
            out = func(*new_args, **new_kwargs)
    else:
        out = func(*new_args, **new_kwargs)
    if write_back:
        with torch.no_grad():
            for old, new in write_back:
                old.copy_(new)
    return out


def _recompute_autocast_off() -> _no_autocast:
    return _no_autocast(candidate_device_types())


def _float32_handler(devices: tuple[str, ...] | None, recompute: bool = False) -> _Handler:
    """Half-precision inputs cast to float32 (float64 stays); autocast off where torch would lower.

    ``recompute``: with grad on, such an op saves its half inputs, not their float32 upcasts, and
    recomputes in backward (:mod:`mpx_torch._recompute`; bit-identical values, fewer saved bytes).
    """
    tensor, half, f32, dtype = torch.Tensor, _HALF, torch.float32, torch.dtype

    def handler(func: Callable, args: tuple, kwargs: dict) -> Any:
        if recompute and not _compiling() and not _leave_alone(args, kwargs):
            out = _recompute.call(func, args, kwargs, _recompute_autocast_off)
            if out is not None:
                _recompute.count_upcast()
                return out
        if devices is None and not kwargs and func not in RUNNING_STATS:
            # the common case (x.sum(), torch.softmax(x, -1)...): positional tensors only
            new = []
            for a in args:
                if isinstance(a, tensor):
                    if a.dtype in half:
                        a = a.to(f32)
                        if not _compiling():
                            _recompute.count_upcast()
                elif type(a) is dtype or (isinstance(a, (list, tuple)) and a and isinstance(a[0], tensor)):
                    break
                new.append(a)
            else:
                return func(*new)
        if _leave_alone(args, kwargs):
            return func(*args, **kwargs)
        return _call_cast(func, args, kwargs, _up, devices)

    return handler


def _lower_handler(compute: torch.dtype, devices: tuple[str, ...], input_only: bool) -> _Handler:
    """float32 (and the other half dtype) cast to the compute dtype, autocast off (its float32 lists)."""

    def pick(t: torch.Tensor) -> torch.dtype | None:
        return compute if t.dtype in (torch.float32, *_HALF) and t.dtype != compute else None

    def handler(func: Callable, args: tuple, kwargs: dict) -> Any:
        if _leave_alone(args, kwargs):
            return func(*args, **kwargs)
        if input_only:  # batch_norm: the input lowers, float32 weights and running stats stay (mixed BN)
            args = (_cast(args[0], pick), *args[1:]) if args else args
            with _autocast_off(devices):
                return func(*args, **kwargs)
        return _call_cast(func, args, kwargs, pick, devices)

    return handler


def _promote_handler(devices: tuple[str, ...] | None) -> _Handler:
    """Every floating tensor cast to the widest floating input (autocast off where it would interfere)."""
    names = {v: k for k, v in _TORCH_DTYPES.items()}

    def handler(func: Callable, args: tuple, kwargs: dict) -> Any:
        dtypes = {t.dtype for t in _floating((*args, *kwargs.values()))}
        if len(dtypes) <= 1 or not dtypes <= names.keys():
            if devices is None:
                return func(*args, **kwargs)
            with _autocast_off(devices):
                return func(*args, **kwargs)
        widest = _TORCH_DTYPES[widest_dtype([names[d] for d in dtypes])]
        return _call_cast(
            func,
            args,
            kwargs,
            lambda t: widest if t.is_floating_point() and t.dtype != widest else None,
            devices,
        )

    return handler


def _passthrough_handler(devices: tuple[str, ...]) -> _Handler:
    """The first floating input's dtype for every floating tensor, autocast off."""

    def handler(func: Callable, args: tuple, kwargs: dict) -> Any:
        first = next(iter(_floating((*args, *kwargs.values()))), None)
        if first is None:
            with _autocast_off(devices):
                return func(*args, **kwargs)
        target = first.dtype
        return _call_cast(
            func,
            args,
            kwargs,
            lambda t: target if t.is_floating_point() and t.dtype != target else None,
            devices,
        )

    return handler


def _check_table(table: OpTable) -> None:
    unknown = [op for op in table if op not in FUNCTIONS]
    if unknown:
        raise MPXError(
            f"op_table: op {unknown[0]!r} has no PyTorch functions in mpx_torch; mapped ops: "
            f"{', '.join(FUNCTIONS)}"
        )


@functools.lru_cache(maxsize=256)
def _lowering_table(
    policy: Policy, table: OpTable, devices: tuple[str, ...], recompute: bool = True
) -> dict[Callable, _Handler]:
    """func -> handler for a half-precision policy, where the policy's class differs from torch's."""
    _check_table(table)
    compute = _TORCH_DTYPES[policy.compute_dtype]
    out: dict[Callable, _Handler] = {}
    for op in table:
        cls = table.classify(op, policy)
        for func, native in FUNCTIONS[op]:
            if cls is native:
                continue
            if cls is OpClass.FLOAT32:
                saves_half = recompute and op in _recompute.RECOMPUTED and func not in RUNNING_STATS
                handler = _float32_handler(devices if native is OpClass.LOWER else None, saves_half)
            elif cls is OpClass.LOWER:
                handler = _lower_handler(compute, devices, input_only=func in RUNNING_STATS)
            elif cls is OpClass.PROMOTE:
                handler = _promote_handler(None if native == PROMOTE_EXCEPT_HALF_MIX else devices)
            else:
                handler = _passthrough_handler(devices)
            out[func] = handler
    return out


@functools.lru_cache(maxsize=64)
def _float32_table(table: OpTable, recompute: bool = True) -> dict[Callable, _Handler]:
    """func -> handler inside a float32 region nested in a lowering one: half inputs computed in float32."""
    _check_table(table)
    plain = _float32_handler(None)  # autocast is off in the whole region
    saving = _float32_handler(None, recompute=True)
    out: dict[Callable, _Handler] = {}
    for op in table:
        if table[op] in (OpClass.LOWER, OpClass.FLOAT32):
            saves_half = recompute and table[op] is OpClass.FLOAT32 and op in _recompute.RECOMPUTED
            for func, _ in FUNCTIONS[op]:
                out[func] = saving if saves_half and func not in RUNNING_STATS else plain
    return out


# -- the mode ---------------------------------------------------------------------------
class _MPXMode(TorchFunctionMode):
    """Routes the functions in ``table`` to their handler; every other call goes straight through."""

    def __init__(self, table: dict[Callable, _Handler]) -> None:
        super().__init__()
        self.table = table

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        handler = self.table.get(func)
        if handler is None:
            return func(*args, **(kwargs or {}))
        return handler(func, args, kwargs or {})


class _ThreadState(threading.local):
    def __init__(self) -> None:  # per thread; an instance attribute keeps dynamo's guard on it stable
        self.mode: _MPXMode | None = None


_state = _ThreadState()


def region_active() -> bool:
    """Whether an mpx autocast region is active in this thread (its function mode is installed)."""
    return _state.mode is not None


class autocast(contextlib.ContextDecorator):
    """Run a region under an mpx policy: ``torch.autocast`` plus the mpx op table.

    Args:
        policy: an :class:`mpx.Policy` or anything :func:`mpx.get_policy` reads
            (``"mixed_bfloat16"``, ``"bf16-mixed"``, ``"params=float32,compute=float16"``...).
        device_type: the device type to autocast (``"cpu"``, ``"cuda"``...), a
            sequence of them, or None (the default) for every device the inputs
            may live on: the CPU, ``torch.get_default_device()``'s type, and
            CUDA when it is available (each device type has its own autocast
            state in torch, so entering several costs nothing per op).
        op_table: the op table to enforce (default :data:`mpx.OP_TABLE`); a copy
            made with ``OP_TABLE.replace(...)`` reclassifies ops.
        cache_enabled: passed to ``torch.autocast`` (None: torch's default).
        recompute: True (the default): a FLOAT32 op of half inputs that needs
            them in backward (softmax, the norms, the losses, pow, exp...) saves
            the half inputs, not their float32 upcasts (nor its float32 output),
            and recomputes the op in backward: the same values and gradients
            bit for bit, about native autocast's saved bytes
            (:mod:`mpx_torch._recompute`; second derivatives work too).

    Under a policy whose compute dtype is float16 or bfloat16, FLOAT32 ops
    (softmax, log_softmax, the norms, the losses, exp, log, pow, sum, mean,
    cumsum, prod, logsumexp, vector_norm) return float32 on every device,
    LOWER ops the compute dtype, PROMOTE ops the widest input, PASSTHROUGH ops
    their input's dtype; ``keep_fp32`` choices move categories to LOWER (via
    :func:`mpx.classify`).  Functional calls (``torch.softmax``,
    ``F.layer_norm``, ``x.sum()``) count as well as modules.  An explicit
    ``dtype=`` or ``out=`` argument is left to torch, and so are in-place
    methods (``x.exp_()``) and float64 inputs, which no op lowers (as in
    ``torch.autocast``).  PROMOTE follows torch's type promotion, in which
    a 0-dim tensor does not widen a dimensioned one.

    A float32 (or float64) policy is a no-op, unless it is entered inside an
    active autocast region (mpx's or torch's): there it turns autocast off and
    computes half-precision inputs of LOWER and FLOAT32 ops in float32.

    Usable as a decorator.  Traceable by ``torch.compile`` (``fullgraph=True``
    works; the region becomes ``torch.autocast`` blocks and the mode's casts
    in the graph, as native autocast; see docs/compile.md).  Raises
    :class:`mpx.PolicyError` for a bad spec and :class:`mpx.MPXError` for a
    bad ``device_type``.
    """

    def __init__(
        self,
        policy: PolicySpec,
        device_type: str | torch.device | Sequence[str] | None = None,
        *,
        op_table: OpTable | None = None,
        cache_enabled: bool | None = None,
        recompute: bool = True,
    ) -> None:
        self.policy = get_policy(policy)
        self.device_types = _device_types(device_type)
        named = self.device_types if device_type is not None else (_default_device_type(),)
        if not _compiling():  # traced code warns nothing: the eager call (or prepare) did
            for device in named:
                warn_if_slow("torch", self.policy, device, stacklevel=3)
        self.op_table = as_op_table(op_table)
        self.cache_enabled = cache_enabled
        if not isinstance(recompute, bool):
            raise MPXError(f"recompute: expected True or False, got {recompute!r}")
        self.recompute = recompute
        self._table = self._build_table()
        self._region = False  # prepare: a float32 policy computes half inputs in float32 even when alone
        self._frames: list[tuple | None] = []

    def _build_table(self) -> dict[Callable, _Handler]:
        lowering, float32 = _lowering_table, _float32_table
        if _compiling():  # dynamo traces the builders themselves (it ignores lru_cache, with a warning)
            lowering, float32 = lowering.__wrapped__, float32.__wrapped__  # type: ignore[attr-defined]
        recompute = getattr(self, "recompute", True)  # (autocast objects pickled before recompute existed)
        if self.policy.lowers_precision:
            return lowering(self.policy, self.op_table, self.device_types, recompute)
        return float32(self.op_table, recompute)

    def __getstate__(self) -> dict[str, Any]:  # handlers are closures: rebuilt on unpickling
        return {k: v for k, v in self.__dict__.items() if k not in ("_table", "_frames")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._frames = []
        self._table = self._build_table()

    def _recreate_cm(self) -> autocast:  # a fresh context for each decorated call
        clone = copy.copy(self)
        clone._frames = []
        return clone

    def _enter(self) -> tuple | None:
        """Enter the region; returns the frame that :meth:`_exit` undoes (None: nothing was done)."""
        if _compiling():
            return self._enter_traced()
        mode = _state.mode
        casts: list[Any] = []
        disabled: tuple[str, ...] = ()
        if self.policy.lowers_precision:
            dtype = _TORCH_DTYPES[self.policy.compute_dtype]
            kwargs = {} if self.cache_enabled is None else {"cache_enabled": self.cache_enabled}
            try:
                for dev in self.device_types:
                    cast = torch.autocast(dev, dtype=dtype, **kwargs)
                    cast.__enter__()
                    casts.append(cast)
            except BaseException:
                for cast in reversed(casts):
                    cast.__exit__(None, None, None)
                raise
        else:
            disabled = tuple(dev for dev in self.device_types if _autocast_enabled(dev))
            if mode is None and not disabled and not self._region:
                return None  # nothing to turn off: a no-op
            for dev in disabled:
                _set_autocast_enabled(dev, False)
        if mode is None:
            mode = _MPXMode(self._table)
            mode.__enter__()
            _state.mode = mode
            return (casts, disabled, mode, True, None)
        previous = mode.table
        mode.table = self._table
        return (casts, disabled, mode, False, previous)

    def _enter_traced(self) -> tuple | None:
        """:meth:`_enter` under dynamo: the same region as ``with`` blocks of ``torch.autocast`` and the mode."""
        mode = _state.mode
        disabled: tuple[str, ...] = ()
        if not self.policy.lowers_precision:
            disabled = tuple(dev for dev in self.device_types if _autocast_enabled(dev))
            if mode is None and not disabled and not self._region:
                return None
        region = self._traced_region(mode, disabled)
        region.__enter__()
        return (region,)

    @contextlib.contextmanager
    def _traced_region(self, mode: _MPXMode | None, disabled: tuple[str, ...]) -> Iterator[None]:
        if self.policy.lowers_precision:
            kwargs: dict[str, Any] = {"dtype": _TORCH_DTYPES[self.policy.compute_dtype]}
            if self.cache_enabled is not None:
                kwargs["cache_enabled"] = self.cache_enabled
            casts = _autocast_all(self.device_types, **kwargs)
        else:
            casts = _autocast_all(disabled, enabled=False)
        with casts:
            if mode is None:
                mode = _MPXMode(self._table)
                with mode:
                    _state.mode = mode
                    try:
                        yield
                    finally:
                        _state.mode = None
            else:
                previous = mode.table
                mode.table = self._table
                try:
                    yield
                finally:
                    mode.table = previous

    @staticmethod
    def _exit(frame: tuple | None) -> None:
        if frame is None:
            return
        if len(frame) == 1:  # a traced region
            frame[0].__exit__(None, None, None)
            return
        casts, disabled, mode, owned, previous = frame
        if owned:
            _state.mode = None
            mode.__exit__(None, None, None)
        else:
            mode.table = previous
        for dev in disabled:
            _set_autocast_enabled(dev, True)
        for cast in reversed(casts):
            cast.__exit__(None, None, None)

    def __enter__(self) -> autocast:
        self._frames.append(self._enter())
        return self

    def __exit__(self, *exc: object) -> None:
        self._exit(self._frames.pop())

    def __repr__(self) -> str:
        return f"mpx_torch.autocast({str(self.policy)!r}, device_type={self.device_types!r})"
