"""The loss-scaling state machine's transition, once for every backend (:func:`mpx.scaler_update`'s rule).

:func:`update` takes the five state values as the backend's arrays (a float32 scale, four
int32 counters) and a bool scalar, and returns the five after the step, with selects and
integer arithmetic only: no Python branch on a value, so it traces into one compiled step
(jit, ``tf.function``, dynamo) that a changing scale never recompiles.  A branch on the
*config* is static, as a shape is.

Each scale product is torch's, ``float32(float64(scale) * float64(factor))``: in float64
where the table has it, else :func:`product_bits` (int32 arithmetic on the scale's bits,
exact, the same float32).  The scale never leaves ``config.bounds``; the counters saturate
at :data:`COUNTER_MAX`.

>>> from mpx.kernels.array_ops import NUMPY_OPS as o
>>> from mpx.scaling import ScalerConfig
>>> s = initial(o, ScalerConfig(growth_interval=1))
>>> float(update(o, ScalerConfig(growth_interval=1), s, True).scale)
131072.0
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Protocol

from mpx.kernels.array_ops import ArrayOps
from mpx.kernels.bits import INF_BITS, TINY_BITS, bits_of, from_bits, to_bits

__all__ = [
    "BACKOFF",
    "COUNTER_MAX",
    "GROWTH",
    "SKIPPED",
    "ScaleState",
    "ScalerRule",
    "bump",
    "events",
    "floor_hit",
    "initial",
    "product_bits",
    "scale_product_bits",
    "update",
]

#: The largest value of every counter: int32's max, which every backend holds.
COUNTER_MAX = 2**31 - 1
#: The bits of a step's events (:func:`events`): skipped, a growth step, a back-off step.
SKIPPED, GROWTH, BACKOFF = 1, 2, 4


class FactorLimbs(Protocol):
    """A factor as ``mantissa * 2**exponent``, the 53-bit mantissa as five 12-bit limbs (low first);
    each limb and the exponent a Python int or an int32 array (a factor chosen per step by a select)."""

    limbs: tuple[Any, Any, Any, Any, Any]
    exponent: Any


class _Limbs(NamedTuple):
    limbs: tuple[Any, Any, Any, Any, Any]
    exponent: Any


class ScalerRule(Protocol):
    """What the kernel reads of an :class:`mpx.ScalerConfig`."""

    kind: str
    growth_interval: int
    hysteresis: int
    hysteresis_reset: str
    first_growth_delay: int
    skip_nonfinite: bool
    growth_factor: float
    backoff_factor: float

    @property
    def first_scale(self) -> float: ...

    @property
    def bounds(self) -> tuple[float, float]: ...

    @property
    def growth_split(self) -> FactorLimbs: ...

    @property
    def backoff_split(self) -> FactorLimbs: ...


class ScaleState(NamedTuple):
    """The scaler's state as a backend's arrays: float32 ``scale``, int32 counters.

    ``nonfinite_since_growth`` counts the non-finite steps since the last growth step (or the
    start) under ``hysteresis_reset="growth"`` only; it stays 0 under ``"finite"``.
    """

    scale: Any
    growth_tracker: Any
    consecutive_nonfinite: Any
    steps: Any
    skipped_steps: Any
    nonfinite_since_growth: Any


def initial(o: ArrayOps, config: ScalerRule) -> ScaleState:
    """The state before the first step, as the table's arrays."""
    return ScaleState(o.float32(config.first_scale), *(o.int32(0) for _ in range(5)))


def bump(o: ArrayOps, counter: Any, by: Any = True) -> Any:
    """``counter + 1`` where ``by`` (a bool, traced or not) holds, saturating at :data:`COUNTER_MAX`."""
    grow = o.lt(counter, COUNTER_MAX)
    if by is not True:
        grow = o.logical_and(grow, by)
    return o.add(counter, o.cast(grow, "int32"))


