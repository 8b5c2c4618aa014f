"""The ``deepspeed`` conformance group (issue 32, item 2): DeepSpeed's own scalers on the scaler cases.

The torch column runs deepspeed 0.19.8's ``DynamicLossScaler`` and non-ZeRO ``FP16_Optimizer`` natively
(mpx blocked) and ``mpx_torch.GradScaler`` under mpx: every mpx row passes; DeepSpeed's own scaler equals
mpx's DeepSpeed mode bit for bit on every sequence, and each of its differences from mpx's default rule
and from torch's GradScaler, and FP16_Optimizer's from DeepSpeed's own scaler, is found and named.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import struct

import pytest

import mpx
from conformance.deepspeed import NOT_INSTALLED
from conformance.deepspeed import cases as C
from mpx_tools.workers import is_installed

CASES = C.deepspeed_cases()
BY_ID = {c["id"]: c for c in CASES}


def test_cases_are_plain_json_and_registered():
    ids = [c["id"] for c in CASES]
    assert len(set(ids)) == len(ids) == len(C.SEQUENCES) * len(C.RULES) + len(C.FP16_OPTIMIZER_SEQUENCES)
    for case in CASES:
        assert case["group"] == "deepspeed" and case["kind"] == "deepspeed_trace"
        assert json.loads(json.dumps(case, allow_nan=False)) == case
    from conformance import cases as all_cases

    assert all_cases.GROUPS[-1] == "deepspeed" and {c["id"] for c in all_cases.deepspeed_cases()} == set(ids)


def test_the_rules_are_the_core_s_configs():
    ds = C.ds_args(16, 1000, 2)
    assert C.rule_config("deepspeed_mode", ds) == mpx.SCALER_PRESETS["deepspeed_fp16"]
    _, config = mpx.from_deepspeed_config({"fp16": {"enabled": True, "consecutive_hysteresis": True}})
    assert C.rule_config("deepspeed_mode", C.ds_args(16, 1000, 2, consecutive=True)) == config
    assert C.rule_config("mpx_default", ds) == mpx.ScalerConfig(growth_interval=1000, hysteresis=2)
    torch_rule = C.rule_config("torch_rule", ds)
    assert (torch_rule.min_scale, torch_rule.max_scale, torch_rule.hysteresis) == (None, None, 1)
    # the window-4 measurement of the issue: DeepSpeed's mode grows at steps 5 and 9, the default at 4 and 8
    grown = {r: [i + 2 for i, (a, b) in enumerate(itertools.pairwise(s)) if b > a]
             for r in C.RULES for s in [BY_ID[f"deepspeed.growth_window_4.{r}"]["expected"]["scales"]]}  # fmt: skip
    assert grown == {"deepspeed_mode": [5, 9], "mpx_default": [4, 8], "torch_rule": [4, 8]}
    assert BY_ID["deepspeed.floor.deepspeed_mode"]["expected"] == {"scales": [1.0], "raised_at": 2}


@pytest.mark.parametrize(
    ("case", "observed_rule", "causes"),
    [
        ("deepspeed.hysteresis_refill.mpx_default", "deepspeed_mode",
         ["growth one step later", "hysteresis refilled only on growth"]),
        ("deepspeed.floor.mpx_default", "deepspeed_mode", ["raise at the floor"]),
        ("deepspeed.floor.torch_rule", "deepspeed_mode", ["raise at the floor", "floor at min_loss_scale"]),
        ("deepspeed.consecutive_hysteresis.torch_rule", "deepspeed_mode", ["growth one step later", "hysteresis"]),
        ("deepspeed.growth_window_4.deepspeed_mode", "mpx_default", None),  # growth a step *earlier*: unnamed
    ],
)  # fmt: skip
def test_a_divergence_is_named_by_the_fewest_rule_changes(case, observed_rule, causes):
    """The observations are another rule's traces, computed by the core: no DeepSpeed needed here."""
    c = BY_ID[case]
    observed = BY_ID[case.rsplit(".", 1)[0] + f".{observed_rule}"]["expected"]
    assert C.trace_causes(c["params"], observed) == causes
    assert C.trace_causes(c["params"], c["expected"]) == []
    kind, severity, topic = C.deepspeed_topic(case, c["params"], c["expected"], observed)
    assert topic.endswith(":" + "+".join(causes or ["unexplained"]))
    assert (kind, severity) == ("scaler semantics", "medium")
    title, explanation = C.finding_text(topic, [case])
    assert case in title and explanation.endswith(".")


