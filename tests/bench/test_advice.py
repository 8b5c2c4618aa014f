"""mpx.advice: the slow-policy table and the warn-once switch (framework-free)."""

import subprocess
import sys
import warnings

import pytest

import mpx
from mpx import advice


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(advice.ENV_SWITCH, raising=False)
    advice.reset_warnings()
    yield
    advice.reset_warnings()


def _calls(*calls):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [advice.warn_if_slow(*c) for c in calls]
    return results, [w for w in caught if issubclass(w.category, advice.SlowPolicyWarning)]


def test_warns_once_per_backend_and_dtype():
    results, caught = _calls(("tf", "mixed_float16"), ("tf", "float16"), ("tf", "mixed_float16", "CPU:0"))
    assert results == [True, False, False]
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "float16" in message and advice.ENV_SWITCH in message and "mpx doctor" in message
    assert caught[0].filename == __file__  # stacklevel points at the caller


def test_each_slow_combination_warns_once():
    results, caught = _calls(
        *[(b, f"params=float32,compute={dt}", dev) for (b, dev, dt) in advice.SLOW_POLICIES]
    )
    assert all(results) and len(caught) == len(advice.SLOW_POLICIES)


@pytest.mark.parametrize(
    "backend,policy,device",
    [("torch", "mixed_bfloat16", "cpu"), ("tf", "mixed_bfloat16", "cpu"), ("jax", "float32", "cpu"),
     ("tf", "mixed_float16", "cuda:0"), ("jax", "mixed_bfloat16", "gpu")],
)  # fmt: skip
def test_fast_combinations_do_not_warn(backend, policy, device):
    results, caught = _calls((backend, policy, device))
    assert results == [False] and caught == []
    assert advice.slow_entry(backend, policy, device) is None


def test_environment_switch_silences(monkeypatch):
    monkeypatch.setenv(advice.ENV_SWITCH, "1")
    results, caught = _calls(("tf", "mixed_float16"))
    assert results == [False] and caught == []
    monkeypatch.setenv(advice.ENV_SWITCH, "0")
    results, caught = _calls(("tf", "mixed_float16"))
    assert results == [True] and len(caught) == 1


def test_warnings_filter_silences():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=advice.SlowPolicyWarning)
        advice.warn_if_slow("jax", "mixed_bfloat16")
    assert caught == []


def test_error_filter_raises():
    with warnings.catch_warnings():
        warnings.simplefilter("error", advice.SlowPolicyWarning)
        with pytest.raises(advice.SlowPolicyWarning):
            advice.warn_if_slow("jax", "mixed_bfloat16")


def test_bad_policy_raises():
    with pytest.raises(mpx.PolicyError):
        advice.warn_if_slow("tf", "float17")


def test_device_kind():
    assert advice.device_kind("cpu") == advice.device_kind("TFRT_CPU_0") == "cpu"
    assert advice.device_kind("cuda:0") == advice.device_kind("/device:GPU:0") == "gpu"


def test_table_entries_are_consistent():
    for key, entry in advice.SLOW_POLICIES.items():
        assert key == (entry.backend, entry.device_kind, entry.compute_dtype)
        assert entry.compute_dtype in mpx.HALF_DTYPES and entry.slowdown > 1
        assert entry.backend in ("torch", "tf", "jax")


def test_warning_is_shown_by_default_in_a_fresh_process():
    code = (
        "import mpx.advice as a; a.warn_if_slow('tf', 'mixed_float16'); a.warn_if_slow('tf', 'mixed_float16')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PATH": ""})
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("SlowPolicyWarning") == 1
