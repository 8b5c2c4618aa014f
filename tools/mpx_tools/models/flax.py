"""The ``models`` group on JAX (the ``jax`` column): a small GPT in Flax NNX and a ResNet in Flax linen,
Flax's own ``dtype`` arguments against mpx_jax.

The models are written as Flax's own examples write them: the GPT as the NNX miniGPT tutorial and the "scan
over layers" guide (``nnx.scan`` over ``nnx.remat``-ed blocks, causal and padding masks, dropout), the
ResNet as the linen ImageNet example (BatchNorm batch statistics).  Natively every module gets the compute
dtype as its ``dtype`` (parameters stay float32, Flax's mixed precision) and a float16 run is loss-scaled
with Flax's ``DynamicScale`` in its documented pattern; under mpx the float32 model is given the policy
(``mpx_jax.flax.apply_policy`` for NNX, ``policy_apply`` for linen) and trained with
``mpx_jax.with_loss_scaling``.  Every aspect (:data:`mpx_tools.models.ASPECTS`) reads the traced program:

- ops: the dtype each dot/conv, softmax ``exp``, reduction and ``rsqrt`` of the forward computed in;
- compile: ``jax.jit`` traces over two calls of the forward;
- overflow: :data:`mpx_tools.models.OVERFLOW_FLAGS` AdamW steps in one jitted step, an inf in the loss;
- logits: max |logits - float32 logits|;
- activations: the bytes ``jax.vjp`` keeps for backward (:func:`mpx_tools.models.residual_bytes`).

Native paths import nothing of mpx: a case's params carry what they need of the core.
"""

from __future__ import annotations

import functools
import importlib
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx

from mpx_tools import models as M

JNP = {"float16": jnp.float16, "bfloat16": jnp.bfloat16, "float32": jnp.float32}
VOCAB, SEQ, EMBED, HEADS, FF, LAYERS, BATCH = 32, 8, 16, 2, 32, 2, 4


def _mpx_jax() -> Any:
    return importlib.import_module("mpx_jax")


def _flax_policy() -> Any:
    return importlib.import_module("mpx_jax.flax")


# -- a small GPT (NNX) ----------------------------------------------------------------------------------
class TransformerBlock(nnx.Module):
    """Attention, dropout, post-norm and a ReLU MLP: the miniGPT tutorial's block (``dtype``: Flax's own)."""

    def __init__(self, rngs: nnx.Rngs, dtype: Any = jnp.float32, rate: float = 0.1):
        kw = {"dtype": dtype, "rngs": rngs}
        # dropout as the tutorial places it, deterministic (the aspects compare deterministic programs); no
        # RNG streams kept in the layers, so the blocks' state is parameters only
        self.mha = nnx.MultiHeadAttention(num_heads=HEADS, in_features=EMBED, decode=False, **kw)
        self.dropout1 = nnx.Dropout(rate=rate, deterministic=True)
        self.layer_norm1 = nnx.LayerNorm(EMBED, epsilon=1e-6, **kw)
        self.linear1 = nnx.Linear(EMBED, FF, **kw)
        self.linear2 = nnx.Linear(FF, EMBED, **kw)
        self.dropout2 = nnx.Dropout(rate=rate, deterministic=True)
        self.layer_norm2 = nnx.LayerNorm(EMBED, epsilon=1e-6, **kw)

    def __call__(self, inputs: jax.Array, mask: jax.Array) -> jax.Array:
        attention = self.dropout1(self.mha(inputs_q=inputs, mask=mask, decode=False))
        out1 = self.layer_norm1(inputs + attention)
        ffn = self.dropout2(self.linear2(nnx.relu(self.linear1(out1))))
        return self.layer_norm2(out1 + ffn)


