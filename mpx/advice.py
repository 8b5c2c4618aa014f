"""Which (backend, device, compute dtype) combinations are known to be slow, and a warn-once helper.

The table :data:`SLOW_POLICIES` holds what ``mpx bench`` and ``mpx doctor``
measured (see the README's "Performance" section): one training step of the
1024-4096-1024 MLP, or a matmul, in a half-precision compute dtype against
float32 on the same device.  A backend calls :func:`warn_if_slow` when a user
selects a policy; it issues one :class:`SlowPolicyWarning` per (backend,
device kind, compute dtype) per process.

Silence it with the environment variable ``MPX_NO_SLOW_WARNING=1`` or with
the standard filter ``warnings.filterwarnings("ignore", category=mpx.advice.SlowPolicyWarning)``.

>>> import warnings
>>> reset_warnings()
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     first = warn_if_slow("tf", "mixed_float16", device="cpu")
...     again = warn_if_slow("tf", "mixed_float16", device="cpu")
>>> first, again, len(caught), caught[0].category.__name__
(True, False, 1, 'SlowPolicyWarning')
>>> slow_entry("torch", "mixed_bfloat16") is None, slow_entry("torch", "mixed_float16").slowdown > 1
(True, True)
"""

from __future__ import annotations

import dataclasses
import os
import threading
import warnings

from mpx.policy import PolicySpec, get_policy

__all__ = [
    "ENV_SWITCH",
    "SLOW_POLICIES",
    "SlowEntry",
    "SlowPolicyWarning",
    "device_kind",
    "reset_warnings",
    "slow_entry",
    "warn_if_slow",
]

#: Set this environment variable to ``1`` (or ``true``/``yes``) to turn every SlowPolicyWarning off.
ENV_SWITCH = "MPX_NO_SLOW_WARNING"


class SlowPolicyWarning(UserWarning):
    """A policy whose compute dtype is known to be slower than float32 on this backend and device."""


@dataclasses.dataclass(frozen=True)
class SlowEntry:
    """One measured slow combination.

    ``slowdown`` is the step (or matmul) time in ``compute_dtype`` divided by the
    float32 time on the same machine (``195.0``: 195 times slower); ``measured``
    says what was timed; ``advice`` is the policy to use instead.
    """

    backend: str
    device_kind: str
    compute_dtype: str
    slowdown: float
    measured: str
    advice: str


#: (backend, device kind, compute dtype) -> what was measured.  Device kinds: ``"cpu"``, ``"gpu"``.
SLOW_POLICIES: dict[tuple[str, str, str], SlowEntry] = {
    entry[:3]: SlowEntry(*entry)
    for entry in (
        ("torch", "cpu", "float16", 10.0,
         "torch 2.13 autocast float16 MLP training step vs float32 on a 2-core AMD EPYC without avx512_fp16 "
         "(5.3-8.2 s against 0.54 s; the CPU's float16 GEMMs in the backward pass are not vectorized)",
         "use mixed_bfloat16 (0.70x the float32 step time on CPUs with avx512_bf16) or float32"),
        ("tf", "cpu", "float16", 1.44,
         "Keras 3.15 / TF 2.21 mixed_float16 MLP training step vs float32 on a 2-core AMD EPYC without "
         "avx512_fp16 (and 195x on another such CPU, measured earlier in this project)",
         "use mixed_bfloat16 (0.71x the float32 step time on CPUs with avx512_bf16) or float32"),
        ("jax", "cpu", "bfloat16", 2.05,
         "jmp-style bfloat16 MLP training step vs float32, XLA:CPU (jax 0.10): bfloat16 elementwise work "
         "and dots are converted to float32 and back",
         "use float32 on XLA:CPU; bfloat16 pays off on TPU and GPU"),
        ("jax", "cpu", "float16", 2.35,
         "jmp-style float16 MLP training step (no loss scaling) vs float32, XLA:CPU (jax 0.10)",
         "use float32 on XLA:CPU; float16 pays off on GPU"),
    )
}  # fmt: skip

_lock = threading.Lock()
_warned: set[tuple[str, str, str]] = set()


def device_kind(device: object = "cpu") -> str:
    """``"cpu"`` or ``"gpu"`` for a device name or object (``"cpu"``, ``"cuda:0"``, ``"GPU:0"``, a jax device...).

    >>> device_kind("cuda:1"), device_kind("/job:localhost/device:CPU:0"), device_kind("TFRT_CPU_0")
    ('gpu', 'cpu', 'cpu')
    """
    name = str(getattr(device, "platform", None) or getattr(device, "type", None) or device).lower()
    if "cpu" in name:
        return "cpu"
    if any(word in name for word in ("cuda", "gpu", "rocm")):
        return "gpu"
    return name.split(":")[0].rsplit("/", 1)[-1] or "cpu"


def slow_entry(backend: str, policy: PolicySpec, device: object = "cpu") -> SlowEntry | None:
    """The :data:`SLOW_POLICIES` entry for ``policy``'s compute dtype on ``backend`` and ``device``, or None."""
    compute = get_policy(policy).compute_dtype
    return SLOW_POLICIES.get((backend, device_kind(device), compute))


def _switched_off() -> bool:
    return os.environ.get(ENV_SWITCH, "").strip().lower() in ("1", "true", "yes", "on")


def warn_if_slow(backend: str, policy: PolicySpec, device: object = "cpu", *, stacklevel: int = 2) -> bool:
    """Warn once per process when ``policy`` is known to be slow on ``backend`` (``torch``, ``tf``, ``jax``).

    Issues ``warnings.warn(..., SlowPolicyWarning)`` the first time a slow
    (backend, device kind, compute dtype) is seen, and returns whether it
    warned.  Nothing happens when ``MPX_NO_SLOW_WARNING=1`` is set; standard
    ``warnings`` filters apply as usual.  ``stacklevel`` is passed to
    ``warnings.warn`` (2: the caller of ``warn_if_slow``; a backend function
    that calls it on behalf of the user passes 3).

    Raises:
        mpx.PolicyError: for a bad policy spec.
    """
    entry = slow_entry(backend, policy, device)
    if entry is None or _switched_off():
        return False
    key = (entry.backend, entry.device_kind, entry.compute_dtype)
    with _lock:
        if key in _warned:
            return False
        _warned.add(key)
    warnings.warn(
        f"mpx: policy {str(get_policy(policy))!r} computes in {entry.compute_dtype}, which is measured "
        f"{entry.slowdown:g}x slower than float32 for {entry.backend} on {entry.device_kind} ({entry.measured}); "
        f"{entry.advice}. Run `mpx doctor` to check this machine; set {ENV_SWITCH}=1 to silence this warning.",
        SlowPolicyWarning,
        stacklevel=stacklevel,
    )
    return True


def reset_warnings() -> None:
    """Forget which combinations already warned (for tests)."""
    with _lock:
        _warned.clear()
