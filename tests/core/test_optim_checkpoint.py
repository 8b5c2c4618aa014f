"""mpx.optim_checkpoint (mpx.optim/1): the reference checkpoints validate, survive numpy.savez, and every malformed
field raises StateDictError naming it."""

import copy

import numpy as np
import optim_parity
import pytest
from hypothesis import given, settings

from mpx import optim_checkpoint as oc
from mpx.errors import StateDictError


@settings(max_examples=20, deadline=None)
@given(optim_parity.momentum_traces())
def test_reference_checkpoints_validate_and_round_trip_through_npz(tmp_path_factory, case):
    k = len(case["grads"])
    d = optim_parity.reference_checkpoint(case, k)
    shapes = [case["w0"][i].shape for i in range(2)]
    checked = oc.check(d, optim_parity.policy_of(case), shapes, optimizer="sgd")
    assert checked["step"] == k and checked["seed"] == case["seed"]
    path = tmp_path_factory.mktemp("ckpt") / "opt.npz"
    np.savez(path, **oc.to_flat(d))
    with np.load(path, allow_pickle=False) as f:
        back = oc.from_flat(dict(f))
    assert optim_parity.equal_checkpoints(back, d)
    oc.check(back, optim_parity.policy_of(case), shapes)


def _case():
    return {
        "w0": np.ones((2, 40), np.float32),
        "grads": np.full((2, 2, 40), 0.5, np.float32),
        "lr": 2.0**-4,
        "update": "kahan",
        "seed": 3,
        "momentum": 0.5,
        "opt_state": "int8:32",
    }


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda d: d.update(format="mpx.optim/2"), "format"),
        (lambda d: d.update(policy="bf16_sr,opt_state=int8:32"), "policy"),
        (lambda d: d.update(policy="no such policy"), "policy"),
        (lambda d: d.update(optimizer="lion"), "optimizer"),
        (lambda d: d.update(step=-1), "step"),
        (lambda d: d.update(seed="1"), "seed"),
        (lambda d: d["params"].pop(), "params"),
        (lambda d: d["params"][1].pop("kahan_comp"), r"params\[1\].kahan_comp"),
        (
            lambda d: d["params"][0].update({"momentum_buffer.q": np.zeros((2, 32), np.int16)}),
            r"params\[0\].momentum_buffer.q",
        ),
        (lambda d: d["params"][0].pop("momentum_buffer.absmax"), r"params\[0\]"),
        (lambda d: d["params"][0].update(master=np.zeros(40, np.float16)), r"params\[0\].master"),
        (lambda d: d["params"][1].update(extra=np.zeros(1)), r"params\[1\]: unknown entries"),
    ],
)
def test_malformed_fields_are_named(change, field):
    d = copy.deepcopy(optim_parity.reference_checkpoint(_case(), 2))
    change(d)
    with pytest.raises(StateDictError, match=field):
        oc.check(d, "bf16_kahan,opt_state=int8:32", [(40,), (40,)])


def test_the_reading_optimizers_kind_must_match():
    d = optim_parity.reference_checkpoint(_case(), 1)
    with pytest.raises(
        StateDictError, match="optimizer: the checkpoint holds 'sgd' state, this optimizer is 'adam'"
    ):
        oc.check(d, "bf16_kahan,opt_state=int8:32", [(40,), (40,)], optimizer="adam")
    assert oc.moment_names("adam", "int8:64") == (
        "exp_avg.q",
        "exp_avg.absmax",
        "exp_avg_sq.q",
        "exp_avg_sq.absmax",
    )
