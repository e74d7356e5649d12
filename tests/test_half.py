"""16-bit gradients (ddpwire.plane.reduce.to_half, from_half, mean_half,
total_half) bit for bit.

References (the tests' one reference, tests/session_helpers.py): for fp16,
numpy's float16 casts (round to nearest even); for bf16, a rounding written
on the integer bits, independently of the kernel's carry trick; and torch's
own casts where torch is installed. NaN bits are
pinned by the module's rule (sign kept, quiet bit set, the top payload bits
kept), not by numpy or torch, whose NaN bits differ from one loop to another.
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpwire import NonFiniteGradient
from ddpwire.plane import reduce as R

from session_helpers import from_half_bits, reference_allreduce, to_half_bits

PATHS = R.available_paths()
# over two threads' minimum range (2 * 2**18), not a whole number of blocks
SPLIT_LEN = (1 << 19) + 4099


@pytest.fixture(params=PATHS)
def path(request):
    with R.use_path(request.param):
        yield request.param


# ---- references ----
# the 16-bit roundings and the mean are the tests' one reference
# (tests/session_helpers.py), written on the integer bits

def ref_to_bf16(x):
    return to_half_bits(x, "bf16")


def ref_to_fp16(x):
    return to_half_bits(x, "fp16")


def ref_from_bf16(h):
    return from_half_bits(h, "bf16")


def ref_from_fp16(h):
    return from_half_bits(h, "fp16")


REF_TO = {"bf16": ref_to_bf16, "fp16": ref_to_fp16}
REF_FROM = {"bf16": ref_from_bf16, "fp16": ref_from_fp16}


def ref_mean_half(inputs, codec):
    """Widen, sum in input order, divide, narrow: the reference's 16-bit
    average of inputs that are 16-bit words already (rounding them to 16
    bits again changes nothing but a signalling NaN's quiet bit, and a NaN
    sum may carry any payload)."""
    return REF_TO[codec](reference_allreduce([REF_FROM[codec](x) for x in inputs], codec=codec))


def assert_same_half(got, want, codec):
    """Bits equal, except that a NaN produced by arithmetic may carry any
    payload (the CPU's NaN propagation, not the rounding)."""
    got = np.asarray(got).view(np.uint16)
    want = np.asarray(want).view(np.uint16)
    if codec == "bf16":
        nan_g, nan_w = (got & 0x7FFF) > 0x7F80, (want & 0x7FFF) > 0x7F80
    else:
        nan_g, nan_w = (got & 0x7FFF) > 0x7C00, (want & 0x7FFF) > 0x7C00
    np.testing.assert_array_equal(nan_g, nan_w)
    np.testing.assert_array_equal(got[~nan_w], want[~nan_w])


# ---- inputs ----

def rounding_sweep(codec):
    """float32 values around every rounding decision: all combinations of
    the bits a 16-bit value keeps (sign, exponent, top mantissa; at 2^-24
    spacing for fp16 subnormals that includes every tie position), each with
    the dropped bits at zero, just below, at and just above the tie, and
    all ones."""
    if codec == "bf16":
        kept = np.arange(1 << 16, dtype=np.uint32) << 16
        lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint32)
    else:
        kept = np.arange(1 << 19, dtype=np.uint32) << 13
        lows = np.array([0, 1, 0x0FFF, 0x1000, 0x1001, 0x1FFF], dtype=np.uint32)
    return (kept[:, None] | lows[None, :]).ravel().view(np.float32)


ALL_HALVES = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)

EDGES = np.array(
    [0.0, -0.0, 1.0, -1.0, 65504.0, -65504.0, 65519.996, 65520.0, -65520.0, 65536.0,
     2.0**-14, 2.0**-14 * (1 - 2.0**-11), 2.0**-24, 2.0**-25, 2.0**-25 * 1.0000001,
     2.0**-26, 1.5 * 2.0**-24, 2.5 * 2.0**-24, 1e-45, -1e-45, 1.17549435e-38,
     3.4028235e38, -3.4028235e38, np.inf, -np.inf, np.nan, -np.nan, 1 + 2.0**-8,
     1 + 3 * 2.0**-8, 1 + 2.0**-11, 1 + 3 * 2.0**-11],
    dtype=np.float32,
)


def float32_bits(n):
    # every bit pattern: NaNs with payloads, infinities, subnormals, -0.0
    return st.lists(st.integers(0, 2**32 - 1), min_size=n, max_size=n).map(
        lambda xs: np.array(xs, dtype=np.uint32).view(np.float32))


