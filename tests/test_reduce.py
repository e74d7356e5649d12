"""ddpwire.plane.reduce against the reference arithmetic, bit for bit.

The reference is numpy float32 arithmetic done one step at a time in input
order, ((x0 + x1) + x2) + ..., then (for the mean, not the total) a division
by k: each numpy step is a correctly rounded IEEE-754 float32 operation, so
any reassociation, fused
multiply-add or reciprocal multiplication in the kernels shows up as a
differing bit. It is the tests' one reference (tests/session_helpers.py).
"""
import array

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ddpwire
from ddpwire import NonFiniteGradient
from ddpwire.plane import reduce as R

from session_helpers import reference_allreduce

PATHS = R.available_paths()
LENGTHS = [0, 1, 7, 4097]
# Large enough that the kernels split it over threads (2 * 2**18 elements).
SPLIT_LEN = (1 << 19) + 4099
# Large enough that a mean streams its stores past the cache on the x86 paths
# even split over two threads (2 * 2**21 elements per range), and not a whole
# number of cache lines or blocks, so each range has a head and a tail too.
STREAM_LEN = (1 << 22) + 4099


def reference(inputs, divide=True):
    """The tests' one reference (tests/session_helpers.py): mean or total."""
    return reference_allreduce(inputs, "avg" if divide else "sum")


#: the two one-pass reductions of k buffers: (kernel, its reference)
KERNELS = {
    "mean": (R.mean, reference),
    "total": (R.total, lambda inputs: reference(inputs, divide=False)),
}


@pytest.fixture(params=sorted(KERNELS))
def kernel(request):
    return KERNELS[request.param]


def bits(a):
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def assert_same_bits(got, want):
    """Bit equality, except that any NaN matches any NaN (payload propagation
    is the CPU's business, not the arithmetic order's)."""
    got = np.asarray(got, dtype=np.float32)
    want = np.asarray(want, dtype=np.float32)
    assert got.shape == want.shape
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(bits(got[~nan]), bits(want[~nan]))


def make_inputs(rng, k, n, offset=0):
    """k float32 buffers of n elements; with offset=1 each starts one element
    into its allocation, so it is only 4-byte aligned."""
    out = []
    for _ in range(k):
        base = (rng.standard_normal(n + offset) * rng.choice([1e-3, 1.0, 1e4])).astype(np.float32)
        out.append(base[offset:])
    return out


@pytest.fixture(params=PATHS)
def path(request):
    with R.use_path(request.param):
        yield request.param


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("offset", [0, 1])
def test_mean_is_bit_exact_and_close(path, kernel, n, k, offset):
    run, want = kernel
    rng = np.random.default_rng(n * 100 + k * 10 + offset)
    inputs = make_inputs(rng, k, n, offset)
    out_base = np.full(n + offset, 7.0, dtype=np.float32)
    out = out_base[offset:]
    got = run(inputs, out=out)
    assert got is out
    assert_same_bits(out, want(inputs))
    wide = np.mean(np.stack([x.astype(np.float64) for x in inputs]), axis=0) if n else np.zeros(0)
    if run is R.total:
        out = out / np.float32(k)  # the same closeness, on the mean's scale
    np.testing.assert_allclose(out, wide, rtol=1e-5 * k, atol=1e-6 * k * np.abs(wide).max(initial=1))
    if offset:
        assert out_base[0] == 7.0  # nothing written before the view


def test_mean_allocates_float32_output():
    inputs = [np.arange(5, dtype=np.float32), np.ones(5, dtype=np.float32)]
    out = R.mean(inputs)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (5,)
    assert_same_bits(out, reference(inputs))


def test_mean_divides_rather_than_multiplies_by_reciprocal():
    # x / 3 and x * (1/3) differ for x = 1.0 in float32 ... find one that does
    xs = np.arange(1, 2000, dtype=np.float32)
    third = np.float32(1) / np.float32(3)
    differs = xs[(xs / np.float32(3)) != (xs * third)]
    assert differs.size  # the test below could fail
    zero = np.zeros_like(differs)
    for p in PATHS:
        with R.use_path(p):
            out = R.mean([differs, zero, zero])
            assert_same_bits(out, differs / np.float32(3))


