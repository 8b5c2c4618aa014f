"""The PyTorch functions behind each canonical op of :data:`mpx.OP_TABLE`.

Each op maps to the function objects a ``TorchFunctionMode`` receives for it
(``torch.softmax``, ``torch.Tensor.softmax``, ``F.softmax``...), each with the
class torch's own autocast gives it on *every* device (``None`` where the
devices disagree or torch's class is not one of mpx's).  The autocast mode
installs a handler only where the policy's class differs from that native
class, so ops torch already gets right cost one dict look-up.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from mpx import OpClass

__all__ = ["FUNCTIONS", "PROMOTE_EXCEPT_HALF_MIX", "RUNNING_STATS"]

_T = torch.Tensor
L, P, N = OpClass.LOWER, OpClass.PROMOTE, OpClass.PASSTHROUGH

#: Native class of ``cat`` and ``stack``: torch promotes, except that CPU
#: autocast raises ("Unexpected floating ScalarType in at::autocast::prioritize")
#: for a float16 + bfloat16 mix, so mpx casts such mixes to float32 first.
PROMOTE_EXCEPT_HALF_MIX = "promote-except-half-mix"
PH = PROMOTE_EXCEPT_HALF_MIX


def _existing(
    *pairs: tuple[object | None, OpClass | str | None],
) -> tuple[tuple[Callable, OpClass | str | None], ...]:
    return tuple((f, native) for f, native in pairs if f is not None)  # type: ignore[misc]


def _get(obj: object, name: str) -> object | None:
    return getattr(obj, name, None)


_special = torch.special
_linalg = torch.linalg

#: canonical op -> ((function, native class on every device or None), ...)
FUNCTIONS: dict[str, tuple[tuple[Callable, OpClass | str | None], ...]] = {
    # LOWER: torch lowers these on CPU and CUDA alike
    "matmul": _existing(
        (torch.matmul, L), (_T.matmul, L), (_T.__matmul__, L), (_get(_T, "__rmatmul__"), L),
        (torch.mm, L), (_T.mm, L), (torch.addmm, L), (_T.addmm, L),
    ),
    "linear": _existing((F.linear, L)),
    "conv": _existing((F.conv1d, L), (F.conv2d, L), (F.conv3d, L)),
    "conv_transpose": _existing((F.conv_transpose1d, L), (F.conv_transpose2d, L), (F.conv_transpose3d, L)),
    "bmm": _existing((torch.bmm, L), (_T.bmm, L), (torch.baddbmm, L), (_T.baddbmm, L)),
    "einsum": _existing((torch.einsum, L)),
    "attention": _existing((F.scaled_dot_product_attention, L)),
    # FLOAT32: torch's CPU lists leave most of these in the input's dtype
    "softmax": _existing((torch.softmax, None), (_T.softmax, None), (F.softmax, None), (_special.softmax, None)),
    "log_softmax": _existing(
        (torch.log_softmax, None), (_T.log_softmax, None), (F.log_softmax, None), (_special.log_softmax, None),
    ),
    "layer_norm": _existing((F.layer_norm, None), (torch.layer_norm, None)),
    "batch_norm": _existing((F.batch_norm, None), (torch.batch_norm, None)),
    "group_norm": _existing((F.group_norm, None), (torch.group_norm, None)),
    "rms_norm": _existing((_get(F, "rms_norm"), None), (_get(torch, "rms_norm"), None)),
    "cross_entropy": _existing((F.cross_entropy, None)),
    "nll_loss": _existing((F.nll_loss, None)),
    "mse_loss": _existing((F.mse_loss, None)),
    "bce_with_logits": _existing(
        (F.binary_cross_entropy_with_logits, None), (torch.binary_cross_entropy_with_logits, None)
    ),
    "exp": _existing(
        (torch.exp, None), (_T.exp, None), (torch.exp2, None), (_T.exp2, None),
        (torch.expm1, None), (_T.expm1, None), (_special.exp2, None), (_special.expm1, None),
    ),
    "log": _existing(
        (torch.log, None), (_T.log, None), (torch.log2, None), (_T.log2, None), (torch.log10, None),
        (_T.log10, None), (torch.log1p, None), (_T.log1p, None), (_special.log1p, None),
    ),
    "pow": _existing((torch.pow, None), (_T.pow, None), (_T.__pow__, None), (_T.__rpow__, None)),
    "sum": _existing((torch.sum, None), (_T.sum, None), (torch.nansum, None), (_T.nansum, None)),
    "mean": _existing((torch.mean, None), (_T.mean, None), (torch.nanmean, None), (_T.nanmean, None)),
    "cumsum": _existing((torch.cumsum, None), (_T.cumsum, None)),
    "prod": _existing((torch.prod, None), (_T.prod, None)),
    "logsumexp": _existing((torch.logsumexp, None), (_T.logsumexp, None), (_special.logsumexp, None)),
    "vector_norm": _existing(
        (_linalg.vector_norm, None), (_linalg.norm, None), (torch.norm, None), (_T.norm, None)
    ),
    # PROMOTE: torch's type promotion (and its CPU promote list for cat and stack)
    "add": _existing(
        (torch.add, P), (_T.add, P), (_T.__add__, P), (_T.__radd__, P),
        (torch.sub, P), (_T.sub, P), (_T.__sub__, P), (_T.__rsub__, P),
    ),
    "mul": _existing((torch.mul, P), (_T.mul, P), (_T.__mul__, P), (_T.__rmul__, P)),
    "cat": _existing((torch.cat, PH), (_get(torch, "concat"), PH), (_get(torch, "concatenate"), PH)),
    "stack": _existing((torch.stack, PH)),
    "where": _existing((torch.where, P), (_T.where, P)),
    # PASSTHROUGH: the input's dtype (torch's CPU list sends max_pool3d to float32)
    "relu": _existing((torch.relu, N), (_T.relu, N), (F.relu, N)),
    "gelu": _existing((F.gelu, N)),
    "max_pool": _existing((F.max_pool1d, N), (F.max_pool2d, N), (F.max_pool3d, None)),
    "reshape": _existing((torch.reshape, N), (_T.reshape, N), (_T.view, N)),
    "transpose": _existing((torch.transpose, N), (_T.transpose, N), (torch.t, N), (_T.t, N)),
    "dropout": _existing((F.dropout, N)),
    "embedding": _existing((F.embedding, N)),
}  # fmt: skip

#: Positions and keywords of the running statistics of the batch-norm functions,
#: which they update in place (so a cast copy must be written back).
RUNNING_STATS: dict[Callable, tuple[tuple[int, str], ...]] = {
    F.batch_norm: ((1, "running_mean"), (2, "running_var")),
    torch.batch_norm: ((3, "running_mean"), (4, "running_var")),
}
