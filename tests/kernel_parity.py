"""The parity checks every backend's table runs against the numpy table, on hypothesis-drawn inputs.

One helper for every suite (tests/conftest.py puts this folder on ``sys.path``; it imports no
framework).  A backend's ``tests/<backend>/test_kernel_parity.py`` does::

    import kernel_parity
    globals().update(kernel_parity.make_tests(lambda: MyOps()))

and gets one test per kernel (:data:`KERNELS`): each draws inputs (random, subnormal, inf,
NaN, zeros, huge and tiny scales, every format and recipe, scaler configs and flag sequences),
runs the kernel with the backend's table on ``ops.from_numpy`` copies and with
:data:`mpx.kernels.NUMPY_OPS`, and requires the same bits (a NaN matches a NaN: frameworks
disagree on the NaN byte of e5m2).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mpx
from mpx.blocks import PRESETS as BLOCK_PRESETS
from mpx.blocks import BlockRecipe
from mpx.kernels import NUMPY_OPS, ArrayOps
from mpx.kernels import blocks as kb
from mpx.kernels import blockwise as kbw
from mpx.kernels import elements as ke
from mpx.kernels import float8 as kf
from mpx.kernels import hadamard as kh
from mpx.kernels import ring as kr
from mpx.kernels import rounding as kround
from mpx.kernels import scale as ks

__all__ = ["KERNELS", "assert_same_bits", "make_tests"]

_SPECIAL = [0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 2.0**-149, -(2.0**-149), 2.0**-126, 1e-40,
            3.4028235e38, -3.4028235e38, 448.0, 449.0, 57344.0, 65504.0, 1e-12, 0.5]  # fmt: skip


def _f32(bits: int) -> float:
    return float(np.int32(bits).view(np.float32))


#: float32 values of every kind: raw bit patterns (subnormals, NaNs, infs included), specials, plain floats
FLOAT32 = st.one_of(
    st.integers(-(2**31), 2**31 - 1).map(_f32),
    st.sampled_from(_SPECIAL),
    st.floats(-1e6, 1e6, width=32),
    st.integers(0, 0x00FFFFFF).map(_f32),  # subnormals and the smallest normals
)
#: non-negative amaxes: what ``max(|x|)`` gives (zeros, subnormals, inf and NaN included)
AMAX = st.one_of(
    st.integers(0, 0x7FFFFFFF).map(_f32),
    st.sampled_from([0.0, 1e-12, 9.99e-13, 1e-45, np.inf, np.nan, 448.0, 3.4028235e38]),
    st.floats(0.0, 1e4, width=32),
)
#: positive finite scales, subnormal to huge
SCALE = st.one_of(
    st.integers(1, 0x7F7FFFFF).map(_f32),
    st.sampled_from([1.0, 224.0, 2.0**-126, 2.0**-149, 3.4028235e38, 65536.0]),
)
RECIPES = st.builds(
    mpx.Float8Recipe,
    format=st.sampled_from(["hybrid", "e4m3"]),
    scaling=st.sampled_from(["delayed", "current"]),
    amax_history_len=st.integers(1, 6),
    amax_compute=st.sampled_from(["max", "most_recent"]),
    margin=st.one_of(st.integers(0, 4), st.sampled_from([40, 300, 1000])),
    power_of_two=st.booleans(),
)
ROLES = st.sampled_from(["input", "weight", "grad"])
FACTORS = st.one_of(
    st.floats(1.0, 2.0**32, exclude_min=True),
    st.floats(2.0**-32, 1.0, exclude_max=True),
    st.sampled_from([2.0, 0.5, 0.9, 1.1, 1.333333412806193]),
)


@st.composite
def scaler_configs(draw: Any) -> mpx.ScalerConfig:
    kind = draw(st.sampled_from(["dynamic", "dynamic", "static", "none"]))
    lo = draw(st.sampled_from([1.0, None, 2.0**-126, 0.25]))
    hi = draw(st.sampled_from([2.0**24, None, 2.0**127, 3.4028235e38]))
    init = draw(st.sampled_from([2.0**16, 1.0, 2.0**24, 3.0]))
    if lo is not None and init < lo:
        init = lo
    if hi is not None and init > hi:
        init = hi
    return mpx.ScalerConfig(
        kind=kind,
        init_scale=init,
        # factors a float32 cannot hold (1.0000001, 1.1, 0.9, 0.3) act as their float64 values
        growth_factor=draw(st.sampled_from([2.0, 1.5, 2.0**32, 1.333333412806193, 1.0000001, 1.1])),
        backoff_factor=draw(st.sampled_from([0.5, 0.9, 2.0**-32, 0.3, 0.7])),
        growth_interval=draw(st.integers(1, 4)),
        min_scale=lo,
        max_scale=hi,
        hysteresis=draw(st.integers(1, 3)),
        hysteresis_reset=draw(st.sampled_from(["finite", "growth"])),
        first_growth_delay=draw(st.integers(0, 2)),
        on_floor=draw(st.sampled_from(["keep", "raise"])),
        skip_nonfinite=draw(st.sampled_from([None, True, False])),
    )


def _bits_view(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype == np.bool_:
        return x
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def assert_same_bits(got: Any, want: Any, what: str) -> None:
    """``got`` (numpy) has ``want``'s dtype, shape and bits; NaNs match NaNs."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, want {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape}, want {want.shape}"
    if want.dtype.kind == "f" or "float8" in want.dtype.name:
        nan_g, nan_w = np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))
        assert (nan_g == nan_w).all(), f"{what}: NaN at {np.argwhere(nan_g != nan_w)[:3].tolist()}"
        got, want = np.where(nan_w, 0, _bits_view(got)), np.where(nan_w, 0, _bits_view(want))
    else:
        got, want = _bits_view(got), _bits_view(want)
    bad = np.argwhere(got != want)
    assert bad.size == 0, (
        f"{what}: bits differ at {bad[:3].tolist()}: got {got.reshape(-1)[:8]}, want {want.reshape(-1)[:8]}"
    )


