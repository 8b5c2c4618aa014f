"""``mpx_jax.optim.policy_optimizer``: a policy's master weights, update rule and optimizer-state storage around
any optax ``GradientTransformation``.

The wrapped transformation runs in float32: it gets float32 gradients, float32 parameters (the float32
master for ``master=float32``) and float32 state; the float32 step ``new = w + u`` is then written back
by the policy's update rule (:mod:`mpx.update_policy`) with the core's kernels
(:mod:`mpx.kernels.rounding`), exactly as :class:`mpx_torch.optim.PolicyOptimizer` does:

* ``update=plain``: rounded to nearest (or kept in the float32 master, rounded into the parameter);
* ``update=stochastic``: stochastically rounded to bfloat16 with the counter-based bits of
  ``(seed, step, parameter index, element index)``; the parameter index is the leaf's position in
  ``jax.tree_util.tree_leaves(params)``, the step the wrapper's own counter (a skipped step is not
  one);
* ``update=kahan``: optimi's Kahan step with a bfloat16 compensation per parameter, the update being
  ``new - w`` (exact in float32).

The updates it returns are float32 differences ``target - w`` (exact), so ``optax.apply_updates`` (which
adds in float32 and casts back to the parameter's dtype) lands every parameter on its target bit for bit.
``opt_state=bfloat16`` stores the wrapped state's float32 leaves in bfloat16 between steps (rounded to
nearest); ``opt_state=int8:BLOCK`` stores each non-scalar float32 leaf (Adam's moments) as a
:class:`Quantized` (int8 codes and a float32 absmax per block, :mod:`mpx.kernels.blockwise`).

Compose it inside :func:`mpx_jax.with_loss_scaling`: a skipped step keeps this state (compensation, master,
step counter, the wrapped state) bit for bit and returns ``-0.0`` updates.

>>> import jax.numpy as jnp, optax
>>> tx = policy_optimizer(optax.sgd(1e-4), "bf16_kahan")
>>> params = {"w": jnp.ones(3, jnp.bfloat16)}
>>> state = tx.init(params)
>>> for _ in range(100):
...     updates, state = tx.update({"w": jnp.ones(3, jnp.bfloat16)}, state, params)
...     params = optax.apply_updates(params, updates)
>>> params["w"].dtype, params["w"].tolist(), round(float(params["w"][0]) + float(state.kahan_comp["w"][0]), 3)
(dtype(bfloat16), [0.98828125, 0.98828125, 0.98828125], 0.99)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpx import Policy, PolicySpec, get_policy
from mpx import optim_checkpoint as ckpt
from mpx.errors import PolicyError, StateDictError, UnsupportedTypeError
from mpx.kernels import blockwise, rounding
from mpx.update_policy import int8_block
from mpx_jax._array_ops import JAX_OPS as O
from mpx_jax.casting import is_floating_array

__all__ = [
    "PolicyOptimizerState",
    "Quantized",
    "load_neutral_state_dict",
    "neutral_state_dict",
    "policy_optimizer",
]


@jax.tree_util.register_pytree_node_class
class Quantized:
    """An int8 block-quantized float32 array (:mod:`mpx.kernels.blockwise`): ``q`` (int8, ``(rows, block)``) and
    ``absmax`` (float32, ``(rows,)``) are its leaves, ``shape`` the array's (static)."""

    def __init__(self, q: Any, absmax: Any, shape: tuple[int, ...]) -> None:
        self.q, self.absmax, self.shape = q, absmax, tuple(shape)

    @classmethod
    def of(cls, x: Any, block: int) -> Quantized:
        q, absmax = blockwise.quantize(O, jnp.reshape(x, (-1,)), block)
        return cls(q, absmax, x.shape)

    def dequantize(self) -> Any:
        n = 1
        for d in self.shape:
            n *= d
        return jnp.reshape(blockwise.dequantize(O, self.q, self.absmax, n), self.shape)

    def tree_flatten(self) -> tuple[tuple[Any, Any], tuple[int, ...]]:
        return (self.q, self.absmax), self.shape

    @classmethod
    def tree_unflatten(cls, shape: tuple[int, ...], leaves: Any) -> Quantized:
        return cls(*leaves, shape)

    def __repr__(self) -> str:
        return f"Quantized(shape={self.shape}, blocks={getattr(self.q, 'shape', None)})"


