"""``mpx_keras.optim.PolicyOptimizer``: a policy's master weights, update rule and optimizer-state storage around
any Keras 3 optimizer, on every Keras backend.

The same rule as :class:`mpx_torch.optim.PolicyOptimizer` and :func:`mpx_jax.optim.policy_optimizer`, with the
core's kernels (:mod:`mpx.kernels.rounding`, :mod:`mpx.kernels.blockwise`) run on ``keras.ops``:

* the wrapped optimizer is built on float32 *work* variables, one per narrower-than-float32 model variable
  (a float32 model variable is its own): it steps them in float32 with float32 gradients;
* the float32 result ``new`` is written back into the model variable by the policy's update rule:
  ``plain`` rounds to nearest (``master=float32``: the work variable is the master, kept between steps),
  ``stochastic`` rounds with the counter-based bits of ``(seed, step, variable index, element index)``
  (``step`` is this optimizer's ``policy_steps`` counter, the index the variable's position in the list the
  optimizer was built with), ``kahan`` runs optimi's Kahan step with a bfloat16 compensation variable;
* ``opt_state=bfloat16|int8:BLOCK``: each floating state variable of the wrapped optimizer (Adam's moments;
  not its ``iterations`` or learning rate) is stored in a bfloat16 variable, or as int8 codes ``(rows, BLOCK)``
  and float32 absmaxes ``(rows,)``, between steps; each step reads it back (dequantized) into the wrapped
  optimizer's float32 variable first.

Keras optimizers own persistent variables, so the wrapped optimizer's float32 work variables and float32
moments stay allocated between steps: in Keras this wrapper gives torch's and optax's bits, not their memory
(``docs/memory.md`` measures both).

Wrap it in :class:`mpx_keras.LossScaleOptimizer` for loss scaling: a skipped step never calls its ``apply``,
so model variables, compensation, stored state and counters stay bit-identical.

>>> import keras
>>> w = keras.Variable(keras.ops.ones(3, "bfloat16"), dtype="bfloat16")
>>> opt = PolicyOptimizer(keras.optimizers.SGD(1e-4), "bf16_kahan")
>>> for _ in range(100):
...     opt.apply([keras.ops.ones(3, "bfloat16")], [w])
>>> [float(v) for v in keras.ops.convert_to_numpy(keras.ops.cast(w, "float32"))]
[0.98828125, 0.98828125, 0.98828125]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

from mpx import Policy, PolicySpec, get_policy
from mpx import optim_checkpoint as ckpt
from mpx.errors import PolicyError, StateDictError, UnsupportedTypeError
from mpx.kernels import blockwise, rounding
from mpx.update_policy import int8_block
from mpx_keras import _compat
from mpx_keras._array_ops import KERAS_ARRAY_OPS as O
from mpx_keras._wrapper import InnerWrapper

__all__ = ["PolicyOptimizer"]

ops = keras.ops


def _host(v: Any) -> np.ndarray:
    """A variable's value as a float32 numpy array (bfloat16 widened exactly)."""
    return np.asarray(ops.convert_to_numpy(ops.cast(v, "float32")), np.float32)


def _torch_convention(value: np.ndarray, f: float) -> np.ndarray:
    """A Keras moment in torch's convention (divided by ``f``; ``+ 0.0``: Keras's ``-lr * 0`` is ``-0.0``)."""
    return (value / np.float32(f) + np.float32(0.0)).astype(np.float32)


