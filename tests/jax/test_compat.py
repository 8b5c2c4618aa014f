"""mpx_jax._compat: every JAX internal behind one gate; a missing one gives the one clear error (#22)."""

import jax
import jax.numpy as jnp
import optax
import pytest

import mpx
import mpx_jax
from mpx_jax import _compat


def test_old_jax_is_refused_with_the_version_error():
    with pytest.raises(mpx.FrameworkVersionError, match=r"jax 0\.4\.30 is older than mpx supports"):
        mpx.versions.require_version("jax", "0.4.30")


@pytest.mark.parametrize(
    ("owner", "name", "qualname"),
    [(jax, "typeof", "jax.typeof"), (jax.lax, "pcast", "jax.lax.pcast")],
    ids=["typeof", "pcast"],
)
def test_accumulation_under_a_jax_without_an_internal_names_it(monkeypatch, owner, name, qualname):
    """Mutation: take the internal away; the accumulation step says which one, through missing_internal."""
    tx = mpx_jax.with_loss_scaling(optax.sgd(0.1), accumulate=2)
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    monkeypatch.delattr(owner, name)
    with pytest.raises(mpx.FrameworkVersionError, match=f"has no {qualname}, which mpx uses for") as info:
        if name == "pcast":  # pcast is called only when a branch varies over an axis the other does not
            _compat.pcast_to_varying(jnp.ones(2), ("x",))
        else:
            tx.update({"w": jnp.ones(3)}, state, params)
    assert f"jax {jax.__version__}" in str(info.value)
    assert isinstance(info.value, ImportError)


def test_mapped_axes_without_manual_axes_names_it(monkeypatch):
    monkeypatch.delattr(jax.sharding, "get_abstract_mesh")
    with pytest.raises(mpx.FrameworkVersionError, match="jax.sharding.get_abstract_mesh.*replica agreement"):
        mpx_jax.mapped_axes()


def test_mapped_axes_lets_an_unexpected_failure_surface(monkeypatch):
    """It used to return () on any exception, silently turning replica agreement off."""

    def broken():
        raise RuntimeError("mesh context corrupted")

    monkeypatch.setattr(jax.sharding, "get_abstract_mesh", broken)
    with pytest.raises(RuntimeError, match="mesh context corrupted"):
        mpx_jax.mapped_axes()
    with pytest.raises(RuntimeError, match="mesh context corrupted"):
        mpx_jax.combine_finite(jnp.asarray(True))


def test_mapped_axes_reads_the_bound_axes():
    assert mpx_jax.mapped_axes() == ()
    seen = []

    def body(x):
        seen.append(mpx_jax.mapped_axes())
        return x

    jax.vmap(body, axis_name="v")(jnp.ones(2))  # a named vmap axis is not a mapped (manual) axis
    assert seen == [()]


def test_varying_axes_reads_the_manual_axis_type(monkeypatch):
    assert _compat.varying_axes(jnp.ones(2)) == frozenset()
    monkeypatch.delattr(type(jax.typeof(jnp.ones(2))), "manual_axis_type")
    with pytest.raises(mpx.FrameworkVersionError, match="ShapedArray.manual_axis_type"):
        _compat.varying_axes(jnp.ones(2))


def test_no_private_jax_access_outside_compat():
    """The loss-scaling modules reach JAX internals only through _compat (code, not docstrings)."""
    import ast
    import inspect

    from mpx_jax import distributed, history, loss_scale, transform

    forbidden = {"typeof", "pcast", "manual_axis_type", "manual_axes", "get_abstract_mesh", "_src", "vma"}
    for module in (transform, distributed, loss_scale, history):
        tree = ast.parse(inspect.getsource(module))
        used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names
                    if n.module and n.module.startswith("jax")}  # fmt: skip
        assert not (used | imported) & forbidden, (module.__name__, (used | imported) & forbidden)


def test_get_loss_scale_under_a_flax_without_nnx_optimizer_names_it(monkeypatch):
    nnx = pytest.importorskip("flax.nnx")
    state = mpx_jax.with_loss_scaling(optax.sgd(0.1)).init({"w": jnp.ones(2)})
    assert mpx_jax.get_loss_scale(state).get_scale() == 65536.0
    monkeypatch.delattr(nnx, "Optimizer")
    with pytest.raises(mpx.FrameworkVersionError, match="has no flax.nnx.Optimizer, which mpx uses for"):
        mpx_jax.get_loss_scale(state)


def test_an_old_flax_is_refused_when_first_used(monkeypatch):
    flax = pytest.importorskip("flax")
    monkeypatch.setattr(_compat, "_FLAX_CHECKED", False)
    monkeypatch.setattr(flax, "__version__", "0.10.0")
    state = mpx_jax.with_loss_scaling(optax.sgd(0.1)).init({"w": jnp.ones(2)})
    with pytest.raises(mpx.FrameworkVersionError, match=r"flax 0\.10\.0 is older than mpx supports"):
        mpx_jax.get_loss_scale(state)


def test_the_skip_under_a_jax_without_its_call_primitive_names_it(monkeypatch):
    from jax.extend.core import primitives

    assert _compat._inline_call_primitives() == {"jit", "closed_call"}
    monkeypatch.delattr(primitives, "jit_p")
    with pytest.raises(
        mpx.FrameworkVersionError, match="jax.extend.core.primitives.jit_p.*with_loss_scaling"
    ):
        _compat._inline_call_primitives()