def product_bits(o: ArrayOps, bits: Any, split: FactorLimbs) -> Any:
    """The int32 bits of ``float32(float64(scale) * factor)`` from int32 operations only.

    ``bits``: the int32 bits of a normal positive float32 ``scale``; ``split``: the factor's
    :func:`mpx.scaling.split_factor`.  The exact 77-bit product of the mantissas is built
    from 12-bit limbs (every intermediate below 2**27), rounded to 53 bits (float64) and
    then to 24 (float32), both to nearest even, as the float64 product is.  Returns the bits
    of +inf when the result overflows float32, and 0 when it lies below 2**-126 (callers
    floor the scale there, so its subnormal value never matters).
    """
    exp_a = o.shr(bits, 23)
    ma = o.bit_or(o.bit_and(bits, 0x7FFFFF), 0x800000)
    a0, a1 = o.bit_and(ma, 0xFFF), o.shr(ma, 12)
    b0, b1, b2, b3, b4 = split.limbs

    def column(*terms: tuple[Any, Any]) -> Any:
        total: Any = 0
        for a, b in terms:
            if not (isinstance(b, int) and b == 0):  # a zero limb known now adds nothing
                total = o.mul(a, b) if isinstance(total, int) else o.add(total, o.mul(a, b))
        return o.int32(total) if isinstance(total, int) else total

    columns = (
        column((a0, b0)),
        column((a1, b0), (a0, b1)),
        column((a1, b1), (a0, b2)),
        column((a1, b2), (a0, b3)),
        column((a1, b3), (a0, b4)),
        column((a1, b4)),
    )
    p: list[Any] = []
    carry: Any = 0
    for c in columns:
        t = o.add(c, carry)
        p.append(o.bit_and(t, 0xFFF))
        carry = o.shr(t, 12)
    p.append(carry)  # the product has 76 or 77 bits: p[6] < 2**5
    short = o.lt(p[6], 16)  # 76 bits: shift left once, so 77 bits = 24 dropped + 53 kept
    q = [
        o.where(short, o.bit_or(o.bit_and(o.shl(p[k], 1), 0xFFF), o.shr(p[k - 1], 11) if k else 0), p[k])
        for k in range(7)
    ]
    # round to 53 bits (float64): drop q[0], q[1]
    dropped = o.bit_or(o.shl(q[1], 12), q[0])
    half = 0x800000
    up = o.logical_or(o.lt(half, dropped), o.logical_and(o.eq(dropped, half), o.eq(o.bit_and(q[2], 1), 1)))
    carry = o.cast(up, "int32")
    for k in range(2, 7):
        t = o.add(q[k], carry)
        q[k] = o.bit_and(t, 0xFFF) if k < 6 else t
        carry = o.shr(t, 12)
    # round those 53 bits to 24 (float32): drop the low 29
    r = o.bit_or(o.bit_or(o.shr(q[4], 5), o.shl(q[5], 7)), o.shl(q[6], 19))
    rest = o.bit_or(o.bit_or(q[2], o.shl(q[3], 12)), o.shl(o.bit_and(q[4], 31), 24))
    half = 0x10000000
    up = o.logical_or(o.lt(half, rest), o.logical_and(o.eq(rest, half), o.eq(o.bit_and(r, 1), 1)))
    r = o.add(r, o.cast(up, "int32"))
    over = o.shr(r, 24)  # 1 when rounding carried to 2**24
    r = o.shr(r, over)
    field = o.add(o.sub(o.add(o.add(exp_a, split.exponent), 53), o.cast(short, "int32")), over)
    safe = o.maximum(o.minimum(field, 254), 1)
    normal = o.bit_or(o.shl(safe, 23), o.bit_and(r, 0x7FFFFF))
    return o.where(o.lt(254, field), INF_BITS, o.where(o.lt(field, 1), 0, normal))


def scale_product_bits(o: ArrayOps, scale: Any, factor: float, split: FactorLimbs) -> Any:
    """The int32 bits of ``float32(float64(scale) * factor)`` for a normal positive float32 ``scale``:
    +inf's bits on overflow, 0 below 2**-126 (as :func:`product_bits`, whichever way it is computed)."""
    if o.float64:
        b = to_bits(o, o.cast(o.mul(o.cast(scale, "float64"), factor), "float32"))
        return o.where(o.lt(b, TINY_BITS), 0, b)
    return product_bits(o, to_bits(o, scale), split)


def _step_product_bits(o: ArrayOps, config: ScalerRule, scale: Any, finite: Any) -> Any:
    """The bits of ``float32(float64(scale) * factor)`` with the growth factor where ``finite`` and the
    backoff factor elsewhere: one product per step, its factor chosen by a select.  +inf's bits on
    overflow; below 2**-126 any bits below 2**-126's (the caller floors them)."""
    if o.float64:
        factor = o.where(finite, o.cast(config.growth_factor, "float64"), config.backoff_factor)
        return to_bits(o, o.cast(o.mul(o.cast(scale, "float64"), factor), "float32"))
    grow, back = config.growth_split, config.backoff_split

    def pick(g: int, b: int) -> Any:
        return g if g == b else o.where(finite, g, b)

    limbs = tuple(pick(g, b) for g, b in zip(grow.limbs, back.limbs, strict=True))
    return product_bits(o, to_bits(o, scale), _Limbs(limbs, pick(grow.exponent, back.exponent)))  # type: ignore[arg-type]


def _growth_due(o: ArrayOps, config: ScalerRule, tracker: Any) -> Any:
    """Whether a finite step after ``tracker`` (the growth tracker before it) is a growth step."""
    return o.eq(o.add(tracker, 1), config.growth_interval + config.first_growth_delay)