class PolicyOptimizerState(NamedTuple):
    """The state of :func:`policy_optimizer`.

    Attributes:
        inner_state: the wrapped transformation's state (``opt_state``'s dtype between steps).
        step: steps taken (int32): the stochastic rounding's step counter.
        kahan_comp: per parameter, its bfloat16 compensation (``update=kahan``), else None.
        master: per parameter, its float32 master (``master=float32``; an empty array for a float32
            parameter), else None.
    """

    inner_state: Any
    step: jax.Array
    kahan_comp: Any
    master: Any


_NONE = jnp.zeros((0,), jnp.float32)  # the master of a parameter that has none (a float32 one)


def _narrow(x: Any) -> bool:
    return is_floating_array(x) and jnp.dtype(x.dtype).itemsize < 4


def policy_optimizer(
    tx: optax.GradientTransformation, policy: PolicySpec, *, seed: int = 0
) -> optax.GradientTransformationExtraArgs:
    """Wrap ``tx`` so that it steps under ``policy``'s memory keys (see the module docs).

    Args:
        tx: any optax transformation (extra args are forwarded).
        policy: a policy or spec (``"bf16_kahan"``, ``"bf16_sr"``, ``"bfloat16,opt_state=bf16"``...).
        seed: the stochastic rounding's seed (a non-negative int; default 0).

    Raises:
        mpx.PolicyError: for a bad seed, or (at ``init``) a
            policy whose update rule needs bfloat16 parameters that are not.
        mpx.UnsupportedTypeError: for a ``tx`` that is not an optax transformation.
    """
    pol: Policy = get_policy(policy)
    block = int8_block(pol.opt_state)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise PolicyError(f"seed: expected a non-negative int, got {seed!r}")
    if not isinstance(tx, optax.GradientTransformation):
        raise UnsupportedTypeError(f"tx: expected an optax GradientTransformation, got {type(tx).__name__}")
    inner = optax.with_extra_args_support(tx)

    def wide(tree: Any) -> Any:
        def cast(x: Any) -> Any:
            if isinstance(x, Quantized):
                return x.dequantize()
            return x.astype(jnp.float32) if _narrow(x) else x

        return jax.tree_util.tree_map(cast, tree, is_leaf=lambda x: isinstance(x, Quantized))

    def store(tree: Any) -> Any:
        if pol.opt_state == "float32":
            return tree
        if block is not None:
            return jax.tree_util.tree_map(
                lambda x: (
                    Quantized.of(x, block)
                    if is_floating_array(x) and x.dtype == jnp.float32 and x.ndim
                    else x
                ),
                tree,
            )

        def cast(x: Any) -> Any:
            if is_floating_array(x) and x.dtype == jnp.float32:
                return rounding.round_bf16(O, x).astype(jnp.bfloat16)
            return x

        return jax.tree_util.tree_map(cast, tree)

    def check(params: Any) -> None:
        if pol.update == "plain":
            return
        for index, p in enumerate(jax.tree_util.tree_leaves(params)):
            if is_floating_array(p) and p.dtype != jnp.bfloat16:
                raise PolicyError(
                    f"update: {pol.update} writes bfloat16 master weights, but parameter {index} is {p.dtype}; "
                    "cast the params to the policy's param dtype (mpx_jax.cast_to_param) first"
                )

    def init_fn(params: Any) -> PolicyOptimizerState:
        check(params)
        master = None
        if pol.master_dtype == "float32":
            master = jax.tree_util.tree_map(lambda p: p.astype(jnp.float32) if _narrow(p) else _NONE, params)
        comp = None
        if pol.update == "kahan":
            comp = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, jnp.bfloat16), params)
        work = params if master is None else _merge(master, params)
        return PolicyOptimizerState(store(inner.init(wide(work))), jnp.zeros([], jnp.int32), comp, master)

    def update_fn(
        updates: Any, state: PolicyOptimizerState, params: Any = None, **extra: Any
    ) -> tuple[Any, PolicyOptimizerState]:
        if params is None:
            raise PolicyError(
                "params: policy_optimizer needs the parameters (tx.update(grads, state, params))"
            )
        work = wide(params if state.master is None else _merge(state.master, params))
        u, new_inner = inner.update(wide(updates), wide(state.inner_state), work, **extra)
        p_leaves, treedef = jax.tree_util.tree_flatten(params)
        w_leaves = treedef.flatten_up_to(work)
        u_leaves = treedef.flatten_up_to(u)
        c_leaves = treedef.flatten_up_to(state.kahan_comp) if state.kahan_comp is not None else None
        m_leaves = treedef.flatten_up_to(state.master) if state.master is not None else None
        out, comps, masters = [], [], []
        for index, (p, w, du) in enumerate(zip(p_leaves, w_leaves, u_leaves, strict=True)):
            if not _narrow(p):
                out.append(du)
                comps.append(None if c_leaves is None else c_leaves[index])
                masters.append(None if m_leaves is None else m_leaves[index])
                continue
            new = w + du.astype(jnp.float32)  # the float32 step
            old = p.astype(jnp.float32)
            if pol.update == "stochastic":
                target = rounding.stochastic_round_bf16(O, new, seed=seed, step=state.step, param=index)
            elif pol.update == "kahan":
                target, c2 = rounding.kahan_add(O, old, c_leaves[index].astype(jnp.float32), new - old)
                comps.append(c2.astype(jnp.bfloat16))
            elif p.dtype == jnp.bfloat16:
                target = rounding.round_bf16(O, new)
            else:
                target = new.astype(p.dtype).astype(jnp.float32)
            if pol.update != "kahan":
                comps.append(None if c_leaves is None else c_leaves[index])
            masters.append(new if m_leaves is not None else None)
            out.append(target - old)  # exact: apply_updates lands on target
        new_state = PolicyOptimizerState(
            store(new_inner),
            state.step + 1,
            None if c_leaves is None else treedef.unflatten(comps),
            None if m_leaves is None else treedef.unflatten(masters),
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _merge(master: Any, params: Any) -> Any:
    """``params`` with each narrow leaf replaced by its float32 master."""
    return jax.tree_util.tree_map(lambda p, m: m if _narrow(p) else p, params, master)


# -- the neutral checkpoint (mpx.optim/1) ----------------------------------------------------------
#: The optax states that hold moments, their neutral kind and (field, neutral name) pairs.
_MOMENT_STATES = {
    optax.ScaleByAdamState: ("adam", (("mu", "exp_avg"), ("nu", "exp_avg_sq"))),
    optax.TraceState: ("sgd", (("trace", "momentum_buffer"),)),
}


def _is_moments(x: Any) -> bool:
    return type(x) in _MOMENT_STATES


def _moment_node(inner_state: Any) -> Any:
    found = [x for x in jax.tree_util.tree_leaves(inner_state, is_leaf=_is_moments) if _is_moments(x)]
    if len(found) != 1:
        raise UnsupportedTypeError(
            f"state: the wrapped transformation holds {len(found)} Adam/trace states; mpx.optim/1 holds one "
            "(optax.adam, optax.adamw or optax.sgd)"
        )
    return found[0]


def neutral_state_dict(
    state: PolicyOptimizerState, params: Any, policy: PolicySpec, *, seed: int = 0
) -> dict[str, Any]:
    """The :func:`policy_optimizer` ``state`` (over ``params``) as the framework-neutral ``mpx.optim/1`` dict of
    numpy arrays (:mod:`mpx.optim_checkpoint`), which torch's and Keras's policy optimizers read.

    ``policy`` and ``seed`` are the ones the transformation was built with (the state does not hold them).

    Raises:
        mpx.UnsupportedTypeError: unless the wrapped transformation holds exactly one ``ScaleByAdamState``
            (``optax.adam``, ``optax.adamw``) or ``TraceState`` (``optax.sgd`` with momentum).
    """
    pol = get_policy(policy)
    node = _moment_node(state.inner_state)
    kind, fields = _MOMENT_STATES[type(node)]
    p_leaves, treedef = jax.tree_util.tree_flatten(params)
    per_field = {name: treedef.flatten_up_to(getattr(node, field)) for field, name in fields}
    comps = treedef.flatten_up_to(state.kahan_comp) if state.kahan_comp is not None else None
    masters = treedef.flatten_up_to(state.master) if state.master is not None else None
    out = []
    for i, p in enumerate(p_leaves):
        entry: dict[str, np.ndarray] = {}
        if comps is not None:
            entry["kahan_comp"] = np.asarray(comps[i])
        if masters is not None and _narrow(p):
            entry["master"] = np.asarray(masters[i])
        for name, leaves in per_field.items():
            leaf = leaves[i]
            if isinstance(leaf, Quantized):
                entry[f"{name}.q"], entry[f"{name}.absmax"] = np.asarray(leaf.q), np.asarray(leaf.absmax)
            else:
                entry[name] = np.asarray(leaf)
        out.append(entry)
    return ckpt.make(pol, seed=seed, step=int(state.step), optimizer=kind, params=out)


def load_neutral_state_dict(
    state: PolicyOptimizerState, params: Any, state_dict: dict[str, Any], policy: PolicySpec, *, seed: int = 0
) -> PolicyOptimizerState:
    """A :func:`policy_optimizer` state holding the ``mpx.optim/1`` dict ``state_dict`` (from any backend); ``state``
    (``tx.init(params)``) gives the structure.  The next ``tx.update`` is the step the saving optimizer would take.

    Raises:
        mpx.StateDictError: naming the field that does not fit (policy, shapes, dtypes, kind), or a seed other
            than the transformation's (``seed``: build ``policy_optimizer(..., seed=saved seed)``).
    """
    pol = get_policy(policy)
    node = _moment_node(state.inner_state)
    kind, fields = _MOMENT_STATES[type(node)]
    p_leaves, treedef = jax.tree_util.tree_flatten(params)
    d = ckpt.check(state_dict, pol, [tuple(p.shape) for p in p_leaves], optimizer=kind)
    if d["seed"] != seed:
        raise StateDictError(
            f"seed: the checkpoint's is {d['seed']}, this transformation's {seed}; "
            f"build policy_optimizer(tx, policy, seed={d['seed']})"
        )
    entries = d["params"]
    step = d["step"]
    block = int8_block(pol.opt_state)
    if all(any(name in e or f"{name}.q" in e for _, name in fields) for e in entries):
        replaced = {}
        for field, name in fields:
            leaves = []
            for p, e in zip(p_leaves, entries, strict=True):
                if block is not None:
                    leaves.append(
                        Quantized(jnp.asarray(e[f"{name}.q"]), jnp.asarray(e[f"{name}.absmax"]), p.shape)
                    )
                else:
                    leaves.append(jnp.asarray(e[name]))
            replaced[field] = treedef.unflatten(leaves)
        if kind == "adam":
            replaced["count"] = jnp.asarray(step, jnp.asarray(node.count).dtype)
        new_node = node._replace(**replaced)
        inner = jax.tree_util.tree_map(
            lambda x: new_node if x is node else x, state.inner_state, is_leaf=_is_moments
        )
    else:
        inner = state.inner_state
    comp = state.kahan_comp
    if comp is not None:
        comp = treedef.unflatten([jnp.asarray(e["kahan_comp"]) for e in entries])
    master = state.master
    if master is not None:
        m_leaves = treedef.flatten_up_to(master)
        master = treedef.unflatten(
            [jnp.asarray(e["master"]) if "master" in e else m for e, m in zip(entries, m_leaves, strict=True)]
        )
    return PolicyOptimizerState(inner, jnp.asarray(step, jnp.int32), comp, master)
