"""The one category table (mpx.categories): its shape, and the two rules every backend follows.

Each backend's own test resolves the table against the real framework (tests/<backend>/test_surface.py),
so a class name that a framework renames fails there.
"""

import types

import pytest

import mpx
from mpx.categories import CATEGORY_CLASSES, category_of, resolve_categories


@pytest.mark.parametrize("backend", sorted(CATEGORY_CLASSES))
def test_every_backend_lists_every_category(backend):
    assert tuple(CATEGORY_CLASSES[backend]) == mpx.CATEGORIES
    assert CATEGORY_CLASSES[backend]["normalization"], "every framework has normalization layers"


def test_missing_names_are_left_out_and_mpx_category_wins():
    class Norm:
        pass

    class Loss(Norm):
        mpx_category = "loss"

    root = types.SimpleNamespace(LayerNorm=Norm, sub=types.SimpleNamespace(Soft=int))
    classes = resolve_categories(
        {"normalization": ("LayerNorm", "Nope.Deeper"), "softmax": ("sub.Soft",)}, root
    )
    assert classes == {"normalization": (Norm,), "softmax": (int,), "loss": ()}
    assert category_of(Norm(), classes) == "normalization"
    assert category_of(Loss(), classes) == "loss"  # its own attribute wins over the class table
    assert category_of(object(), classes) is None


def test_a_bad_mpx_category_names_the_layer_and_the_allowed_values():
    class Odd:
        mpx_category = "attention"
        name = "block.attn"

    with pytest.raises(
        mpx.PolicyError,
        match=r"block.attn: mpx_category 'attention' is not a category; allowed: normalization, softmax, loss",
    ):
        category_of(Odd(), resolve_categories("torch", types.SimpleNamespace()))
