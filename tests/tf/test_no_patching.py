"""Importing mpx_tf / mpx_keras patches nothing; the op table's dispatch lives only while a policy needs it (#24)."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
import threading
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import mpx
import mpx_tf

A = importlib.import_module("mpx_tf.autocast")  # the module (mpx_tf.autocast is also the scope)
L = keras.layers
ROOT = Path(__file__).resolve().parents[2]


def snapshot() -> dict:
    """Every public function of :data:`NAMESPACES` (and ``Layer.__call__``) by dotted name."""
    import keras
    import tensorflow as tf

    roots = {"keras": keras, "tf": tf}
    out = {}
    for dotted in ("keras.ops", "keras.ops.nn", "keras.ops.numpy", "keras.ops.linalg", "keras.losses",
                   "tf", "tf.math", "tf.nn", "tf.linalg"):  # fmt: skip
        root, *parts = dotted.split(".")
        module = roots[root]
        for part in parts:
            module = getattr(module, part)
        for name in dir(module):
            fn = getattr(module, name, None)
            if not name.startswith("_") and callable(fn) and not isinstance(fn, type):
                out[f"{dotted}.{name}"] = fn
    out["keras.layers.Layer.__call__"] = keras.layers.Layer.__call__
    return out


_SNAPSHOT = inspect.getsource(snapshot)


def _changed(before: dict, after: dict) -> list[str]:
    return sorted(name for name, fn in before.items() if after.get(name) is not fn)


@pytest.fixture(autouse=True)
def _no_hold():
    """mpx's global policy of this thread back to float32 (a mixed one set by another test holds the table)."""
    mpx_tf.set_global_policy("float32")
    assert A.holds() == 0
    yield
    mpx_tf.set_global_policy("float32")


def test_importing_mpx_tf_and_mpx_keras_replaces_no_function(run_python):
    script = _SNAPSHOT + (
        "import json, keras\n"
        "before = snapshot()\n"
        "parse = keras.DTypePolicy._parse_name\n"
        "import mpx_keras, mpx_tf\n"
        "after = snapshot()\n"
        "import importlib\n"
        "A = importlib.import_module('mpx_tf.autocast')\n"
        "print(json.dumps({'n': len(before), 'changed': sorted(k for k in before if after[k] is not before[k]),\n"
        "  'holds': A.holds(), 'targets': len(A.wrapped_functions()),\n"
        "  'parse_replaced': keras.DTypePolicy._parse_name is not parse}))\n"
    )
    env = {**os.environ, "KERAS_BACKEND": "tensorflow", "PYTHONPATH": str(ROOT)}
    [(code, out, err)] = run_python([[sys.executable, "-c", script]], env=env, cwd=str(ROOT))
    assert code == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["n"] > 1000  # the snapshot covers the namespaces
    assert result["changed"] == []
    assert result["holds"] == 0 and result["targets"] >= 150
    # Keras's dtype-policy name parser learns `mpx:` names at import (so load_model reads them): mpx_keras's
    # one documented install (mpx_keras.layer_policy, undone by uninstall()), not a function of the op table.
    assert result["parse_replaced"] is True


def test_every_dispatched_function_is_in_the_snapshot():
    names = set(snapshot())
    assert set(A.wrapped_functions()) <= names


def test_scopes_install_only_while_they_run_and_put_everything_back():
    before = snapshot()
    x16 = tf.ones((2, 3), "float16")
    for scope in (mpx_tf.autocast, mpx_tf.policy_scope):
        with scope("mixed_float16"):
            assert A.holds() == 1
            assert keras.ops.softmax is not before["keras.ops.softmax"]
            assert tf.matmul is not before["tf.matmul"]
            assert set(_changed(before, snapshot())) == set(A.wrapped_functions())
            assert keras.ops.softmax(x16).dtype == tf.float32
            with scope("mixed_bfloat16"), scope("float32"):  # nested: one install, more holds
                assert A.holds() == 3  # one install; a float32 scope in a mixed one forces: it holds too
            assert A.holds() == 1
        assert A.holds() == 0
        assert _changed(before, snapshot()) == []
        assert keras.ops.softmax(x16).dtype == tf.float16
    with mpx_tf.autocast("float32"), mpx_tf.policy_scope("float32"):  # nothing lowers, nothing forced
        assert A.holds() == 0 and _changed(before, snapshot()) == []


