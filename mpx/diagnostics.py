"""Framework-neutral diagnostics: non-finite reports, underflow statistics and the advice rules (numpy only).

The backends (``mpx_torch.watch``, ``mpx_tf.watch``, ``mpx_jax.find_nonfinite``
and each backend's ``underflow_stats``) measure on the device and hand the
few numbers they read back to the functions here, which turn them into
report objects, one log line and advice.  :func:`underflow_reference` is the
numpy computation the backends must match.

Definitions (all per parameter or layer, on the *scaled* gradient ``g * scale``):

* ``zero_fraction``: elements that are 0 once cast to the compute dtype;
* ``subnormal_fraction``: elements that are subnormal (non-zero, below
  ``dtype_info(compute).smallest_normal`` in magnitude) once cast;
* ``underflow_fraction``: the sum of the two (the fraction the issue asks for);
* ``lost_fraction``: elements non-zero in float32 that become 0 in the compute
  dtype (an exact zero, e.g. behind a ReLU, is not lost);
* ``headroom_log2``: ``log2(dtype_info("float16").max / max|g * scale|)`` (inf
  for an all-zero gradient, negative when something overflows float16).

>>> stats = underflow_reference({"w": np.array([0.0, 1e-9, 1e-3, 2.0], np.float32)}, scale=1.0)
>>> stats.layers[0].zero_fraction, stats.layers[0].subnormal_fraction, stats.layers[0].lost_fraction
(0.5, 0.0, 0.25)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpx.dtypes import canonical_dtype, dtype_info, numpy_dtype
from mpx.errors import MPXError

__all__ = [
    "LOGGER",
    "DiagnosticsError",
    "LayerUnderflow",
    "NonfiniteReport",
    "NonfiniteSite",
    "UnderflowReport",
    "advise",
    "build_underflow_report",
    "check_scale",
    "headroom_log2",
    "nonfinite_report",
    "underflow_reference",
]

#: The logger every diagnostic writes its one line to.
LOGGER = logging.getLogger("mpx.diagnostics")

#: Advice thresholds: lost + subnormal fraction above which the scale is too low, when the headroom
#: (log2) is at least ``_LOW_HEADROOM``; a headroom below ``_HIGH_HEADROOM`` means the scale is too high.
_UNDERFLOW_LIMIT = 0.01
_LOW_HEADROOM = 2.0
_HIGH_HEADROOM = 1.0


class DiagnosticsError(MPXError):
    """Bad input to a diagnostic (an unknown field, a non-positive scale)."""


@dataclass(frozen=True)
class NonfiniteSite:
    """Where non-finite values were seen.

    ``kind`` is ``forward`` (a module's or layer's output), ``backward`` (the
    gradient flowing into a module's or layer's inputs), ``gradient`` (a
    parameter's gradient) or ``equation`` (a JAX equation's output).
    ``max_abs`` is the largest magnitude in the tensor (inf when it holds an
    inf, NaN when it holds only NaNs and zeros), ``nan`` and ``inf`` the
    element counts; ``source`` a ``file:line (function)`` where known.
    """

    kind: str
    name: str
    max_abs: float
    nan: int = 0
    inf: int = 0
    dtype: str | None = None
    source: str | None = None
    detail: str | None = None

    def describe(self) -> str:
        what = {"forward": "forward output of", "backward": "gradient into the inputs of",
                "gradient": "gradient of parameter", "equation": "output of equation"}.get(self.kind, self.kind)  # fmt: skip
        where = f" at {self.source}" if self.source else ""
        return (f"{what} {self.name!r}{where} (max|x| {self.max_abs:g}, {self.nan} NaN, {self.inf} inf"
                + (f", {self.dtype}" if self.dtype else "") + ")")  # fmt: skip


@dataclass(frozen=True)
class NonfiniteReport:
    """What a watch found on one step.

    ``first`` is where non-finite values first appeared (None on a finite
    step): the first forward output, else the first site of the backward pass
    in the order it ran (a module's input gradient or a parameter's gradient).  ``sites`` lists every non-finite site in the
    order seen; ``checked`` how many modules/layers/equations were watched;
    ``scale`` the loss scale of the step (None when not given).
    """

    backend: str
    first: NonfiniteSite | None
    sites: tuple[NonfiniteSite, ...] = ()
    checked: int = 0
    scale: float | None = None
    gradient_sites: tuple[NonfiniteSite, ...] = field(default=())

    @property
    def finite(self) -> bool:
        """True when nothing non-finite was seen."""
        return self.first is None

    @property
    def origin(self) -> str | None:
        """The name of the module, layer or equation where non-finite values first appeared."""
        return None if self.first is None else self.first.name

    def summary(self) -> str:
        """The one log line."""
        scale = "" if self.scale is None else f", loss scale {self.scale:g}"
        if self.first is None:
            return f"mpx {self.backend}: all finite ({self.checked} checked{scale})"
        more = len(self.sites) - 1
        grads = len(self.gradient_sites)
        return (f"mpx {self.backend}: non-finite values first in the {self.first.describe()}{scale}"
                + (f"; {more} later site(s)" if more > 0 else "")
                + (f"; {grads} parameter gradient(s) non-finite" if grads else ""))  # fmt: skip

    def __str__(self) -> str:
        return self.summary()


def nonfinite_report(
    backend: str,
    sites: Sequence[NonfiniteSite],
    *,
    checked: int = 0,
    scale: float | None = None,
    log: bool = True,
) -> NonfiniteReport:
    """Build the report from the non-finite sites in the order they were seen, and log its one line.

    The first forward (or equation) site wins, since a non-finite forward makes
    every gradient non-finite; without one, the first site of the backward
    pass in the order it ran (an input gradient or a parameter gradient).  The
    line is logged at WARNING when something was non-finite, at INFO otherwise.
    """
    forward = [s for s in sites if s.kind in ("forward", "equation")]
    first = forward[0] if forward else next(iter(sites), None)
    report = NonfiniteReport(backend=backend, first=first, sites=tuple(sites), checked=checked, scale=scale,
                             gradient_sites=tuple(s for s in sites if s.kind == "gradient"))  # fmt: skip
    if log:
        LOGGER.log(logging.INFO if report.finite else logging.WARNING, report.summary())
    return report


# -- underflow ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerUnderflow:
    """Underflow figures of one parameter or layer (fractions in [0, 1]; see the module docs)."""

    name: str
    size: int
    zero_fraction: float
    subnormal_fraction: float
    lost_fraction: float
    max_abs_scaled: float
    headroom_log2: float

    @property
    def underflow_fraction(self) -> float:
        """Zero or subnormal in the compute dtype."""
        return self.zero_fraction + self.subnormal_fraction


@dataclass(frozen=True)
class UnderflowReport:
    """Underflow statistics of one step's gradients at one loss scale.

    ``layers`` in the order given; the totals are element-weighted over all of
    them; ``advice`` one sentence (or None when the scale looks right).
    """

    backend: str
    compute_dtype: str
    scale: float
    layers: tuple[LayerUnderflow, ...]
    underflow_fraction: float
    lost_fraction: float
    subnormal_fraction: float
    headroom_log2: float
    advice: str | None

    def by_name(self) -> dict[str, LayerUnderflow]:
        """The layers by name."""
        return {layer.name: layer for layer in self.layers}

    def summary(self) -> str:
        """The one log line."""
        worst = max(self.layers, key=lambda s: s.lost_fraction + s.subnormal_fraction, default=None)
        worst_text = (
            ""
            if worst is None
            else f"; worst {worst.name!r} {worst.lost_fraction + worst.subnormal_fraction:.2%}"
        )
        return (f"mpx {self.backend}: {self.compute_dtype} gradients at scale {self.scale:g}: "
                f"{self.underflow_fraction:.2%} zero or subnormal ({self.lost_fraction:.2%} lost, "
                f"{self.subnormal_fraction:.2%} subnormal){worst_text}, headroom {self.headroom_log2:.1f} bits"
                + (f"; advice: {self.advice}" if self.advice else ""))  # fmt: skip

    def __str__(self) -> str:
        return self.summary()


def headroom_log2(max_abs_scaled: float) -> float:
    """``log2(float16 max / max_abs_scaled)``: how many doublings of the scale fit before float16 overflows.

    >>> headroom_log2(65504.0 / 8)
    3.0
    """
    m = float(max_abs_scaled)
    if math.isnan(m) or math.isinf(m):
        return -math.inf
    if m == 0.0:
        return math.inf
    return math.log2(dtype_info("float16").max / m)


def advise(compute_dtype: str, scale: float, underflow: float, headroom: float) -> str | None:
    """The advice rule: one sentence when the scale is clearly too low or too high, else None.

    ``underflow`` is the lost plus subnormal fraction (exact zeros excluded),
    ``headroom`` :func:`headroom_log2` of the largest scaled gradient.

    * float16: ``headroom < 1`` (within a factor 2 of overflow, or past it): too high;
      ``underflow > 1%`` with ``headroom >= 2``: too low, raise it by the
      headroom less one bit.
    * bfloat16 or float32 compute with ``underflow > 1%``: loss scaling cannot fix
      a dtype whose range is float32's; the gradients themselves are that small.

    >>> advise("float16", 1.0, 0.2, 12.0)
    'the loss scale 1 is too low: 20.00% of scaled gradients are lost or subnormal in float16 and there are 12.0 bits of headroom; raise it about 2**11 (init_scale or min_scale of the ScalerConfig)'
    >>> advise("float16", 2.0**16, 0.0, 0.5) is not None
    True
    """
    compute = canonical_dtype(compute_dtype, field="compute_dtype")
    if compute == "float16":
        if headroom < _HIGH_HEADROOM:
            return (f"the loss scale {scale:g} is too high: the largest scaled gradient is within "
                    f"{max(headroom, 0):.1f} bits of float16's max; expect skipped steps (a dynamic scaler backs "
                    "off on its own; a static scale should be lowered)")  # fmt: skip
        if underflow > _UNDERFLOW_LIMIT and headroom >= _LOW_HEADROOM:
            bits = math.floor(headroom) - 1 if math.isfinite(headroom) else 8
            return (f"the loss scale {scale:g} is too low: {underflow:.2%} of scaled gradients are lost or subnormal "
                    f"in float16 and there are {headroom:.1f} bits of headroom; raise it about 2**{bits} "
                    "(init_scale or min_scale of the ScalerConfig)")  # fmt: skip
        return None
    if underflow > _UNDERFLOW_LIMIT:
        return (f"{underflow:.2%} of gradients are lost or subnormal in {compute}, whose range is float32's: "
                "loss scaling does not help; check the loss normalization or keep these layers in float32")
    return None


def _as_float(x: Any) -> float:
    return float(np.asarray(x, np.float64))


def build_underflow_report(
    backend: str,
    names: Sequence[str],
    sizes: Sequence[int],
    counts: Any,
    *,
    scale: float,
    compute_dtype: str,
    log: bool = True,
) -> UnderflowReport:
    """The report from the device's counts, read back in one transfer.

    ``counts`` is an array of shape ``(len(names), 4)``: per layer the number
    of elements zero in the compute dtype, subnormal in it, non-zero in
    float32 but zero in the compute dtype, and the max |scaled gradient|.
    Logs the one line at INFO (WARNING when there is advice).
    """
    compute = canonical_dtype(compute_dtype, field="compute_dtype")
    counts = np.asarray(counts, np.float64).reshape(len(names), 4) if len(names) else np.zeros((0, 4))
    layers = []
    for name, size, (zero, sub, lost, top) in zip(names, sizes, counts, strict=True):
        n = max(int(size), 1)
        layers.append(LayerUnderflow(name=name, size=int(size), zero_fraction=float(zero) / n,
                                     subnormal_fraction=float(sub) / n, lost_fraction=float(lost) / n,
                                     max_abs_scaled=float(top), headroom_log2=headroom_log2(top)))  # fmt: skip
    total = max(sum(int(s) for s in sizes), 1)
    zero = float(counts[:, 0].sum()) / total
    sub = float(counts[:, 1].sum()) / total
    lost = float(counts[:, 2].sum()) / total
    top = float(np.nanmax(counts[:, 3])) if len(layers) else 0.0
    if len(layers) and np.isnan(counts[:, 3]).any():
        top = math.nan
    room = headroom_log2(top)
    report = UnderflowReport(backend=backend, compute_dtype=compute, scale=float(scale), layers=tuple(layers),
                             underflow_fraction=zero + sub, lost_fraction=lost, subnormal_fraction=sub,
                             headroom_log2=room, advice=advise(compute, float(scale), lost + sub, room))  # fmt: skip
    if log:
        LOGGER.log(logging.WARNING if report.advice else logging.INFO, report.summary())
    return report


def check_scale(scale: Any) -> float:
    """``scale`` as a positive finite float; raises :class:`DiagnosticsError` naming the field otherwise."""
    try:
        value = _as_float(scale)
    except (TypeError, ValueError):
        raise DiagnosticsError(f"scale: expected a positive number, got {scale!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise DiagnosticsError(f"scale: expected a positive finite number, got {value!r}")
    return value


def underflow_reference(
    grads: Mapping[str, Any] | Iterable[tuple[str, Any]],
    *,
    scale: float,
    compute_dtype: str = "float16",
    scaled: bool = False,
    backend: str = "numpy",
    log: bool = False,
) -> UnderflowReport:
    """The numpy computation of the statistics: what every backend's ``underflow_stats`` must match.

    ``grads`` maps names to float32 gradients; unscaled (multiplied by
    ``scale`` here, in float32) unless ``scaled``.  The scaled value is cast
    to ``compute_dtype`` (round to nearest even) and classified there.
    """
    compute = canonical_dtype(compute_dtype, field="compute_dtype")
    value = check_scale(scale)
    items = list(grads.items()) if isinstance(grads, Mapping) else list(grads)
    tiny = dtype_info(compute).smallest_normal
    names, sizes, rows = [], [], []
    for name, g in items:
        g32 = np.asarray(g, np.float32)
        s = g32 if scaled else g32 * np.float32(value)
        with np.errstate(over="ignore"):  # an overflow to inf is what the headroom reports
            c = np.abs(s.astype(numpy_dtype(compute)).astype(np.float32))
        zero = c == 0
        top = float(np.max(np.abs(s))) if s.size else 0.0
        rows.append([zero.sum(), ((c > 0) & (c < tiny)).sum(), (zero & (s != 0)).sum(), top])
        names.append(str(name))
        sizes.append(int(s.size))
    return build_underflow_report(backend, names, sizes, np.array(rows, np.float64).reshape(len(rows), 4),
                                  scale=value, compute_dtype=compute, log=log)  # fmt: skip