class MiniGPT(nnx.Module):
    """Token and position embeddings, ``LAYERS`` blocks scanned over (each ``nnx.remat``-ed), a linear head."""

    def __init__(self, rngs: nnx.Rngs, dtype: Any = jnp.float32):
        self.token_emb = nnx.Embed(VOCAB, EMBED, dtype=dtype, rngs=rngs)
        self.pos_emb = nnx.Embed(SEQ, EMBED, dtype=dtype, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create_block(rngs: nnx.Rngs) -> TransformerBlock:
            return TransformerBlock(rngs, dtype)

        self.blocks = create_block(rngs)
        self.output_layer = nnx.Linear(EMBED, VOCAB, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.token_emb(tokens) + self.pos_emb(jnp.arange(tokens.shape[1])[None, :])
        mask = nnx.combine_masks(
            nnx.make_causal_mask(tokens), nnx.make_attention_mask(tokens > 0, tokens > 0)
        )

        @nnx.scan(in_axes=(nnx.Carry, 0, None), out_axes=nnx.Carry)
        @nnx.remat
        def forward(x: jax.Array, block: TransformerBlock, mask: jax.Array) -> jax.Array:
            return block(x, mask)

        return self.output_layer(forward(x, self.blocks, mask))


# -- a ResNet (linen) -----------------------------------------------------------------------------------
class ResNetBlock(nn.Module):
    filters: int
    conv: Any
    norm: Any
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = nn.relu(self.norm()(self.conv(self.filters, (3, 3), self.strides)(x)))
        y = self.norm(scale_init=nn.initializers.zeros_init())(self.conv(self.filters, (3, 3))(y))
        if x.shape != y.shape:
            x = self.norm(name="norm_proj")(
                self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(x)
            )
        return nn.relu(x + y)


class ResNet(nn.Module):
    """Two stages of one block each, 8 filters, 4 classes: the ImageNet example's ResNet, small."""

    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        conv = partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = partial(
            nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5, dtype=self.dtype
        )
        x = nn.relu(norm(name="bn_init")(conv(8, (3, 3), name="conv_init")(x)))
        x = ResNetBlock(8, conv=conv, norm=norm)(x)
        x = ResNetBlock(16, conv=conv, norm=norm, strides=(2, 2))(x)
        return nn.Dense(4, dtype=self.dtype)(jnp.mean(x, axis=(1, 2)))


@functools.cache
def _resnet_variables() -> Any:
    """The ResNet's float32 parameters and batch statistics, initialised in one jitted program."""
    return jax.jit(lambda key, x: ResNet().init(key, x, train=False))(
        jax.random.PRNGKey(0), jnp.asarray(IMAGES)
    )


@functools.cache
def _gpt_float32() -> tuple[Any, Any]:
    """The float32 GPT's graph and state, built once per process in one jitted program (eagerly, each
    initializer compiles per shape): every mode's GPT shares its parameters."""
    return nnx.split(nnx.jit(lambda: MiniGPT(nnx.Rngs(params=0), dtype=jnp.float32))())


def _gpt(dtype: Any) -> MiniGPT:
    """A GPT computing in ``dtype`` with the float32 GPT's parameters (float32, as Flax keeps them): its graph
    from ``nnx.eval_shape`` (nothing initialised or compiled), its state the float32 GPT's."""
    graphdef, state = _gpt_float32()
    if dtype != jnp.float32:
        graphdef = nnx.split(nnx.eval_shape(lambda: MiniGPT(nnx.Rngs(params=0), dtype=dtype)))[0]
    return nnx.merge(graphdef, state)


TOKENS = np.asarray(jax.random.randint(jax.random.PRNGKey(5), (BATCH, SEQ + 1), 1, VOCAB)).copy()
TOKENS[0, -3:] = 0  # padding
IMAGES = np.asarray(jax.random.normal(jax.random.PRNGKey(7), (BATCH, 8, 8, 3)))
LABELS = np.arange(BATCH) % 4


class Subject:
    """One model in one mode: ``forward(params, extra, train)`` -> (logits, new extra), its float32
    ``params`` and ``extra`` (the ResNet's batch statistics; ``{}`` for the GPT), and the batch's labels."""

    def __init__(self, name: str, mode: str, policy: str | None, compute: str) -> None:
        dtype = JNP[compute] if mode == "native" else jnp.float32
        if name == "nnx_gpt":
            model = _gpt(dtype)
            if mode == "mpx":
                _flax_policy().apply_policy(model, policy)
            graphdef, params, rest = nnx.split(model, nnx.Param, ...)
            self.params, self.extra = params, {}
            self.inputs, self.labels = jnp.asarray(TOKENS[:, :-1]), jnp.asarray(TOKENS[:, 1:])

            def forward(params: Any, extra: Any, train: bool) -> tuple[jax.Array, Any]:
                return nnx.merge(graphdef, params, rest)(self.inputs), extra

        elif name == "resnet":
            module = ResNet(dtype=dtype)
            variables = _resnet_variables()
            apply = _flax_policy().policy_apply(ResNet(), policy) if mode == "mpx" else module.apply
            self.params, self.extra = variables["params"], variables["batch_stats"]
            self.inputs, self.labels = jnp.asarray(IMAGES), jnp.asarray(LABELS)

            def forward(params: Any, extra: Any, train: bool) -> tuple[jax.Array, Any]:
                if not train:
                    return apply({"params": params, "batch_stats": extra}, self.inputs, train=False), extra
                out, updates = apply(
                    {"params": params, "batch_stats": extra}, self.inputs, mutable=["batch_stats"]
                )
                return out, updates["batch_stats"]

        else:
            raise KeyError(f"no Flax model {name!r}: nnx_gpt or resnet")
        self.forward = forward
        self.jitted: Any = None

    def loss(self, params: Any, extra: Any) -> tuple[jax.Array, Any]:
        logits, new_extra = self.forward(params, extra, True)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), self.labels).mean()
        return loss, new_extra