def test_mean_sums_in_input_order():
    # (big + 1) - big == 0 in float32 but (big - big) + 1 == 1: order matters.
    big = np.float32(2.0**25)
    xs = [np.full(9, v, dtype=np.float32) for v in (big, 1.0, -big)]
    for p in PATHS:
        with R.use_path(p):
            assert_same_bits(R.mean(xs), np.zeros(9, np.float32))
            assert_same_bits(R.mean([xs[0], xs[2], xs[1]]), np.full(9, 1 / 3, np.float32))


def test_sum_overflow_is_not_a_non_finite_input():
    m = np.finfo(np.float32).max
    x = np.full(3, m, dtype=np.float32)
    out = R.mean([x, x])
    assert np.isinf(out).all()  # inf / 2, as the reference computes


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_thread_split_gives_the_same_bits(threads):
    rng = np.random.default_rng(5)
    inputs = make_inputs(rng, 5, SPLIT_LEN, offset=1)
    want = reference(inputs)
    with R.use_threads(threads):
        assert R.current_threads() == threads
        for p in PATHS:
            with R.use_path(p):
                assert_same_bits(R.mean(inputs), want)
                acc = inputs[0].copy()
                for x in inputs[1:]:
                    R.accumulate(acc, x)
                R.scale(acc, 5)
                assert_same_bits(acc, want)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k", [3, 8])
