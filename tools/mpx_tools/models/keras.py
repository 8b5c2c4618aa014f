"""The ``models`` group on Keras 3 (the ``tf``, ``keras-jax`` and ``keras-torch`` columns): keras-hub's
Bert, GPT2 and Llama backbones from tiny constructor arguments, Keras's own dtype policies against mpx_keras.

:func:`observe` measures one aspect (:data:`mpx_tools.models.ASPECTS`) in one mode on the backend this
process runs Keras on.  Natively the backbone is built under Keras's policy of the case's name
(``keras.config.set_dtype_policy``) and trained with ``keras.optimizers.LossScaleOptimizer``; under mpx it
is built in ``mpx_keras.policy_scope`` and given the policy by ``apply_policy`` (``mpx_tf`` on TensorFlow),
and trained with mpx's ``LossScaleOptimizer``.  Every model is given the float32 reference's weights.

- ops: the dtype each matmul, softmax and norm computed in, read from the backend (the jaxpr on jax, a
  ``TorchDispatchMode`` on torch, the traced graph on TensorFlow); a softmax or norm in half is a violation;
- compile: traces over two calls of the forward (``jax.jit``, ``tf.function``); on torch
  ``torch.compile(fullgraph=True)`` of the first transformer block (dynamo cannot trace the backbone's own
  Functional call in one graph, natively either: :data:`WHOLE_BACKBONE_BREAKS`);
- overflow: :data:`mpx_tools.models.OVERFLOW_FLAGS` AdamW steps in float16 with an inf in the loss;
- logits: max |output - float32 output| (the backbone's sequence output: keras-hub's backbones have no head);
- activations: the bytes kept for backward: ``jax.vjp``'s residuals (jax), the tensors autograd saves
  (torch); TensorFlow has no such figure (the case says so).

Native paths import nothing of mpx: a case's params carry what they need of the core.  The adapter's hooks
(``value_and_grad``, ``apply``, ``optimizer``, ``current_scale``: conformance/adapters/keras.py) take the
training steps, as in the scaler cases.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from mpx_tools import models as M
from mpx_tools.skip import Skip

VOCAB, SEQ, BATCH = 16, 8, 2
#: model -> keras-hub backbone class and its tiny constructor arguments (one layer: compiling is the time)
BACKBONES: dict[str, tuple[str, dict]] = {
    "bert": ("BertBackbone", {"num_heads": 2, "max_sequence_length": 16}),
    "gpt2": ("GPT2Backbone", {"num_heads": 2, "max_sequence_length": 16}),
    "llama": ("LlamaBackbone", {"num_query_heads": 2, "num_key_value_heads": 1}),
}
#: dropout 0.1 (off in the calls here, which are not training): Keras's attention then computes its scores
#: with its own einsums, not its fused kernel, whose float16 x float16 -> float32 dot XLA:CPU cannot compile
SIZES = {"vocabulary_size": VOCAB, "num_layers": 1, "hidden_dim": 16, "intermediate_dim": 16, "dropout": 0.1}
#: kind -> the backend's op names (as tests/keras/_op_dtypes.py): what the ops aspect reads
KINDS: dict[str, dict[str, tuple[str, ...]]] = {
    "matmul": {"jax": ("dot_general",), "torch": ("mm", "bmm", "addmm", "baddbmm", "matmul", "einsum"),
               "tensorflow": ("MatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum")},
    # jax.nn.softmax is reduce_max, exp, sum, div: these backbones have no other exp
    "softmax": {"jax": ("exp",), "torch": ("_softmax", "_log_softmax"), "tensorflow": ("Softmax", "LogSoftmax")},
    "norm": {"jax": ("rsqrt",), "torch": ("rsqrt", "native_layer_norm"), "tensorflow": ("Rsqrt",)},
}  # fmt: skip
HALF = ("float16", "bfloat16")
#: why the tf column skips the activations aspect
NO_BYTES_ON_TF = ("TensorFlow has no public figure of the tensors a GradientTape keeps for backward (no "
                  "saved-tensor hooks, no vjp residuals to read): the activations aspect runs in the keras-jax "
                  "and keras-torch columns")  # fmt: skip


def backend() -> str:
    return keras.config.backend()


def _keras_hub() -> Any:
    try:
        return importlib.import_module("keras_hub")
    except ImportError as err:
        raise Skip(f"keras-hub is not installed ({err}); pip install keras-hub") from None


def _mpx() -> Any:
    """mpx_keras (mpx_tf on TensorFlow: the same API plus tf.*), imported on mpx paths only."""
    return importlib.import_module("mpx_tf" if backend() == "tensorflow" else "mpx_keras")


def keras_policy(params: dict, key: str = "policy_dtypes") -> str:
    """Keras's policy for the case's mpx policy: ``mixed_<compute>`` (the models group's policies are mixed)."""
    return f"mixed_{params[key]['compute_dtype']}"


def _backbone(name: str) -> keras.Model:
    cls, args = BACKBONES[name]
    return getattr(_keras_hub().models, cls)(**SIZES, **args)


def inputs(name: str, batch: int = BATCH, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = {"token_ids": rng.integers(1, VOCAB, (batch, SEQ)).astype("int32"),
         "padding_mask": np.ones((batch, SEQ), "int32")}  # fmt: skip
    if name == "bert":
        x["segment_ids"] = np.zeros((batch, SEQ), "int32")
    return x


#: what one worker process built, kept for the next aspect: (kind, model, mode, policy) -> object
_CACHE: dict[tuple, Any] = {}


def _cached(key: tuple, make: Callable[[], Any]) -> Any:
    if key not in _CACHE:
        _CACHE[key] = make()
    return _CACHE[key]


def reference(name: str, seed: int = 0) -> keras.Model:
    """The float32 backbone, random weights from ``seed`` (one per process and model)."""

    def make() -> keras.Model:
        keras.utils.set_random_seed(seed)
        return _backbone(name)

    return _cached(("reference", name, seed), make)


def model_for(name: str, mode: str, policy: str) -> keras.Model:
    """The backbone of ``mode`` under ``policy`` with the reference's weights (one per process; the aspects
    that train build their own)."""
    return _cached(
        ("model", name, mode, policy), lambda: build(name, mode, policy, reference(name).get_weights())
    )


def build(name: str, mode: str, policy: str, weights: list[np.ndarray] | None = None) -> keras.Model:
    """The backbone natively under Keras's ``policy`` or under mpx (``mode="mpx"``), with ``weights``."""
    if mode == "mpx":
        mpx = _mpx()
        with mpx.policy_scope(policy):
            model = _backbone(name)
        mpx.apply_policy(model, policy)
    else:
        keras.config.set_dtype_policy(policy)
        try:
            model = _backbone(name)
        finally:
            keras.config.set_dtype_policy("float32")
    if weights is not None:
        model.set_weights(weights)
    return model


def sequence_output(out: Any) -> Any:
    return out["sequence_output"] if isinstance(out, dict) else out


def _numpy(x: Any) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(x, "float32")))