def _backoff_due(o: ArrayOps, config: ScalerRule, consecutive: Any, since: Any) -> Any:
    """Whether a non-finite step leaving these counts (non-finite steps in a row, and since the last
    growth) is a back-off step, its hysteresis spent; a Python True for a hysteresis of 1."""
    if config.hysteresis <= 1:
        return True
    return o.le(config.hysteresis, since if config.hysteresis_reset == "growth" else consecutive)


def events(o: ArrayOps, config: ScalerRule, tracker_before: Any, new: ScaleState) -> Any:
    """The events of the step that took the growth tracker from ``tracker_before`` to ``new``'s state, as
    an int32 of :data:`SKIPPED` | :data:`GROWTH` | :data:`BACKOFF` bits: the conditions :func:`update`
    selects on (a growth or back-off step counts even where a bound keeps the scale)."""
    nonfinite = o.lt(0, new.consecutive_nonfinite)
    out = o.cast(nonfinite, "int32") if config.skip_nonfinite else o.int32(0)  # SKIPPED: bit 0
    if config.kind == "dynamic":
        grew = o.logical_and(o.logical_not(nonfinite), _growth_due(o, config, tracker_before))
        due = _backoff_due(o, config, new.consecutive_nonfinite, new.nonfinite_since_growth)
        backed = nonfinite if due is True else o.logical_and(nonfinite, due)
        out = o.bit_or(out, o.bit_or(o.shl(o.cast(grew, "int32"), 1), o.shl(o.cast(backed, "int32"), 2)))
    return out


def update(o: ArrayOps, config: ScalerRule, state: ScaleState, finite: Any) -> ScaleState:
    """The state after a step whose gradients were ``finite`` (a bool scalar array; traced or not).

    A dynamic scale grows by ``growth_factor`` on the ``growth_interval``-th finite step in a
    row, up to ``max_scale`` and never to a non-finite float32, and backs off by
    ``backoff_factor`` once ``hysteresis`` non-finite steps have come in a row, down to
    ``min_scale`` (2**-126 for None).  Positive float32 values order as their bits, so the
    bounds apply to the bits.  The step counts as skipped when it is not finite and
    ``config.skip_nonfinite``.  What the config fixes (a hysteresis of 1, no ceiling, no
    skipping, the default reset and delay) is decided here, in Python, and leaves its selects
    out of the traced step.

    DeepSpeed's modes: ``first_growth_delay`` d > 0 makes the first growth after a non-finite
    step (or the start) wait ``growth_interval + d`` finite steps and each later one
    ``growth_interval`` (the tracker restarts at d after a growth, at 0 after a non-finite step);
    ``hysteresis_reset="growth"`` counts the non-finite steps since the last growth step
    (``nonfinite_since_growth``) instead of those in a row, so only a growth refills the budget.
    """
    consecutive = o.where(finite, 0, bump(o, state.consecutive_nonfinite))
    scale, tracker, since = state.scale, state.growth_tracker, state.nonfinite_since_growth
    if config.kind == "dynamic":
        lo, hi = config.bounds
        delay = config.first_growth_delay
        sbits = to_bits(o, scale)
        product = _step_product_bits(o, config, scale, finite)
        grown = o.minimum(product, bits_of(hi)) if hi != math.inf else product
        grown = o.where(o.lt(product, INF_BITS), grown, sbits)  # a growth to inf keeps the scale
        backed = o.maximum(product, bits_of(lo))
        counted = o.add(tracker, 1)
        hit = _growth_due(o, config, tracker)
        if config.hysteresis_reset == "growth":
            since = bump(o, since, o.logical_not(finite))
        if config.hysteresis > 1:  # else every non-finite step backs off
            backed = o.where(_backoff_due(o, config, consecutive, since), backed, sbits)
        scale = from_bits(o, o.where(finite, o.where(hit, grown, sbits), backed))
        tracker = o.where(finite, o.where(hit, delay, counted), 0)
        if config.hysteresis_reset == "growth":
            since = o.where(o.logical_and(finite, hit), 0, since)
    skipped = state.skipped_steps
    if config.skip_nonfinite:
        skipped = bump(o, skipped, o.logical_not(finite))
    return ScaleState(scale, tracker, consecutive, bump(o, state.steps), skipped, since)


def floor_hit(o: ArrayOps, config: ScalerRule, old_scale: Any, new: ScaleState) -> Any:
    """Whether the step that produced ``new`` was due to back off while the scale (``old_scale``,
    before the step) was already at its floor: the condition ``on_floor="raise"`` raises on
    (DeepSpeed's "Current loss scale already at minimum").  A bool array; a Python False for a
    scale that never moves."""
    if config.kind != "dynamic":
        return False
    due = o.lt(0, new.consecutive_nonfinite)
    if config.hysteresis > 1:
        due = o.logical_and(due, _backoff_due(o, config, new.consecutive_nonfinite, new.nonfinite_since_growth))
    return o.logical_and(due, o.le(to_bits(o, old_scale), bits_of(config.bounds[0])))
