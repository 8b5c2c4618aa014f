"""The core's kernels (mpx.kernels) run with mpx_torch's table give the numpy table's bits, on hypothesis-drawn
inputs (subnormals, infs, NaNs, huge and tiny scales, every format and recipe, scaler configs): see
tests/kernel_parity.py.  CPU tensors; these tests are what proves the table's flags (exact_float32, float64)."""

import kernel_parity
import numpy as np
import pytest
import torch
from torch._dynamo.testing import CompileCounter

import mpx
from mpx.kernels import NUMPY_OPS, bits
from mpx.kernels import float8 as kf
from mpx.kernels import ring as kr
from mpx.kernels import scale as ks
from mpx_torch._array_ops import TorchOps, ops_for

OPS = TorchOps("cpu")

globals().update(kernel_parity.make_tests(lambda: OPS))


def test_flags_are_torchs_arithmetic():
    assert OPS.exact_float32 and OPS.float64 and not TorchOps("mps").float64
    tiny = torch.tensor(2.0**-140)  # a subnormal operand and a subnormal product are kept
    assert (tiny * 0.5).item() == 2.0**-141
    assert ops_for("cpu").device == ops_for(torch.device("cpu")).device == torch.device("cpu")


def test_constants_are_made_on_the_tables_device():
    o = TorchOps("meta")  # a device without data: every constant a kernel makes must be made there
    assert o.float32(1.0).device.type == "meta" and o.int32(3).device.type == "meta"
    assert o.where(True, 1, 2).dtype == torch.int32 and o.where(True, 1.0, 2.0).dtype == torch.float32
    # past float32's max a value rounds as a cast does (torch.full alone refuses it)
    assert OPS.float32(1e39).item() == float("inf") and OPS.float32(3.4028235e38).item() == float(
        np.finfo("f4").max
    )


def test_a_ring_row_is_written_in_place():
    rows, recorded = torch.zeros((3, 4), dtype=torch.int32), OPS.int32(0)
    want_rows, want_n = np.zeros((3, 4), np.int32), NUMPY_OPS.int32(0)
    for step in range(5):
        out, recorded = kr.record(OPS, rows, recorded, kr.row(OPS, OPS.float32(2.0 * step), step, 0, step))
        assert out is rows
        want_rows, want_n = kr.record(
            NUMPY_OPS, want_rows, want_n, kr.row(NUMPY_OPS, np.float32(2.0 * step), step, 0, step)
        )
    assert (rows.numpy() == want_rows).all() and int(recorded) == int(want_n) == 5


TRACED = {
    "quantize": lambda o, x: kf.quantize(o, x, o.float32(3.0), "e5m2"),
    "abs_max_window_max": lambda o, x: kf.window_max(o, x, bits.abs_max(o, x)),
    "delayed_update_tensor": lambda o, x: kf.update_tensor(
        o, mpx.Float8Recipe(amax_history_len=8), "grad", x[0], x.abs(), bits.abs_max(o, x), o.lt(x[1], 0)
    ),
    "ring": lambda o, x: kr.record(
        o, o.int32(x.reshape(2, 4)), o.int32(5), kr.row(o, o.max(x), 1, 2, 3), o.lt(0, x[0])
    ),
    "current_compute_scale": lambda o, x: kf.compute_scale(
        o, mpx.Float8Recipe(scaling="current"), bits.abs_max(o, x), "e4m3"
    ),
    "scale_update": lambda o, x: ks.update(
        o, mpx.ScalerConfig(hysteresis=2), ks.initial(o, mpx.ScalerConfig()), o.lt(0, x[0])
    ),
}


@pytest.mark.parametrize("kernel", TRACED.values(), ids=list(TRACED))
def test_kernels_trace_under_dynamo_in_one_graph(kernel):
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(lambda x: kernel(OPS, x), backend=counter, fullgraph=True)
    for values in ([1.0, -3.0, 0.0, 5.0, 2.0, 1e-40, 7.0, 8.0], [9.0, 2.0, -1.0, 4.0, 5.0, 6.0, 7.0, 8.0]):
        x = torch.tensor(values)
        got, want = compiled(x), kernel(OPS, x)
        got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
        for g, w in zip(got, want, strict=True):
            kernel_parity.assert_same_bits(OPS.to_numpy(g), OPS.to_numpy(w), "compiled")
    assert counter.frame_count == 1  # one graph, no recompile for new values
