"""The version floors: one table in the core, the same floors in pyproject.toml's extras."""

import re
from pathlib import Path

import pytest
import tomllib

import mpx
from mpx.versions import MINIMUM_VERSIONS, missing_internal, parse_version, require_version

ROOT = Path(__file__).resolve().parents[2]
PYPI_NAME = {"tensorflow": "tensorflow-cpu"}


def test_pyproject_declares_the_tested_floors():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    declared = {}
    for req in [r for reqs in extras.values() for r in reqs]:
        m = re.fullmatch(r"([A-Za-z0-9_-]+)>=([0-9.]+)", req)
        if m:
            declared[m.group(1)] = m.group(2)
    for framework, floor in MINIMUM_VERSIONS.items():
        assert declared[PYPI_NAME.get(framework, framework)] == floor, framework


def test_the_constraints_pin_satisfies_every_floor():
    pins = dict(
        line.split("==") for line in (ROOT / "ci/constraints.txt").read_text().splitlines() if "==" in line
    )
    for framework, floor in MINIMUM_VERSIONS.items():
        assert parse_version(pins[PYPI_NAME.get(framework, framework)]) >= parse_version(floor)


@pytest.mark.parametrize(
    ("installed", "ok"), [("2.13.0+cpu", True), ("2.14.1", True), ("2.12.9", False), ("3.0.0rc1", True)]
)
def test_require_version(installed, ok):
    if ok:
        require_version("torch", installed)
    else:
        with pytest.raises(
            mpx.FrameworkVersionError, match=r"torch 2.12.9 is older than mpx supports \(torch >= 2.13.0"
        ):
            require_version("torch", installed)


def test_missing_internal_is_one_clear_error():
    err = missing_internal("jax", "0.10.2", "jax._src.core.Primitive", "autocast")
    assert isinstance(err, mpx.MPXError) and isinstance(err, ImportError)
    assert str(err).startswith("jax 0.10.2 has no jax._src.core.Primitive, which mpx uses for autocast")
