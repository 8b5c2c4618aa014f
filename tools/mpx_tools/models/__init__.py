"""The models of the conformance ``models`` group (also timed by ``mpx bench``): real model code (Hugging
Face Transformers) built from tiny configs, natively and under mpx.

Each model (GPT-2, Llama, BERT, T5, ViT; random weights, nothing downloaded) is one set of cases,
one per aspect (:data:`ASPECTS`).  A backend's models module (``mpx_tools.models.torch``) builds
the models and observes each aspect in both modes; natively the framework's own autocast runs,
under mpx the prepared model.  What is measured is deterministic: dtypes, graph counts, the scale
trace, bytes; the logits' error is a number checked against a bound.
"""

from __future__ import annotations

#: The models, in report order.
MODELS = ("gpt2", "llama", "bert", "t5", "vit")
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