def _size(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _narrow(dtype: Any) -> bool:
    name = keras.backend.standardize_dtype(dtype)
    return name in ("bfloat16", "float16")


@keras.saving.register_keras_serializable(package="mpx_keras")
class PolicyOptimizer(InnerWrapper, keras.optimizers.Optimizer):
    """A Keras optimizer stepped under a policy's memory keys (see the module docs).

    Args:
        inner_optimizer: any ``keras.optimizers.Optimizer`` (not loss scaling: wrap this object in
            :class:`mpx_keras.LossScaleOptimizer` instead).
        policy: a policy or spec (``"bf16_kahan"``, ``"bf16_sr"``, ``"mixed_bfloat16_8bit_adam"``...).
        seed: the stochastic rounding's seed (a non-negative int; default 0).
        name: the optimizer's name (default ``"policy_optimizer"``).

    Raises:
        mpx.PolicyError: for a bad seed, or (at ``build``) a policy whose update rule writes bfloat16 master
            weights to a variable that is not bfloat16.
        mpx.UnsupportedTypeError: for an inner optimizer that is not a plain Keras optimizer, or that
            accumulates gradients.
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        policy: PolicySpec,
        *,
        seed: int = 0,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer) or isinstance(
            inner_optimizer, (keras.optimizers.LossScaleOptimizer, PolicyOptimizer)
        ):
            raise UnsupportedTypeError(
                f"inner_optimizer: expected a plain keras.optimizers.Optimizer, got {type(inner_optimizer).__name__}; "
                "wrap loss scaling around the PolicyOptimizer: LossScaleOptimizer(PolicyOptimizer(opt, policy))."
            )
        if inner_optimizer.gradient_accumulation_steps:
            raise UnsupportedTypeError(
                "inner_optimizer: gradient_accumulation_steps is not supported under a PolicyOptimizer; "
                "accumulate outside it."
            )
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise PolicyError(f"seed: expected a non-negative int, got {seed!r}")
        super().__init__(learning_rate=0.0, name=name or "policy_optimizer", **kwargs)
        self.inner_optimizer = inner_optimizer
        self.policy: Policy = get_policy(policy)
        self.seed = seed
        self._block = int8_block(self.policy.opt_state)

    # -- Keras's optimizer API (variables, iterations, learning_rate, apply_gradients: InnerWrapper) --------
    def build(self, var_list: Sequence[Any]) -> None:
        pol = self.policy
        var_list = list(var_list)
        self._policy_steps = self.add_variable((), initializer="zeros", dtype="int32", name="policy_steps")
        self._work: list[Any] = []
        self._comp: list[Any] = []
        for index, v in enumerate(var_list):
            narrow = _narrow(v.dtype)
            if pol.update != "plain" and keras.backend.standardize_dtype(v.dtype) != "bfloat16":
                raise PolicyError(
                    f"update: {pol.update} writes bfloat16 master weights, but variable {index} ({v.path}) is "
                    f"{keras.backend.standardize_dtype(v.dtype)}; build the model under the policy "
                    "(mpx_keras.policy_scope or dtype='bfloat16') first"
                )
            work = v
            if narrow:
                work = self.add_variable(v.shape, initializer="zeros", dtype="float32", name="work")
                work.assign(ops.cast(v, "float32"))  # the float32 master of master=float32
            self._work.append(work)
            self._comp.append(
                self.add_variable(v.shape, initializer="zeros", dtype="bfloat16", name="kahan_comp")
                if pol.update == "kahan"
                else None
            )
        self.inner_optimizer.build(self._work)
        skip = {id(self.inner_optimizer.iterations)}
        lr = getattr(self.inner_optimizer, "_learning_rate", None)
        if isinstance(lr, keras.Variable):
            skip.add(id(lr))
        # (the wrapped optimizer's variable's index, bf16 or codes, absmaxes or None): an index, as a variable
        # held here would be tracked as this optimizer's too (and listed twice in ``variables``)
        self._stored: list[tuple[int, Any, Any]] = []
        if pol.opt_state != "float32":
            for k, var in enumerate(self.inner_optimizer.variables):
                if id(var) in skip or keras.backend.standardize_dtype(var.dtype) != "float32":
                    continue
                if self._block is None:
                    stored = self.add_variable(
                        var.shape, initializer="zeros", dtype="bfloat16", name="state_bf16"
                    )
                    self._stored.append((k, stored, None))
                else:
                    rows = max(1, -(-_size(var.shape) // self._block))
                    q = self.add_variable(
                        (rows, self._block), initializer="zeros", dtype="int8", name="state_q"
                    )
                    absmax = self.add_variable(
                        (rows,), initializer="zeros", dtype="float32", name="state_absmax"
                    )
                    self._stored.append((k, q, absmax))
        keras.optimizers.Optimizer.build(self, var_list)

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> None:
        """One step of the wrapped optimizer in float32, written back by the policy's update rule."""
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
        trainable_variables = self._build_for(trainable_variables)
        pol = self.policy
        inner_vars = self.inner_optimizer.variables
        for k, stored, absmax in self._stored:  # the stored state, read back in float32
            var = inner_vars[k]
            if absmax is None:
                var.assign(ops.cast(stored, "float32"))
            else:
                n = _size(var.shape)
                var.assign(ops.reshape(blockwise.dequantize(O, stored, absmax, n), var.shape))
        olds = []
        for v, work in zip(trainable_variables, self._work, strict=True):
            old = ops.cast(v, "float32")
            olds.append(old)
            if work is not v and pol.master_dtype != "float32":
                work.assign(old)
        step = ops.convert_to_tensor(self._policy_steps)
        self.inner_optimizer.apply([None if g is None else ops.cast(g, "float32") for g in grads], self._work)
        for index, (v, work, comp, old, g) in enumerate(
            zip(trainable_variables, self._work, self._comp, olds, grads, strict=True)
        ):
            if work is v or g is None:
                continue
            new = ops.convert_to_tensor(work)
            if pol.update == "stochastic":
                target = rounding.stochastic_round_bf16(O, new, seed=self.seed, step=step, param=index)
            elif pol.update == "kahan":
                target, c2 = rounding.kahan_add(O, old, ops.cast(comp, "float32"), ops.subtract(new, old))
                comp.assign(ops.cast(c2, "bfloat16"))
            elif keras.backend.standardize_dtype(v.dtype) == "bfloat16":
                target = rounding.round_bf16(O, new)
            else:
                target = new
            v.assign(ops.cast(target, v.dtype))
        for k, stored, absmax in self._stored:  # the float32 state stored as opt_state says
            value = ops.convert_to_tensor(inner_vars[k])
            if absmax is None:
                stored.assign(ops.cast(rounding.round_bf16(O, value), "bfloat16"))
            else:
                q, a = blockwise.quantize(O, ops.reshape(value, (-1,)), self._block)
                stored.assign(q)
                absmax.assign(a)
        self._policy_steps.assign(ops.add(step, 1))

    # -- inspection ----------------------------------------------------------------------------
    @property
    def policy_steps(self) -> int:
        """Steps taken (a skipped step is not one): the stochastic rounding's step counter (a host read)."""
        return int(ops.convert_to_numpy(self._policy_steps)) if self.built else 0

    def state_of(self, index: int) -> dict[str, Any]:
        """This optimizer's own variables of the model variable at ``index``: ``kahan_comp``, ``work``."""
        out = {}
        if self._comp[index] is not None:
            out["kahan_comp"] = self._comp[index]
        if self._work[index] is not _compat.optimizer_variables(self)[index]:
            out["work"] = self._work[index]
        return out

    # -- the neutral checkpoint (mpx.optim/1) --------------------------------------------------
    def _moments(self) -> tuple[str, dict[str, list[Any]], float]:
        """The neutral kind, the wrapped optimizer's moment variables by neutral name (one per model variable),
        and the factor from torch's convention to Keras's (``-lr`` for SGD's momentum, which holds the step)."""
        inner = self.inner_optimizer
        if not self.built:
            raise StateDictError("optimizer: build it first (optimizer.build(model.trainable_variables))")
        index = [_compat.optimizer_variable_index(inner, w) for w in self._work]
        if isinstance(inner, keras.optimizers.Adam | keras.optimizers.AdamW):
            if inner.amsgrad:
                raise UnsupportedTypeError(
                    "inner_optimizer: amsgrad has no mpx.optim/1 form; use amsgrad=False"
                )
            moments = {"exp_avg": inner._momentums, "exp_avg_sq": inner._velocities}
            return "adam", {k: [v[j] for j in index] for k, v in moments.items()}, 1.0
        if isinstance(inner, keras.optimizers.SGD):
            lr = float(ops.convert_to_numpy(inner.learning_rate))
            found = {"momentum_buffer": [inner.momentums[j] for j in index]} if inner.momentum else {}
            return "sgd", found, -lr
        raise UnsupportedTypeError(
            f"inner_optimizer: {type(inner).__name__} has no mpx.optim/1 form; Adam, AdamW and SGD have"
        )

    def _storage(self) -> dict[int, tuple[Any, Any]]:
        """Each wrapped variable's storage (by ``id``): ``(bf16 variable or int8 codes, absmaxes or None)``."""
        inner_vars = self.inner_optimizer.variables
        return {id(inner_vars[k]): (s, a) for k, s, a in self._stored}

    def neutral_state_dict(self) -> dict[str, Any]:
        """This optimizer's state as the framework-neutral ``mpx.optim/1`` dict of numpy arrays
        (:mod:`mpx.optim_checkpoint`), which mpx_torch's and mpx_jax's policy optimizers read (a host read).

        Keras's SGD keeps ``-lr * buf`` where torch keeps ``buf``: the dict holds torch's (divided by ``-lr``:
        exact for a power-of-two rate, one float32 rounding otherwise).

        Raises:
            mpx.UnsupportedTypeError: for a wrapped optimizer other than Adam, AdamW (no amsgrad) and SGD.
            mpx.StateDictError: before the optimizer is built.
        """
        kind, moments, f = self._moments()
        storage = self._storage()
        params = []
        for i, (v, work) in enumerate(zip(_compat.optimizer_variables(self), self._work, strict=True)):
            entry: dict[str, np.ndarray] = {}
            if self._comp[i] is not None:
                entry["kahan_comp"] = _host(self._comp[i]).astype(ckpt.BF16)
            if work is not v and self.policy.master_dtype == "float32":
                entry["master"] = _host(work)
            for name, variables in moments.items():
                var = variables[i]
                stored, absmax = storage.get(id(var), (None, None))
                if absmax is not None:
                    q = ops.convert_to_numpy(stored).astype(np.int8)
                    entry[f"{name}.q"] = q if f > 0 else (-q).astype(np.int8)
                    entry[f"{name}.absmax"] = (_host(absmax) / np.float32(abs(f))).astype(np.float32)
                elif stored is not None:
                    entry[name] = _torch_convention(_host(stored), f).astype(ckpt.BF16)
                else:
                    entry[name] = _torch_convention(_host(var), f)
            params.append(entry)
        return ckpt.make(self.policy, seed=self.seed, step=self.policy_steps, optimizer=kind, params=params)

    def load_neutral_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Read an ``mpx.optim/1`` dict (from any backend's ``neutral_state_dict``) into this built optimizer: the
        compensation, masters, moments (stored form), seed and step (also the wrapped optimizer's ``iterations``).
        Load before the first compiled step (the seed is read when a step is traced).

        Raises:
            mpx.StateDictError: naming the field that does not fit (policy, shapes, dtypes, kind), or when the
                optimizer is not built.
        """
        kind, moments, f = self._moments()
        shapes = [tuple(int(d) for d in v.shape) for v in _compat.optimizer_variables(self)]
        d = ckpt.check(state_dict, self.policy, shapes, optimizer=kind)
        storage = self._storage()
        for i, (v, work, entry) in enumerate(
            zip(_compat.optimizer_variables(self), self._work, d["params"], strict=True)
        ):
            if self._comp[i] is not None:
                self._comp[i].assign(ops.cast(entry["kahan_comp"].astype(np.float32), "bfloat16"))
            if "master" in entry and work is not v:
                work.assign(entry["master"])
            for name, variables in moments.items():
                var = variables[i]
                stored, absmax = storage.get(id(var), (None, None))
                if absmax is not None:
                    q = entry.get(f"{name}.q", np.zeros(tuple(stored.shape), np.int8))
                    stored.assign(q if f > 0 else (-q).astype(np.int8))
                    a = entry.get(f"{name}.absmax", np.zeros(tuple(absmax.shape), np.float32))
                    absmax.assign((a * np.float32(abs(f))).astype(np.float32))
                else:
                    value = entry.get(name, np.zeros(tuple(var.shape), np.float32)).astype(np.float32)
                    value = (value * np.float32(f)).astype(np.float32)
                    if stored is not None:
                        stored.assign(ops.cast(value, "bfloat16"))
                    else:
                        var.assign(value)
        self.seed = d["seed"]
        self._policy_steps.assign(d["step"])
        self.inner_optimizer.iterations.assign(d["step"])

    def get_config(self) -> dict[str, Any]:
        """``name``, the serialized ``inner_optimizer``, ``policy`` (its spec string) and ``seed``."""
        return {**super().get_config(), "policy": str(self.policy), "seed": self.seed}

    def __repr__(self) -> str:
        return (
            f"PolicyOptimizer({type(self.inner_optimizer).__name__}, {str(self.policy)!r}, seed={self.seed})"
        )