def half_bits(n):
    return st.lists(st.integers(0, 2**16 - 1), min_size=n, max_size=n).map(
        lambda xs: np.array(xs, dtype=np.uint16))


def shifted(x, offset):
    """x copied into a buffer starting `offset` elements into its allocation,
    so it is only element-aligned."""
    base = np.empty(len(x) + offset, dtype=x.dtype)
    base[offset:] = x
    return base[offset:]


# ---- conversions ----

@pytest.mark.parametrize("codec", R.CODECS)
def test_to_half_rounds_every_decision_as_the_reference(path, codec):
    x = np.concatenate([rounding_sweep(codec), EDGES])
    got = R.to_half(x, codec=codec)
    assert got.dtype == np.uint16 and got.shape == x.shape
    np.testing.assert_array_equal(got, REF_TO[codec](x))


@pytest.mark.parametrize("codec", R.CODECS)
def test_to_half_of_any_bit_pattern_is_the_reference(path, codec):
    # every class of float32 at random: NaNs with any payload (signalling
    # or quiet), infinities, subnormals, values that overflow; on x86 the
    # fp16 conversions take the F16C instructions, which must agree too
    u = np.random.default_rng(11).integers(0, 1 << 32, size=1 << 20, dtype=np.uint64)
    x = u.astype(np.uint32).view(np.float32)
    np.testing.assert_array_equal(R.to_half(x, codec=codec), REF_TO[codec](x))


@pytest.mark.parametrize("codec", R.CODECS)
def test_from_half_widens_all_65536_values_exactly(path, codec):
    got = R.from_half(ALL_HALVES, codec=codec)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), REF_FROM[codec](ALL_HALVES).view(np.uint32))
    # every non-NaN value survives the round trip
    back = R.to_half(got, codec=codec)
    np.testing.assert_array_equal(back, REF_TO[codec](got))
    finite_or_inf = ~np.isnan(got)
    np.testing.assert_array_equal(back[finite_or_inf], ALL_HALVES[finite_or_inf])


def test_nan_stays_a_quiet_nan_of_its_sign():
    x = np.array([0x7F800001, 0xFF800001, 0x7FC00000, 0xFFFFFFFF, 0x7FA00000], np.uint32).view(np.float32)
    bf = R.to_half(x, codec="bf16")
    fp = R.to_half(x, codec="fp16")
    np.testing.assert_array_equal(bf, [0x7FC0, 0xFFC0, 0x7FC0, 0xFFFF, 0x7FE0])
    np.testing.assert_array_equal(fp, [0x7E00, 0xFE00, 0x7E00, 0xFFFF, 0x7F00])


@pytest.mark.parametrize("codec", R.CODECS)
@pytest.mark.parametrize("n", [0, 1, 7, 4095, 4097])
@pytest.mark.parametrize("offset", [0, 1])
def test_odd_lengths_and_unaligned_buffers(path, codec, n, offset):
    rng = np.random.default_rng(n * 2 + offset)
    x = shifted(rng.integers(0, 2**32, n, dtype=np.uint32).view(np.float32), offset)
    out = shifted(np.full(n, 0xABCD, np.uint16), offset)
    assert R.to_half(x, out, codec=codec) is out
    np.testing.assert_array_equal(out, REF_TO[codec](x))
    wide = shifted(np.full(n, 7.0, np.float32), offset)
    assert R.from_half(out, wide, codec=codec) is wide
    np.testing.assert_array_equal(wide.view(np.uint32), REF_FROM[codec](out).view(np.uint32))


@pytest.mark.parametrize("codec", R.CODECS)
def test_paths_and_thread_splits_give_the_same_bits(codec):
    rng = np.random.default_rng(5)
    x = rng.integers(0, 2**32, SPLIT_LEN, dtype=np.uint32).view(np.float32)
    halves = [shifted(rng.integers(0, 2**16, SPLIT_LEN, dtype=np.uint16), 1) for _ in range(3)]
    results = []
    for p in PATHS:
        for threads in (1, 2, 3):
            with R.use_path(p), R.use_threads(threads):
                out = np.empty(SPLIT_LEN, np.uint16)
                with pytest.raises(NonFiniteGradient):
                    R.mean_half(halves, out, codec=codec)
                results.append((R.to_half(x, codec=codec), R.from_half(halves[0], codec=codec), out))
    np.testing.assert_array_equal(results[0][0], REF_TO[codec](x))
    np.testing.assert_array_equal(results[0][1].view(np.uint32),
                                  REF_FROM[codec](halves[0]).view(np.uint32))
    for to, frm, mean in results[1:]:
        np.testing.assert_array_equal(to, results[0][0])
        np.testing.assert_array_equal(frm.view(np.uint32), results[0][1].view(np.uint32))
        np.testing.assert_array_equal(mean, results[0][2])


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 300).flatmap(float32_bits), st.sampled_from(R.CODECS),
       st.sampled_from(PATHS), st.integers(0, 1))