@pytest.mark.parametrize("offset", [0, 1])
def test_large_mean_with_streaming_stores_gives_the_same_bits(kernel, threads, k, offset):
    run, reference = kernel
    rng = np.random.default_rng(k * 10 + offset)
    inputs = make_inputs(rng, k, STREAM_LEN, offset)
    # the first non-finite lies inside the streamed lines, a lower-index one
    # of a later input in the head: the report still follows (input, index)
    inputs[1][STREAM_LEN // 2 + 5] = np.inf
    inputs[1][STREAM_LEN - 1] = np.nan
    inputs[k - 1][3] = np.nan
    want = reference(inputs)
    portable = np.empty(STREAM_LEN, np.float32)
    with R.use_path("portable"), pytest.raises(NonFiniteGradient):
        run(inputs, out=portable)
    assert_same_bits(portable, want)
    out_base = np.full(STREAM_LEN + 2 * offset, 7.0, dtype=np.float32)
    out = out_base[offset:STREAM_LEN + offset]  # only float-aligned when offset
    with R.use_threads(threads):
        for p in PATHS:
            out[:] = 7.0
            with R.use_path(p), pytest.raises(NonFiniteGradient) as info:
                run(inputs, out=out)
            assert (info.value.input, info.value.index) == (1, STREAM_LEN // 2 + 5)
            np.testing.assert_array_equal(bits(out), bits(portable))  # NaNs too
            assert_same_bits(out, want)
    assert (out_base[:offset] == 7.0).all() and (out_base[STREAM_LEN + offset:] == 7.0).all()


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("offset", [0, 1])
def test_streaming_accumulate_then_scale_equals_mean(path, n, offset):
    rng = np.random.default_rng(n + offset)
    inputs = make_inputs(rng, 4, n, offset)
    acc_base = np.zeros(n + offset, dtype=np.float32)
    acc = acc_base[offset:]
    acc[:] = inputs[0]
    for x in inputs[1:]:
        assert R.accumulate(acc, x) is acc
    assert R.scale(acc, 4) is acc
    assert_same_bits(acc, reference(inputs))
    assert_same_bits(acc, R.mean(inputs))


def test_scale_rounds_divisor_to_float32_and_divides():
    x = np.arange(1, 100, dtype=np.float32)
    R.scale(x, 0.1)
    want = np.arange(1, 100, dtype=np.float32) / np.float32(0.1)
    assert_same_bits(x, want)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("n", [1, 7, 4097, SPLIT_LEN])
def test_mean_reports_non_finite(path, kernel, bad, where, n):
    run, reference = kernel
    rng = np.random.default_rng(1)
    inputs = make_inputs(rng, 3, n, offset=1)
    index = {"first": 0, "middle": n // 2, "last": n - 1}[where]
    inputs[1][index] = bad
    out = np.empty(n, dtype=np.float32)
    with pytest.raises(NonFiniteGradient) as info:
        run(inputs, out=out)
    err = info.value
    assert (err.input, err.index) == (1, index)
    assert np.isnan(err.value) if np.isnan(bad) else err.value == bad
    assert isinstance(err, ddpwire.DdpwireError) and isinstance(err, ValueError)
    # the kernel finishes the buffer: out is the complete reference result
    assert_same_bits(out, reference(inputs))


@pytest.mark.parametrize("n", [4097, SPLIT_LEN])
def test_first_means_lowest_input_then_lowest_index(path, kernel, n):
    rng = np.random.default_rng(2)
    inputs = make_inputs(rng, 6, n)
    inputs[4][0] = np.nan  # lower index, higher input
    inputs[2][n - 1] = np.inf
    inputs[2][n - 2] = -np.inf  # the answer: input 2, index n - 2
    inputs[3][n // 2] = np.nan
    with pytest.raises(NonFiniteGradient) as info:
        kernel[0](inputs)
    assert (info.value.input, info.value.index, info.value.value) == (2, n - 2, -np.inf)


@pytest.mark.parametrize("n", [1, 7, 4097, SPLIT_LEN])
def test_accumulate_and_first_non_finite_report_first_index(path, n):
    for index in sorted({0, n // 2, n - 1}):
        src = np.ones(n, dtype=np.float32)
        src[index] = np.nan
        src[-1] = np.inf
        acc = np.full(n, 2.0, dtype=np.float32)
        with pytest.raises(NonFiniteGradient) as info:
            R.accumulate(acc, src)
        assert (info.value.input, info.value.index) == (0, index)
        assert_same_bits(acc, np.float32(2.0) + src)  # finished, not stopped
        assert R.first_non_finite(src) == index
    assert R.first_non_finite(np.ones(n, dtype=np.float32)) is None


def test_accumulate_does_not_check_the_accumulator():
    acc = np.array([np.inf, 1.0], dtype=np.float32)
    R.accumulate(acc, np.ones(2, dtype=np.float32))
    assert acc[0] == np.inf and acc[1] == 2.0


def test_largest_finite_and_subnormals_are_finite():
    tiny = np.float32(1e-45)  # subnormal
    x = np.array([np.finfo(np.float32).max, -np.finfo(np.float32).max, tiny, -0.0], np.float32)
    assert R.first_non_finite(x) is None
    assert_same_bits(R.mean([x, x, x]), reference([x, x, x]))


def test_accepts_common_buffer_types():
    import torch

    n = 33
    a = np.linspace(-3, 3, n, dtype=np.float32)
    b = array.array("f", [0.25] * n)
    c = memoryview(np.arange(n, dtype=np.float32).tobytes()).cast("f")
    d = torch.linspace(0, 1, n, dtype=torch.float32).numpy()
    e = np.arange(n * 2, dtype=np.float32).reshape(2, n)[1]  # a C-contiguous row
    want = reference([a, np.frombuffer(b, np.float32), np.asarray(c), d, e])
    assert_same_bits(R.mean([a, b, c, d, e]), want)
    out = torch.zeros(n, dtype=torch.float32)
    R.mean([a, b, c, d, e], out=out.numpy())
    assert_same_bits(out.numpy(), want)
    acc = array.array("f", [1.0] * n)
    R.accumulate(acc, d)
    assert_same_bits(np.frombuffer(acc, np.float32), np.float32(1.0) + d)
    grid = np.ones((3, 4), dtype=np.float32)  # any C-contiguous shape, as flat
    assert R.mean([grid, grid]).shape == (12,)


@pytest.mark.parametrize(
    "call, exc, name",
    [
        (lambda g: R.mean([g, np.zeros(8)]), TypeError, "inputs[1]"),
        (lambda g: R.mean([g, g.astype(">f4")]), TypeError, "inputs[1]"),
        (lambda g: R.mean([g, np.zeros(16, np.float32)[::2]]), ValueError, "inputs[1]"),
        (lambda g: R.mean([g, np.zeros(7, np.float32)]), ValueError, "inputs[1]"),
        (lambda g: R.mean([g, 3.0]), TypeError, "inputs[1]"),
        (lambda g: R.mean([]), ValueError, "inputs"),
        (lambda g: R.mean(5), TypeError, "inputs"),
        (lambda g: R.mean([g], out=np.zeros(7, np.float32)), ValueError, "out"),
        (lambda g: R.mean([g], out=np.zeros(8)), TypeError, "out"),
        (lambda g: R.mean([g], out=bytes(32)), TypeError, "out"),
        (lambda g: R.mean([g], out=_read_only(8)), ValueError, "out"),
        (lambda g: R.mean([g], out=np.zeros(16, np.float32)[::2]), ValueError, "out"),
        (lambda g: R.mean([g, g], out=g), ValueError, "out"),
        (lambda g: R.total([]), ValueError, "the sum of no buffers"),
        (lambda g: R.total([g, g], out=g), ValueError, "out"),
        (lambda g: R.total([g, np.zeros(7, np.float32)]), ValueError, "inputs[1]"),
        (lambda g: R.accumulate(_read_only(8), g), ValueError, "acc"),
        (lambda g: R.accumulate(np.zeros(8, np.int32), g), TypeError, "acc"),
        (lambda g: R.accumulate(np.zeros(9, np.float32), g), ValueError, "acc"),
        (lambda g: R.accumulate(g, np.zeros(8)), TypeError, "src"),
        (lambda g: R.accumulate(g[1:], g[:-1]), ValueError, "overlaps"),
        (lambda g: R.scale(_read_only(8), 2), ValueError, "buf"),
        (lambda g: R.scale(g, 0), ValueError, "divisor"),
        (lambda g: R.scale(g, 1e-50), ValueError, "divisor"),
        (lambda g: R.scale(g, 1e39), ValueError, "divisor"),
        (lambda g: R.scale(g, float("nan")), ValueError, "divisor"),
        (lambda g: R.scale(g, "2"), TypeError, "divisor"),
        (lambda g: R.first_non_finite([1.0, 2.0]), TypeError, "buf"),
    ],
)
def test_bad_arguments_raise_typed_errors_naming_the_argument(call, exc, name):
    g = np.arange(8, dtype=np.float32)
    before = g.copy()
    with pytest.raises(exc) as info:
        call(g)
    assert name in str(info.value)
    assert_same_bits(g, before)  # nothing was written


def _read_only(n):
    a = np.zeros(n, dtype=np.float32)
    a.flags.writeable = False
    return a


def test_read_only_inputs_are_fine():
    x = _read_only(4)
    assert_same_bits(R.mean([x, x]), np.zeros(4, np.float32))
    assert R.first_non_finite(memoryview(bytes(16)).cast("f")) is None


def test_path_control():
    assert PATHS[0] == "portable"
    assert set(PATHS) <= {"portable", "avx2", "avx512"}
    best = R.current_path()
    assert best == PATHS[-1]
    with R.use_path("portable"):
        assert R.current_path() == "portable"
    assert R.current_path() == best
    R.use_path("portable")  # a plain call keeps the setting
    try:
        assert R.current_path() == "portable"
    finally:
        R.use_path("auto")
    assert R.current_path() == best
    with pytest.raises(ValueError, match="unknown path"):
        R.use_path("sse9")
    for missing in {"avx2", "avx512"} - set(PATHS):
        with pytest.raises(ValueError, match="not available"):
            R.use_path(missing)
    assert R.current_path() == best
    with pytest.raises(ValueError, match="threads"):
        R.use_threads(-1)


def _float32_arrays(n):
    # every bit pattern: NaNs with payloads, infinities, subnormals, -0.0
    return st.lists(st.integers(0, 2**32 - 1), min_size=n, max_size=n).map(
        lambda xs: np.array(xs, dtype=np.uint32).view(np.float32)
    )


@st.composite
def _case(draw):
    n = draw(st.integers(0, 300))
    k = draw(st.integers(1, 9))
    if draw(st.booleans()):
        inputs = [draw(_float32_arrays(n)) for _ in range(k)]
    else:
        finite = st.floats(width=32, allow_nan=False, allow_infinity=False)
        inputs = [np.array(draw(st.lists(finite, min_size=n, max_size=n)), np.float32)
                  for _ in range(k)]
    offset = draw(st.integers(0, 1))
    shifted = []
    for x in inputs:
        base = np.empty(n + offset, dtype=np.float32)
        base[offset:] = x
        shifted.append(base[offset:])
    return shifted, draw(st.sampled_from(PATHS))


@settings(max_examples=300, deadline=None)
@given(_case())
def test_mean_matches_reference_on_random_bits(case):
    inputs, p = case
    want = reference(inputs)
    first = None
    for j, x in enumerate(inputs):
        bad = np.flatnonzero(~np.isfinite(x))
        if bad.size:
            first = (j, int(bad[0]))
            break
    out = np.empty(len(inputs[0]), dtype=np.float32)
    with R.use_path(p):
        if first is None:
            R.mean(inputs, out=out)
        else:
            with pytest.raises(NonFiniteGradient) as info:
                R.mean(inputs, out=out)
            assert (info.value.input, info.value.index) == first
            assert R.first_non_finite(inputs[first[0]]) == first[1]
    assert_same_bits(out, want)