def _run(
    o: ArrayOps,
    fn: Callable[..., Any],
    inputs: tuple[Any, ...],
    compile_with: Callable[..., Any] | None = None,
) -> list[np.ndarray]:
    arrays = [i for i, x in enumerate(inputs) if isinstance(x, (np.ndarray, np.generic))]
    args = list(inputs)
    for i in arrays:
        args[i] = o.from_numpy(np.asarray(inputs[i]))
    if compile_with is None:
        out = fn(o, *args)
    else:  # one compiled function of the array inputs (everything else is static, as a config is)

        def inner(*traced: Any) -> Any:
            full = list(args)
            for i, a in zip(arrays, traced, strict=True):
                full[i] = a
            return fn(o, *full)

        out = compile_with(inner)(*(args[i] for i in arrays))
    outs = out if isinstance(out, tuple) else (out,)
    return [o.to_numpy(x) for x in outs]


def check(
    o: ArrayOps,
    name: str,
    fn: Callable[..., Any],
    *inputs: Any,
    compile_with: Callable[..., Any] | None = None,
) -> None:
    """Run ``fn(ops, *inputs)`` with ``o`` and with numpy; every output's bits must agree.

    ``compile_with``: None to run eagerly, or the backend's compiler (``jax.jit``, ``tf.function``...):
    then ``o``'s run is one compiled function of the array inputs.
    """
    want = _run(NUMPY_OPS, fn, inputs)
    got = _run(o, fn, inputs, compile_with)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same_bits(g, w, f"{name} ({o!r}) output {i} for inputs {inputs!r}")


# -- the kernels, as (strategy of inputs, function of (ops, *inputs)) --------------------------------------


def _quantize(o: ArrayOps, x: Any, scale: Any, fmt: str) -> Any:
    return kf.quantize(o, x, scale, fmt)


def _compute_scale(o: ArrayOps, recipe: Any, amax: Any, fmt: str, prev: Any) -> Any:
    return kf.compute_scale(o, recipe, amax, fmt, prev)


def _update_tensor(o: ArrayOps, recipe: Any, role: str, scale: Any, hist: Any, amax: Any, skip: Any) -> Any:
    return kf.update_tensor(o, recipe, role, scale, hist, amax, skip)


def _window_max(o: ArrayOps, a: Any, b: Any) -> Any:
    return kf.window_max(o, a, b)


def _abs_max(o: ArrayOps, x: Any) -> Any:
    return mpx.kernels.bits.abs_max(o, x)


