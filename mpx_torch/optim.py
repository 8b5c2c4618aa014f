"""``mpx_torch.optim.PolicyOptimizer``: a policy's master weights, update rule and optimizer-state storage around
any ``torch.optim`` optimizer.

The wrapped optimizer computes every step in float32: for each parameter the wrapper hands it a
float32 copy of the weight (its float32 master for ``master=float32``) and of the gradient, and
float32 state; then it writes the float32 result back by the policy's update rule
(:mod:`mpx.update_policy`), with the core's kernels (:mod:`mpx.kernels.rounding`):

* ``update=plain``: rounded to nearest into the parameter (or kept in the float32 master);
* ``update=stochastic``: stochastically rounded to bfloat16 with the counter-based bits of
  ``(seed, step, parameter index, element index)``: the bits mpx_jax rounds with;
* ``update=kahan``: optimi's Kahan summation: the float32 update ``u = new - old`` enters a bfloat16
  compensation buffer (``c1 = bf16(c + u)``, ``w1 = bf16(w + c1)``, ``c2 = bf16(c1 + bf16(w - w1))``).

``opt_state=bfloat16`` stores the wrapped optimizer's floating state in bfloat16 between steps
(rounded to nearest; float32 inside a step).  ``opt_state=int8:BLOCK`` stores each floating state
tensor of the parameter's shape (Adam's moments) as int8 codes and a float32 absmax per block
(:mod:`mpx.kernels.blockwise`), in the wrapper's own state (``state_of(p)["exp_avg.q"]``,
``["exp_avg.absmax"]``), and hands the wrapped optimizer the dequantized float32 tensor at each step.

Use it where the optimizer goes, with :class:`mpx_torch.GradScaler` too (a skipped step never calls
:meth:`PolicyOptimizer.step`, so weights, compensation, state and the step counter stay as they were);
an LR scheduler takes the wrapped optimizer (the two share ``param_groups``):

>>> import torch, mpx_torch
>>> from mpx_torch.optim import PolicyOptimizer
>>> w = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
>>> opt = PolicyOptimizer(torch.optim.SGD([w], lr=1e-4), "bf16_kahan")
>>> for _ in range(100):
...     w.grad = torch.ones_like(w)
...     opt.step()
>>> w.dtype, w.tolist(), round(float(w.detach()[0].float() + opt.state_of(w)["kahan_comp"][0].float()), 3)
(torch.bfloat16, [0.98828125, 0.98828125, 0.98828125], 0.99)
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from typing import Any

import ml_dtypes
import numpy as np
import torch

from mpx import Policy, PolicySpec, get_policy
from mpx import optim_checkpoint as ckpt
from mpx.errors import MPXError, PolicyError, StateDictError, UnsupportedTypeError
from mpx.kernels import blockwise, rounding
from mpx.update_policy import int8_block
from mpx_torch._array_ops import ops_for
from mpx_torch.prepare import prepared_policy

__all__ = ["PolicyOptimizer", "attach_policy", "attached_policy"]

_STEP_KEYS = ("step",)  # state entries that are counters, never cast


class PolicyOptimizer:
    """A ``torch.optim`` optimizer stepped under a policy's memory keys (see the module docs).

    Args:
        optimizer: any ``torch.optim.Optimizer`` over the model's parameters (bfloat16 ones for
            ``update=kahan|stochastic``).  Its ``param_groups`` and ``state`` are this object's.
        policy: a policy or spec (``"bf16_kahan"``, ``"bf16_sr"``, ``"bfloat16,opt_state=bf16"``...), or a
            module :func:`mpx_torch.prepare` put under one.
        seed: the stochastic rounding's seed (an int; default 0).

    Raises:
        mpx.PolicyError: for a bad seed, or a policy whose master is bfloat16 over parameters that are
            not (checked at each step).
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, policy: PolicySpec | torch.nn.Module, *, seed: int = 0
    ):
        if isinstance(policy, torch.nn.Module):
            found = prepared_policy(policy)
            if found is None:
                raise PolicyError("policy: the module was not prepared with mpx_torch.prepare; pass a policy")
            policy = found
        self.policy: Policy = get_policy(policy)
        self._block = int8_block(self.policy.opt_state)
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise PolicyError(f"seed: expected a non-negative int, got {seed!r}")
        self.optimizer = optimizer
        self.seed = seed
        self.steps = 0  # steps taken (a skipped step is not one): the generator's step counter
        self._inner_step: Callable[..., Any] | None = None  # attach_policy: the optimizer's step before it
        self._extra: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    # -- the optimizer's surface -------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups (the same list)."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The wrapped optimizer's state (float32 inside a step, ``opt_state``'s dtype between steps)."""
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_of(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """The wrapper's own state of ``param``: ``kahan_comp`` (bfloat16) and/or ``master`` (float32)."""
        return self._extra.get(param, {})

    def __repr__(self) -> str:
        return f"PolicyOptimizer({type(self.optimizer).__name__}, {str(self.policy)!r}, seed={self.seed})"

    def _params(self) -> Iterator[tuple[int, torch.Tensor]]:
        index = 0
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                yield index, p
                index += 1

    # -- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step of the wrapped optimizer in float32, written back by the policy's update rule."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pol = self.policy
        swapped: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
        for index, p in self._params():
            if p.grad is None:
                continue
            if pol.update != "plain" and p.dtype != torch.bfloat16:
                raise PolicyError(
                    f"update: {pol.update} writes bfloat16 master weights, but parameter {index} is {p.dtype}; "
                    "prepare the model under the policy (params=bfloat16) first"
                )
            extra = self._extra.setdefault(p, {})
            wide = p.dtype != torch.float32  # a narrower parameter: the step runs on a float32 copy
            if wide or pol.opt_state != "float32":
                self._widen_state(p)
            if not wide:
                continue
            storage, grad = p.data, p.grad
            if pol.master_dtype == "float32":
                if "master" not in extra:
                    extra["master"] = storage.float()
                work = extra["master"]
            else:
                work = storage.float()
            old = work.clone() if pol.update == "kahan" else None
            p.data = work
            p.grad = grad.float()
            swapped.append((index, p, storage, grad, old))
        try:
            (self._inner_step or self.optimizer.step)()
        finally:
            for index, p, storage, grad, old in swapped:
                new = p.data
                p.data = storage
                p.grad = grad
                self._write_back(index, p, new, old)
        if pol.opt_state != "float32":
            for _, p in self._params():
                self._narrow_state(p)
        self.steps += 1
        return loss

    def _write_back(self, index: int, p: torch.Tensor, new: torch.Tensor, old: torch.Tensor | None) -> None:
        """The float32 result ``new`` into the parameter ``p`` by the update rule."""
        o = ops_for(p.device)
        update = self.policy.update
        if update == "stochastic":
            value = rounding.stochastic_round_bf16(o, new, seed=self.seed, step=self.steps, param=index)
            p.copy_(value)  # exact: the kernel's float32 holds a bfloat16
        elif update == "kahan":
            extra = self._extra[p]
            comp = extra.get("kahan_comp")
            if comp is None:
                comp = extra["kahan_comp"] = torch.zeros_like(p, dtype=torch.bfloat16)
            w1, c2 = rounding.kahan_add(o, p.float(), comp.float(), new - old)
            p.copy_(w1)
            comp.copy_(c2)
        else:  # a float32 master: round to nearest into the parameter
            p.copy_(rounding.round_bf16(o, new) if p.dtype == torch.bfloat16 else new)

    def _widen_state(self, p: torch.Tensor) -> None:
        """The wrapped optimizer's state of ``p`` in float32 (dequantized from the int8 blocks)."""
        for key, value in self.optimizer.state.get(p, {}).items():
            if key not in _STEP_KEYS and torch.is_tensor(value) and value.is_floating_point():
                self.optimizer.state[p][key] = value.float()
        extra = self._extra.get(p, {})
        for key in [k[: -len(".q")] for k in extra if k.endswith(".q")]:
            q, absmax = extra.pop(f"{key}.q"), extra.pop(f"{key}.absmax")
            flat = blockwise.dequantize(ops_for(p.device), q, absmax, p.numel())
            self.optimizer.state[p][key] = flat.reshape(p.shape)

    def _narrow_state(self, p: torch.Tensor) -> None:
        """The wrapped optimizer's float32 state of ``p`` stored as ``opt_state`` says."""
        o = ops_for(p.device)
        state = self.optimizer.state.get(p, {})
        for key, value in list(state.items()):
            if key in _STEP_KEYS or not torch.is_tensor(value) or value.dtype != torch.float32:
                continue
            if self._block is None:
                state[key] = rounding.round_bf16(o, value).to(torch.bfloat16)
            elif value.shape == p.shape:  # a moment: int8 blocks in the wrapper's state
                q, absmax = blockwise.quantize(o, value.reshape(-1), self._block)
                extra = self._extra.setdefault(p, {})
                extra[f"{key}.q"], extra[f"{key}.absmax"] = q, absmax
                del state[key]

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"optimizer": the wrapped optimizer's state dict, "mpx": {policy, seed, steps, tensors}}``; ``tensors``
        maps each of the wrapper's own state names (``kahan_comp``, ``master``, ``exp_avg.q``,
        ``exp_avg.absmax``...) to ``{parameter index: tensor}``."""
        tensors: dict[str, dict[int, torch.Tensor]] = {}
        for index, p in self._params():
            for key, value in self._extra.get(p, {}).items():
                tensors.setdefault(key, {})[index] = value.clone()
        mpx_state = {"policy": str(self.policy), "seed": self.seed, "steps": self.steps, "tensors": tensors}
        return {"optimizer": type(self.optimizer).state_dict(self.optimizer), "mpx": mpx_state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Read a :meth:`state_dict` back: the wrapped optimizer's state keeps its stored dtype (torch would
        cast it to the bfloat16 parameters' dtype), the compensation and masters their own.

        Raises:
            mpx.StateDictError: for a dict that is not this wrapper's, or of another policy.
        """
        if not isinstance(state_dict, dict) or set(state_dict) != {"optimizer", "mpx"}:
            raise StateDictError(
                "state_dict: expected a PolicyOptimizer.state_dict() with keys optimizer and mpx"
            )
        mpx_state = state_dict["mpx"]
        if get_policy(mpx_state["policy"]) != self.policy:
            raise StateDictError(
                f"state_dict: saved under policy {mpx_state['policy']!r}, this wrapper's is {str(self.policy)!r}"
            )
        params = dict(self._params())
        saved = [(p, p.data) for p in params.values()]
        stored = {k: v for k, v in state_dict["optimizer"]["state"].items()}
        try:  # torch casts floating state to each parameter's dtype: show it the stored dtype instead
            for index, p in params.items():
                value = next(
                    (
                        v
                        for k, v in stored.get(index, {}).items()
                        if k not in _STEP_KEYS and torch.is_tensor(v)
                    ),
                    None,
                )
                if value is not None and value.is_floating_point():
                    p.data = torch.empty_like(p.data, dtype=value.dtype)
            type(self.optimizer).load_state_dict(self.optimizer, state_dict["optimizer"])
        finally:
            for p, data in saved:
                p.data = data
        self.seed, self.steps = int(mpx_state["seed"]), int(mpx_state["steps"])
        self._extra = {}
        for key, by_index in mpx_state["tensors"].items():
            for index, value in by_index.items():
                self._extra.setdefault(params[int(index)], {})[key] = value.clone().to(
                    params[int(index)].device
                )

    # -- the neutral checkpoint (mpx.optim/1) ------------------------------------------------------
    def _kind(self) -> str:
        """The neutral optimizer kind of the wrapped optimizer (``adam`` or ``sgd``)."""
        if isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            if any(g.get("amsgrad") for g in self.optimizer.param_groups):
                raise UnsupportedTypeError("optimizer: amsgrad has no mpx.optim/1 form; use amsgrad=False")
            return "adam"
        if isinstance(self.optimizer, torch.optim.SGD):
            return "sgd"
        raise UnsupportedTypeError(
            f"optimizer: {type(self.optimizer).__name__} has no mpx.optim/1 form; Adam, AdamW and SGD have"
        )

    def neutral_state_dict(self) -> dict[str, Any]:
        """This optimizer's state as the framework-neutral ``mpx.optim/1`` dict of numpy arrays
        (:mod:`mpx.optim_checkpoint`), which mpx_jax's and mpx_keras's policy optimizers read.

        Raises:
            mpx.UnsupportedTypeError: for a wrapped optimizer other than Adam, AdamW (no amsgrad) and SGD.
        """
        kind = self._kind()
        params = []
        for _, p in self._params():
            extra, state = self._extra.get(p, {}), self.optimizer.state.get(p, {})
            entry: dict[str, np.ndarray] = {}
            if "kahan_comp" in extra:
                entry["kahan_comp"] = _to_numpy(extra["kahan_comp"])
            elif self.policy.update == "kahan":
                entry["kahan_comp"] = np.zeros(tuple(p.shape), ckpt.BF16)
            if "master" in extra:
                entry["master"] = _to_numpy(extra["master"])
            for name in ckpt.MOMENTS[kind]:
                if f"{name}.q" in extra:
                    entry[f"{name}.q"] = _to_numpy(extra[f"{name}.q"])
                    entry[f"{name}.absmax"] = _to_numpy(extra[f"{name}.absmax"])
                elif torch.is_tensor(state.get(name)):
                    entry[name] = _to_numpy(state[name])
            params.append(entry)
        return ckpt.make(self.policy, seed=self.seed, step=self.steps, optimizer=kind, params=params)

    def load_neutral_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Read an ``mpx.optim/1`` dict (from any backend's :meth:`neutral_state_dict`): the compensation, masters,
        moments (in their stored form), seed and step; the next step is the one the saving optimizer would take.

        Raises:
            mpx.StateDictError: naming the field that does not fit this optimizer (policy, shapes, dtypes, kind).
        """
        kind = self._kind()
        params = [p for _, p in self._params()]
        d = ckpt.check(state_dict, self.policy, [tuple(p.shape) for p in params], optimizer=kind)
        self.seed, self.steps = d["seed"], d["step"]
        self._extra = {}
        for p, entry in zip(params, d["params"], strict=True):
            extra: dict[str, torch.Tensor] = {}
            state: dict[str, Any] = {}
            for name, value in entry.items():
                target = (
                    extra if name in ("kahan_comp", "master") or name.endswith((".q", ".absmax")) else state
                )
                target[name] = _from_numpy(value, p.device)
            if kind == "adam" and any(n.startswith("exp_avg") for n in entry):
                state["step"] = torch.tensor(float(d["step"]), dtype=torch.float32)
            if state:
                self.optimizer.state[p] = state
            else:
                self.optimizer.state.pop(p, None)
            if extra:
                self._extra[p] = extra


def attach_policy(optimizer: torch.optim.Optimizer, policy: PolicySpec, *, seed: int = 0) -> PolicyOptimizer:
    """Step ``optimizer`` itself under ``policy``'s memory keys, in place, and return the :class:`PolicyOptimizer`
    that does it.

    ``optimizer`` stays the ``torch.optim`` object LR schedulers, Accelerate, the HF Trainer and Lightning hold:
    its ``step`` (this instance's only) is the policy optimizer's, which calls the step it had before (an LR
    scheduler's counting wrapper included); its ``state_dict()`` is torch's plus the wrapper's part under
    ``"mpx"`` (:meth:`PolicyOptimizer.state_dict`), which its ``load_state_dict`` reads back.
    :func:`mpx_torch.accelerate.attach` (so :class:`mpx_torch.transformers.MPXTrainer`) and
    :class:`mpx_torch.lightning.MPXPrecision` call it for a policy that names ``master``, ``update`` or
    ``opt_state`` (:func:`mpx.update_policy.needs_policy_optimizer`).

    Raises:
        mpx.MPXError: when a policy is already attached to ``optimizer``.
        mpx.PolicyError: as :class:`PolicyOptimizer`.
    """
    if attached_policy(optimizer) is not None:
        raise MPXError("optimizer: a policy is already attached to it (mpx_torch.optim.attach_policy)")
    wrapper = PolicyOptimizer(optimizer, policy, seed=seed)
    wrapper._inner_step = optimizer.step
    optimizer._mpx_policy_optimizer = wrapper  # type: ignore[attr-defined]
    optimizer.step = types.MethodType(_attached_step, optimizer)  # type: ignore[method-assign]
    optimizer.state_dict = types.MethodType(_attached_state_dict, optimizer)  # type: ignore[method-assign]
    optimizer.load_state_dict = types.MethodType(_attached_load_state_dict, optimizer)  # type: ignore[method-assign]
    return wrapper


def attached_policy(optimizer: Any) -> PolicyOptimizer | None:
    """The :class:`PolicyOptimizer` :func:`attach_policy` attached to ``optimizer``, or None."""
    return getattr(optimizer, "_mpx_policy_optimizer", None)


def _attached_step(self: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
    return self._mpx_policy_optimizer.step(closure)  # type: ignore[attr-defined]


def _attached_state_dict(self: torch.optim.Optimizer) -> dict[str, Any]:
    saved = self._mpx_policy_optimizer.state_dict()  # type: ignore[attr-defined]
    return {**saved["optimizer"], "mpx": saved["mpx"]}


def _attached_load_state_dict(self: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    state_dict = dict(state_dict)
    mpx_state = state_dict.pop("mpx", None)
    if mpx_state is None:
        raise StateDictError(
            "state_dict: this optimizer steps under an mpx policy; its state dict has no 'mpx' entry "
            "(it was saved without the policy)"
        )
    self._mpx_policy_optimizer.load_state_dict({"optimizer": state_dict, "mpx": mpx_state})  # type: ignore[attr-defined]


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """A tensor as numpy (bfloat16 as ``ml_dtypes.bfloat16``), copied."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.float().numpy().astype(ml_dtypes.bfloat16)
    return t.numpy().copy()


def _from_numpy(a: np.ndarray, device: torch.device) -> torch.Tensor:
    if a.dtype == ckpt.BF16:
        return torch.from_numpy(a.astype(np.float32)).to(device=device, dtype=torch.bfloat16)
    return torch.from_numpy(np.array(a)).to(device)
