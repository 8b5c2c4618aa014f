"""Every JAX, optax and Flax internal mpx_jax uses, behind one version gate.

Importing this module checks that jax and optax are at least the versions mpx is
tested with (:data:`mpx.versions.MINIMUM_VERSIONS`) and raises
:class:`mpx.FrameworkVersionError` otherwise; Flax is checked the first time a
function here needs it.  Each internal (an attribute JAX does not document, a
primitive name, a ``jax._src`` module) is looked up here, when it is used, and a
missing one raises :func:`mpx.versions.missing_internal`'s error naming it and
what mpx needs it for.  No fallback changes behaviour silently.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import optax

from mpx.versions import missing_internal, require_version

require_version("jax", jax.__version__)
require_version("optax", optax.__version__)

__all__ = [
    "INLINE_CALL_PRIMITIVES",
    "ClosedJaxpr",
    "Literal",
    "manual_axes",
    "nnx_if_loaded",
    "pcast_to_varying",
    "typeof",
    "varying_axes",
]


def _missing(name: str, used_for: str) -> Exception:
    return missing_internal("jax", jax.__version__, name, used_for)


def _attr(obj: Any, name: str, qualname: str, used_for: str) -> Any:
    """``getattr(obj, name)``, or the one version error naming ``qualname``."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise _missing(qualname, used_for) from None


# -- loss scaling: the skip interpreter, accumulation under shard_map, replica agreement ----------------

try:
    from jax.extend.core import ClosedJaxpr, Literal
except ImportError as exc:  # pragma: no cover - jax.extend.core is public since jax 0.4.30
    raise _missing("jax.extend.core.ClosedJaxpr/Literal", "with_loss_scaling's skip") from exc

#: Call primitives whose body with_loss_scaling's skip runs inline (their jaxpr is in ``params["jaxpr"]``).
INLINE_CALL_PRIMITIVES = frozenset({"jit", "pjit", "closed_call", "core_call"})


def typeof(x: Any) -> Any:
    """The abstract value (``ShapedArray``) of ``x``: ``jax.typeof``."""
    return _attr(jax, "typeof", "jax.typeof", "the mapped axes a value varies over (accumulate=k)")(x)


def varying_axes(x: Any) -> frozenset:
    """The ``shard_map`` axes ``x`` (a value or an abstract value) varies over; empty outside shard_map.

    Read from ``aval.manual_axis_type.varying`` (jax 0.10).
    """
    used_for = "the mapped axes a value varies over (accumulate=k under shard_map)"
    shaped = _attr(jax.core, "ShapedArray", "jax.core.ShapedArray", used_for)
    aval = x if isinstance(x, shaped) else typeof(x)
    mat = _attr(aval, "manual_axis_type", "ShapedArray.manual_axis_type", used_for)
    return frozenset(_attr(mat, "varying", "ShapedArray.manual_axis_type.varying", used_for))


def pcast_to_varying(x: Any, axes: tuple[Any, ...]) -> Any:
    """``x`` cast to vary over ``axes`` as well (``lax.pcast(..., to="varying")``; values unchanged)."""
    pcast = _attr(jax.lax, "pcast", "jax.lax.pcast", "accumulate=k under shard_map")
    return pcast(x, axes, to="varying")


def manual_axes() -> tuple[Any, ...]:
    """The manual (mapped) axis names bound where this is traced: ``get_abstract_mesh().manual_axes``."""
    used_for = "replica agreement (mapped_axes)"
    get_mesh = _attr(jax.sharding, "get_abstract_mesh", "jax.sharding.get_abstract_mesh", used_for)
    mesh = get_mesh()
    return tuple(_attr(mesh, "manual_axes", "AbstractMesh.manual_axes", used_for) or ())


# -- Flax NNX: read and write the loss scale held in nnx.Optimizer / OptArray variables ------------------

_FLAX_CHECKED = False


def nnx_if_loaded() -> Any:
    """``flax.nnx`` when Flax is imported (version-checked once), else None: without Flax imported no
    NNX object can exist, so mpx_jax never imports Flax itself."""
    global _FLAX_CHECKED
    if "flax" not in sys.modules:
        return None
    import flax
    from flax import nnx

    if not _FLAX_CHECKED:
        require_version("flax", flax.__version__)
        _FLAX_CHECKED = True
    for name in ("Optimizer", "Variable"):
        if not hasattr(nnx, name):
            raise missing_internal("flax", flax.__version__, f"flax.nnx.{name}", "get_loss_scale")
    return nnx
