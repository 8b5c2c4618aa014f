"""The arithmetic mpx runs in training, written once over a table of array operations.

Each backend passes its :class:`ArrayOps` (numpy's, :data:`NUMPY_OPS`, is the reference)
and gets exactly the numpy table's bits:

* :mod:`mpx.kernels.bits`: float32 values through their bits (finite tests, exact products);
* :mod:`mpx.kernels.scale`: the loss scaler's transition (:func:`mpx.scaler_update`);
* :mod:`mpx.kernels.float8`: FP8 quantize, the scale from an amax, the amax history;
* :mod:`mpx.kernels.ring`: the scaler-history ring buffer;
* :mod:`mpx.kernels.rounding`: float32 -> bfloat16 rounding (nearest, stochastic, Kahan);
* :mod:`mpx.kernels.blockwise`: 8-bit block-quantized optimizer state (linear absmax);
* :mod:`mpx.kernels.elements`: FP8/FP6/FP4 element codes (encode, decode);
* :mod:`mpx.kernels.blocks`: block-scaled quantization (MX, NVFP4, blockwise and rowwise FP8);
* :mod:`mpx.kernels.hadamard`: the random Hadamard transform of NVFP4's weight-gradient operands;
* :mod:`mpx.kernels.parity`: the checks a backend's parity test runs against numpy.

No backend defines a float-bit helper, a quantize, a scale update or a ring buffer of
its own; a new rule or format is one kernel here.
"""

from mpx.kernels import bits, blocks, blockwise, elements, float8, hadamard, ring, rounding, scale
from mpx.kernels.array_ops import DTYPE_NAMES, NUMPY_OPS, ArrayOps, NumpyOps

__all__ = [
    "DTYPE_NAMES",
    "NUMPY_OPS",
    "ArrayOps",
    "NumpyOps",
    "bits",
    "blocks",
    "blockwise",
    "elements",
    "float8",
    "hadamard",
    "ring",
    "rounding",
    "scale",
]