def test_to_half_matches_reference_on_random_bits(x, codec, p, offset):
    x = shifted(x, offset)
    with R.use_path(p):
        got = R.to_half(x, codec=codec)
        np.testing.assert_array_equal(got, REF_TO[codec](x))
        np.testing.assert_array_equal(R.from_half(got, codec=codec).view(np.uint32),
                                      REF_FROM[codec](got).view(np.uint32))


# ---- against torch ----

TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def torch_to_half(x, codec):
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(np.array(x)).to(getattr(torch, TORCH_DTYPES[codec]))
    return t.view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("codec", R.CODECS)
def test_to_half_gives_torchs_bits(path, codec):
    pytest.importorskip("torch")
    x = np.concatenate([rounding_sweep(codec), EDGES])
    # torch's NaN bits vary between its own loops: compare NaN-ness there
    assert_same_half(R.to_half(x, codec=codec), torch_to_half(x, codec), codec)


@pytest.mark.parametrize("codec", R.CODECS)
def test_from_half_gives_torchs_values(path, codec):
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(ALL_HALVES.view(np.int16).copy()).view(getattr(torch, TORCH_DTYPES[codec]))
    want = t.float().numpy()
    got = R.from_half(ALL_HALVES, codec=codec)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 300).flatmap(float32_bits), st.sampled_from(R.CODECS))
def test_to_half_gives_torchs_bits_on_random_bits(x, codec):
    pytest.importorskip("torch")
    assert_same_half(R.to_half(x, codec=codec), torch_to_half(x, codec), codec)


# ---- the 16-bit mean ----

def widen_mean_narrow(inputs, codec):
    """The composition mean_half promises to equal, on the compiled kernels."""
    wide = [R.from_half(x, codec=codec) for x in inputs]
    out = np.empty(len(inputs[0]), np.float32)
    try:
        R.mean(wide, out)
    except NonFiniteGradient:
        pass
    return R.to_half(out, codec=codec)


def first_non_finite(inputs, codec):
    for j, x in enumerate(inputs):
        bad = np.flatnonzero(~np.isfinite(REF_FROM[codec](x)))
        if bad.size:
            return j, int(bad[0])
    return None


@st.composite
def mean_case(draw):
    n = draw(st.integers(0, 300))
    k = draw(st.integers(1, 5))
    codec = draw(st.sampled_from(R.CODECS))
    if draw(st.booleans()):
        inputs = [draw(half_bits(n)) for _ in range(k)]
    else:
        # finite halves only (exponent not all ones), so averages are exercised
        top = 0x7F7F if codec == "bf16" else 0x7BFF
        finite = st.integers(0, top).flatmap(lambda m: st.sampled_from([m, m | 0x8000]))
        inputs = [np.array(draw(st.lists(finite, min_size=n, max_size=n)), np.uint16)
                  for _ in range(k)]
    offset = draw(st.integers(0, 1))
    return [shifted(x, offset) for x in inputs], codec, draw(st.sampled_from(PATHS))


@settings(max_examples=300, deadline=None)
@given(mean_case())
def test_mean_half_is_widen_mean_narrow_bit_for_bit(case):
    inputs, codec, p = case
    first = first_non_finite(inputs, codec)
    out = np.empty(len(inputs[0]), np.uint16)
    with R.use_path(p):
        want = widen_mean_narrow(inputs, codec)
        if first is None:
            assert R.mean_half(inputs, out, codec=codec) is out
        else:
            with pytest.raises(NonFiniteGradient) as info:
                R.mean_half(inputs, out, codec=codec)
            assert (info.value.input, info.value.index) == first
            value = REF_FROM[codec](inputs[first[0]][first[1]:first[1] + 1])[0]
            assert np.isnan(info.value.value) if np.isnan(value) else info.value.value == value
    np.testing.assert_array_equal(out, want)
    assert_same_half(out, ref_mean_half(inputs, codec), codec)


@pytest.mark.parametrize("codec", R.CODECS)
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("n", [0, 1, 1023, 1025, 4097])
def test_mean_half_lengths_and_groups(path, codec, k, n):
    rng = np.random.default_rng(k * 10000 + n)
    # finite values of every magnitude: widen random float32 normals
    inputs = [shifted(R.to_half((rng.standard_normal(n) * 10.0 ** rng.integers(-6, 4, n))
                                .astype(np.float32), codec=codec), j % 2) for j in range(k)]
    out = shifted(np.zeros(n, np.uint16), 1)
    R.mean_half(inputs, out, codec=codec)
    np.testing.assert_array_equal(out, widen_mean_narrow(inputs, codec))
    np.testing.assert_array_equal(out, ref_mean_half(inputs, codec))


