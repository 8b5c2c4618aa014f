"""The shared scaler-surface checks (mpx.testing) hold for the core's reference scaler.

This shows the checks pass on the state machine itself, so a backend that fails one differs from the core.
The backends run the same checks in tests/<backend>/test_surface.py.
"""

import pytest

import mpx
from mpx.testing import SURFACE_CHECKS


class CoreAdapter:
    def make(self, config):
        return mpx.LossScaler(config)

    def step(self, scaler, finite):
        scaler.update(finite)
        mpx.check_stuck(scaler.config, scaler.get_scale(), scaler.state.consecutive_nonfinite)
        return scaler

    def multiply(self, scaler, value):
        return value * scaler.get_scale()

    def load(self, scaler, data):
        scaler.load_state_dict(data)
        return scaler

    def history(self, config, flags):
        scaler = mpx.LossScaler(config)
        scaler.record_history()
        for finite in flags:
            scaler.update(finite)
        return scaler.history()


# The core's LossScaler predates the surface: its ``scale`` is the float property DESIGN.md names.
CORE_CHECKS = {name: check for name, check in SURFACE_CHECKS.items() if name != "names"}


@pytest.mark.parametrize("check", CORE_CHECKS.values(), ids=list(CORE_CHECKS))
def test_core_scaler_meets_the_surface(check):
    check(CoreAdapter())


def test_a_check_fails_for_a_scaler_that_differs():
    class Drifting(CoreAdapter):
        def step(self, scaler, finite):
            return super().step(scaler, True)  # never sees an overflow

    with pytest.raises(AssertionError):
        SURFACE_CHECKS["trace"](Drifting())
