"""The models of the conformance ``models`` group (also timed by ``mpx bench``): real model code built
from tiny configs, natively and under mpx, in every column.

Each model (random weights, nothing downloaded) is one set of cases, one per aspect (:data:`ASPECTS`);
:data:`COLUMNS` says which columns run it and with which code: Hugging Face Transformers' GPT-2, Llama,
BERT, T5 and ViT on torch (``mpx_tools.models.torch``); keras-hub's GPT2, Llama and Bert backbones on
Keras (``mpx_tools.models.keras``: the ``tf``, ``keras-jax`` and ``keras-torch`` columns); a Flax NNX
GPT and a linen ResNet on JAX (``mpx_tools.models.flax``), and keras-hub's GPT2 on JAX through
``mpx_jax.autocast`` (``mpx_tools.models.keras_on_jax``).  A column skips a model it has no code for,
saying which columns run it.  Each backend's module observes every aspect in both modes; natively the
framework's own mixed precision runs, under mpx mpx's.  What is measured is deterministic: dtypes, trace
or graph counts, the scale trace, bytes; the logits' error is a number checked against a bound.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mpx_tools.skip import Skip

#: The models, in report order.
MODELS = ("gpt2", "llama", "bert", "t5", "vit", "nnx_gpt", "resnet", "keras_gpt2")
KERAS_COLUMNS = ("tf", "keras-jax", "keras-torch")
#: model -> the columns that run it, and with what (the report's words)
COLUMNS: dict[str, dict[str, str]] = {
    "gpt2": {"torch": "HF GPT2LMHeadModel", **dict.fromkeys(KERAS_COLUMNS, "keras-hub GPT2Backbone")},
    "llama": {"torch": "HF LlamaForCausalLM", **dict.fromkeys(KERAS_COLUMNS, "keras-hub LlamaBackbone")},
    "bert": {"torch": "HF BertForMaskedLM", **dict.fromkeys(KERAS_COLUMNS, "keras-hub BertBackbone")},
    "t5": {"torch": "HF T5ForConditionalGeneration"},
    "vit": {"torch": "HF ViTForImageClassification"},
    "nnx_gpt": {"jax": "a Flax NNX GPT (mpx_tools.models.flax.MiniGPT)"},
    "resnet": {"jax": "a Flax linen ResNet (mpx_tools.models.flax.ResNet)"},
    "keras_gpt2": {"jax": "keras-hub GPT2Backbone (Keras on jax) through mpx_jax.autocast; natively Keras's mixed "
                          "policy (mpx_tools.models.keras_on_jax)"},
}



def models_of(column: str) -> tuple[str, ...]:
    """The models ``column`` runs (``"torch"``: the Hugging Face ones), in report order."""
    return tuple(m for m in MODELS if column in COLUMNS[m])


#: What is observed per model (case id ``models.<model>.<aspect>``).
ASPECTS = ("ops", "compile", "overflow", "logits", "activations")
#: The policy of the ops, compile, logits and activations aspects (CPU autocast's native half dtype).
POLICY = "mixed_bfloat16"
#: The overflow aspect's policy, scaler config and steps: an inf enters the loss at step 2 (of 6).
OVERFLOW_POLICY = "mixed_float16"
OVERFLOW_CONFIG = {"init_scale": 2.0**10, "growth_interval": 2}
OVERFLOW_FLAGS = [True, True, False, True, True, True]
#: The logits' bound: max |logits - float32 logits| <= LOGITS_TOL * max |float32 logits| (8 bfloat16 eps).
LOGITS_TOL = 8 * 2.0**-7
#: Saved-activation bytes under mpx at most this many times native autocast's (issue 23, item 6).
ACTIVATION_RATIO = 1.05
#: The columns whose native mixed precision keeps the same ops in float32 as mpx (torch.autocast: softmax,
#: norms and losses): the activations bound is ACTIVATION_RATIO x native there.  Keras's policies and
#: Flax's ``dtype`` compute softmax and norm outputs in half, which mpx keeps in float32 (the op table): the
#: bytes those outputs add are the precision contract's, not mpx's overhead, so the bound there is float32's
#: bytes (mixed precision keeps less than float32), the ratio to native reported beside it.
SAME_CONTRACT_AS_NATIVE = ("torch",)


def check_column(column: str, model: str) -> None:
    """Raise :class:`Skip` when ``column`` has no code for ``model``, naming the columns that run it."""
    runs = COLUMNS.get(model)
    if runs is None:
        raise KeyError(f"no model {model!r}; models: {', '.join(MODELS)}")
    if column not in runs:
        where = "; ".join(f"{c}: {what}" for c, what in runs.items())
        raise Skip(f"{model} is not in the {column} column's models (it runs in {where})")


def residual_bytes(fn: Callable[..., Any], *args: Any) -> int:
    """The bytes ``jax.vjp(fn, *args)`` keeps for backward: its residuals that are not ``args``' own arrays
    (read from the traced jaxpr, each variable once), the closed-over constants excluded."""
    import jax
    import numpy as np

    def residuals(*a: Any) -> list:
        return jax.tree_util.tree_leaves(jax.vjp(fn, *a)[1])

    closed = jax.make_jaxpr(residuals)(*args)
    inputs_ = set(map(id, closed.jaxpr.invars)) | set(map(id, closed.jaxpr.constvars))
    seen: dict[int, int] = {}
    for var in closed.jaxpr.outvars:
        if hasattr(var, "aval") and id(var) not in inputs_ and not hasattr(var, "val"):
            seen[id(var)] = int(np.prod(var.aval.shape, dtype=np.int64)) * var.aval.dtype.itemsize
    return sum(seen.values())


def activation_verdict(column: str, mine: int, native: int, float32: int) -> dict:
    """The activations aspect's figures and verdict for ``column``: ``mine`` bytes (this mode's), ``native``
    and ``float32`` bytes; ``within_ratio`` against :data:`ACTIVATION_RATIO` x native in the columns of
    :data:`SAME_CONTRACT_AS_NATIVE`, against float32's bytes elsewhere (``bound`` says which)."""
    same = column in SAME_CONTRACT_AS_NATIVE
    limit = ACTIVATION_RATIO * native if same else float32
    return {"bytes": mine, "native_bytes": native, "float32_bytes": float32,
            "ratio_to_native": round(mine / native, 4), "ratio_to_float32": round(mine / float32, 4),
            "bound": f"{ACTIVATION_RATIO:g} x native" if same else "1 x float32", "within_ratio": mine <= limit}  # fmt: skip