_SUBJECTS: dict[tuple, Subject] = {}


def subject(name: str, mode: str, policy: str | None, compute: str) -> Subject:
    """The model of ``mode`` (``native``, ``mpx`` or ``float32``), one per process: the aspects share it."""
    key = (name, mode, policy, compute)
    if key not in _SUBJECTS:
        if name == "keras_gpt2":  # keras-hub's, through mpx_jax.autocast (Keras imported for it only)
            from mpx_tools.models.keras_on_jax import KerasSubject

            _SUBJECTS[key] = KerasSubject(name, mode, policy, compute)  # type: ignore[assignment]
        else:
            _SUBJECTS[key] = Subject(name, mode, policy, compute)
    return _SUBJECTS[key]


def evaluate(s: Subject) -> jax.Array:
    """The logits of ``s`` (not training), through one ``jax.jit`` per subject (the compile aspect's)."""
    if s.jitted is None:
        s.jitted = jax.jit(lambda p, e: s.forward(p, e, False)[0])
    return s.jitted(s.params, s.extra)


# -- aspects ----------------------------------------------------------------------------------------------
#: primitive -> kind; a kind the policy keeps in float32 computed in half is a violation
PRIMITIVES = {"dot_general": "matmul", "conv_general_dilated": "conv", "exp": "softmax", "reduce_sum": "sum",
              "rsqrt": "norm"}  # fmt: skip


def op_dtypes(s: Subject, name: str, keep_float32: list[str]) -> dict:
    """Per kind the dtypes the forward computed it in (inputs' dtype), how often; the violations."""
    norm = "batch_norm" if name == "resnet" else "layer_norm"
    table_op = {"matmul": "matmul", "conv": "conv", "softmax": "softmax", "sum": "sum", "norm": norm}
    computed: dict[str, dict[str, int]] = {}
    violations: set[str] = set()

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            kind = PRIMITIVES.get(eqn.primitive.name)
            if kind is not None:
                dtype = str(eqn.invars[0].aval.dtype)
                per = computed.setdefault(table_op[kind], {})
                per[dtype] = per.get(dtype, 0) + 1
                if dtype in ("float16", "bfloat16") and table_op[kind] in keep_float32:
                    violations.add(table_op[kind])
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else (param,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(lambda p, e: s.forward(p, e, True)[0])(s.params, s.extra).jaxpr)
    return {"computed": {op: dict(sorted(v.items())) for op, v in sorted(computed.items())},
            "half": sorted(op for op, v in computed.items() if {"float16", "bfloat16"} & set(v)),
            "float32": sorted(op for op, v in computed.items() if "float32" in v),
            "violations": sorted(violations)}  # fmt: skip


def compile_counts(s: Subject, calls: int = 2) -> dict:
    traces: list[int] = []

    def traced(p: Any, e: Any) -> jax.Array:
        traces.append(1)
        return s.forward(p, e, False)[0]

    jitted = jax.jit(traced)
    outs = [np.asarray(jitted(s.params, s.extra)) for _ in range(calls)]
    s.jitted = jitted  # the logits aspect calls it again
    return {"graphs": len(traces), "breaks": 0, "fullgraph": True, "tracer": "jax.jit",
            "recompiles": len(traces) - 1, "calls_agree": all(np.array_equal(o, outs[0]) for o in outs)}  # fmt: skip


def _bits(tree: Any) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]


