"""Core of issue 18 items 4-5: stuck detection fields and decision, ScalerHistory (``mpx history plot``, a
tool's command: tests/bench/test_cli_tools.py)."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mpx
from mpx.history import ScalerHistory, decode_events, encode_events
from mpx.scaling import COUNTER_MAX, ScalerConfig
from mpx.stuck import is_stuck, signal_stuck, stuck_message

ROOT = Path(__file__).resolve().parents[2]


# -- config fields ---------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -1, COUNTER_MAX + 1, 2.0, True, "3"])
def test_max_consecutive_skips_is_bounded(bad) -> None:
    with pytest.raises(
        mpx.ScalerConfigError, match=r"max_consecutive_skips: expected None or an int in \[1, 2\*\*31 - 1\]"
    ):
        mpx.ScalerConfig(max_consecutive_skips=bad)


@pytest.mark.parametrize("bad", ["raises", None, 1])
def test_on_stuck_values(bad) -> None:
    with pytest.raises(mpx.ScalerConfigError, match="on_stuck: .* allowed: raise, warn"):
        mpx.ScalerConfig(on_stuck=bad)


def test_defaults_and_state_dict_round_trip() -> None:
    cfg = mpx.ScalerConfig()
    assert cfg.max_consecutive_skips is None and cfg.on_stuck == "raise"
    cfg = mpx.ScalerConfig(max_consecutive_skips=COUNTER_MAX, on_stuck="warn")
    scaler = mpx.LossScaler(cfg)
    scaler.update(False)
    data = json.loads(json.dumps(scaler.state_dict()))
    assert data["config"]["max_consecutive_skips"] == COUNTER_MAX and data["config"]["on_stuck"] == "warn"
    assert mpx.load_state_dict(data)[0] == cfg


def test_older_dicts_without_the_keys_load_with_detection_off() -> None:
    data = mpx.LossScaler(mpx.ScalerConfig(growth_interval=7)).state_dict()
    for key in ("max_consecutive_skips", "on_stuck"):
        del data["config"][key]
    cfg, _ = mpx.load_state_dict(data)
    assert cfg == mpx.ScalerConfig(growth_interval=7)


# -- the decision ------------------------------------------------------------------------
@given(n=st.integers(1, 6), k=st.integers(0, 40))
def test_is_stuck_at_multiples_of_n_only(n: int, k: int) -> None:
    assert is_stuck(mpx.ScalerConfig(max_consecutive_skips=n), k) == (k > 0 and k % n == 0)
    assert not is_stuck(mpx.ScalerConfig(), k)
    assert not is_stuck(mpx.ScalerConfig(kind="none", max_consecutive_skips=n), k)  # never skips


def _state(scale: float, k: int) -> mpx.ScalerState:
    return mpx.ScalerState(scale, consecutive_nonfinite=k, steps=k, skipped_steps=k)


def test_messages() -> None:
    cfg = mpx.ScalerConfig(max_consecutive_skips=4, min_scale=2.0)
    assert stuck_message(cfg, _state(2.0, 3), False) is None
    loss = stuck_message(cfg, _state(2.0, 4), False)
    assert loss.startswith("loss scaler stuck: 4 steps in a row skipped (max_consecutive_skips=4), scale 2: ")
    assert "forward loss itself is non-finite" in loss and "no loss scale can help" in loss
    at_min = stuck_message(cfg, _state(2.0, 4), True)
    assert "the loss is finite and the gradients overflow at the minimum scale (2)" in at_min
    unknown = stuck_message(cfg, _state(2.0, 4), None)
    assert "of unknown finiteness" in unknown and "minimum scale (2)" in unknown
    backing = stuck_message(cfg, _state(64.0, 8), True)
    assert "backs off toward min_scale (2)" in backing
    static = mpx.ScalerConfig(kind="static", init_scale=8.0, max_consecutive_skips=1)
    assert "minimum scale (8)" in stuck_message(static, _state(8.0, 1), True)


def test_signal_stuck_modes() -> None:
    signal_stuck(mpx.ScalerConfig(), None)  # nothing
    with pytest.raises(mpx.ScalerStuckError, match="boom") as info:
        signal_stuck(mpx.ScalerConfig(max_consecutive_skips=1), "boom")
    assert isinstance(info.value, mpx.MPXError)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        signal_stuck(mpx.ScalerConfig(max_consecutive_skips=1, on_stuck="warn"), "boom")
    assert [(c.category, str(c.message)) for c in caught] == [(mpx.ScalerStuckWarning, "boom")]


# -- history -------------------------------------------------------------------------------
@settings(max_examples=50, deadline=None)
@given(flags=st.lists(st.booleans(), max_size=60), interval=st.integers(1, 4), hysteresis=st.integers(1, 3))
def test_reference_history_follows_scaler_update(flags, interval, hysteresis) -> None:
    cfg = mpx.ScalerConfig(init_scale=16.0, growth_interval=interval, hysteresis=hysteresis, max_scale=64.0)
    h = mpx.ScalerHistory.reference(cfg, flags)
    s = mpx.scaler_init(cfg)
    for i, finite in enumerate(flags):
        before = s
        s = mpx.scaler_update(cfg, s, finite)
        assert h.steps[i] == i + 1 and h.scale[i] == s.scale
        assert h.skipped[i] == (s.skipped_steps > before.skipped_steps)
        assert h.growth[i] == (finite and s.growth_tracker == 0)
        assert h.backoff[i] == ((not finite) and s.consecutive_nonfinite >= hysteresis)
    assert mpx.ScalerHistory.from_dict(json.loads(json.dumps(h.to_dict()))) == h


def test_growth_and_backoff_count_capped_steps() -> None:
    cfg = mpx.ScalerConfig(init_scale=2.0, growth_interval=1, max_scale=2.0, min_scale=2.0)
    h = mpx.ScalerHistory.reference(cfg, [True, False])
    assert h.scale == [2.0, 2.0] and h.growth == [True, False] and h.backoff == [False, True]
    none = mpx.ScalerHistory.reference(mpx.ScalerConfig(kind="none"), [True, False])
    assert none.scale == [1.0, 1.0] and none.skipped == none.growth == none.backoff == [False, False]


@pytest.mark.parametrize(
    ("change", "match"),
    [({"format": "x"}, "format"), ({"steps": [1]}, "same length"), ({"scale": [1.0, -1.0]}, "scale"),
     ({"skipped": [0, 1]}, "skipped"), ({"steps": [0, 1]}, "steps"), ({"config": {"kind": "x"}}, "config")],
)  # fmt: skip
def test_from_dict_rejects(change, match) -> None:
    data = {**mpx.ScalerHistory.reference(mpx.ScalerConfig(), [True, False]).to_dict(), **change}
    with pytest.raises(mpx.HistoryError, match=match):
        mpx.ScalerHistory.from_dict(data)


def test_save_load(tmp_path) -> None:
    h = mpx.ScalerHistory.reference(mpx.ScalerConfig(growth_interval=2), [True] * 5)
    assert mpx.ScalerHistory.load(h.save(tmp_path / "h.json")) == h
    (tmp_path / "bad.json").write_text("{", encoding="utf-8")
    with pytest.raises(mpx.HistoryError, match="not a JSON scaler history"):
        mpx.ScalerHistory.load(tmp_path / "bad.json")


@pytest.mark.parametrize("capacity", [3, 5, 8])
def test_from_rows_reads_the_ring_buffer_in_step_order(capacity):
    import numpy as np

    config = ScalerConfig(growth_interval=2, init_scale=4.0)
    flags = [True, True, False, True, True, True, False]
    ref = ScalerHistory.reference(config, flags)
    rows = np.zeros((capacity, 4), np.int64)
    for i, (scale, step) in enumerate(zip(ref.scale, ref.steps, strict=True)):
        state = mpx.scaler_init(config)
        for f in flags[: i + 1]:
            state = mpx.scaler_update(config, state, f)
        bits = int(np.float32(scale).view(np.int32))
        events = encode_events(ref.skipped[i], ref.growth[i], ref.backoff[i])
        rows[i % capacity] = [bits, events, state.consecutive_nonfinite, step]
    got = ScalerHistory.from_rows(config, rows, len(flags))
    keep = min(capacity, len(flags))
    assert got.steps == ref.steps[-keep:]
    assert got.scale == ref.scale[-keep:]
    assert got.skipped == ref.skipped[-keep:] and got.growth == ref.growth[-keep:]


def test_from_rows_refuses_another_layout():
    import numpy as np

    with pytest.raises(mpx.HistoryError, match=r"shape \(capacity, 4\)"):
        ScalerHistory.from_rows(ScalerConfig(), np.zeros((4, 3), np.int64), 1)


def _deepspeed_events(window: int, hysteresis: int, consecutive: bool, overflows: list[bool]) -> tuple[list, list]:
    """DeepSpeed's DynamicLossScaler.update_scale (deepspeed 0.19.8) as plain Python, no raise at the floor:
    per step whether it grew and whether it backed off (or would have, at the floor)."""
    cur_iter, last_overflow, cur_hysteresis = 0, -1, hysteresis
    growth, backoff = [], []
    for overflow in overflows:
        grew = backed = False
        if overflow:
            if hysteresis == 1 or cur_hysteresis == 1:
                backed = True
            else:
                cur_hysteresis -= 1
            last_overflow = cur_iter
        else:
            if consecutive:
                cur_hysteresis = hysteresis
            stable = cur_iter - last_overflow - 1
            if stable > 0 and stable % window == 0:
                cur_hysteresis, grew = hysteresis, True
        cur_iter += 1
        growth.append(grew)
        backoff.append(backed)
    return growth, backoff


@settings(max_examples=60, deadline=None)
@given(
    overflows=st.lists(st.sampled_from([False] * 3 + [True]), max_size=50),
    window=st.integers(1, 4),
    hysteresis=st.integers(1, 3),
    consecutive=st.booleans(),
)
def test_events_under_the_deepspeed_preset_are_deepspeeds(overflows, window, hysteresis, consecutive) -> None:
    """The events come from the kernel's transition: growth on the (window+1)-th clean step, then every window,
    and back-offs when DeepSpeed's hysteresis is spent (refilled only by a growth unless consecutive), even at
    the floor; the old inference from the state alone (growth where the tracker is 0, back-off after
    ``hysteresis`` overflows in a row) gets both wrong in this mode."""
    cfg = mpx.ScalerConfig(**{**mpx.SCALER_PRESETS["deepspeed_fp16"].to_dict(), "init_scale": 4.0,
                              "growth_interval": window, "hysteresis": hysteresis,
                              "hysteresis_reset": "finite" if consecutive else "growth"})  # fmt: skip
    flags = [not o for o in overflows]
    h = mpx.ScalerHistory.reference(cfg, flags)
    growth, backoff = _deepspeed_events(window, hysteresis, consecutive, overflows)
    assert h.growth == growth and h.backoff == backoff and h.skipped == overflows
    scaler = mpx.LossScaler(dataclasses.replace(cfg, on_floor="keep"))  # the core's scaler records the same
    scaler.record_history()
    for finite in flags:
        scaler.update(finite)
    if flags:
        assert scaler.history() == mpx.ScalerHistory.reference(dataclasses.replace(cfg, on_floor="keep"), flags)


def test_event_bits_round_trip() -> None:
    for bits in range(8):
        assert encode_events(*decode_events(bits)) == bits
