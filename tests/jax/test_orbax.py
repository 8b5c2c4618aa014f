"""mpx_jax.orbax: loss-scale configs saved with their state, checked on restore, atomic (issue 25, item 3)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpx
import mpx_jax

ocp = pytest.importorskip("orbax.checkpoint")
nnx = pytest.importorskip("flax.nnx")
import mpx_jax.nnx  # noqa: E402
from mpx_jax.orbax import (  # noqa: E402
    StandardCheckpointer,
    StandardRestore,
    StandardSave,
    saved_loss_scales,
)

SAVED = mpx.ScalerConfig(growth_interval=2, min_scale=0.25)


def optax_state(config=SAVED, steps=(True, True, True, False)):
    params = {"w": jnp.arange(3.0)}
    tx = mpx_jax.with_loss_scaling(optax.adam(1e-3), config)
    state = tx.init(params)
    for finite in steps:
        grads = {"w": jnp.full(3, 1.0 if finite else jnp.inf, jnp.float32)}
        _, state = tx.update(grads, state, params)
    return {"params": params, "opt_state": state}


def save(path, item, **kwargs):
    with StandardCheckpointer() as ckptr:
        ckptr.save(path, item, **kwargs)
        ckptr.wait_until_finished()


def restore(path, target=None):
    with StandardCheckpointer() as ckptr:
        return ckptr.restore(path, target)


def same(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(la, lb, strict=True)
    )


def test_round_trip_with_target_keeps_state_and_config(tmp_path):
    item = optax_state()
    save(tmp_path / "c", item)
    back = restore(tmp_path / "c", optax_state(steps=()))
    assert same(back, item)
    ls = mpx_jax.get_loss_scale(back["opt_state"])
    assert ls.config == SAVED and ls.state == mpx_jax.get_loss_scale(item["opt_state"]).state


def test_mismatching_target_raises_naming_the_fields(tmp_path):
    save(tmp_path / "c", optax_state())
    other = optax_state(config=mpx.ScalerConfig(), steps=())
    with pytest.raises(
        mpx.StateDictError, match=r"\['opt_state'\]\.loss_scale: the saved config differs"
    ) as e:
        restore(tmp_path / "c", other)
    assert "growth_interval 2 vs 2000" in str(e.value) and "min_scale 0.25 vs 1.0" in str(e.value)
    # orbax alone adopts the target's config without a word: what mpx_jax.orbax prevents
    with ocp.StandardCheckpointer() as plain:
        adopted = plain.restore(tmp_path / "c", other)
    assert mpx_jax.get_loss_scale(adopted["opt_state"]).config.growth_interval == 2000


def test_restore_without_target_rebuilds_the_loss_scale(tmp_path):
    item = optax_state()
    save(tmp_path / "c", item, custom_metadata={"mine": 1})
    raw = restore(tmp_path / "c")
    ls = raw["opt_state"]["loss_scale"]
    assert isinstance(ls, mpx_jax.LossScale)
    assert ls.state_dict() == mpx_jax.get_loss_scale(item["opt_state"]).state_dict()
    assert np.array_equal(raw["params"]["w"], item["params"]["w"])
    assert list(saved_loss_scales(tmp_path / "c")) == ["['opt_state'].loss_scale"]
    # a lone LossScale is a tree too
    save(tmp_path / "lone", mpx_jax.LossScale.create(SAVED).update(True))
    assert (
        restore(tmp_path / "lone").state_dict() == mpx_jax.LossScale.create(SAVED).update(True).state_dict()
    )


def recording(item, capacity=8):
    ls = mpx_jax.get_loss_scale(item["opt_state"]).record_history(capacity=capacity)
    return {**item, "opt_state": mpx_jax.set_loss_scale(item["opt_state"], ls)}


def test_a_recording_state_keeps_its_history_ring(tmp_path):
    item = optax_state(steps=())
    item = recording(item)
    params, tx = item["params"], mpx_jax.with_loss_scaling(optax.adam(1e-3), SAVED)
    state = item["opt_state"]
    for finite in (True, True, False):
        _, state = tx.update({"w": jnp.full(3, 1.0 if finite else jnp.inf, jnp.float32)}, state, params)
    item = {**item, "opt_state": state}
    save(tmp_path / "c", item)
    want = mpx.ScalerHistory.reference(SAVED, [True, True, False])
    back = restore(tmp_path / "c", recording(optax_state(steps=())))  # a recording target
    assert same(back, item) and mpx_jax.get_loss_scale(back["opt_state"]).history() == want
    raw = restore(tmp_path / "c")  # without a target: the rebuilt LossScale records on
    ls = raw["opt_state"]["loss_scale"]
    assert ls.history() == want
    assert ls.update(True).history() == mpx.ScalerHistory.reference(SAVED, [True, True, False, True])


def test_checkpoint_without_mpx_metadata_and_a_loss_scale_target(tmp_path):
    with ocp.StandardCheckpointer() as plain:
        plain.save(tmp_path / "c", optax_state())
        plain.wait_until_finished()
    with pytest.raises(mpx.StateDictError, match="saved without mpx's loss-scale metadata"):
        restore(tmp_path / "c", optax_state(steps=()))
    assert isinstance(restore(tmp_path / "c")["opt_state"]["loss_scale"], dict)  # nothing to rebuild


class Model(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 2, rngs=rngs)
        self.bn = nnx.BatchNorm(2, rngs=rngs)


def nnx_objects(config=SAVED, seed=0):
    model = Model(nnx.Rngs(seed))
    return model, mpx_jax.nnx.Optimizer(
        model, mpx_jax.with_loss_scaling(optax.adam(1e-3), config), wrt=nnx.Param
    )


def test_nnx_objects_round_trip_and_mismatch(tmp_path):
    model, opt = nnx_objects()
    mpx_jax.set_loss_scale(opt, mpx_jax.get_loss_scale(opt).update(True))
    save(tmp_path / "c", {"model": model, "opt": opt})
    m2, o2 = nnx_objects(seed=1)
    back = restore(tmp_path / "c", {"model": m2, "opt": o2})
    assert same(back["model"], model) and same(back["opt"], opt)
    assert mpx_jax.get_loss_scale(back["opt"]).state == mpx_jax.get_loss_scale(opt).state
    nnx.update(m2, nnx.state(back["model"]))  # orbax returns new objects; put them in the live ones as usual
    assert same(m2, model)
    m3, o3 = nnx_objects(config=mpx.ScalerConfig(growth_interval=5))
    with pytest.raises(mpx.StateDictError, match=r"\['opt'\]\.opt_state\.loss_scale.*growth_interval 2 vs 5"):
        restore(tmp_path / "c", {"model": m3, "opt": o3})
    with pytest.raises(mpx.StateDictError, match="holds no LossScale there, so its config cannot be checked"):
        restore(tmp_path / "c", {"model": nnx.state(m3), "opt": nnx.state(o3)})
    raw = restore(tmp_path / "c")
    assert raw["opt"]["opt_state"]["loss_scale"].state == mpx_jax.get_loss_scale(opt).state


def test_checkpoint_manager_async_saves(tmp_path):
    options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True)
    expected = {}
    with ocp.CheckpointManager(tmp_path / "run", options=options) as mngr:
        for step in range(4):
            item = optax_state(steps=(True,) * step)
            expected[step] = mpx_jax.get_loss_scale(item["opt_state"]).state
            mngr.save(step, args=StandardSave(item))  # returns while writing
        mngr.wait_until_finished()
        assert mngr.all_steps() == [2, 3]
        back = mngr.restore(3, args=StandardRestore(optax_state(steps=())))
        assert mpx_jax.get_loss_scale(back["opt_state"]).state == expected[3]
        raw = mngr.restore(2, args=StandardRestore())
        assert raw["opt_state"]["loss_scale"].state == expected[2]
        with pytest.raises(mpx.StateDictError, match="growth_interval 2 vs 2000"):
            mngr.restore(3, args=StandardRestore(optax_state(config=mpx.ScalerConfig(), steps=())))
    assert (
        saved_loss_scales(tmp_path / "run" / "3" / "default")["['opt_state'].loss_scale"].state == expected[3]
    )
    with ocp.CheckpointManager(tmp_path / "run") as fresh:  # a new run: orbax finds mpx's handler by itself
        assert fresh.restore(3)["opt_state"]["loss_scale"].state == expected[3]


def test_composite_items(tmp_path):
    item = optax_state()
    with ocp.CheckpointManager(tmp_path / "run", item_names=("state", "meta")) as mngr:
        mngr.save(0, args=ocp.args.Composite(state=StandardSave(item), meta=ocp.args.JsonSave({"epoch": 1})))
        mngr.wait_until_finished()
        back = mngr.restore(0, args=ocp.args.Composite(state=StandardRestore(), meta=ocp.args.JsonRestore()))
    want = mpx_jax.get_loss_scale(item["opt_state"]).state_dict()
    assert back.state["opt_state"]["loss_scale"].state_dict() == want and back.meta == {"epoch": 1}


# -- kill -9 during a save ----------------------------------------------------------------------------
CHILD = textwrap.dedent(
    """
    import sys
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    import mpx, mpx_jax
    from mpx_jax.orbax import StandardSave

    options = ocp.CheckpointManagerOptions(max_to_keep=None, enable_async_checkpointing=True)
    mngr = ocp.CheckpointManager(sys.argv[1], options=options)
    big = jnp.arange(2_000_000, dtype=jnp.float32)  # 8 MB: the save takes a while
    ls = mpx_jax.LossScale.create(mpx.ScalerConfig(growth_interval=1, min_scale=None))
    for step in range(100_000):
        ls = ls.update(step % 3 != 2)
        mngr.save(step, args=StandardSave({"big": big + step, "loss_scale": ls}))
        print(step, flush=True)
    """
)


def reference_scales(n):
    config, state = mpx.ScalerConfig(growth_interval=1, min_scale=None), None
    state = mpx.scaler_init(config)
    out = []
    for step in range(n):
        state = mpx.scaler_update(config, state, step % 3 != 2)
        out.append(state)
    return out


def test_kill_9_during_save_never_yields_a_wrong_scale(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    caught_mid_save = 0
    for attempt, wait_for in enumerate((3, 6, 9)):
        root = tmp_path / f"run{attempt}"
        child = subprocess.Popen(
            [sys.executable, str(script), str(root)], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
        )
        try:
            for _ in range(wait_for):  # a hang shows as a test timeout, never as a failure on a slow machine
                assert child.stdout.readline(), "the child died before saving"
            time.sleep(0.05 * attempt)
            child.send_signal(signal.SIGKILL)
        finally:
            child.kill()
            child.wait()
        names = os.listdir(root)
        caught_mid_save += any("tmp" in name for name in names)
        with ocp.CheckpointManager(root) as mngr:
            steps = mngr.all_steps()
            assert steps, names
            expected = reference_scales(max(steps) + 1)
            for step in steps:
                raw = mngr.restore(step, args=StandardRestore())
                assert raw["loss_scale"].state == expected[step], step
                assert float(raw["big"][1]) == 1.0 + step
    assert caught_mid_save  # at least one kill landed while a save was being written
