"""Framework versions: the floors mpx is tested with, and the one error every backend's ``_compat`` raises.

Each backend reaches framework internals (private names, private modules) only through its
``_compat`` module, which calls :func:`require_version` once at import and :func:`missing_internal`
when a private name it needs is not there, so every such failure reads the same way.

>>> require_version("torch", "2.13.0+cpu")
>>> require_version("jax", "0.4.30")
Traceback (most recent call last):
...
mpx.errors.FrameworkVersionError: jax 0.4.30 is older than mpx supports (jax >= 0.10.2, the version its tests run); upgrade jax
>>> print(missing_internal("torch", "2.13.0", "torch._amp_foreach_non_finite_check_and_unscale_", "GradScaler.unscale_"))
torch 2.13.0 has no torch._amp_foreach_non_finite_check_and_unscale_, which mpx uses for GradScaler.unscale_; mpx is tested with torch >= 2.13.0: report this with the torch version
"""

from __future__ import annotations

import re

from mpx.errors import FrameworkVersionError

__all__ = ["MINIMUM_VERSIONS", "missing_internal", "parse_version", "require_version"]

#: The oldest version of each framework mpx supports: the versions its CI runs (pyproject.toml's
#: extras declare the same floors; tests/core/test_versions.py checks that they agree).
MINIMUM_VERSIONS: dict[str, str] = {
    "torch": "2.13.0",
    "tensorflow": "2.21.0",
    "keras": "3.15.0",
    "jax": "0.10.2",
    "flax": "0.12.8",
    "optax": "0.2.8",
    "orbax-checkpoint": "0.12.8",  # mpx_jax.orbax
    # the training libraries mpx_torch.lightning / .accelerate / .transformers integrate with
    "lightning": "2.6.6",
    "accelerate": "1.16",
    "transformers": "5.25",
}


def parse_version(version: str) -> tuple[int, ...]:
    """The leading numeric release of a version string: ``"2.13.0+cpu"`` -> ``(2, 13, 0)``."""
    match = re.match(r"\d+(\.\d+)*", str(version).strip())
    if match is None:
        raise FrameworkVersionError(f"cannot read a version number from {version!r}")
    return tuple(int(part) for part in match.group(0).split("."))


def require_version(framework: str, installed: str) -> None:
    """Raise :class:`mpx.FrameworkVersionError` when ``installed`` is below ``MINIMUM_VERSIONS[framework]``."""
    minimum = MINIMUM_VERSIONS[framework]
    if parse_version(installed) < parse_version(minimum):
        raise FrameworkVersionError(
            f"{framework} {installed} is older than mpx supports ({framework} >= {minimum}, the version its "
            f"tests run); upgrade {framework}"
        )


def missing_internal(framework: str, installed: str, name: str, used_for: str) -> FrameworkVersionError:
    """The error for a framework internal (``name``) that ``installed`` lacks or changed; raise it."""
    return FrameworkVersionError(
        f"{framework} {installed} has no {name}, which mpx uses for {used_for}; mpx is tested with "
        f"{framework} >= {MINIMUM_VERSIONS[framework]}: report this with the {framework} version"
    )
