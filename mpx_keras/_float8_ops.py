"""The FP8 GEMM of :mod:`mpx_keras.float8` in ``keras.ops``, on the core's FP8 kernels.

The arithmetic is :mod:`mpx.kernels.float8`'s, run with :data:`~mpx_keras._array_ops.KERAS_ARRAY_OPS`
on every Keras backend (TensorFlow, JAX, PyTorch): quantize (``mpx.float8.quantize``'s bytes, NaN as
NaN), ``compute_scale``, the amax history (``record``, ``window``) and ``max(|x|)``
(:func:`mpx.kernels.bits.abs_max`).  What is Keras's own stays here:

* :func:`fp8_contract` is the FP8 GEMM (``mpx.float8.fp8_dot``, up to float32 rounding of the
  sums) with a ``keras.ops.custom_gradient``: e4m3 input and kernel, the output gradient in e5m2
  under ``hybrid``, dgrad and wgrad from the quantized operands, and the FP8 state's next values
  as the "gradients" of its variables (Keras's ``overwrite_with_gradient``);
* :func:`contraction`: the einsum equations of a Dense or EinsumDense and of its backward GEMMs.
"""

from __future__ import annotations

import math
import string
from collections.abc import Sequence
from typing import Any

import keras

from mpx import float8 as core
from mpx.float8 import Float8Recipe
from mpx.kernels import bits
from mpx.kernels import float8 as fp8_kernels
from mpx_keras._array_ops import KERAS_ARRAY_OPS

__all__ = ["KERAS_FORMATS", "contraction", "fp8_contract", "quantize"]

ops = keras.ops
_O = KERAS_ARRAY_OPS
#: The Keras dtype name of each FP8 format of :data:`mpx.float8.FORMATS`.
KERAS_FORMATS = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}


def quantize(x: Any, scale: Any, fmt: str) -> Any:
    """``fp8(clip(float32(x) * float32(scale), -fp8_max, fp8_max))`` as a Keras tensor of the FP8 dtype
    (:func:`mpx.kernels.float8.quantize` with the ``keras.ops`` table; ``fmt``: ``"e4m3"`` or ``"e5m2"``)."""
    return fp8_kernels.quantize(_O, x, scale, fmt)


# -- the FP8 GEMM ---------------------------------------------------------------------------------------


def contraction(equation: str | None, x_ndim: int) -> tuple[str, str, str]:
    """The three einsum equations (forward, dgrad, wgrad) of a Dense (``equation`` None) or EinsumDense.

    An ellipsis is spelled out for ``x_ndim``; every index of an operand must appear in the other
    operand or the output, once per operand (the backward GEMMs are einsums of the same indices).

    Raises:
        mpx.Float8Error: for an equation whose backward is not such a pair of einsums.
    """
    if equation is None:
        letters = string.ascii_lowercase[: x_ndim - 1]
        x, w, out = letters + "y", "yz", letters + "z"
    else:
        spec = equation.replace(" ", "")
        try:
            inputs, out = spec.split("->")
            x, w = inputs.split(",")
        except ValueError:
            raise core.Float8Error(
                f"equation: {equation!r} is not an 'x,w->out' einsum equation; FP8 needs one"
            ) from None
        if "..." in x:
            free = [c for c in string.ascii_letters if c not in spec]
            fill = "".join(free[: x_ndim - len(x.replace("...", ""))])
            x, w, out = (part.replace("...", fill) for part in (x, w, out))
        for name, part, others in (("input", x, w + out), ("kernel", w, x + out), ("output", out, x + w)):
            if "." in part or len(set(part)) != len(part) or any(c not in others for c in part):
                raise core.Float8Error(
                    f"equation: {equation!r}: each index of the {name} must appear once in it and in another "
                    "operand for an FP8 EinsumDense (its backward GEMMs are einsums of the same indices)"
                )
    return f"{x},{w}->{out}", f"{out},{w}->{x}", f"{x},{out}->{w}"


def _nan_unless(ok: Any, y: Any) -> Any:
    return ops.where(ok, y, math.nan)


