"""The int8 wire codec (csrc/int8.c, ddpwire.plane.reduce.int8_*, the codec
table's kernels and average): a byte an element and a float32 scale per
256, against its definition written again in numpy
(tests/session_helpers.py int8_round_trip), bit for bit."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpwire import NonFiniteGradient
from ddpwire.plane import codecs, reduce

from session_helpers import INT8_BLOCK, int8_round_trip, reference_allreduce

F32_MAX = float(np.finfo(np.float32).max)


def vector(n, seed, magnitude):
    rng = np.random.default_rng(seed)
    # within ±4 of the magnitude: finite up to a quarter of float32's largest
    x = np.clip(rng.standard_normal(n), -4, 4).astype(np.float32) * np.float32(magnitude)
    # some blocks of zeros, and some elements exactly on a rounding tie
    if n > INT8_BLOCK:
        x[:INT8_BLOCK] = 0
    return x


def bits(x):
    return np.asarray(x, dtype=np.float32).view(np.uint32)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 3 * INT8_BLOCK + 7), st.integers(0, 2**32 - 1),
       st.sampled_from([1e-40, 1e-30, 1e-6, 1.0, 1e6, 1e30, 8e37, F32_MAX / 4]))
def test_encode_then_decode_is_the_definition_bit_for_bit(n, seed, magnitude):
    x = vector(n, seed, magnitude)
    coded = reduce.int8_encode(x)
    assert coded.dtype == np.uint8 and coded.size == reduce.int8_size(n)
    back = reduce.int8_decode(coded)
    assert np.array_equal(bits(back), bits(int8_round_trip(x)))
    # every element within half its block's scale (max |x| / 127) of itself
    for b in range(0, n, INT8_BLOCK):
        block = x[b:b + INT8_BLOCK].astype(np.float64)
        scale = np.abs(block).max() / 127
        err = np.abs(back[b:b + INT8_BLOCK].astype(np.float64) - block)
        assert np.all(err <= scale / 2 * (1 + 1e-5) + 1e-45)


def test_the_layout_is_a_scale_then_a_byte_per_element_per_block():
    x = np.zeros(INT8_BLOCK + 3, np.float32)
    x[0], x[1], x[INT8_BLOCK] = 127.0, -63.5, 2.0  # -63.5 is a tie: rounds to even -64
    coded = reduce.int8_encode(x)
    assert coded.size == INT8_BLOCK + 3 + 8
    assert coded[:4].view("<f4")[0] == np.float32(1.0)
    codes = coded[4:4 + INT8_BLOCK].view(np.int8)
    assert (codes[0], codes[1]) == (127, -64) and not codes[2:].any()
    tail = coded[4 + INT8_BLOCK:]
    assert tail[:4].view("<f4")[0] == np.float32(2.0) / np.float32(127)
    assert list(tail[4:].view(np.int8)) == [127, 0, 0]


def test_a_block_holding_a_nan_or_inf_decodes_to_nan_and_the_others_keep_their_values():
    x = np.linspace(-1, 1, 3 * INT8_BLOCK, dtype=np.float32)
    x[INT8_BLOCK + 5] = np.inf
    x[2 * INT8_BLOCK + 9] = np.nan
    back = reduce.int8_decode(reduce.int8_encode(x))
    assert np.isnan(back[INT8_BLOCK:]).all()
    assert np.array_equal(bits(back[:INT8_BLOCK]), bits(int8_round_trip(x[:INT8_BLOCK])))


@pytest.mark.parametrize("top", [F32_MAX, np.nextafter(np.float32(F32_MAX), np.float32(0)),
                                 np.float32(3.3e38)])
def test_a_block_near_the_float32_limit_decodes_finite(top):
    # max / 127 rounded up would make 127 x scale overflow: the scale is
    # taken one step lower, so no finite element comes back infinite
    x = np.linspace(-1, 1, 300, dtype=np.float32) * np.float32(top)
    x[7] = -np.float32(top)
    back = reduce.int8_decode(reduce.int8_encode(x))
    assert np.isfinite(back).all()
    assert np.array_equal(bits(back), bits(int8_round_trip(x)))
    scale = np.float64(top) / 127
    assert np.all(np.abs(back.astype(np.float64) - x) <= scale / 2 * (1 + 1e-5))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.integers(1, 2 * INT8_BLOCK + 1), st.integers(0, 2**32 - 1))
def test_the_mean_decodes_sums_in_order_and_divides(k, n, seed):
    xs = [vector(n, seed + i, 10.0 ** i) for i in range(k)]
    coded = [reduce.int8_encode(x) for x in xs]
    decoded = [reduce.int8_decode(c) for c in coded]
    assert np.array_equal(bits(reduce.int8_mean(coded)), bits(reduce.mean(decoded)))
    assert np.array_equal(bits(reduce.int8_mean(coded, divide=False)), bits(reduce.total(decoded)))
    # and a flat int8 allreduce's result from every member's bytes is the reference's
    assert np.array_equal(bits(codecs.INT8.average(coded)),
                          bits(reference_allreduce(xs, codec="int8")))


def test_the_mean_names_the_first_non_finite_input_and_still_writes_everything():
    xs = [np.ones(600, np.float32) for _ in range(3)]
    xs[2][5] = np.nan
    xs[1][300] = np.inf  # input 1 comes first; its block starts at element 256
    coded = [reduce.int8_encode(x) for x in xs]
    out = np.empty(600, np.float32)
    with pytest.raises(NonFiniteGradient) as info:
        reduce.int8_mean(coded, out)
    assert (info.value.input, info.value.index) == (1, INT8_BLOCK)
    assert np.isnan(info.value.value)
    assert np.isnan(out[:2 * INT8_BLOCK]).all() and (out[2 * INT8_BLOCK:] == 1).all()
    # the codec's average passes it on instead
    assert np.isnan(codecs.INT8.average(coded)[:2 * INT8_BLOCK]).all()


def test_bad_arguments_are_named():
    x = np.ones(300, np.float32)
    coded = reduce.int8_encode(x)
    with pytest.raises(ValueError, match=r"src is 261 bytes, which no int8 encoding is"):
        reduce.int8_decode(np.zeros(261, np.uint8))  # 256 + 4 is 260, 257 + 8 is 265
    with pytest.raises(ValueError, match=r"out is 10 bytes, 300 elements encode to 308"):
        reduce.int8_encode(x, np.empty(10, np.uint8))
    with pytest.raises(ValueError, match=r"out has 3 elements, src encodes 300"):
        reduce.int8_decode(coded, np.empty(3, np.float32))
    with pytest.raises(ValueError, match=r"inputs\[1\] is 5 bytes, inputs\[0\] is 308"):
        reduce.int8_mean([coded, np.zeros(5, np.uint8)])
    with pytest.raises(ValueError, match="inputs is empty"):
        reduce.int8_mean([])
    with pytest.raises(TypeError, match=r"src must hold native float32"):
        reduce.int8_encode(np.ones(3, np.float64))
    with pytest.raises(TypeError, match=r"inputs\[0\] must hold native bytes"):
        reduce.int8_mean([np.ones(3, np.float32)])
    with pytest.raises(ValueError, match="overlaps"):
        buf = np.zeros(1024, np.uint8)
        reduce.int8_encode(buf[:400].view(np.float32), buf[:reduce.int8_size(100)])
    with pytest.raises(ValueError, match="must not be negative"):
        reduce.int8_size(-1)
    assert [reduce.int8_size(n) for n in (0, 1, 256, 257)] == [0, 5, 260, 265]
