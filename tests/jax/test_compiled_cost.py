"""What ``with_loss_scaling`` adds to a compiled float16 train step, from XLA's own accounting.

Deterministic figures of the compiled step (``jax.jit(step).lower(...).compile()``), for both ways of
writing a float16 model (``mpx_jax.autocast`` and jmp's plain casts), with and without donating the
parameters and optimizer state:

* bytes accessed (``cost_analysis()``): the scaled step reads and writes at most the unscaled step's
  bytes plus 1.5x the float32 gradients' bytes (+64 KiB for the scalars and small leaves).  That 1.5x
  is the finiteness check, whose reduction XLA:CPU does not fuse with the gradient's producer: it reads
  each gradient once (4 bytes an element) and writes and reads back a bool per element (1 + 1).
  Nothing else is added: the skip's selects ride inside the optimizer's own passes;
* buffer copies (``copy`` instructions of the entry computation, in bytes copied) and temporaries
  (``memory_analysis()``): no more than the unscaled step's (+64 KiB: under donation XLA may copy a
  scalar of the loss scale); every byte the unscaled step aliases is aliased too, so a donated
  optimizer state is updated in place.

Every bound is against the unscaled step compiled from the same model, so it holds for any
implementation that costs no more than the check (a formulation that selects the inner update's
outputs breaks it: 2.5x the gradient bytes without donation, 6.5x with it, every moment copied;
``tests/jax/bench_loss_scaling.py --select`` shows it, docs/jax_loss_scaling.md has the figures).
"""

import functools
import importlib.util
import math
import pathlib
import re

import jax
import numpy as np
import optax
import pytest

import mpx_jax

# the bench script's models (tests run with --import-mode=importlib)
_spec = importlib.util.spec_from_file_location(
    "bench_loss_scaling", pathlib.Path(__file__).with_name("bench_loss_scaling.py")
)
_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_bench)
build = _bench.build

#: The check's bytes per float32 gradient byte (read 4, write and read back a 1-byte bool: 6 of 4).
CHECK_BYTES_PER_GRAD_BYTE = 1.5
SLACK_BYTES = 64 * 1024
DIMS = {"d": 256, "h": 1024, "batch": 64}
#: HLO element types whose names are not numpy's
ITEMSIZE = {
    "pred": "bool",
    "f32": "float32",
    "f16": "float16",
    "bf16": "uint16",
    "s32": "int32",
    "f64": "float64",
}


def profile(fn, *args):
    compiled = fn.lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    text = compiled.as_text()
    entry = text[text.index("\nENTRY") :]
    entry = entry[: entry.index("\n}")]
    mem = compiled.memory_analysis()
    copies = re.findall(r"= (\w+)\[([\d,]*)\]\S* copy\(", entry)
    return {
        "bytes": cost["bytes accessed"],
        "copies": len(copies),
        "copied": sum(
            np.dtype(ITEMSIZE.get(t, t)).itemsize * math.prod(map(int, filter(None, d.split(","))))
            for t, d in copies
        ),
        "temp": mem.temp_size_in_bytes,
        "alias": mem.alias_size_in_bytes,
    }


def steps(model, donate, scaled_tx):
    params, loss, (x, y) = build(model, **DIMS)
    tx = optax.adamw(1e-4)
    jit = functools.partial(jax.jit, donate_argnums=(0, 1) if donate else ())

    @jit
    def unscaled(p, st):
        g = jax.grad(loss)(p, x, y)
        u, st = tx.update(g, st, p)
        return optax.apply_updates(p, u), st

    stx = scaled_tx(tx)

    @jit
    def scaled(p, st):
        ls = mpx_jax.get_loss_scale(st)
        g = jax.grad(lambda q: ls.scale(loss(q, x, y)))(p)
        u, st = stx.update(g, st, p)
        return optax.apply_updates(p, u), st

    grad_bytes = sum(a.size * 4 for a in jax.tree_util.tree_leaves(params))
    return profile(unscaled, params, tx.init(params)), profile(scaled, params, stx.init(params)), grad_bytes


@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
@pytest.mark.parametrize("model", ["mpx", "jmp"])
def test_scaled_step_costs_only_the_finiteness_check(model, donate):
    base, scaled, grad_bytes = steps(model, donate, mpx_jax.with_loss_scaling)
    extra = scaled["bytes"] - base["bytes"]
    assert 0 < extra <= CHECK_BYTES_PER_GRAD_BYTE * grad_bytes + SLACK_BYTES, (
        extra / grad_bytes,
        base,
        scaled,
    )
    # a scalar of the loss scale may be copied under donation (its old value is read after the new one
    # is written); no array is
    assert scaled["copied"] <= base["copied"] + SLACK_BYTES, (base, scaled)
    assert scaled["temp"] <= base["temp"] + SLACK_BYTES, (base, scaled)
    assert scaled["alias"] >= base["alias"], (base, scaled)  # plus the loss scale's own scalars
    if donate:  # params, mu and nu updated in place
        assert base["alias"] >= 3 * grad_bytes