def fp8_contract(
    recipe: Float8Recipe,
    equations: tuple[str, str, str],
    x: Any,
    kernel: Any,
    state: Sequence[Any],
    training: bool,
) -> Any:
    """``einsum(x, kernel)`` as an FP8 GEMM (a float32 result), differentiable, updating its FP8 state.

    ``state``: ``[input scale, input history, weight scale, weight history, grad scale, grad history]``
    (the histories None under current scaling) as tensors read from the layer's variables.

    Delayed scaling stores, per tensor, the history of the amaxes of steps <= t-1 and the scale step
    t-1 quantized with; step t quantizes with ``compute_scale(window(history), previous=that scale)``,
    which is the scale :func:`mpx.float8.float8_update` computed at the end of step t-1 (its
    keep-previous rule needs the older one).  The "gradients" the optimizer writes are the history with
    this step's amax recorded and the scale this step used.  Stored so, an accumulation window (Keras's
    inner ``gradient_accumulation_steps`` takes the MAX of overwrite-with-gradient values over its
    micro-batches) records the MAX of the micro-batches' amaxes once, and every micro-batch writes the
    same scale: exactly one ``float8_update`` of the window.  Current scaling quantizes each tensor
    with its own amax's scale and records it.

    The forward contracts the quantized ``x`` and ``kernel`` (e4m3) in float32 and multiplies by both
    inverse scales; a non-finite operand makes the result NaN.  The backward quantizes the output
    gradient (e5m2 under ``hybrid``) and computes dgrad and wgrad from the quantized operands the same
    way.  ``training`` False: the state's "gradients" are its values unchanged.
    """
    forward_eq, dgrad_eq, wgrad_eq = equations
    current = recipe.scaling == "current"
    fi, fw, fg = (recipe.format_of(role) for role in core.ROLES)
    names = [(role, i) for i, role in enumerate(core.ROLES)]
    x_dtype = keras.backend.standardize_dtype(x.dtype)
    k_dtype = keras.backend.standardize_dtype(kernel.dtype)
    args = [x, kernel] + [t for t in state if t is not None]

    def unpack(flat: Sequence[Any]) -> list[tuple[Any, Any]]:
        it = iter(flat)
        return [(next(it), None if current else next(it)) for _ in names]

    @ops.custom_gradient
    def gemm(*flat: Any) -> Any:
        xv, kv = flat[0], flat[1]
        tensors = unpack(flat[2:])
        ax, aw = bits.abs_max(_O, xv), bits.abs_max(_O, kv)
        if current:
            sx, sw = (
                fp8_kernels.compute_scale(_O, recipe, ax, fi),
                fp8_kernels.compute_scale(_O, recipe, aw, fw),
            )
            used = [None, None, None]
        else:  # the scales float8_update gave at the end of the last step (see the docstring)
            used = [
                fp8_kernels.compute_scale(_O, recipe, fp8_kernels.window(_O, recipe, h), fmt, s)
                for (s, h), fmt in zip(tensors, (fi, fw, fg), strict=True)
            ]
            sx, sw = used[0], used[1]
        qx = ops.cast(quantize(xv, sx, fi), "float32")
        qw = ops.cast(quantize(kv, sw, fw), "float32")
        inv_x, inv_w = ops.divide(1.0, sx), ops.divide(1.0, sw)
        ok = ops.logical_and(ops.isfinite(ax), ops.isfinite(aw))
        y = _nan_unless(ok, ops.einsum(forward_eq, qx, qw) * inv_x * inv_w)

        def grad(*args: Any, upstream: Any = None, variables: Any = None) -> Any:
            if upstream is None:
                (upstream,) = args
            ag = bits.abs_max(_O, upstream)
            sg = fp8_kernels.compute_scale(_O, recipe, ag, fg) if current else used[2]
            qg = ops.cast(quantize(upstream, sg, fg), "float32")
            inv_g = ops.divide(1.0, sg)
            ok_g = ops.logical_and(ok, ops.isfinite(ag))
            dx = _nan_unless(ok_g, ops.einsum(dgrad_eq, qg, qw) * inv_g * inv_w)
            dk = _nan_unless(ok_g, ops.einsum(wgrad_eq, qx, qg) * inv_x * inv_g)
            out = [ops.cast(dx, x_dtype), ops.cast(dk, k_dtype)]
            for (role, _), (scale, history), observed, this in zip(
                names, tensors, (ax, aw, ag), used, strict=True
            ):
                if training and current:
                    scale = fp8_kernels.compute_scale(_O, recipe, observed, recipe.format_of(role), scale)
                elif training:
                    scale, history = this, fp8_kernels.record(_O, history, observed)
                out.append(ops.convert_to_tensor(scale) + 0.0)
                if history is not None:
                    out.append(ops.convert_to_tensor(history) + 0.0)
            return tuple(out)

        return y, grad

    return gemm(*args)
