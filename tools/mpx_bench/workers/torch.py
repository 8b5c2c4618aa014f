"""The PyTorch bench worker: torch.autocast + torch.amp.GradScaler natively, mpx_torch under mpx."""

from __future__ import annotations

import contextlib
import copy
import math
import platform
import sys
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mpx
import mpx_torch
from mpx_bench import models
from mpx_bench.harness import Config
from mpx_bench.workers.common import CPU_PROBE_N, activation_profile, plan, timed_probe
from mpx_torch import float8

_DT = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def info(device: str) -> dict[str, Any]:
    dev = torch.device(device)
    name = (
        torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine()
    )
    out = {"framework": "torch", "versions": {"torch": torch.__version__}, "device": str(dev), "device_name": name,
           "threads": torch.get_num_threads()}  # fmt: skip
    if torch.cuda.is_available():
        out["gpus"] = [f"{torch.cuda.get_device_name(i)} (compute capability "
                       f"{'.'.join(map(str, torch.cuda.get_device_capability(i)))})"
                       for i in range(torch.cuda.device_count())]  # fmt: skip
    if dev.type == "cuda":
        out["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(dev)))
    if "--probe" not in sys.argv:  # a probe (mpx doctor) times matmuls only
        out["hf_activations"] = hf_activations()
    return out


#: The Hugging Face models whose saved-activation bytes every torch bench reports (issue 23), at a
#: sequence/hidden ratio of real models (GPT-2: 1024 / 768) with 2 blocks, random weights, on the CPU.
HF_ACTIVATION_MODELS = ("gpt2", "llama")
HF_ACTIVATION_SHAPE = {"hidden": 128, "seq": 256, "heads": 4, "layers": 2}


def hf_activations() -> dict[str, Any]:
    """Per model of :data:`HF_ACTIVATION_MODELS`: the bytes autograd saves for backward in one forward
    (saved-tensor hooks, each storage once, parameters excluded) in float32 (``float32_bytes``), under
    ``torch.autocast`` bfloat16 (``native_bytes``) and prepared under mixed_bfloat16 (``mpx_bytes``), and
    ``mpx/native``.  Deterministic (counted, not timed).  ``{"skipped": why}`` without transformers."""
    from mpx_tools.models import torch as hf
    from mpx_tools.skip import Skip

    out: dict[str, Any] = {"shape": dict(HF_ACTIVATION_SHAPE)}
    for name in HF_ACTIVATION_MODELS:
        try:
            got = hf.activation_bytes(name, **HF_ACTIVATION_SHAPE)
        except Skip as why:
            return {"skipped": str(why)}
        out[name] = {"float32_bytes": got["float32"], "native_bytes": got["native"], "mpx_bytes": got["mpx"],
                     "mpx/native": round(got["mpx"] / got["native"], 4)}  # fmt: skip
    return out


def compute_dtype(policy: str) -> str:
    return mpx.get_policy(policy).compute_dtype


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def probe(dtypes: list[str], budget_s: float, device: str, n: int | None = None) -> dict[str, Any]:
    dev = torch.device(device)
    n = n or (4096 if dev.type == "cuda" else CPU_PROBE_N)
    runs = {}
    for name in dtypes:
        a = torch.randn(n, n, device=dev).to(_DT[name])
        b = torch.randn(n, n, device=dev).to(_DT[name])

        def run(a: torch.Tensor = a, b: torch.Tensor = b) -> None:
            F.linear(a, b).sum()  # what nn.Linear runs (torch's CPU mm takes a slower float16 path)
            _sync(dev)

        runs[name] = run
    return {name: {"n": n, **r} for name, r in timed_probe(runs, 2.0 * n**3, budget_s).items()}


# -- models ---------------------------------------------------------------------------
class _Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).reshape(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = self.softmax(q @ k.transpose(-1, -2) * (1.0 / math.sqrt(d // self.heads)))
        return self.out((att @ v).transpose(1, 2).reshape(b, s, d))


class _Block(nn.Module):
    def __init__(self, d: int, heads: int, ff: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(d), _Attention(d, heads)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, ff), nn.GELU(), nn.Linear(ff, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class _Transformer(nn.Module):
    def __init__(self, d: int, heads: int, ff: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[_Block(d, heads, ff) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(x)).mean(dim=1))


def build(model: str, size: str, device: torch.device) -> tuple[nn.Module, torch.Tensor, torch.Tensor, Any]:
    """The float32 network, its input and target on ``device``, and its loss function."""
    d = models.dims(model, size)
    x, y = models.data(model, size)
    torch.manual_seed(0)
    if model == "mlp":
        net: nn.Module = nn.Sequential(nn.Linear(d["d"], d["h"]), nn.GELU(), nn.Linear(d["h"], d["d"]))
        loss = F.mse_loss
    elif model == "transformer":
        net = _Transformer(d["d"], d["heads"], d["ff"], d["layers"])
        loss = F.mse_loss
    else:
        c1, c2, c3 = d["channels"]
        net = nn.Sequential(
            nn.Conv2d(d["cin"], c1, 3, padding=1), nn.ReLU(),
            nn.Conv2d(c1, c2, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(c2, c3, 3, stride=2, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c3, d["classes"]),
        )  # fmt: skip
        x = x.transpose(0, 3, 1, 2).copy()  # NCHW
        loss = F.cross_entropy
    return net.to(device), torch.tensor(x, device=device), torch.tensor(y, device=device), loss


# -- measurement ------------------------------------------------------------------------
_VIEWS = {"ToCopyBackward0", "TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0",
          "ReshapeAliasBackward0", "ExpandBackward0", "UnsqueezeBackward0", "UnsafeViewBackward0"}  # fmt: skip


def _from_parameter(t: torch.Tensor) -> bool:
    """Whether ``t`` is a parameter or a cast/view of one (autocast's weight copies)."""
    if t.is_leaf:
        return t.requires_grad
    fn = t.grad_fn
    while fn is not None and type(fn).__name__ in _VIEWS:
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if len(nxt) != 1:
            return False
        fn = nxt[0]
    return fn is not None and type(fn).__name__ == "AccumulateGrad"


class Runner:
    def __init__(self, net: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: Any, ctx: Any, scaler: Any,
                 device: torch.device, compile: bool = False) -> None:  # fmt: skip
        self.net, self.x, self.y, self.loss, self.ctx, self.scaler, self.device = (
            net,
            x,
            y,
            loss,
            ctx,
            scaler,
            device,
        )
        # FP8 Linears (a policy with fp8=): their state commits after each step, as in training
        self.fp8 = [m for _, m in float8.float8_layers(net)]
        fused = device.type == "cuda"
        self.opt = torch.optim.AdamW(net.parameters(), lr=1e-4, **({"fused": True} if fused else {}))
        # --compile: the whole step under torch.compile (inductor); dynamo's counters, read around each
        # of this runner's steps, give its compiles, graphs and breaks (configurations run one at a time)
        self.compiled = torch.compile(self._body) if compile else None
        self.compile_stats = {"frames_compiled": 0, "graphs": 0, "graph_breaks": 0, "steps": 0,
                              "frames_compiled_after_warmup": 0}  # fmt: skip

    def forward_loss(self) -> torch.Tensor:
        with self.ctx():
            out = self.net(self.x)
            return self.loss(out.float(), self.y)

    def step(self) -> None:
        if self.compiled is None:
            self._step()
        else:
            from torch._dynamo.utils import counters

            self.opt.zero_grad(set_to_none=True)  # eager: dynamo skips zero_grad (a break at the top)

            before = (counters["frames"]["total"], counters["stats"]["unique_graphs"],
                      sum(counters["graph_break"].values()))  # fmt: skip
            self.compiled()
            stats = self.compile_stats
            frames = counters["frames"]["total"] - before[0]
            stats["frames_compiled"] += frames
            stats["graphs"] += counters["stats"]["unique_graphs"] - before[1]
            stats["graph_breaks"] += sum(counters["graph_break"].values()) - before[2]
            if stats["steps"] >= 1:
                stats["frames_compiled_after_warmup"] += frames
            stats["steps"] += 1
        _sync(self.device)

    def _step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self._body()

    def _body(self) -> None:
        """The step after ``zero_grad``: forward, loss, backward (scaled), optimizer step, scaler update."""
        loss = self.forward_loss()
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            loss.backward()
            self.opt.step()
        if self.fp8:
            float8.commit_float8(self.net, self.scaler if self.scaler is not None else False)

    def fp8_figures(self) -> dict[str, Any]:
        """``fp8_layers``, ``fp8_gemm`` (the GEMMs they run) and ``fp8_note`` (``CPU emulation`` unless every
        FP8 GEMM runs ``torch._scaled_mm`` on a CUDA device); empty without FP8 layers."""
        if not self.fp8:
            return {}
        gemms = sorted({m.fp8_gemm for m in self.fp8})
        hardware = gemms == ["scaled_mm"] and self.device.type == "cuda"
        note = (
            f"FP8 GEMMs on {torch.cuda.get_device_name(self.device)} (torch._scaled_mm)"
            if hardware
            else "CPU emulation: FP8 quantize-dequantize around float32 GEMMs (no FP8 hardware here); the time "
            "is the emulation's, not an FP8 device's"
        )
        return {"fp8_layers": len(self.fp8), "fp8_gemm": gemms, "fp8_note": note}

    def measure(self) -> dict[str, Any]:
        saved: dict[tuple[int, int], int] = {}
        weights: dict[tuple[int, int], int] = {}
        producers: dict[tuple[int, int], tuple[str, str, int]] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if _from_parameter(t):
                weights[key] = storage.nbytes()
            else:
                saved[key] = storage.nbytes()
                made_by = "input" if t.grad_fn is None else type(t.grad_fn).__name__.removesuffix("Backward0")
                producers.setdefault(key, (made_by, str(t.dtype).removeprefix("torch."), storage.nbytes()))
            return t

        self.opt.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = self.forward_loss()
        loss.backward()
        self.opt.zero_grad(set_to_none=True)
        out: dict[str, Any] = {
            "activation_bytes": sum(saved.values()),
            "activation_profile": activation_profile(producers.values()),
            "saved_weight_copy_bytes": sum(v for k, v in weights.items() if k[0] not in self._param_ptrs()),
            "traces_per_step": 0,
            "traces_note": "eager: nothing is traced or compiled",
            **self.fp8_figures(),
        }
        if self.compiled is not None:
            stats = self.compile_stats
            out.update(stats)
            out["traces_total"] = stats["frames_compiled"]
            out["traces_per_step"] = stats["frames_compiled_after_warmup"] / max(1, stats["steps"] - 1)
            out["traces_note"] = (
                f"torch.compile (inductor): {stats['frames_compiled']} frames compiled, {stats['graphs']} graphs, "
                f"{stats['graph_breaks']} graph breaks, {stats['frames_compiled_after_warmup']} compiles after "
                "the first step; activations measured eagerly"
            )
        if self.device.type == "cuda":
            out["host_syncs_per_step"] = self._count_syncs()
        return out

    def _param_ptrs(self) -> set[int]:
        return {p.untyped_storage().data_ptr() for p in self.net.parameters()}

    def _count_syncs(self) -> int:
        previous = torch.cuda.get_sync_debug_mode()
        try:
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self.step()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        return sum("synchroniz" in str(w.message) for w in caught)


def configs(model: str, size: str, policies: list[str], device: str, slow: dict[str, str],
            compile: bool = False) -> list[Config]:  # fmt: skip
    """The configurations to time; ``compile``: also ``native-compiled`` and ``mpx-compiled`` per policy."""
    dev = torch.device(device)
    base = build(model, size, dev)

    def make(full_mode: str, policy: mpx.Policy | None) -> Any:
        mode = full_mode.removesuffix("-compiled")
        compiled = full_mode != mode

        def build_runner() -> Runner:
            runner = _build_runner()
            if compiled:
                import torch._dynamo

                # every configuration compiles the same code objects (the step, the optimizer's) for its own
                # objects in this one process: a limit of 8 per code would run later configurations eagerly
                torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
                torch._dynamo.config.accumulated_recompile_limit = max(
                    torch._dynamo.config.accumulated_recompile_limit, 4096
                )
                runner.compiled = torch.compile(runner._body)
            return runner

        def _build_runner() -> Runner:
            net, x, y, loss = copy.deepcopy(base[0]), base[1], base[2], base[3]
            if mode == "fp32" or policy is None:
                return Runner(net, x, y, loss, contextlib.nullcontext, None, dev)
            if mode.startswith("native"):
                param, compute = _DT[policy.param_dtype], _DT[policy.compute_dtype]
                net = net.to(param)
                xin = x.to(param)
                ctx = (
                    (lambda: torch.autocast(dev.type, dtype=compute))
                    if compute != param
                    else contextlib.nullcontext
                )
                scaler = None
                if policy.compute_dtype == "float16" and mode == "native":
                    scaler = torch.amp.GradScaler(dev.type)
                return Runner(net, xin, y, loss, ctx, scaler, dev)
            net = mpx_torch.prepare(net, policy, device_type=dev.type)
            xin = x.to(_DT[policy.param_dtype])
            config = mpx.ScalerConfig.for_policy(policy)
            scaler = None
            if mode == "mpx" and config.kind != "none":
                scaler = mpx_torch.GradScaler(config, device=dev.type)
            return Runner(net, xin, y, loss, contextlib.nullcontext, scaler, dev)

        return build_runner

    out = plan(policies, slow, make)
    if compile:
        out.append(Config("fp32-compiled", "float32", "fp32-compiled", make("fp32-compiled", None)))
        for cfg in [c for c in out if c.mode == "native"]:  # each half-precision policy once
            for mode in ("native-compiled", "mpx-compiled"):
                out.append(Config(f"{cfg.policy}/{mode}", cfg.policy, mode,
                                  make(mode, mpx.get_policy(cfg.policy)), cfg.skip))  # fmt: skip
    return out