#: the native divergences, case -> the causes named (every other native row passes); the DeepSpeed mode rows
#: of DynamicLossScaler all pass, bit for bit
KNOWN = {
    "deepspeed.growth_window_4.mpx_default": "growth one step later",
    "deepspeed.growth_window_4.torch_rule": "growth one step later",
    "deepspeed.hysteresis_refill.mpx_default": "growth one step later+hysteresis refilled only on growth",
    "deepspeed.hysteresis_refill.torch_rule": "growth one step later+hysteresis refilled only on growth+hysteresis",
    "deepspeed.consecutive_hysteresis.mpx_default": "growth one step later",
    "deepspeed.consecutive_hysteresis.torch_rule": "growth one step later+hysteresis",
    "deepspeed.floor.mpx_default": "raise at the floor",
    "deepspeed.floor.torch_rule": "raise at the floor+floor at min_loss_scale",
    "deepspeed.defaults.mpx_default": "hysteresis refilled only on growth",
    "deepspeed.defaults.torch_rule": "hysteresis refilled only on growth+hysteresis",
    "deepspeed.random_long.mpx_default": "growth one step later+hysteresis refilled only on growth",
    "deepspeed.random_long.torch_rule": "growth one step later+hysteresis refilled only on growth+hysteresis",
    "deepspeed.fp16_optimizer.hysteresis_refill": "no hysteresis",
    "deepspeed.fp16_optimizer.floor": "no raise at the floor",
    "deepspeed.fp16_optimizer.random_long": "no hysteresis+no raise at the floor",
}


def _bits(values: list[float]) -> list[bytes]:
    return [struct.pack("<f", v) for v in values]


def test_the_torch_column_runs_deepspeed_s_own_scalers(group_report):
    from conformance.findings import findings

    if not is_installed("torch"):
        pytest.skip("torch is not installed")
    data = group_report("torch", "deepspeed")
    rows = {(r["case"], r["mode"]): r for r in data["results"]}
    assert {c for c, _ in rows} == set(BY_ID), [r for r in data["results"] if r["case"] == "worker"]
    assert data["backends"]["torch"]["mpx_free"] is True
    for case in CASES:
        mine = rows[(case["id"], "mpx")]
        assert mine["status"] == "pass", (case["id"], mine["detail"])
        assert _bits(mine["observed"]["scales"]) == _bits(case["expected"]["scales"])
    native = {c: rows[(c, "native")] for c in BY_ID}
    if importlib.util.find_spec("deepspeed") is None:
        assert {r["status"] for r in native.values()} == {"skip"}
        assert {r["detail"] for r in native.values()} == {NOT_INSTALLED}
        pytest.skip(NOT_INSTALLED)
    for c, r in native.items():
        assert r["status"] == ("differs" if c in KNOWN else "pass"), (c, r["status"], r["detail"])
    for seq, *_ in C.SEQUENCES:  # under the DeepSpeed mode mpx's traces are DeepSpeed's, bit for bit
        case = f"deepspeed.{seq}.deepspeed_mode"
        assert _bits(native[case]["observed"]["scales"]) == _bits(rows[(case, "mpx")]["observed"]["scales"])
        assert native[case]["observed"]["raised_at"] == rows[(case, "mpx")]["observed"]["raised_at"]
    topics = {c: f["topic"].split(":", 3)[3] for f in findings(data) for c in f["cases"]}
    assert topics == KNOWN
