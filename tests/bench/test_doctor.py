"""``mpx doctor``'s decision rule and the interleaved matmul probe, without a framework."""

from __future__ import annotations

import itertools

import pytest

from mpx_bench.doctor import FAST_RATIO, recommend
from mpx_bench.workers.common import timed_probe

NATIVE_BF16 = {
    "bfloat16": {"native": True, "flags": ["avx512_bf16"]},
    "float16": {"native": False, "flags": []},
}
NO_HW = {"bfloat16": {"native": False, "flags": []}, "float16": {"native": False, "flags": []}}


def _probe(bf16: float, fp16: float | None = None) -> dict:
    out = {"float32": {"seconds": 1.0}, "bfloat16": {"seconds": bf16}}
    if fp16 is not None:
        out["float16"] = {"seconds": fp16}
    return out


@pytest.mark.parametrize(
    ("ratio", "support", "expected"),
    [
        (0.5, None, "mixed_bfloat16"),
        (FAST_RATIO, None, "mixed_bfloat16"),
        (0.95, None, "float32"),
        (0.95, NO_HW, "float32"),
        (0.95, NATIVE_BF16, "mixed_bfloat16"),  # probe noise near the cut-off, hardware support decides
        (1.0, NATIVE_BF16, "mixed_bfloat16"),
        (1.05, NATIVE_BF16, "float32"),  # slower than float32: never recommended
    ],
)
def test_recommendation_rule(ratio, support, expected):
    assert recommend("torch", _probe(ratio), "cpu", support)["policy"] == expected


def test_hardware_support_does_not_apply_to_a_gpu():
    assert recommend("torch", _probe(0.95), "cuda", NATIVE_BF16)["policy"] == "float32"


def test_listed_slow_policy_is_never_recommended():
    # mpx.advice lists XLA:CPU bfloat16 and float16 as slow on whole steps, whatever a matmul says
    assert recommend("jax", _probe(0.3, 0.3), "cpu", NATIVE_BF16)["policy"] == "float32"


def test_fastest_candidate_wins_and_why_names_it():
    rec = recommend("torch", _probe(0.8, 0.5), "cuda")
    assert rec["policy"] == "mixed_float16" and "0.50x" in rec["why"] and "loss scaling" in rec["why"]
    rec = recommend("tf", _probe(0.97), "cpu", NATIVE_BF16)
    assert "avx512_bf16" in rec["why"] and "0.97x" in rec["why"]


def test_no_probe_means_float32():
    assert recommend("torch", None)["policy"] == "float32"
    assert recommend("torch", {"bfloat16": {"seconds": 0.1}})["policy"] == "float32"


def test_timed_probe_interleaves_and_keeps_the_fastest_call():
    """On a simulated clock that each call advances by its cost: no wall-clock time is measured."""
    now = [0.0]
    order: list[str] = []
    costs = {"a": itertools.cycle([3e-3, 1e-3]), "b": itertools.cycle([2e-3])}

    def make(name):
        def run():
            order.append(name)
            now[0] += next(costs[name])

        return run

    out = timed_probe({"a": make("a"), "b": make("b")}, 1e6, 0.05, clock=lambda: now[0])
    assert order[:2] == ["a", "b"]  # warm-up, one each
    timed = order[2:]
    assert timed == ["a", "b"] * (len(timed) // 2)  # A B A B ...: one of each per round
    # warm-up 5 ms, then rounds of 3 ms and 5 ms alternately (a: 1 or 3 ms, b: 2 ms); after 11 rounds
    # (48 ms) the next would overrun the 50 ms budget (elapsed plus the best of each: 51 ms)
    assert out["a"]["calls"] == out["b"]["calls"] == 11 and now[0] == pytest.approx(0.048)
    assert out["a"]["seconds"] == pytest.approx(1e-3) and out["b"]["seconds"] == pytest.approx(2e-3)
    assert out["a"]["gflops"] == pytest.approx(1e6 / 1e-3 / 1e9)
    single = timed_probe({"slow": make("b")}, 1e6, 0.0, clock=lambda: now[0])
    assert single["slow"]["calls"] == 1  # every run gets one timed call, even over budget
