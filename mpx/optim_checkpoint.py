"""The neutral optimizer-state checkpoint ``mpx.optim/1``: what a policy optimizer keeps (master weights, Kahan
compensation, the moments in their stored form, the step, the policy and seed), as plain numpy arrays, written and
read by torch's ``PolicyOptimizer``, optax's ``policy_optimizer`` and Keras's ``PolicyOptimizer`` alike, so a run
saved in one framework resumes in another.

The dict::

    {"format": "mpx.optim/1", "policy": str(policy), "seed": int, "step": int,
     "optimizer": "adam" | "sgd",
     "params": [ {name: numpy array, ...} for each parameter, in the optimizer's order ]}

Per parameter (every array of the parameter's shape unless said):

* ``master``: float32, the float32 master (``master=float32`` over narrower params), where the wrapper has one;
* ``kahan_comp``: bfloat16 (``ml_dtypes.bfloat16``), the compensation (``update=kahan``);
* the moments, by torch's names and in torch's convention: ``exp_avg`` and ``exp_avg_sq`` for ``adam``
  (Adam and AdamW), ``momentum_buffer`` for ``sgd`` (``buf = momentum * buf + grad``; absent without momentum),
  each stored as the policy's ``opt_state`` says: float32, bfloat16, or for ``int8:BLOCK`` two arrays
  ``NAME.q`` (int8, ``(rows, BLOCK)``) and ``NAME.absmax`` (float32, ``(rows,)``) of
  :mod:`mpx.kernels.blockwise` with ``rows = ceil(size / BLOCK)``.

``step`` is the number of steps taken (a skipped step is not one): the stochastic rounding's step counter and
Adam's bias-correction count.  :func:`check` validates a dict against the reading wrapper's policy and
parameter shapes and raises :class:`mpx.StateDictError` naming the field; nothing is ever unpickled
(:func:`to_flat` / :func:`from_flat` give ``numpy.savez``'s flat form).

>>> import numpy as np
>>> d = make("bf16_kahan", seed=1, step=3, optimizer="sgd", params=[{"kahan_comp": np.zeros(2, BF16)}])
>>> check(d, "bf16_kahan", [(2,)])["step"], sorted(to_flat(d))
(3, ['format', 'optimizer', 'params/0/kahan_comp', 'policy', 'seed', 'step'])
>>> check(d, "bf16_sr", [(2,)])
Traceback (most recent call last):
...
mpx.errors.StateDictError: policy: the checkpoint was saved under 'params=bfloat16,...,update=kahan', this optimizer's is '...update=stochastic'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from mpx.errors import MPXError, StateDictError
from mpx.policy import Policy, PolicySpec, get_policy
from mpx.update_policy import int8_block

__all__ = ["BF16", "FORMAT", "MOMENTS", "check", "from_flat", "make", "moment_names", "to_flat"]

#: The format tag of the dict.
FORMAT = "mpx.optim/1"
#: numpy's bfloat16 (ml_dtypes): the dtype of ``kahan_comp`` and of bfloat16-stored moments.
BF16 = np.dtype(ml_dtypes.bfloat16)
#: The moments of each optimizer kind, by torch's names.
MOMENTS: dict[str, tuple[str, ...]] = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


def moment_names(optimizer: str, opt_state: str) -> tuple[str, ...]:
    """The array names one parameter's moments take under ``opt_state`` (``exp_avg.q``, ``exp_avg.absmax``...)."""
    names = MOMENTS[optimizer]
    if int8_block(opt_state) is None:
        return names
    return tuple(f"{n}.{part}" for n in names for part in ("q", "absmax"))


