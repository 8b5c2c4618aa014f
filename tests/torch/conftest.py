import pytest

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