@pytest.mark.parametrize("codec", R.CODECS)
@pytest.mark.parametrize("k", [1, 2, 3, 5, 9])
@pytest.mark.parametrize("n", [0, 1, 1025, 4097])
def test_total_half_is_widen_sum_narrow_on_every_path(path, codec, k, n):
    rng = np.random.default_rng(k * 1000 + n + 7)
    inputs = [shifted(R.to_half((rng.standard_normal(n) * 10.0 ** rng.integers(-6, 4, n))
                                .astype(np.float32), codec=codec), j % 2) for j in range(k)]
    out = shifted(np.zeros(n, np.uint16), 1)
    assert R.total_half(inputs, out, codec=codec) is out
    want = REF_TO[codec](reference_allreduce([REF_FROM[codec](x) for x in inputs], "sum",
                                             codec=codec))
    assert_same_half(out, want, codec)
    if k > 1 and n:  # the sum, not the mean
        assert not np.array_equal(out, R.mean_half(inputs, codec=codec))


@pytest.mark.parametrize("codec", R.CODECS)
def test_mean_half_reports_the_first_non_finite_and_finishes(path, codec):
    n = 5000
    inf = 0x7F80 if codec == "bf16" else 0x7C00
    one = R.to_half(np.ones(n, np.float32), codec=codec)
    inputs = [one.copy() for _ in range(4)]
    inputs[3][10] = inf           # a lower index in a later input loses
    inputs[1][4500] = inf | 0x8000
    inputs[2][3] = inf | 0x0001   # a NaN
    out = np.zeros(n, np.uint16)
    with pytest.raises(NonFiniteGradient) as info:
        R.mean_half(inputs, out, codec=codec)
    assert (info.value.input, info.value.index, info.value.value) == (1, 4500, -np.inf)
    np.testing.assert_array_equal(out, widen_mean_narrow(inputs, codec))
    assert out[0] == one[0] and out[-1] == one[-1]


def test_float16_arrays_are_accepted_for_fp16():
    x = np.array([1.5, -2.25, 65504.0, np.inf], np.float16)
    wide = R.from_half(x, codec="fp16")
    np.testing.assert_array_equal(wide, x.astype(np.float32))
    out = np.empty(4, np.float16)
    assert R.to_half(wide, out, codec="fp16") is out
    np.testing.assert_array_equal(out.view(np.uint16), x.view(np.uint16))
    with pytest.raises(NonFiniteGradient):
        R.mean_half([x, x], out, codec="fp16")
    np.testing.assert_array_equal(out.view(np.uint16), x.view(np.uint16))


def test_bad_arguments_raise_clear_errors():
    f = np.ones(4, np.float32)
    h = np.ones(4, np.uint16)
    with pytest.raises(ValueError, match="codec"):
        R.to_half(f, codec="fp8")
    with pytest.raises(TypeError):
        R.to_half(f)  # codec is required and keyword-only
    with pytest.raises(TypeError, match="float32"):
        R.to_half(h, codec="bf16")
    with pytest.raises(TypeError, match="uint16"):
        R.from_half(f, codec="bf16")
    with pytest.raises(TypeError, match="uint16"):
        R.to_half(f, np.ones(4, np.int32), codec="bf16")
    with pytest.raises(ValueError, match="elements"):
        R.to_half(f, np.ones(5, np.uint16), codec="bf16")
    with pytest.raises(ValueError, match="elements"):
        R.from_half(h, np.ones(3, np.float32), codec="bf16")
    with pytest.raises(ValueError, match="contiguous"):
        R.from_half(np.ones(8, np.uint16)[::2], codec="bf16")
    ro = np.ones(4, np.uint16)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        R.to_half(f, ro, codec="fp16")
    with pytest.raises(ValueError, match="empty"):
        R.mean_half([], codec="bf16")
    with pytest.raises(ValueError, match=r"inputs\[1\] has 3"):
        R.mean_half([h, h[:3]], codec="bf16")
    with pytest.raises(ValueError, match="overlaps"):
        R.mean_half([h, h], h, codec="bf16")
    with pytest.raises(TypeError, match="sequence"):
        R.mean_half(3, codec="bf16")
    assert R.CODECS == ("bf16", "fp16")
