import os
import subprocess
import sys
import textwrap
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import mpx
import mpx.advice
import mpx_jax
import mpx_jax.flax

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="the slow-policy table lists jax half precision on XLA:CPU only"
)


def slow(caught):
    return [w for w in caught if issubclass(w.category, mpx.SlowPolicyWarning)]


CALLS = {
    "autocast": lambda policy: mpx_jax.autocast(jnp.sin, policy),
    "apply_policy": lambda policy: mpx_jax.flax.apply_policy(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), policy),
    "policy_apply": lambda policy: mpx_jax.flax.policy_apply(nn.Dense(2), policy),
}


@pytest.mark.parametrize("entry", sorted(CALLS))
def test_each_entry_point_warns_once_pointing_at_the_caller(warnings_on, entry):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        CALLS[entry]("mixed_float16")
        for other in CALLS.values():  # the same combination: no second warning
            other("mixed_float16")
    (warning,) = slow(caught)
    assert warning.filename == __file__, warning.filename
    message = str(warning.message)
    assert "float16" in message and "jax on cpu" in message and "MPX_NO_SLOW_WARNING" in message
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        CALLS[entry]("mixed_bfloat16")  # bfloat16 is a combination of its own
        CALLS[entry]("mixed_bfloat16")
    assert len(slow(caught)) == 1


def test_float32_does_not_warn_and_the_switch_silences(warnings_on, monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("error", mpx.SlowPolicyWarning)
        for call in CALLS.values():
            call("float32")
        monkeypatch.setenv("MPX_NO_SLOW_WARNING", "1")
        for call in CALLS.values():
            call("mixed_float16")
            call("mixed_bfloat16")


SCRIPT = textwrap.dedent(
    """
    import jax.numpy as jnp
    import mpx_jax
    f = mpx_jax.autocast(jnp.sin, "mixed_float16")  # line 4: the warning points here
    g = mpx_jax.autocast(jnp.cos, "mixed_float16")
    print("done", f(jnp.ones(2)).dtype)
    """
)


@pytest.mark.parametrize("switch", [None, "1"])
def test_a_fresh_process_warns_once_unless_switched_off(switch):
    env = {k: v for k, v in os.environ.items() if k != "MPX_NO_SLOW_WARNING"}
    env["JAX_PLATFORMS"] = "cpu"
    if switch is not None:
        env["MPX_NO_SLOW_WARNING"] = switch
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "done float32" in proc.stdout
    count = proc.stderr.count("SlowPolicyWarning")
    if switch is None:
        assert count == 1 and "<string>:4" in proc.stderr, proc.stderr
    else:
        assert count == 0, proc.stderr
