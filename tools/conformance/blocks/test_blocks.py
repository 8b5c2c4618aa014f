"""The ``blocks`` conformance group (issue 31, item 4): its cases are the core's, and each column runs them.

Every mpx row passes on every column (the backend's table gives the core's bytes); native rows pass,
differ with a named cause, or observe that no block-scaled format exists; the divergences found so far
are still found, each named (a framework upgrade that changes them shows here).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from conformance.blocks import block_input, digest, observe
from conformance.blocks import cases as C
from mpx.blocks import PRESETS
from mpx.kernels import blocks as kb
from mpx.kernels.array_ops import NUMPY_OPS
from mpx_tools.workers import BACKENDS, is_installed

CASES = C.blocks_cases()


def test_cases_are_plain_json_and_cover_every_preset_and_input():
    ids = [c["id"] for c in CASES]
    assert len(set(ids)) == len(ids) == 6 * 3 + 1
    assert {c["params"]["preset"] for c in CASES} == set(C.BLOCK_PRESETS)
    for case in CASES:
        assert case["group"] == "blocks" and case["kind"] == "block_quantize"
        assert json.loads(json.dumps(case, allow_nan=False)) == case
    from conformance import cases as all_cases

    assert "blocks" in all_cases.GROUPS and {c["id"] for c in all_cases.blocks_cases()} == set(ids)


def test_expectations_are_the_core_s_and_the_digest_tells_nans_apart_from_nothing_else():
    case = next(c for c in CASES if c["id"] == "blocks.mxfp8.specials")
    x = block_input("specials", case["params"]["seed"])
    assert np.isnan(x).sum() == 1 and np.isinf(x).sum() == 2
    q = kb.quantize(NUMPY_OPS, x, PRESETS["mxfp8"], "input")
    assert case["expected"] == observe(q.codes, "e4m3", q.scales, "e8m0", None)
    # every NaN byte of an element or scale is one NaN; a changed byte changes the digest
    codes = q.codes.copy()
    nan = codes == 0x7F
    assert nan.any()
    assert digest(np.where(nan, 0xFF, codes), "e4m3", q.scales, "e8m0") == digest(
        codes, "e4m3", q.scales, "e8m0"
    )
    codes[0, 0] ^= 1
    assert digest(codes, "e4m3", q.scales, "e8m0")[0] != case["expected"]["codes"]


def test_a_floor_native_rule_is_named_where_rceil_is_asked():
    case = next(c for c in CASES if c["id"] == "blocks.mxfp8.random")
    rceil = next(c for c in CASES if c["id"] == "blocks.mxfp8_rceil.random")
    assert rceil["expected"]["scales"] != case["expected"]["scales"]  # the rules differ on these inputs
    kind, severity, topic = C.blocks_topic(case["id"], case["params"], case["expected"], rceil["expected"])
    assert (kind, severity, topic) == ("default differs", "medium", "blocks-quantize:RCEIL rule+codes+scales")
    zero = next(c for c in CASES if c["id"] == "blocks.nvfp4.zero_tensor")
    observed = dict(zero["expected"], scales="0" * 64)
    assert C.blocks_topic(zero["id"], zero["params"], zero["expected"], observed)[1:] == (
        "high",
        "blocks-quantize:zero_tensor+scales",
    )
    assert (
        C.blocks_topic(zero["id"], zero["params"], zero["expected"], {"missing": "no"})[2] == "blocks-missing"
    )


#: per column: the native divergences found so far (case -> topic); every other native row passes or
#: observes a missing format
KNOWN = {
    "torch": {
        "blocks.nvfp4.zero_tensor": "blocks-quantize:zero_tensor+codes+scales+tensor_scale",
        "blocks.mxfp8.specials": "blocks-quantize:specials+codes",  # a NaN block's other elements: 0, not NaN
        "blocks.mxfp4.specials": "blocks-quantize:specials+codes",
        "blocks.nvfp4.specials": "blocks-quantize:specials+codes",
        # rowwise: a NaN row gets scale NaN, an inf row scale 0 (mpx: 1.0, saturating)
        "blocks.fp8_rowwise.specials": "blocks-quantize:specials+codes+scales",
    },
    "jax": {  # jax.nn.scaled_dot_general's quantizer under jit: RCEIL only (eagerly, an all-zero block's
        # x / 2**-127 is 0 / 0 = NaN too: XLA:CPU flushes the scale; the jitted quantizer folds it)
        "blocks.mxfp8.random": "blocks-quantize:RCEIL rule+codes+scales",
        "blocks.mxfp8.zero_blocks": "blocks-quantize:RCEIL rule+codes+scales",
        "blocks.mxfp8.specials": "blocks-quantize:specials+codes+scales",
        "blocks.mxfp8_rceil.specials": "blocks-quantize:specials+codes+scales",
        "blocks.nvfp4.random": "blocks-quantize:random+codes+scales",  # no 2**-6 floor; x / ts / s
        "blocks.nvfp4.zero_blocks": "blocks-quantize:zero_blocks+codes+scales",
        "blocks.nvfp4.specials": "blocks-quantize:specials+codes",
        "blocks.nvfp4.zero_tensor": "blocks-quantize:zero_tensor+codes+scales+tensor_scale",
    },
}
MISSING = {"torch": {"fp8_blockwise"}, "jax": {"mxfp4", "fp8_blockwise", "fp8_rowwise"}}


@pytest.mark.parametrize("backend", ["torch", "tf", "jax", "keras-jax", "keras-torch"])
def test_backend_runs_the_blocks_group(backend, group_report):
    from conformance.findings import findings

    if not is_installed(backend):
        pytest.skip(f"{BACKENDS[backend]} is not installed")
    data = group_report(backend, "blocks")
    rows = {(r["case"], r["mode"]): r for r in data["results"]}
    assert {c for c, _ in rows} == {c["id"] for c in CASES}, [
        r for r in data["results"] if r["case"] == "worker"
    ]
    for (case, mode), r in rows.items():
        if mode == "mpx":
            assert r["status"] == "pass", (case, r["detail"])
        else:
            assert r["status"] in ("pass", "differs"), (case, r["status"], r["detail"])
    topics = {c: f["topic"] for f in findings(data) for c in f["cases"]}
    missing = {
        c["id"] for c in CASES if c["params"]["preset"] in MISSING.get(backend, {p for p in C.BLOCK_PRESETS})
    }
    assert {c for c, t in topics.items() if t == "blocks-missing"} == missing
    assert {c: t for c, t in topics.items() if t != "blocks-missing"} == KNOWN.get(backend, {}), topics
