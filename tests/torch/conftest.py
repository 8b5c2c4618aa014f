import os

import pytest

# The slow-policy warning (torch float16 on CPU) is tested on its own in test_slow_warning.py.
os.environ.setdefault("MPX_NO_SLOW_WARNING", "1")

torch = pytest.importorskip("torch")

CUDA = torch.cuda.is_available()


def pytest_generate_tests(metafunc):
    if "device" in metafunc.fixturenames:
        metafunc.parametrize(
            "device",
            [
                "cpu",
                pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no CUDA device")),
            ],
        )
