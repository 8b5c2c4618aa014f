"""The ``models`` group on PyTorch: Hugging Face models from tiny configs, ``torch.autocast`` against mpx.

:func:`build` makes each model and a batch (seeded, random weights, nothing downloaded);
:func:`observe` measures one aspect in one mode.  The measurements are also the test suite's
(tests/torch/test_hf_models.py, tests/torch/test_activation_memory.py) and ``mpx bench``'s:

- :func:`op_dtypes`: the dtype each op of the op table computed in (a ``TorchFunctionMode``
  outside the model sees every call with the inputs it finally got and the result it gave);
- :func:`compile_counts`: graphs and breaks under ``torch.compile(fullgraph=True)`` (a counting backend);
- :func:`overflow_run`: a short float16 run with an inf injected into the loss (skip, scale trace);
- :func:`logits_error`: max |logits - float32 logits|;
- :func:`saved_bytes` / :func:`saved_profile`: the bytes autograd saves for backward, counted by
  saved-tensor hooks (each storage once, parameters excluded), and the same bytes by producing op.

Native paths import nothing of mpx (a native worker blocks it, conformance/isolation.py): a case's
params carry what they need of the core (``policy_dtypes``, ``float32_ops``, the ``config`` dict);
called without them (the test suite, ``mpx bench``) the functions ask the core themselves.  The ops
are recognised by the harness's own table (:data:`OP_FUNCTIONS`, the functions of mpx_torch's).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from mpx_tools import models as M

HALF = (torch.float16, torch.bfloat16)
NAMES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
}
TORCH_DTYPES = {v: k for k, v in NAMES.items()}
VOCAB, BATCH, SEQ = 128, 2, 16


def _transformers() -> Any:
    from mpx_tools.skip import Skip

    try:
        import transformers
    except ImportError as err:  # the models group needs the integrations extra
        raise Skip(
            f"transformers is not installed ({err}); pip install 'mpx-precision[integrations]'"
        ) from None
    transformers.logging.set_verbosity_error()
    return transformers


def config(name: str, *, hidden: int = 32, layers: int = 2, heads: int = 4, seq: int = 64) -> Any:
    """A tiny config of model ``name`` (``hidden`` width, ``layers`` blocks, ``heads`` heads)."""
    T = _transformers()
    if name == "gpt2":
        return T.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=VOCAB, n_positions=seq,
                            bos_token_id=0, eos_token_id=0)  # fmt: skip
    if name == "llama":
        return T.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), vocab_size=VOCAB,
                             max_position_embeddings=seq, bos_token_id=0, eos_token_id=0)  # fmt: skip
    if name == "bert":
        return T.BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                            intermediate_size=2 * hidden, vocab_size=VOCAB, max_position_embeddings=seq)  # fmt: skip
    if name == "t5":
        return T.T5Config(d_model=hidden, d_ff=2 * hidden, d_kv=hidden // heads, num_layers=layers, num_heads=heads,
                          vocab_size=VOCAB, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)  # fmt: skip
    if name == "vit":
        return T.ViTConfig(image_size=32, patch_size=8, hidden_size=hidden, num_hidden_layers=layers,
                           num_attention_heads=heads, intermediate_size=2 * hidden, num_labels=10)  # fmt: skip
    raise KeyError(f"no model {name!r}; models: {', '.join(M.MODELS)}")


_CLASSES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "bert": "BertForMaskedLM",
    "t5": "T5ForConditionalGeneration",
    "vit": "ViTForImageClassification",
}


def build(
    name: str, seed: int = 0, *, batch: int = BATCH, seq: int = SEQ, **sizes: int
) -> tuple[nn.Module, dict]:
    """Model ``name`` (float32, random weights from ``seed``, dropout off) and a batch with labels."""
    T = _transformers()
    cfg = config(name, seq=max(64, seq), **sizes)
    torch.manual_seed(seed)
    model = getattr(T, _CLASSES[name])(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    if name == "vit":
        inputs = {"pixel_values": torch.randn(batch, 3, 32, 32, generator=gen),
                  "labels": torch.randint(0, 10, (batch,), generator=gen)}  # fmt: skip
    else:
        ids = torch.randint(2, VOCAB, (batch, seq), generator=gen)
        inputs = {"input_ids": ids, "labels": ids.clone()}
        if name == "bert":
            inputs["attention_mask"] = torch.ones_like(ids)
        if name == "t5":  # decoder inputs given (the compile aspect runs without labels)
            labels = torch.randint(2, VOCAB, (batch, seq // 2), generator=gen)
            inputs["labels"] = labels
            inputs["decoder_input_ids"] = torch.cat([torch.zeros_like(labels[:, :1]), labels[:, :-1]], 1)
    return model, inputs


def _mpx() -> Any:
    import mpx

    return mpx


def mpx_torch() -> Any:
    import mpx_torch as module

    return module


def runner(
    model: nn.Module, mode: str, policy: str = M.POLICY, compute_dtype: str | None = None
) -> Callable[..., Any]:
    """``fn(**batch)``: the model natively under ``torch.autocast`` (``mode="native"``) at ``compute_dtype``
    (default: ``policy``'s, asked of the core), prepared under ``policy`` (``"mpx"``, on a copy), or in
    float32 (``"float32"``)."""
    if mode == "mpx":
        prepared = mpx_torch().prepare(copy.deepcopy(model), _mpx().get_policy(policy))
        return lambda **batch: prepared(**batch)
    if mode == "native":
        dtype = TORCH_DTYPES[compute_dtype or _mpx().get_policy(policy).compute_dtype]

        def native(**batch: Any) -> Any:
            with torch.autocast("cpu", dtype=dtype):
                return model(**batch)

        return native
    if mode == "float32":
        return lambda **batch: model(**batch)
    raise KeyError(f"mode {mode!r}: native, mpx or float32")


# -- which ops computed in which dtype ---------------------------------------------------------------
#: canonical op -> the torch functions observed as that op, as attribute paths from ``torch`` (a path
#: this torch lacks is left out).  The same functions as mpx_torch's table (``mpx_torch._ops.FUNCTIONS``,
#: conformance/test_conformance.py checks it), named here so that a native run recognises them without mpx.
OP_FUNCTIONS: dict[str, tuple[str, ...]] = {
    "matmul": ("matmul", "Tensor.matmul", "Tensor.__matmul__", "Tensor.__rmatmul__", "mm", "Tensor.mm", "addmm",
               "Tensor.addmm"),
    "linear": ("nn.functional.linear",),
    "conv": ("nn.functional.conv1d", "nn.functional.conv2d", "nn.functional.conv3d"),
    "conv_transpose": ("nn.functional.conv_transpose1d", "nn.functional.conv_transpose2d",
                       "nn.functional.conv_transpose3d"),
    "bmm": ("bmm", "Tensor.bmm", "baddbmm", "Tensor.baddbmm"),
    "einsum": ("einsum",),
    "attention": ("nn.functional.scaled_dot_product_attention",),
    "softmax": ("softmax", "Tensor.softmax", "nn.functional.softmax", "special.softmax"),
    "log_softmax": ("log_softmax", "Tensor.log_softmax", "nn.functional.log_softmax", "special.log_softmax"),
    "layer_norm": ("nn.functional.layer_norm", "layer_norm"),
    "batch_norm": ("nn.functional.batch_norm", "batch_norm"),
    "group_norm": ("nn.functional.group_norm", "group_norm"),
    "rms_norm": ("nn.functional.rms_norm", "rms_norm"),
    "cross_entropy": ("nn.functional.cross_entropy",),
    "nll_loss": ("nn.functional.nll_loss",),
    "mse_loss": ("nn.functional.mse_loss",),
    "bce_with_logits": ("nn.functional.binary_cross_entropy_with_logits", "binary_cross_entropy_with_logits"),
    "exp": ("exp", "Tensor.exp", "exp2", "Tensor.exp2", "expm1", "Tensor.expm1", "special.exp2", "special.expm1"),
    "log": ("log", "Tensor.log", "log2", "Tensor.log2", "log10", "Tensor.log10", "log1p", "Tensor.log1p",
            "special.log1p"),
    "pow": ("pow", "Tensor.pow", "Tensor.__pow__", "Tensor.__rpow__"),
    "sum": ("sum", "Tensor.sum", "nansum", "Tensor.nansum"),
    "mean": ("mean", "Tensor.mean", "nanmean", "Tensor.nanmean"),
    "cumsum": ("cumsum", "Tensor.cumsum"),
    "prod": ("prod", "Tensor.prod"),
    "logsumexp": ("logsumexp", "Tensor.logsumexp", "special.logsumexp"),
    "vector_norm": ("linalg.vector_norm", "linalg.norm", "norm", "Tensor.norm"),
    "add": ("add", "Tensor.add", "Tensor.__add__", "Tensor.__radd__", "sub", "Tensor.sub", "Tensor.__sub__",
            "Tensor.__rsub__"),
    "mul": ("mul", "Tensor.mul", "Tensor.__mul__", "Tensor.__rmul__"),
    "cat": ("cat", "concat", "concatenate"),
    "stack": ("stack",),
    "where": ("where", "Tensor.where"),
    "relu": ("relu", "Tensor.relu", "nn.functional.relu"),
    "gelu": ("nn.functional.gelu",),
    "max_pool": ("nn.functional.max_pool1d", "nn.functional.max_pool2d", "nn.functional.max_pool3d"),
    "reshape": ("reshape", "Tensor.reshape", "Tensor.view"),
    "transpose": ("transpose", "Tensor.transpose", "t", "Tensor.t"),
    "dropout": ("nn.functional.dropout",),
    "embedding": ("nn.functional.embedding",),
}  # fmt: skip


def _resolve(path: str) -> Callable | None:
    """The object at ``torch.<path>``, or None when this torch has none."""
    obj: Any = torch
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


@functools.cache
def _canonical() -> dict[Callable, str]:
    """torch function -> canonical op of the op table (:data:`OP_FUNCTIONS`, resolved)."""
    out: dict[Callable, str] = {}
    for op, paths in OP_FUNCTIONS.items():
        for path in paths:
            func = _resolve(path)
            if func is not None:
                out.setdefault(func, op)
    return out


class _Calls(TorchFunctionMode):
    """Records (canonical op, the dtype it computed in, explicit dtype) for every op-table function called."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str, bool]] = []
        self.table = _canonical()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        op = self.table.get(func)
        if op is not None:
            first = out[0] if isinstance(out, (tuple, list)) and out else out
            if isinstance(first, torch.Tensor) and first.dtype in NAMES:
                explicit = bool(kwargs and kwargs.get("dtype") is not None) or any(
                    type(a) is torch.dtype for a in args
                )
                self.calls.append((op, NAMES[first.dtype], explicit))
        return out


def float32_ops(policy: str = M.POLICY) -> list[str]:
    """The ops of the table that ``policy`` keeps in float32 (asked of the core: mpx paths and tests only)."""
    mpx = _mpx()
    return sorted(op for op in mpx.OP_TABLE if mpx.classify(op, policy) is mpx.OpClass.FLOAT32)


def op_dtypes(fn: Callable[..., Any], batch: dict, keep_float32: list[str] | None = None) -> dict:
    """Per canonical op the dtypes it computed in (its result's), how often, and the FLOAT32-class ops
    computed in half precision without an explicit ``dtype=`` (``violations``, a precision hazard).

    ``keep_float32``: the FLOAT32-class ops (a case's precomputed ``float32_ops``); default: those of
    :data:`mpx_tools.models.POLICY`, asked of the core.
    """
    recorder = _Calls()
    with torch.no_grad(), recorder:
        fn(**batch)
    computed: dict[str, dict[str, int]] = {}
    violations: set[str] = set()
    kept = set(float32_ops(M.POLICY) if keep_float32 is None else keep_float32)
    for op, dtype, explicit in recorder.calls:
        per = computed.setdefault(op, {})
        per[dtype] = per.get(dtype, 0) + 1
        if dtype in ("float16", "bfloat16") and not explicit and op in kept:
            violations.add(op)
    half = sorted(op for op, per in computed.items() if set(per) & {"float16", "bfloat16"})
    full = sorted(op for op, per in computed.items() if "float32" in per)
    return {"computed": {op: dict(sorted(v.items())) for op, v in sorted(computed.items())},
            "half": half, "float32": full, "violations": sorted(violations)}  # fmt: skip


# -- compile ----------------------------------------------------------------------------------------------
class _Counting:
    def __init__(self) -> None:
        self.graphs: list[Any] = []

    def __call__(self, gm: Any, example_inputs: list) -> Any:
        self.graphs.append(gm)
        return gm.forward


def compile_counts(fn: Callable[..., Any], batch: dict, calls: int = 2) -> dict:
    """Graphs, breaks and frames compiled under ``torch.compile(fullgraph=True)`` over ``calls`` calls."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    backend = _Counting()
    compiled = torch.compile(lambda b: fn(**b).logits, backend=backend, fullgraph=True)
    try:
        with torch.no_grad():
            outs = [compiled(batch) for _ in range(calls)]
    except Exception as err:  # fullgraph refused: the break is the observation
        return {"graphs": None, "breaks": None, "fullgraph": False, "error": f"{type(err).__name__}: "
                f"{str(err).splitlines()[0][:200]}"}  # fmt: skip
    with torch.no_grad():
        eager = fn(**batch).logits
    out = {
        "graphs": len(backend.graphs),
        "breaks": sum(counters["graph_break"].values()),
        "fullgraph": True,
        "recompiles": counters["stats"]["unique_graphs"] - len(backend.graphs[:1]),
        "same_as_eager": all(torch.equal(o, eager) for o in outs),
    }
    torch._dynamo.reset()
    return out


# -- a float16 run with an injected overflow ------------------------------------------------------------
def overflow_run(name: str, mode: str, config: dict | None = None) -> dict:
    """:data:`mpx_tools.models.OVERFLOW_FLAGS` steps of AdamW under float16 with an inf in the loss where
    the flag is False: the scale after each step, the steps skipped, and whether a skipped step left
    the parameters and the optimizer state bit-identical.

    ``config``: the scaler config as ``mpx.ScalerConfig.to_dict()`` (a case's precomputed ``config``);
    default: :data:`mpx_tools.models.OVERFLOW_CONFIG`'s, made by the core."""
    model, batch = build(name)
    cfg = _mpx().ScalerConfig(**M.OVERFLOW_CONFIG).to_dict() if config is None else config
    if mode == "mpx":
        with warnings.catch_warnings():  # float16 on a CPU is slow: the run is 6 tiny steps
            warnings.simplefilter("ignore", _mpx().SlowPolicyWarning)
            mpx_torch().prepare(model, M.OVERFLOW_POLICY)
        scaler: Any = mpx_torch().GradScaler(cfg)
        region: Callable[[], Any] = contextlib.nullcontext
    else:
        scaler = torch.amp.GradScaler("cpu", init_scale=cfg["init_scale"], growth_factor=cfg["growth_factor"],
                                      backoff_factor=cfg["backoff_factor"], growth_interval=cfg["growth_interval"])  # fmt: skip
        region = functools.partial(torch.autocast, "cpu", dtype=torch.float16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scales, skipped, unchanged, losses = [], [], [], []
    for step, finite in enumerate(M.OVERFLOW_FLAGS):
        before = _snapshot(model, opt)
        opt.zero_grad()
        with region():
            loss = model(**batch).loss
        losses.append(float(loss.detach()))
        bad = loss * (1.0 if finite else float("inf"))
        scaler.scale(bad).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(float(scaler.get_scale()))
        if _snapshot(model, opt) == before:
            skipped.append(step)
            unchanged.append(step)
    return {"scales": scales, "skipped": skipped, "unchanged_on_skip": skipped == unchanged,
            "losses_finite": all(x == x and abs(x) != float("inf") for x in losses)}  # fmt: skip


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> list[bytes]:
    out = [p.detach().float().numpy().tobytes() for p in model.parameters()]
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                out.append(value.detach().float().numpy().tobytes())
    return out


# -- logits ------------------------------------------------------------------------------------------------
def logits_error(name: str, mode: str, compute_dtype: str | None = None) -> dict:
    """max |logits - float32 logits| of ``mode``, and the bound (:data:`mpx_tools.models.LOGITS_TOL`);
    ``compute_dtype``: native autocast's (see :func:`runner`)."""
    model, batch = build(name)
    with torch.no_grad():
        want = model(**batch).logits.double()
        got = runner(model, mode, compute_dtype=compute_dtype)(**batch).logits
    err = float((got.double() - want).abs().max())
    scale = float(want.abs().max())
    return {"dtype": NAMES[got.dtype], "max_abs_error": err, "max_abs_float32": scale,
            "within_tolerance": err <= M.LOGITS_TOL * scale}  # fmt: skip


# -- saved activations -------------------------------------------------------------------------------------
@contextlib.contextmanager
def _saved(model: nn.Module, into: list[torch.Tensor]) -> Iterator[None]:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            into.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def _unique_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def saved_bytes(model: nn.Module, fn: Callable[..., Any], batch: dict) -> int:
    """The bytes autograd keeps for backward in one forward of ``fn(**batch)`` (a loss), each storage once,
    the model's parameters excluded (their half copies count)."""
    saved: list[torch.Tensor] = []
    with _saved(model, saved):
        loss = fn(**batch).loss
    total = _unique_bytes(saved)
    del saved
    loss.backward()  # backward runs: a recompute must work
    model.zero_grad(set_to_none=True)
    return total


class _Producers(TorchFunctionMode):
    """storage pointer -> the function that produced the tensor (for the profile).  Every result is kept
    alive until the profile is read, so no storage is reused and each pointer has one producer."""

    def __init__(self) -> None:
        super().__init__()
        self.by_storage: dict[int, str] = {}
        self.alive: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.alive.append(t)
                self.by_storage.setdefault(
                    t.untyped_storage().data_ptr(), getattr(func, "__name__", str(func))
                )
        return out


def saved_profile(model: nn.Module, fn: Callable[..., Any], batch: dict) -> list[dict]:
    """The saved bytes by (producing function, dtype), largest first: what the activation memory is made of."""
    saved: list[torch.Tensor] = []
    producers = _Producers()
    with _saved(model, saved), producers:
        loss = fn(**batch).loss
    loss.backward()  # outside the hooks: what a recompute saves in backward is not forward's
    rows: dict[tuple[str, str], list[int]] = {}
    seen: set[int] = set()
    for t in saved:
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        key = (producers.by_storage.get(ptr, "(inside an op)"), NAMES.get(t.dtype, str(t.dtype)))
        row = rows.setdefault(key, [0, 0])
        row[0] += 1
        row[1] += t.untyped_storage().nbytes()
    model.zero_grad(set_to_none=True)
    return [{"producer": k[0], "dtype": k[1], "tensors": v[0], "bytes": v[1]}
            for k, v in sorted(rows.items(), key=lambda kv: -kv[1][1])]  # fmt: skip


def activation_bytes(
    name: str, *, with_mpx: bool = True, compute_dtype: str | None = None, **build_kwargs: Any
) -> dict:
    """Saved-activation bytes of model ``name`` in float32, natively and (``with_mpx``) under mpx, one
    forward each; ``compute_dtype``: native autocast's (see :func:`runner`)."""
    model, batch = build(name, **build_kwargs)
    model.train(False)
    out = {mode: saved_bytes(model, runner(model, mode, compute_dtype=compute_dtype), batch)
           for mode in ("float32", "native")}  # fmt: skip
    if with_mpx:
        prepared = mpx_torch().prepare(copy.deepcopy(model), M.POLICY)
        out["mpx"] = saved_bytes(prepared, lambda **b: prepared(**b), batch)
    return out


# -- the cases --------------------------------------------------------------------------------------------
def observe(params: dict, mode: str) -> dict:
    """The observation of one ``models`` case (``params``: ``model`` and ``aspect``) in ``mode``."""
    name, aspect = params["model"], params["aspect"]
    compute = params["policy_dtypes"]["compute_dtype"] if "policy_dtypes" in params else None
    if aspect == "ops":
        model, batch = build(name)
        return op_dtypes(runner(model, mode, compute_dtype=compute), batch, params.get("float32_ops"))
    if aspect == "compile":  # the logits only: HF's loss_function logs a warning, which dynamo refuses
        model, batch = build(name)
        fn = runner(model, mode, compute_dtype=compute)
        return compile_counts(fn, {k: v for k, v in batch.items() if k != "labels"})
    if aspect == "overflow":
        return overflow_run(name, mode, params.get("config"))
    if aspect == "logits":
        return logits_error(name, mode, compute)
    if aspect == "activations":
        got = activation_bytes(name, with_mpx=mode == "mpx", compute_dtype=compute)
        ratio = got[mode] / got["native"]
        return {"saved_bytes": got[mode], "native_saved_bytes": got["native"], "float32_saved_bytes": got["float32"],
                "ratio_to_native": round(ratio, 4), "within_ratio": ratio <= M.ACTIVATION_RATIO}  # fmt: skip
    raise KeyError(f"aspect {aspect!r}: one of {', '.join(M.ASPECTS)}")