def _scale_trace(o: ArrayOps, config: mpx.ScalerConfig, flags: Any) -> Any:
    state = ks.initial(o, config)
    outs = []
    for i in range(flags.shape[0]):
        before, tracker = state.scale, state.growth_tracker
        state = ks.update(o, config, state, flags[i])
        outs.extend(state)
        hit = ks.floor_hit(o, config, before, state)
        outs.append(o.cast(hit, "int32") if hit is not False else o.int32(0))
        outs.append(ks.events(o, config, tracker, state))  # the history's event bits
    return tuple(outs)


def _product_bits(o: ArrayOps, scales: Any, factor: float) -> Any:
    split = mpx.scaling.split_factor(factor)
    return ks.product_bits(o, o.bitcast(scales, "int32"), split), ks.scale_product_bits(
        o, scales, factor, split
    )


def _ring(o: ArrayOps, rows: Any, values: Any, when: Any) -> Any:
    recorded = o.int32(0)
    for i in range(values.shape[0]):
        row = kr.row(o, values[i], i, i % 3, i + 1)
        rows, recorded = kr.record(o, rows, recorded, row, when[i])
    return rows, recorded


def _round_bf16(o: ArrayOps, x: Any) -> Any:
    return kround.round_bf16(o, x)


def _stochastic_round(o: ArrayOps, x: Any, seed: int, step: Any, param: int) -> Any:
    return kround.stochastic_round_bf16(o, x, seed=seed, step=step, param=param)


def _kahan_add(o: ArrayOps, w: Any, c: Any, u: Any) -> Any:
    return kround.kahan_add(o, w, c, u)


def _blockwise(o: ArrayOps, flat: Any, block: int) -> Any:
    q, absmax = kbw.quantize(o, flat, block)
    return q, absmax, kbw.dequantize(o, q, absmax, int(flat.shape[0]))


def _arr(values: list[float]) -> np.ndarray:
    return np.asarray(values, np.float32)


_X = st.lists(FLOAT32, min_size=1, max_size=40).map(_arr)
_PAIR = st.integers(1, 12).flatmap(
    lambda n: st.tuples(*(st.lists(FLOAT32, min_size=n, max_size=n).map(_arr) for _ in range(2)))
)
# one shape per new kernel (eager JAX compiles each primitive once per shape): the values vary, not the sizes
_X16 = st.lists(FLOAT32, min_size=16, max_size=16).map(_arr)
_HISTORY = st.lists(AMAX.filter(np.isfinite), min_size=6, max_size=6)
_SKIP = st.sampled_from([None, np.asarray(True), np.asarray(False)])


#: normal magnitudes in [2**-100, 2**100] and zeros: no float32 sum of them is subnormal (the Kahan kernel's
#: float32 adds are the table's; XLA and TensorFlow flush subnormal sums)
_NORMAL = st.one_of(
    st.just(0.0), st.floats(2.0**-100, 2.0**100, width=32), st.floats(-(2.0**100), -(2.0**-100), width=32)
)