def overflow_run(name: str, mode: str, params: dict) -> dict:
    """The float16 run: one jitted step per flag, AdamW, an inf in the loss where the flag is False."""
    s = subject(name, mode, params["policy"], params["policy_dtypes"]["compute_dtype"])
    cfg, tx0 = params["config"], optax.adamw(1e-3)
    if mode == "native":  # Flax's documented pattern: DynamicScale.value_and_grad, then select on is_fin
        from flax.training.dynamic_scale import DynamicScale

        scaler: Any = DynamicScale(growth_factor=cfg["growth_factor"], backoff_factor=cfg["backoff_factor"],
                                   growth_interval=cfg["growth_interval"], scale=cfg["init_scale"])  # fmt: skip
        tx = tx0

        @jax.jit
        def step(p: Any, e: Any, o: Any, scaler: Any, poison: jax.Array) -> tuple:
            grad_fn = scaler.value_and_grad(lambda q: _poisoned(s, q, e, poison), has_aux=True)
            scaler, ok, (loss, new_e), grads = grad_fn(p)
            updates, new_o = tx.update(grads, o, p)
            keep = partial(jax.tree_util.tree_map, lambda a, b: jnp.where(ok, a, b))
            return keep(optax.apply_updates(p, updates), p), keep(new_e, e), keep(new_o, o), scaler, loss

        def scale(scaler: Any, o: Any) -> float:
            return float(scaler.scale)

        inner = lambda o: o  # noqa: E731
    else:
        mj = _mpx_jax()
        tx, scaler = mj.with_loss_scaling(tx0, cfg), None

        @jax.jit
        def step(p: Any, e: Any, o: Any, scaler: Any, poison: jax.Array) -> tuple:
            ls = mj.get_loss_scale(o)
            grads, (loss, new_e) = jax.grad(lambda q: _scaled(ls, s, q, e, poison), has_aux=True)(p)
            updates, new_o = tx.update(grads, o, p)
            return (
                optax.apply_updates(p, updates),
                mj.select_tree(mj.all_finite(grads), new_e, e),
                new_o,
                None,
                loss,
            )

        def scale(scaler: Any, o: Any) -> float:
            return float(mj.get_loss_scale(o).loss_scale)

        def inner(o: Any) -> Any:
            return o.inner_state

    p, e = s.params, s.extra
    o = tx.init(p)
    scales, skipped, unchanged, losses = [], [], [], []
    for i, finite in enumerate(M.OVERFLOW_FLAGS):
        before = _bits((p, e, inner(o)))
        p, e, o, scaler, loss = step(p, e, o, scaler, jnp.float32(1.0 if finite else np.inf))
        losses.append(float(loss))
        scales.append(scale(scaler, o))
        if _bits((p, e, inner(o))) == before:
            skipped.append(i)
            unchanged.append(i)
    finite_losses = [v for v, f in zip(losses, M.OVERFLOW_FLAGS, strict=True) if f]
    return {"scales": scales, "skipped": skipped, "unchanged_on_skip": skipped == unchanged,
            "losses_finite": bool(np.all(np.isfinite(finite_losses)))}  # fmt: skip


def _poisoned(s: Subject, p: Any, e: Any, poison: jax.Array) -> tuple:
    loss, new_e = s.loss(p, e)
    return loss * poison, new_e


def _scaled(ls: Any, s: Subject, p: Any, e: Any, poison: jax.Array) -> tuple:
    loss, new_e = s.loss(p, e)
    return ls.scale(loss * poison), (loss * poison, new_e)


def logits_error(name: str, mode: str, params: dict) -> dict:
    compute = params["policy_dtypes"]["compute_dtype"]
    ref = subject(name, "float32", None, "float32")
    want = np.asarray(evaluate(ref), np.float64)
    got = evaluate(subject(name, mode, params["policy"], compute))
    err = float(np.abs(np.asarray(got, np.float64) - want).max())
    top = float(np.abs(want).max())
    return {"dtype": str(got.dtype), "max_abs_error": err, "max_abs_float32": top,
            "within_tolerance": err <= M.LOGITS_TOL * top}  # fmt: skip


def activation_bytes(s: Subject) -> int:
    return M.residual_bytes(lambda p: s.loss(p, s.extra)[0], s.params)


def activations(name: str, mode: str, params: dict) -> dict:
    compute = params["policy_dtypes"]["compute_dtype"]
    native = activation_bytes(subject(name, "native", None, compute))
    mine = native if mode == "native" else activation_bytes(subject(name, "mpx", params["policy"], compute))
    f32 = activation_bytes(subject(name, "float32", None, "float32"))
    return {**M.activation_verdict("jax", mine, native, f32), "measure": "jax.vjp residual bytes"}


def observe(params: dict, mode: str) -> dict:
    """The observation of one ``models`` case (``params``: ``model``, ``aspect``) in ``mode``."""
    name, aspect = params["model"], params["aspect"]
    M.check_column("jax", name)
    compute = params["policy_dtypes"]["compute_dtype"]
    if aspect == "ops":
        return op_dtypes(subject(name, mode, params["policy"], compute), name, params["float32_ops"])
    if aspect == "compile":
        return compile_counts(subject(name, mode, params["policy"], compute))
    if aspect == "overflow":
        return overflow_run(name, mode, params)
    if aspect == "logits":
        return logits_error(name, mode, params)
    if aspect == "activations":
        return activations(name, mode, params)
    raise KeyError(f"aspect {aspect!r}: one of {', '.join(M.ASPECTS)}")