def test_an_exception_inside_a_scope_leaks_nothing():
    before = snapshot()
    for scope in (mpx_tf.autocast, mpx_tf.policy_scope):
        with pytest.raises(ZeroDivisionError), scope("mixed_float16"), scope("mixed_bfloat16"):
            assert A.holds() == 2
            1 / 0  # noqa: B018
        assert A.holds() == 0 and _changed(before, snapshot()) == []
    with pytest.raises(mpx.PolicyError), mpx_tf.autocast("float17"):
        pass
    assert A.holds() == 0 and _changed(before, snapshot()) == []


def test_set_global_policy_holds_until_a_float32_one_replaces_it():
    before = snapshot()
    mpx_tf.set_global_policy("mixed_float16")
    assert A.holds() == 1 and keras.ops.softmax(tf.ones((2, 3), "float16")).dtype == tf.float32
    mpx_tf.set_global_policy("mixed_bfloat16")  # replaces its own hold
    assert A.holds() == 1
    with mpx_tf.policy_scope("float32"):  # forces float32 inside: holds while it runs
        assert A.holds() == 2
    assert A.holds() == 1
    mpx_tf.set_global_policy("float32")
    assert A.holds() == 0 and _changed(before, snapshot()) == []


class Probe(L.Layer):
    """Records, inside its call, whether the op table's dispatch is installed and a softmax's dtype."""

    seen: dict = {}  # noqa: RUF012

    def call(self, x):
        Probe.seen.update(holds=A.holds(), softmax=keras.ops.softmax(x).dtype)
        return x


def test_a_layer_with_an_mpx_policy_holds_the_dispatch_during_its_call_only():
    before = snapshot()  # Layer.__call__ included: apply_policy wraps the layers' `call`, per instance
    with mpx_tf.policy_scope("mixed_float16"):
        model = keras.Sequential([keras.Input((3,)), L.Dense(3), Probe()])
    mpx_tf.apply_policy(model, "mixed_float16")
    Probe.seen.clear()
    model(np.ones((2, 3), "float32"))
    assert Probe.seen["holds"] >= 1 and Probe.seen["softmax"] == "float32"
    assert A.holds() == 0 and _changed(before, snapshot()) == []
    Probe.seen.clear()
    with pytest.raises(ValueError):
        model(np.ones((2, 5), "float32"))  # a wrong shape fails inside the call
    assert A.holds() == 0 and _changed(before, snapshot()) == []


def test_threads_share_one_install_and_each_keeps_its_own_rule():
    before = snapshot()
    x16 = tf.ones((2, 3), "float16")
    inside, go_on = threading.Barrier(2), threading.Event()
    seen: dict[str, object] = {}

    def scoped():
        with mpx_tf.autocast("mixed_float16"):
            inside.wait()
            seen["scoped"] = keras.ops.softmax(x16).dtype
            go_on.wait()

    def plain():
        inside.wait()  # the other thread is inside its scope: the dispatch is installed
        seen["installed"] = keras.ops.softmax is not before["keras.ops.softmax"]
        seen["plain"] = keras.ops.softmax(x16).dtype  # no policy in this thread: untouched
        go_on.set()

    threads = [threading.Thread(target=scoped), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert seen == {"scoped": tf.float32, "installed": True, "plain": tf.float16}
    assert A.holds() == 0 and _changed(before, snapshot()) == []


def test_a_release_without_an_acquire_is_an_error_and_changes_nothing():
    with pytest.raises(mpx.MPXError, match="without a matching acquire"):
        A.release()
    assert A.holds() == 0
    give_back = A.hold(A.Rule(mpx.get_policy("mixed_float16"), mpx.OP_TABLE))
    assert A.holds() == 1
    give_back()
    give_back()  # idempotent
    assert A.holds() == 0


def test_a_function_replaced_by_someone_else_meanwhile_is_left_theirs():
    original = keras.ops.softmax
    mine = lambda *a, **k: "mine"  # noqa: E731
    try:
        with mpx_tf.autocast("mixed_float16"):
            keras.ops.softmax = mine
        assert keras.ops.softmax is mine  # not put back over theirs
        with mpx_tf.autocast("mixed_float16"):  # theirs is what the next install wraps, and puts back
            assert keras.ops.softmax(1) == "mine" and keras.ops.softmax is not mine
        assert keras.ops.softmax is mine
    finally:
        keras.ops.softmax = original
    with mpx_tf.autocast("mixed_float16"):
        assert keras.ops.softmax(tf.ones((2, 3), "float16")).dtype == tf.float32
    assert keras.ops.softmax is original
