"""Per-call cost of the op table's dispatch: installed only while a policy needs it (#24) vs patched at import.

Not a test (no timing assertions).  ``python tests/tf/bench_dispatch.py [--old REF] [--rounds 3]``: each round
runs one process with this checkout's :mod:`mpx_tf.autocast` and one with the module as it was at git ``REF``
(default ``0fea889~1``: wrappers installed at import, frame walk by module name), interleaved, and prints the
median over rounds of the best-of-5 microseconds per call of:

- ``plain_keras`` / ``plain_tf``: ``keras.ops.softmax`` / ``tf.reduce_sum`` of a small float16 tensor, no policy
  active (in the old module after a scope was once entered, as in any process that used mpx);
- ``scoped_user``: ``keras.ops.softmax`` of float16 from user code inside ``autocast("mixed_float16")`` (retyped);
- ``scoped_library``: the same call from a library's frame (a ``keras_hub`` module) inside the scope (passes through);
- ``enter_exit``: entering and leaving ``autocast("mixed_float16")`` with no other policy active (the new module
  installs and removes its wrappers here); ``nested_enter_exit``: the same inside another such scope;
- ``model_call``: an eager call of a small model given ``mixed_float16`` by ``apply_policy`` (Dense +
  LayerNormalization; the new module installs the dispatch for the outermost layer's call).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def worker(which: str, old_ref: str) -> dict[str, float]:
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    import tensorflow as tf

    import mpx_tf

    if which == "new":
        module = importlib.import_module("mpx_tf.autocast")
    else:  # the module as it was at old_ref, loaded beside the package: it wraps the functions at import
        source = subprocess.run(
            ["git", "show", f"{old_ref}:mpx_tf/autocast.py"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        spec = importlib.util.spec_from_loader("mpx_tf._autocast_old", loader=None)
        module = importlib.util.module_from_spec(spec)
        exec(compile(source, str(ROOT / "mpx_tf" / "_autocast_old.py"), "exec"), module.__dict__)
    autocast = module.autocast
    x16 = tf.ones((4, 8), "float16")
    site = Path(tf.__file__).resolve().parents[1]  # site-packages
    library: dict = {"__name__": "keras_hub._mpx_bench", "keras": keras}
    exec(compile("def call(x):\n    return keras.ops.softmax(x)\n", str(site / "keras_hub" / "_mpx_bench.py"), "exec"), library)  # fmt: skip

    def best(stmt, number=2000) -> float:
        return min(timeit.repeat(stmt, number=number, repeat=5)) / number * 1e6

    with autocast("mixed_float16"):
        pass  # the old module switches its wrappers on here, for good
    out = {
        "plain_keras": best(lambda: keras.ops.softmax(x16)),
        "plain_tf": best(lambda: tf.reduce_sum(x16)),
    }

    def enter_exit() -> None:
        with autocast("mixed_float16"):
            pass

    out["enter_exit"] = best(enter_exit, 500)
    with mpx_tf.policy_scope("mixed_float16"):
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(8), keras.layers.LayerNormalization()]
        )
    mpx_tf.apply_policy(model, "mixed_float16")
    x32 = tf.ones((4, 8))
    out["model_call"] = best(lambda: model(x32), 200)
    with autocast("mixed_float16"):
        assert keras.ops.softmax(x16).dtype == tf.float32
        # the old module retypes the library's call too (keras-hub counted as user code)
        assert library["call"](x16).dtype == (tf.float16 if which == "new" else tf.float32)
        out["scoped_user"] = best(lambda: keras.ops.softmax(x16))
        out["scoped_library"] = best(lambda: library["call"](x16))
        out["nested_enter_exit"] = best(enter_exit, 500)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--old", default="0fea889~1", help="git ref of the patch-at-import mpx_tf/autocast.py"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", choices=("new", "old"))
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.old)))
        return
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3", "MPX_NO_SLOW_WARNING": "1"}
    results: dict[str, list[dict[str, float]]] = {"new": [], "old": []}
    for _ in range(args.rounds):
        for which in ("new", "old"):
            run = subprocess.run(
                [sys.executable, __file__, "--worker", which, "--old", args.old],
                env=env, capture_output=True, text=True, check=True,
            )  # fmt: skip
            results[which].append(json.loads(run.stdout.strip().splitlines()[-1]))
    print(f"{'us per call':<20}{'new':>10}{'old':>10}")
    for key in results["new"][0]:
        new = statistics.median(r[key] for r in results["new"])
        old = statistics.median(r[key] for r in results["old"])
        print(f"{key:<20}{new:>10.2f}{old:>10.2f}")


if __name__ == "__main__":
    main()