def make(
    policy: PolicySpec, *, seed: int, step: int, optimizer: str, params: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """The ``mpx.optim/1`` dict of these fields (arrays copied into numpy)."""
    return {
        "format": FORMAT,
        "policy": str(get_policy(policy)),
        "seed": int(seed),
        "step": int(step),
        "optimizer": optimizer,
        "params": [{k: np.array(v) for k, v in p.items()} for p in params],
    }


def _int(d: Mapping[str, Any], key: str) -> int:
    value = d.get(key)
    if isinstance(value, np.ndarray) and value.shape == () and value.dtype.kind in "iu":
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise StateDictError(f"{key}: expected a non-negative int, got {value!r}")
    return value


def _want(field: str, arr: Any, dtype: np.dtype, shape: tuple[int, ...]) -> None:
    if not isinstance(arr, np.ndarray):
        raise StateDictError(f"{field}: expected a numpy array, got {type(arr).__name__}")
    if arr.dtype != dtype or tuple(arr.shape) != tuple(shape):
        raise StateDictError(
            f"{field}: expected {np.dtype(dtype).name}{list(shape)}, got {arr.dtype.name}{list(arr.shape)}"
        )


def check(
    d: Mapping[str, Any],
    policy: PolicySpec,
    shapes: Sequence[tuple[int, ...]],
    *,
    optimizer: str | None = None,
) -> dict[str, Any]:
    """``d`` validated for a wrapper under ``policy`` whose parameters have ``shapes`` (and, if given, whose
    optimizer is of kind ``optimizer``); returns it with ``seed``/``step`` as ints.

    Raises:
        mpx.StateDictError: naming the field (``format``, ``policy``, ``params[1].exp_avg.q``...) and what was
            expected.
    """
    if not isinstance(d, Mapping) or d.get("format") != FORMAT:
        got = d.get("format") if isinstance(d, Mapping) else type(d).__name__
        raise StateDictError(f"format: expected {FORMAT!r}, got {got!r}")
    pol: Policy = get_policy(policy)
    try:
        saved = get_policy(d.get("policy"))
    except (MPXError, TypeError):
        raise StateDictError(f"policy: {d.get('policy')!r} is not a policy spec") from None
    if saved != pol:
        raise StateDictError(f"policy: the checkpoint was saved under {str(saved)!r}, this optimizer's is {str(pol)!r}")
    kind = d.get("optimizer")
    if kind not in MOMENTS:
        raise StateDictError(f"optimizer: expected one of {', '.join(MOMENTS)}, got {kind!r}")
    if optimizer is not None and kind != optimizer:
        raise StateDictError(f"optimizer: the checkpoint holds {kind!r} state, this optimizer is {optimizer!r}")
    params = d.get("params")
    if not isinstance(params, Sequence) or len(params) != len(shapes):
        n = len(params) if isinstance(params, Sequence) else type(params).__name__
        raise StateDictError(f"params: expected {len(shapes)} parameters, got {n}")
    block = int8_block(pol.opt_state)
    for i, (p, shape) in enumerate(zip(params, shapes, strict=True)):
        shape = tuple(int(s) for s in shape)
        if not isinstance(p, Mapping):
            raise StateDictError(f"params[{i}]: expected a dict of arrays, got {type(p).__name__}")
        if pol.update == "kahan":
            _want(f"params[{i}].kahan_comp", p.get("kahan_comp"), BF16, shape)
        if "master" in p:
            _want(f"params[{i}].master", p["master"], np.dtype(np.float32), shape)
        names = [n for n in moment_names(kind, pol.opt_state) if n in p]
        if names and len(names) != len(moment_names(kind, pol.opt_state)):
            raise StateDictError(
                f"params[{i}]: expected all of {', '.join(moment_names(kind, pol.opt_state))} or none, got {names}"
            )
        for name in MOMENTS[kind]:
            if not names:
                break
            field = f"params[{i}].{name}"
            if block is not None:
                rows = max(1, -(-int(np.prod(shape, dtype=np.int64)) // block))
                _want(f"{field}.q", p[f"{name}.q"], np.dtype(np.int8), (rows, block))
                _want(f"{field}.absmax", p[f"{name}.absmax"], np.dtype(np.float32), (rows,))
            else:
                dtype = BF16 if pol.opt_state == "bfloat16" else np.dtype(np.float32)
                _want(field, p[name], dtype, shape)
        extra = set(p) - {"kahan_comp", "master", *moment_names(kind, pol.opt_state)}
        if extra:
            raise StateDictError(f"params[{i}]: unknown entries {sorted(extra)}")
    return {**d, "seed": _int(d, "seed"), "step": _int(d, "step")}


def to_flat(d: Mapping[str, Any]) -> dict[str, Any]:
    """``d`` as one level of names (``params/0/exp_avg.q``), for ``numpy.savez`` (strings and ints as they are)."""
    out = {k: v for k, v in d.items() if k != "params"}
    for i, p in enumerate(d["params"]):
        for name, arr in p.items():
            out[f"params/{i}/{name}"] = arr
    return out


def from_flat(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The nested dict of :func:`to_flat`'s form (0-d arrays of ``numpy.load`` become str/int; the 2-byte raw
    arrays ``.npy`` files make of bfloat16 become bfloat16 again)."""
    out: dict[str, Any] = {}
    params: dict[int, dict[str, Any]] = {}
    for key, value in flat.items():
        if key.startswith("params/"):
            _, index, name = key.split("/", 2)
            value = np.asarray(value)
            if value.dtype.kind == "V" and value.dtype.itemsize == 2:  # .npy files keep bfloat16 as 2 raw bytes
                value = value.view(BF16)
            params.setdefault(int(index), {})[name] = value
        else:
            value = np.asarray(value)
            out[key] = value.item() if value.shape == () else value
    out["params"] = [params.get(i, {}) for i in range(max(params, default=-1) + 1)]
    return out