# -- which ops computed in which dtype ---------------------------------------------------------------
def _float(dtypes: Any) -> tuple[str, ...]:
    return tuple(d for d in dtypes if d in ("float16", "bfloat16", "float32", "float64"))


def record(fn: Callable[..., Any], *args: Any) -> list[tuple[str, tuple[str, ...]]]:
    """(kind of :data:`KINDS`, floating input dtypes) of every such op ``fn(*args)`` computes, in order."""
    kinds = {n: k for k, names in KINDS.items() for n in names[backend()]}
    found: list[tuple[str, tuple[str, ...]]] = []
    if backend() == "jax":
        import jax

        def walk(jaxpr: Any) -> None:
            for eqn in jaxpr.eqns:
                if eqn.primitive.name in kinds:
                    found.append((kinds[eqn.primitive.name], _float(str(v.aval.dtype) for v in eqn.invars)))
                for param in eqn.params.values():
                    for sub in param if isinstance(param, (list, tuple)) else (param,):
                        inner = getattr(sub, "jaxpr", sub)
                        if hasattr(inner, "eqns"):
                            walk(inner)

        walk(jax.make_jaxpr(fn)(*args).jaxpr)
    elif backend() == "torch":
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        class Recorder(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
                kind = kinds.get(func.overloadpacket.__name__)
                if kind is not None:
                    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
                    found.append((kind, _float(str(t.dtype).removeprefix("torch.") for t in leaves
                                               if isinstance(t, torch.Tensor))))  # fmt: skip
                return func(*args, **(kwargs or {}))

        with torch.no_grad(), Recorder():
            fn(*args)
    else:
        import tensorflow as tf

        graph = tf.function(fn).get_concrete_function(*args).graph
        for op in graph.get_operations():
            if op.type in kinds:
                found.append((kinds[op.type], _float(t.dtype.name for t in op.inputs)))
    return found


def _forward(model: keras.Model, x: dict) -> tuple[Callable[..., Any], tuple]:
    """``(fn, args)``: the model's forward as the backend's recorder and tracer take it."""
    if backend() == "jax":
        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        return (lambda t, n, x: model.stateless_call(t, n, x)[0]), (trainable, non_trainable, x)
    if backend() == "tensorflow":
        import tensorflow as tf

        return (lambda x: model(x)), ({k: tf.TensorSpec(v.shape, v.dtype) for k, v in x.items()},)
    return (lambda x: model(x)), (x,)


def op_dtypes(model: keras.Model, name: str, x: dict, keep_float32: list[str]) -> dict:
    """Per kind the dtypes it computed in and how often; a softmax or norm (a FLOAT32 op of the table:
    ``keep_float32``) computed in half is a violation."""
    norm = "rms_norm" if name == "llama" else "layer_norm"
    table_op = {"matmul": "matmul", "softmax": "softmax", "norm": norm}
    computed: dict[str, dict[str, int]] = {}
    violations = set()
    fn, args = _forward(model, x)
    for kind, dtypes in record(fn, *args):
        op = table_op[kind]
        dtype = dtypes[0] if dtypes else "float32"
        per = computed.setdefault(op, {})
        per[dtype] = per.get(dtype, 0) + 1
        if dtype in HALF and op in keep_float32:
            violations.add(op)
    return {"computed": {op: dict(sorted(v.items())) for op, v in sorted(computed.items())},
            "half": sorted(op for op, v in computed.items() if set(v) & set(HALF)),
            "float32": sorted(op for op, v in computed.items() if "float32" in v),
            "violations": sorted(violations)}  # fmt: skip


# -- compile -------------------------------------------------------------------------------------------
def compile_counts(model: keras.Model, x: dict, calls: int = 2) -> dict:
    """Traces (jax.jit, tf.function) or graphs and breaks (torch.compile(fullgraph=True)) over ``calls``."""
    if backend() == "torch":
        return _torch_compile_counts(model, x, calls)
    traces: list[int] = []
    fn, args = _forward(model, x)
    if backend() == "jax":
        import jax

        def traced(*a: Any) -> Any:
            traces.append(1)
            return fn(*a)

        compiled = jax.jit(traced)
        outs = [compiled(*args) for _ in range(calls)]
        _CACHE[("jitted", id(model))] = (model, compiled)  # the logits aspect calls it again
        tracer = "jax.jit"
    else:
        import tensorflow as tf

        def traced_tf(x: dict) -> Any:
            traces.append(1)
            return model(x)

        compiled = tf.function(traced_tf)
        outs = [compiled(x) for _ in range(calls)]
        tracer = "tf.function"
    first = _numpy(sequence_output(outs[0]))
    return {"graphs": len(traces), "breaks": 0, "fullgraph": True, "tracer": tracer, "recompiles": len(traces) - 1,
            "calls_agree": all(np.array_equal(_numpy(sequence_output(o)), first) for o in outs)}  # fmt: skip


#: why the keras-torch column compiles the backbone's first block, not the backbone
WHOLE_BACKBONE_BREAKS = ("the backbone's own call (Keras's Functional model) does not trace in one graph on "
                         "Keras's torch backend, natively either: dynamo 'Failed to trace builtin operator is_not' "
                         "with tuples, inside Keras; its first transformer block is compiled")  # fmt: skip


def _torch_compile_counts(model: keras.Model, x: dict, calls: int) -> dict:
    """``torch.compile(fullgraph=True)`` of the backbone's first transformer block (:data:`WHOLE_BACKBONE_BREAKS`)
    with dynamo's eager backend (no inductor: graphs and breaks are dynamo's), over ``calls`` calls."""
    import torch
    from torch._dynamo.utils import counters

    model(x)  # one eager call first: mpx binds a keras-hub layer at its first call, not in a trace
    block = next(layer for layer in model.layers if layer.name.startswith("transformer_layer"))
    hidden = torch.as_tensor(np.random.default_rng(1).normal(size=(BATCH, SEQ, SIZES["hidden_dim"])), dtype=torch.float32)
    graphs: list[Any] = []

    def keep(gm: Any, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(block, backend=keep, fullgraph=True)
    with torch.no_grad():
        outs = [compiled(hidden) for _ in range(calls)]
        eager = block(hidden)
    breaks = sum(counters["graph_break"].values())
    recompiles = len(graphs) - 1
    torch._dynamo.reset()
    return {"graphs": len(graphs), "breaks": breaks, "fullgraph": True, "tracer": "torch.compile (dynamo)",
            "recompiles": recompiles, "compiled": block.name, "why_a_block": WHOLE_BACKBONE_BREAKS,
            "calls_agree": all(torch.equal(o, outs[0]) for o in outs), "equals_eager": torch.equal(outs[0], eager)}


# -- a float16 run with an injected overflow ------------------------------------------------------------
def overflow_run(name: str, mode: str, params: dict, adapter: Any) -> dict:
    """:data:`mpx_tools.models.OVERFLOW_FLAGS` AdamW steps under float16 with an inf in the loss where the
    flag is False: the scale after each step, the steps skipped, and whether a skipped step left the weights
    and the optimizer's variables bit-identical.  ``adapter``: the column's (its training hooks)."""
    if backend() == "jax" and name == "llama":
        raise Skip("keras-hub's Llama always takes Keras's fused attention on jax, which asks XLA:CPU for a "
                   "float16 x float16 -> float32 dot_general that it cannot compile in a jitted train step (under "
                   "Keras's own mixed_float16 as under mpx); the tf and keras-torch columns run it")  # fmt: skip
    policy = params["policy"] if mode == "mpx" else keras_policy(params)
    model = build(name, mode, policy, reference(name).get_weights())
    x = inputs(name)
    inner = keras.optimizers.AdamW(1e-3)
    opt = adapter.optimizer(mode, params["config"], inner)
    # Llama's LM-head matrix (reverse_embeddings) is not used by the backbone's output: no gradient
    variables = [v for v in model.trainable_variables if not v.path.endswith("reverse_embeddings")]
    opt.build(variables)

    def loss_fn(poison: float) -> Any:  # every output (Bert's pooled one too: its pooler trains)
        out = model(x)
        parts = [keras.ops.mean(keras.ops.square(keras.ops.cast(o, "float32")))
                 for o in (out.values() if isinstance(out, dict) else [out])]  # fmt: skip
        return opt.scale_loss(sum(parts) * poison)

    def snapshot() -> list[bytes]:
        return [
            np.asarray(keras.ops.convert_to_numpy(v.value)).tobytes() for v in [*variables, *inner.variables]
        ]

    train = _train_step(variables, opt, loss_fn, adapter)
    scales, skipped, unchanged, losses = [], [], [], []
    for step, finite in enumerate(M.OVERFLOW_FLAGS):
        before = snapshot()
        scale = adapter.current_scale(opt)
        losses.append(float(_numpy(train(1.0 if finite else float("inf")))) / scale)
        scales.append(adapter.current_scale(opt))
        if snapshot() == before:
            skipped.append(step)
            unchanged.append(step)
    finite_losses = [v for v, f in zip(losses, M.OVERFLOW_FLAGS, strict=True) if f]
    return {"scales": scales, "skipped": skipped, "unchanged_on_skip": skipped == unchanged,
            "losses_finite": all(np.isfinite(finite_losses))}  # fmt: skip


def _train_step(
    variables: list, opt: Any, loss_fn: Callable[[Any], Any], adapter: Any
) -> Callable[[float], Any]:
    """``step(poison)``: one training step of ``variables`` (the scaled loss back); on jax one ``jax.jit`` of
    the gradient and the optimizer's ``stateless_apply`` (compiled once), elsewhere the adapter's eager hooks."""
    if backend() != "jax":

        def eager(poison: float) -> Any:
            loss, grads = adapter.value_and_grad(lambda: loss_fn(poison), variables)
            adapter.apply(opt, grads, variables)
            return loss

        return eager
    import jax

    opt_vars = list(opt.variables)

    def pure(tv: list, ov: list, poison: Any) -> tuple:
        def scaled(tv: list) -> Any:
            with keras.StatelessScope(
                state_mapping=[*zip(variables, tv, strict=True), *zip(opt_vars, ov, strict=True)]
            ):
                return loss_fn(poison)

        loss, grads = jax.value_and_grad(scaled)(tv)
        new_tv, new_ov = opt.stateless_apply(ov, grads, tv)
        return loss, new_tv, new_ov

    jitted = jax.jit(pure)

    def step(poison: float) -> Any:
        loss, tv, ov = jitted([v.value for v in variables], [v.value for v in opt_vars], np.float32(poison))
        for var, value in zip([*variables, *opt_vars], [*tv, *ov], strict=True):
            var.assign(value)
        return loss

    return step


# -- logits ------------------------------------------------------------------------------------------------
def call(model: keras.Model, x: dict) -> Any:
    """``model(x)``; on jax through one ``jax.jit`` per model (the compile aspect's, when it ran first)."""
    if backend() != "jax":
        return model(x)
    import jax

    fn, args = _forward(model, x)
    held, jitted = _CACHE.get(("jitted", id(model)), (None, None))
    if held is not model:
        jitted = jax.jit(fn)
        _CACHE[("jitted", id(model))] = (model, jitted)
    return jitted(*args)


def logits_error(name: str, mode: str, params: dict) -> dict:
    """max |output - float32 output| of ``mode`` and the bound (:data:`mpx_tools.models.LOGITS_TOL`)."""
    x = inputs(name)
    want = _numpy(sequence_output(call(reference(name), x))).astype(np.float64)
    policy = params["policy"] if mode == "mpx" else keras_policy(params)
    got = sequence_output(call(model_for(name, mode, policy), x))
    err = float(np.abs(_numpy(got).astype(np.float64) - want).max())
    scale = float(np.abs(want).max())
    return {"dtype": keras.backend.standardize_dtype(got.dtype), "max_abs_error": err, "max_abs_float32": scale,
            "within_tolerance": err <= M.LOGITS_TOL * scale}  # fmt: skip


# -- activations -------------------------------------------------------------------------------------------
def activation_bytes(model: keras.Model, x: dict) -> int:
    """The bytes autodiff keeps for backward in one forward of a loss of the output, each buffer once, the
    parameters and the batch excluded (their half copies count).  jax: the residuals of ``jax.vjp`` (the
    outputs of its traced jaxpr that are not its inputs: traced, not run); torch: the tensors autograd
    saves (saved-tensor hooks, each storage once)."""
    if backend() == "jax":
        import jax

        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]

        def loss(t: list) -> Any:
            out = sequence_output(model.stateless_call(t, non_trainable, x)[0])
            return jax.numpy.mean(jax.numpy.square(out.astype("float32")))

        return M.residual_bytes(loss, trainable)
    if backend() == "torch":
        import torch

        params = {v.value.untyped_storage().data_ptr() for v in model.weights}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                seen[ptr] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = keras.ops.cast(sequence_output(model(x)), "float32")
            loss = keras.ops.mean(keras.ops.square(out))
        loss.backward()
        return sum(seen.values())
    raise Skip(NO_BYTES_ON_TF)


def activations(name: str, mode: str, params: dict) -> dict:
    if backend() == "tensorflow":
        raise Skip(NO_BYTES_ON_TF)
    x = inputs(name)
    native = activation_bytes(model_for(name, "native", keras_policy(params)), x)
    mine = native if mode == "native" else activation_bytes(model_for(name, "mpx", params["policy"]), x)
    column = {"jax": "keras-jax", "torch": "keras-torch"}[backend()]
    f32 = activation_bytes(reference(name), x)
    measure = "jax.vjp residual bytes" if backend() == "jax" else "saved-tensor bytes"
    return {**M.activation_verdict(column, mine, native, f32), "measure": measure}


# -- the cases --------------------------------------------------------------------------------------------
def observe(params: dict, mode: str, adapter: Any) -> dict:
    """The observation of one ``models`` case (``params``: ``model``, ``aspect``) in ``mode``."""
    name, aspect = params["model"], params["aspect"]
    M.check_column(adapter.name, name)
    policy = params["policy"] if mode == "mpx" else keras_policy(params)
    if aspect == "ops":
        return op_dtypes(model_for(name, mode, policy), name, inputs(name), params["float32_ops"])
    if aspect == "compile":
        return compile_counts(model_for(name, mode, policy), inputs(name))
    if aspect == "overflow":
        return overflow_run(name, mode, params, adapter)
    if aspect == "logits":
        return logits_error(name, mode, params)
    if aspect == "activations":
        return activations(name, mode, params)
    raise KeyError(f"aspect {aspect!r}: one of {', '.join(M.ASPECTS)}")
