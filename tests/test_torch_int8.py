"""The 8-bit pseudo-gradient of DiLoCo(wire="int8"): codes and per-block
scales (ddpwire.torch.local_steps.quantize_int8, dequantize_mean)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from ddpwire.torch.local_steps import INT8_BLOCK, dequantize_mean, quantize_int8  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3 * INT8_BLOCK + 7), st.integers(0, 2**32 - 1), st.floats(1e-6, 1e6))
def test_every_element_is_within_half_its_block_scale(n, seed, magnitude):
    x = torch.from_numpy(np.random.default_rng(seed).standard_normal(n).astype(np.float32))
    x = x * magnitude
    codes, scales = quantize_int8(x)
    assert codes.dtype == torch.int8 and codes.numel() == -(-n // INT8_BLOCK) * INT8_BLOCK
    assert scales.numel() == -(-n // INT8_BLOCK)
    assert int(codes.abs().max()) <= 127
    back = dequantize_mean([codes], [scales], n)
    half = (scales / 2).repeat_interleave(INT8_BLOCK)[:n]
    # half a step, plus the float32 rounding of the division and the product
    assert torch.all((back - x).abs() <= half * (1 + 1e-5) + 1e-12 * magnitude)
    # each block's largest element is kept to float32 rounding
    for b in range(scales.numel()):
        block = x[b * INT8_BLOCK:(b + 1) * INT8_BLOCK]
        big = int(block.abs().argmax())
        got = back[b * INT8_BLOCK + big]
        assert abs(float(got) - float(block[big])) <= 1e-6 * abs(float(block[big]))


def test_a_block_of_zeros_has_scale_zero_and_comes_back_exactly():
    x = torch.zeros(2 * INT8_BLOCK)
    x[INT8_BLOCK:] = torch.linspace(-1, 1, INT8_BLOCK)
    codes, scales = quantize_int8(x)
    assert float(scales[0]) == 0.0 and torch.all(codes[:INT8_BLOCK] == 0)
    back = dequantize_mean([codes], [scales], 2 * INT8_BLOCK)
    assert torch.equal(back[:INT8_BLOCK], torch.zeros(INT8_BLOCK))


def test_the_mean_sums_the_ranks_in_order_in_float32():
    rng = np.random.default_rng(3)
    xs = [torch.from_numpy(rng.standard_normal(700).astype(np.float32)) for _ in range(3)]
    q = [quantize_int8(x) for x in xs]
    got = dequantize_mean([c for c, _ in q], [s for _, s in q], 700)
    want = np.zeros(3 * INT8_BLOCK, np.float32)
    for c, s in q:
        want = want + c.numpy().astype(np.float32) * np.repeat(s.numpy(), INT8_BLOCK)
    assert np.array_equal(got.numpy(), (want[:700] / np.float32(3)).astype(np.float32))
    # and it is within the mean of the ranks' half scales of the exact mean
    exact = torch.stack(xs).mean(dim=0)
    half = sum((s / 2).repeat_interleave(INT8_BLOCK)[:700] for _, s in q) / 3
    assert torch.all((got - exact).abs() <= half * (1 + 1e-5))
