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
from collections.abc import Iterable
from typing import Any

import jax
import optax

from mpx.versions import missing_internal, require_version

require_version("jax", jax.__version__)
require_version("optax", optax.__version__)

__all__ = [
    "AUTOCAST_PRIMITIVES",
    "INLINE_CALL_PRIMITIVES",
    "Jaxpr",
    "bind_params",
    "check_autocast_primitives",
    "eqn_context_manager",
    "function_name",
    "name_scopes",
    "param",
    "softmax_custom_jvp",
    "summarize_source",
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


def _inline_call_primitives() -> frozenset[str]:
    from jax.extend.core import primitives

    used_for = "with_loss_scaling's skip (state computed inside a jit call)"
    names = frozenset(
        _attr(_attr(primitives, attr, f"jax.extend.core.primitives.{attr}", used_for), "name", attr, used_for)
        for attr in ("jit_p", "closed_call_p")
    )
    if names != {"jit", "closed_call"}:
        raise _missing(f"the call primitives named 'jit' and 'closed_call' (found {sorted(names)})", used_for)
    return names


#: Call primitives whose body with_loss_scaling's skip runs inline (their jaxpr is in ``params["jaxpr"]``).
INLINE_CALL_PRIMITIVES = _inline_call_primitives()


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


# -- autocast and find_nonfinite: jaxpr interpretation ---------------------------------------------------

try:
    from jax.extend.core import Jaxpr
    from jax.extend.core import primitives as _primitives
except ImportError as exc:  # pragma: no cover - jax.extend.core is public since jax 0.4.30
    raise _missing("jax.extend.core.Jaxpr/primitives", "autocast") from exc

#: The primitives autocast handles by name (its rules and its control flow), each with the
#: ``jax.extend.core.primitives`` attribute that must carry that name.
AUTOCAST_PRIMITIVES: dict[str, str] = {
    "dot_general": "dot_general_p",
    "conv_general_dilated": "conv_general_dilated_p",
    "convert_element_type": "convert_element_type_p",
    "custom_jvp_call": "custom_jvp_call_p",
    "custom_vjp_call": "custom_vjp_call_p",
    "scan": "scan_p",
    "while": "while_p",
    "cond": "cond_p",
    "remat2": "remat_p",
    "jit": "jit_p",
    "closed_call": "closed_call_p",
}


def check_autocast_primitives(names: Iterable[str] = ()) -> None:
    """Check that every primitive autocast matches by name still has that name in this JAX.

    The primitives of :data:`AUTOCAST_PRIMITIVES` are checked against their ``jax.extend.core.primitives``
    attribute, and each of ``names`` (the op rules' tables) must be the name of one of those primitives.
    A renamed primitive (``pjit`` became ``jit`` in jax 0.7) would otherwise silently fall out of the op
    table: autocast would run it at its traced dtypes.
    """
    used_for = "autocast's op rules"
    for name, attr in AUTOCAST_PRIMITIVES.items():
        prim = getattr(_primitives, attr, None)
        if getattr(prim, "name", None) != name:
            raise _missing(f"jax.extend.core.primitives.{attr} named {name!r}", used_for)
    known = {getattr(getattr(_primitives, a), "name", None) for a in dir(_primitives) if a.endswith("_p")}
    for name in sorted(set(names) - known):
        raise _missing(f"a primitive named {name!r} in jax.extend.core.primitives", used_for)


def param(eqn: Any, key: str) -> Any:
    """``eqn.params[key]``, or the one version error naming the primitive's missing parameter."""
    try:
        return eqn.params[key]
    except KeyError:
        raise _missing(f"the {key!r} parameter of the {eqn.primitive.name} primitive", "autocast") from None


def bind_params(eqn: Any, params: dict[str, Any]) -> dict[str, Any]:
    """``eqn.primitive.get_bind_params(params)``: the keyword arguments ``bind`` takes for ``params``."""
    used_for = "binding one jaxpr equation (autocast, with_loss_scaling's skip, find_nonfinite)"
    get = _attr(eqn.primitive, "get_bind_params", "Primitive.get_bind_params", used_for)
    out = get(params)
    if not isinstance(out, dict):  # jax < 0.7 returned (subfuns, params)
        raise _missing("Primitive.get_bind_params returning a dict", used_for)
    return out


def eqn_context_manager(eqn: Any) -> Any:
    """The context manager ``eqn`` was traced under (``eqn.ctx.manager``: a name scope, a mesh), or None."""
    ctx = _attr(eqn, "ctx", "JaxprEqn.ctx", "running an equation in the context it was traced in")
    return _attr(ctx, "manager", "JaxprEqnContext.manager", "running an equation in the context it was traced in")


def name_scopes(source_info: Any) -> tuple[tuple[str, str], ...]:
    """``(kind, name)`` of each entry of an equation's name stack (``"Scope"``/``"Transform"``)."""
    used_for = "an equation's name stack (autocast's float32 regions, find_nonfinite's paths)"
    stack = _attr(source_info, "name_stack", "SourceInfo.name_stack", used_for)
    entries = _attr(stack, "stack", "NameStack.stack", used_for)
    return tuple((type(e).__name__, str(_attr(e, "name", "NameStack entry .name", used_for))) for e in entries)


def summarize_source(source_info: Any) -> str:
    """``file:line (function)`` of an equation: ``jax._src.source_info_util.summarize``."""
    used_for = "find_nonfinite's source lines"
    try:
        from jax._src import source_info_util
    except ImportError as exc:
        raise _missing("jax._src.source_info_util", used_for) from exc
    return _attr(source_info_util, "summarize", "jax._src.source_info_util.summarize", used_for)(source_info)


def softmax_custom_jvp(enabled: bool) -> Any:
    """``jax.softmax_custom_jvp(enabled)``: a context in which ``jax.nn.softmax`` traces as a named call."""
    return _attr(jax, "softmax_custom_jvp", "jax.softmax_custom_jvp", "autocast of softmax by name")(enabled)


def function_name(eqn: Any) -> str | None:
    """The name JAX kept on a call equation: ``jit``'s ``name`` parameter, or the function a
    ``custom_jvp``/``custom_vjp`` body was traced from (``call_jaxpr.jaxpr.debug_info.func_src_info``,
    ``"_softmax at .../functions.py:614"`` -> ``"_softmax"``); None for an anonymous one."""
    name = eqn.params.get("name")
    if isinstance(name, str):
        return name
    call = eqn.params.get("call_jaxpr")
    if call is None:
        return None
    used_for = "autocast's classes of named functions (jax.nn.softmax...)"
    jaxpr = call.jaxpr if isinstance(call, ClosedJaxpr) else call
    info = _attr(jaxpr, "debug_info", "Jaxpr.debug_info", used_for)
    if info is None:
        return None
    src = _attr(info, "func_src_info", "DebugInfo.func_src_info", used_for)
    return src.split(" at ", 1)[0].strip() if isinstance(src, str) and src else None