def _bf16(values: list[float]) -> np.ndarray:
    return np.asarray(values, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _kahan_inputs(n: int) -> Any:
    return st.tuples(
        *(st.lists(_NORMAL, min_size=n, max_size=n).map(_bf16) for _ in range(2)),
        st.lists(_NORMAL, min_size=n, max_size=n).map(_arr),
    )


def _tensor_inputs(t: tuple[Any, ...]) -> tuple[Any, ...]:
    recipe, role, scale, history, amax, skip = t
    hist = _arr(history[: recipe.amax_history_len]) if recipe.scaling == "delayed" else _arr([])
    return recipe, role, np.float32(scale), hist, np.float32(amax), skip


def _blocks(o: ArrayOps, x: Any, name: str, role: str, axis: int) -> Any:
    recipe = BLOCK_RECIPES[name]
    q = kb.quantize(o, x, recipe, role, axis)
    ts = o.float32(0.0) if q.tensor_scale is None else q.tensor_scale
    return q.codes, q.scales, ts, kb.dequantize(o, q, recipe, role, axis)


def _elements(o: ArrayOps, x: Any, fmt: str, shift: int) -> Any:
    codes = ke.encode(o, x, fmt, shift)
    return codes, ke.decode(o, codes, fmt)


#: the block recipes the parity tests draw: every round-to-nearest preset (the randomized ones, which take a
#: seed, are RANDOM_RECIPES'), and the E8M0 rules with FP6 and e5m2 elements
BLOCK_RECIPES = {
    **{n: r for n, r in BLOCK_PRESETS.items() if r.rounding == "nearest" and not r.hadamard},
    "e5m2_even": BlockRecipe(element="e5m2", scale_rule="even", weight_block="8x8"),
    "e2m3_rceil": BlockRecipe(element="e2m3", scale_rule="rceil", input_block="1x4"),
    "e3m2_tensor": BlockRecipe(element="e3m2", input_block="tensor", grad_block="row"),
    "e5m2_f32": BlockRecipe(element="e5m2", scale="float32", scale_rule="nearest"),
}


#: the randomized block recipes (stochastic rounding of gradients, the Hadamard transform of wgrad operands)
RANDOM_RECIPES = {
    "nvfp4_te": BLOCK_PRESETS["nvfp4_te"],
    "mxfp8_sr_rht": BlockRecipe(rounding="stochastic", hadamard=True, scale_rule="rceil"),
    "blockwise_sr": BlockRecipe(input_block="1x8", grad_block="1x8", scale="pow2", rounding="stochastic"),
}


def _blocks_random(o: ArrayOps, x: Any, name: str, role: str, axis: int, seed: int, step: Any) -> Any:
    recipe = RANDOM_RECIPES[name]
    q = kb.quantize(o, x, recipe, role, axis, seed=seed, step=step, index=7)
    ts = o.float32(0.0) if q.tensor_scale is None else q.tensor_scale
    return q.codes, q.scales, ts, kb.dequantize(o, q, recipe, role, axis)


def _rht(o: ArrayOps, x: Any, mask: Any, axis: int) -> Any:
    return kh.rht(o, x, mask, axis)


def _random_block_inputs(t: tuple[Any, ...]) -> tuple[Any, ...]:
    (x, _, _, axis), name, role, seed, step = t
    return x, name, role, axis, seed, step


def _rht_inputs(t: tuple[Any, ...]) -> tuple[Any, ...]:
    (x, _, _, axis), mask = t
    return x, np.asarray(mask, np.int32), axis


@st.composite
def _block_inputs(draw: Any) -> tuple[Any, ...]:
    rows, cols = 17, 33  # one shape no block divides (eager JAX compiles each op per shape: keep it one)
    kind = draw(st.sampled_from(["any", "normal", "zero_rows"]))
    if kind == "any":
        x = np.asarray(draw(st.lists(FLOAT32, min_size=rows * cols, max_size=rows * cols)), np.float32)
    else:
        seed = draw(st.integers(0, 2**16))
        rng = np.random.default_rng(seed)
        x = (rng.standard_normal(rows * cols) * np.exp(rng.uniform(-90, 90))).astype(np.float32)
        if kind == "zero_rows":
            x[: cols * (rows // 2)] = 0.0
    name = draw(st.sampled_from(sorted(BLOCK_RECIPES)))
    return x.reshape(rows, cols), name, draw(ROLES), draw(st.sampled_from([0, 1]))


#: name -> (strategy of the inputs tuple, the function run with each table)
KERNELS: dict[str, tuple[Any, Callable[..., Any]]] = {
    "quantize": (
        st.tuples(_X, SCALE.map(np.float32), st.sampled_from(["e4m3", "e5m2"])),
        _quantize,
    ),
    "compute_scale": (
        st.tuples(RECIPES, AMAX.map(np.float32), st.sampled_from(["e4m3", "e5m2"]), SCALE.map(np.float32)),
        _compute_scale,
    ),
    "update_tensor": (
        st.tuples(RECIPES, ROLES, SCALE, _HISTORY, AMAX, _SKIP).map(_tensor_inputs),
        _update_tensor,
    ),
    "window_max": (_PAIR, _window_max),
    "abs_max": (st.tuples(_X), _abs_max),
    "scale_update": (
        st.tuples(scaler_configs(), st.lists(st.booleans(), min_size=1, max_size=12).map(np.asarray)),
        _scale_trace,
    ),
    "product_bits": (
        st.tuples(
            st.lists(st.integers(0x00800000, 0x7F7FFFFF), min_size=1, max_size=16).map(
                lambda b: np.asarray(b, np.int32).view(np.float32)
            ),
            FACTORS,
        ),
        _product_bits,
    ),
    "round_bf16": (st.tuples(_X16), _round_bf16),
    "stochastic_round": (
        st.tuples(
            _X16,
            st.integers(0, 2**32 - 1),
            st.one_of(st.integers(0, 2**31 - 1), st.integers(0, 2**31 - 1).map(np.int32)),
            st.integers(0, 2**20),
        ),
        _stochastic_round,
    ),
    "kahan_add": (st.just(8).flatmap(_kahan_inputs), _kahan_add),
    "blockwise_int8": (
        st.tuples(
            st.lists(FLOAT32.filter(np.isfinite), min_size=24, max_size=24).map(_arr),
            st.sampled_from([4, 32]),
        ),
        _blockwise,
    ),
    "blocks": (_block_inputs(), _blocks),
    "blocks_random": (
        st.tuples(
            _block_inputs(),
            st.sampled_from(sorted(RANDOM_RECIPES)),
            st.sampled_from(["input", "grad"]),
            st.integers(0, 2**32 - 1),
            st.one_of(st.integers(0, 2**31 - 1), st.integers(0, 2**31 - 1).map(np.int32)),
        ).map(_random_block_inputs),
        _blocks_random,
    ),
    "hadamard": (
        st.tuples(_block_inputs(), st.lists(st.integers(0, 1), min_size=16, max_size=16)).map(_rht_inputs),
        _rht,
    ),
    "elements": (
        st.tuples(
            st.lists(FLOAT32, min_size=24, max_size=24).map(_arr),
            st.sampled_from(sorted(ke.ELEMENT_FORMATS)),
            st.sampled_from([0, 7, -9, 126, 140, -127]),
        ),
        _elements,
    ),
    "ring": (
        st.tuples(
            st.integers(1, 4).map(lambda n: np.zeros((n, 4), np.int32)),
            st.lists(SCALE, min_size=1, max_size=9).map(_arr),
            st.lists(st.booleans(), min_size=9, max_size=9).map(np.asarray),
        ),
        _ring,
    ),
}


#: kernels run with fewer examples than a backend asks for (a 10-round generator is many ops per call)
_MAX_EXAMPLES = {"round_bf16": 10, "stochastic_round": 6, "kahan_add": 8, "blockwise_int8": 5}
#: per kernel, the hypothesis examples eagerly and compiled, where fewer than make_tests' own (eager JAX
#: compiles every op for each new block geometry: about 3 s an example)
_FEW = {"blocks": (3, 3), "blocks_random": (3, 2), "hadamard": (3, 2), "elements": (10, 3)}


def make_tests(
    make_ops: Callable[[], ArrayOps],
    max_examples: int = 60,
    *,
    compile_with: Callable[..., Any] | None = None,
    suffix: str = "",
    kernels: tuple[str, ...] | None = None,
) -> dict[str, Callable[..., None]]:
    """``{test_kernel_parity_<name><suffix>: test}`` for every kernel (or those named in ``kernels``):
    the backend's table against numpy.

    ``make_ops`` is called once per test run (lazily, so collecting imports nothing heavy).
    ``compile_with``: run the backend's side as one compiled function (see :func:`check`); give the
    tests a ``suffix`` then (``"_under_jit"``), so they sit beside the eager ones.
    """
    tests: dict[str, Callable[..., None]] = {}
    for name, (strategy, fn) in KERNELS.items():
        if kernels is not None and name not in kernels:
            continue
        test = _parity_test(make_ops, name, fn, compile_with, suffix)
        few = _FEW.get(name)  # the block kernels: few examples (every backend, eager and compiled)
        examples = min(max_examples, _MAX_EXAMPLES.get(name, max_examples))
        examples = examples if few is None else few[compile_with is not None]
        test = settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])(
            given(strategy)(test)
        )
        tests[test.__name__] = test
    return tests


def _parity_test(
    make_ops: Callable[[], ArrayOps],
    name: str,
    fn: Callable[..., Any],
    compile_with: Callable[..., Any] | None,
    suffix: str,
) -> Callable[..., None]:
    def test(inputs: tuple[Any, ...]) -> None:
        check(make_ops(), name, fn, *inputs, compile_with=compile_with)

    test.__name__ = test.__qualname__ = f"test_kernel_parity_{name}{suffix}"
    return test
