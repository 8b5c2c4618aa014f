"""The README's PyTorch examples run as written (each in a fresh interpreter; see conftest's run_example)."""

import pytest

#: example name -> what its output must contain
NAMES = {
    "torch": "accuracy",
    "torch-quickstart": "torch.float32 65536.0",
    "torch-ddp": "[(65536.0, 3), (65536.0, 3)]",
}


@pytest.mark.parametrize("name", list(NAMES))
def test_readme_example_runs(name, run_example):
    assert NAMES[name] in run_example(name)
