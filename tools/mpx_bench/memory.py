"""``mpx bench --memory``: bytes per parameter of training state per policy, counted from the tensors after one AdamW
step (not timed, deterministic).

Per backend (torch, jax; each in its own process: ``python -m mpx_bench.memory BACKEND --policy ...``) the bench
MLP (:mod:`mpx_bench.models`) is built under the policy (``mpx_torch.prepare``; ``mpx_jax.cast_to_param``), takes
one AdamW step (through the policy optimizer when the policy names ``master``, ``update`` or ``opt_state``), and
the bytes of each kind of tensor are summed:

* ``weights``: the parameters; ``grads``: their gradients;
* ``extra``: the policy optimizer's own tensors (Kahan compensation, float32 masters);
* ``state``: the optimizer's moments (int8 codes and absmaxes included; per-tensor scalars such as the step
  count left out).

``per_param`` is each sum divided by the number of parameters.

>>> row = {"weights": 2.0, "grads": 2.0, "extra": 2.0, "state": 8.0}
>>> table([{"backend": "torch", "policy": "bf16_kahan", "per_param": row, "total": 14.0}]).splitlines()[2]
'torch    bf16_kahan  2.000    2.000  2.000        8.000  14.000'
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_POLICIES", "measure", "run", "table"]

#: The policies ``mpx bench --memory`` counts when none is named.
DEFAULT_POLICIES = ("float32", "mixed_bfloat16", "bf16_kahan", "bf16_sr", "mixed_bfloat16_8bit_adam")
_KINDS = ("weights", "grads", "extra", "state")


def _torch(policy: str, size: str) -> dict[str, int]:
    import torch

    import mpx
    import mpx_torch
    from mpx.update_policy import needs_policy_optimizer
    from mpx_bench.models import data, dims
    from mpx_torch.optim import PolicyOptimizer

    d = dims("mlp", size)
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(d["d"], d["h"]), torch.nn.GELU(), torch.nn.Linear(d["h"], d["d"])
    )
    p = mpx.get_policy(policy)
    net = mpx_torch.prepare(net, p)
    opt: Any = torch.optim.AdamW(net.parameters(), lr=1e-4)
    wrapper = PolicyOptimizer(opt, p) if needs_policy_optimizer(p) else None
    x, y = (torch.from_numpy(a) for a in data("mlp", size))
    torch.nn.functional.mse_loss(net(x).float(), y).backward()
    (wrapper or opt).step()
    out = dict.fromkeys(_KINDS, 0)
    for q in net.parameters():
        out["weights"] += q.numel() * q.element_size()
        out["grads"] += q.grad.numel() * q.grad.element_size()
        own = wrapper.state_of(q) if wrapper is not None else {}
        for name, t in own.items():
            out["state" if name.endswith((".q", ".absmax")) else "extra"] += t.numel() * t.element_size()
        for t in opt.state[q].values():
            if torch.is_tensor(t) and t.dim() > 0:
                out["state"] += t.numel() * t.element_size()
    out["params"] = sum(q.numel() for q in net.parameters())
    return out


def _jax(policy: str, size: str) -> dict[str, int]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import mpx
    import mpx_jax
    from mpx.update_policy import needs_policy_optimizer
    from mpx_bench.models import data, dims
    from mpx_jax.optim import policy_optimizer

    d = dims("mlp", size)
    rng = np.random.default_rng(0)
    params = {
        "w1": rng.standard_normal((d["d"], d["h"]), np.float32) * 0.02,
        "b1": np.zeros(d["h"], np.float32),
        "w2": rng.standard_normal((d["h"], d["d"]), np.float32) * 0.02,
        "b2": np.zeros(d["d"], np.float32),
    }
    p = mpx.get_policy(policy)
    params = mpx_jax.cast_to_param(p, jax.tree_util.tree_map(jnp.asarray, params))
    tx = optax.adamw(1e-4)
    if needs_policy_optimizer(p):
        tx = policy_optimizer(tx, p)
    x, y = (jnp.asarray(a) for a in data("mlp", size))

    def loss(w: Any) -> Any:
        w = mpx_jax.cast_to_compute(p, w)
        h = jax.nn.gelu(x.astype(w["w1"].dtype) @ w["w1"] + w["b1"])
        return jnp.mean(jnp.square((h @ w["w2"] + w["b2"]).astype(jnp.float32) - y))

    state = tx.init(params)
    grads = jax.grad(loss)(params)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)

    def nbytes(tree: Any, min_ndim: int = 0) -> int:
        return sum(int(a.nbytes) for a in jax.tree_util.tree_leaves(tree) if a.ndim >= min_ndim)

    out = {"weights": nbytes(params), "grads": nbytes(grads), "extra": 0, "state": 0}
    if hasattr(state, "inner_state"):
        out["extra"] = nbytes(state.kahan_comp) + nbytes(state.master, 1)
        out["state"] = nbytes(state.inner_state, 1)
    else:
        out["state"] = nbytes(state, 1)
    out["params"] = sum(int(a.size) for a in jax.tree_util.tree_leaves(params))
    return out


def measure(backend: str, policy: str, size: str = "small") -> dict[str, Any]:
    """One row: ``{"backend", "policy", "params", "bytes": {kind: n}, "per_param": {kind: x}, "total"}``."""
    counts = {"torch": _torch, "jax": _jax}[backend](policy, size)
    n = counts.pop("params")
    per = {k: counts[k] / n for k in _KINDS}
    return {"backend": backend, "policy": policy, "params": n, "bytes": counts, "per_param": per,
            "total": sum(per.values())}  # fmt: skip


def table(rows: Sequence[dict[str, Any]]) -> str:
    """A plain-text table of rows (bytes per parameter)."""
    head = ("backend", "policy", "weights", "grads", "comp/master", "state", "total")
    body = [
        (r["backend"], r["policy"], *(f"{r['per_param'][k]:.3f}" for k in _KINDS), f"{r['total']:.3f}")
        for r in rows
    ]
    widths = [max(len(str(c)) for c in col) for col in zip(head, *body, strict=True)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
             for line in [head, tuple("-" * w for w in widths), *body]]  # fmt: skip
    return "\n".join(lines)


def run(
    backends: Sequence[str], policies: Sequence[str], size: str, out: Path
) -> tuple[list[dict[str, Any]], int]:
    """Each backend (torch, jax) in its own process; writes ``out/memory.json`` and ``out/memory.md``; returns the
    rows and the exit status (1 when a worker failed)."""
    from mpx_tools.workers import worker_env

    rows: list[dict[str, Any]] = []
    status = 0
    for backend in [b for b in backends if b in ("torch", "jax")]:
        args = [sys.executable, "-m", "mpx_bench.memory", backend, "--size", size]
        for p in policies:
            args += ["--policy", p]
        proc = subprocess.run(args, capture_output=True, text=True, env=worker_env(backend), timeout=1800)
        if proc.returncode != 0:
            print(
                f"mpx bench --memory: {backend} failed: {proc.stderr.strip().splitlines()[-1:]}",
                file=sys.stderr,
            )
            status = 1
            continue
        rows += [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory.json").write_text(json.dumps({"size": size, "rows": rows}, indent=1))
    (out / "memory.md").write_text(
        f"# Bytes per parameter (mlp, size {size}, one AdamW step)\n\n```\n{table(rows)}\n```\n"
    )
    return rows, status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpx_bench.memory")
    parser.add_argument("backend", choices=("torch", "jax"))
    parser.add_argument("--policy", action="append", default=None)
    parser.add_argument("--size", default="small")
    args = parser.parse_args(argv)
    for policy in args.policy or DEFAULT_POLICIES:
        print(json.dumps(measure(args.backend, policy, args.size)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
