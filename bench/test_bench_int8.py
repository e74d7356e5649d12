"""The int8 wire codec (csrc/int8.c): ddpwire.plane.reduce.int8_encode,
int8_decode and int8_mean side by side with numpy doing the same per-block
arithmetic (a scale per 256 elements), in one run, on 64 MiB of float32
(16 Mi elements; 16.25 MiB encoded).

    python -m pytest -q bench/test_bench_int8.py --benchmark-json=int8.json

Each ddpwire case runs after its numpy baseline and records, in extra_info,
``speedup_vs_numpy`` (numpy's median time over ddpwire's). numpy's result
is checked against ddpwire's bits first, so both compute the same thing.
"""
import functools

import numpy as np
import pytest

from ddpwire.plane import reduce as R

N = 64 * 2**20 // 4
BLOCK = R.INT8_BLOCK
ROUNDS = 5
F32_MAX = np.float32(np.finfo(np.float32).max)

_medians = {}


@functools.lru_cache(maxsize=1)
def data():
    rng = np.random.default_rng(3)
    x = rng.standard_normal(N, dtype=np.float32)
    coded = [R.int8_encode(rng.standard_normal(N, dtype=np.float32)) for _ in range(4)]
    return x, coded


def numpy_encode(x):
    """csrc/int8.h's encoding in numpy (N a multiple of the block: no tail)."""
    blocks = x.reshape(-1, BLOCK)
    scale = np.abs(blocks).max(axis=1) / np.float32(127)
    over = ~(scale * np.float32(127) <= F32_MAX)
    scale[over] = np.nextafter(scale[over], np.float32(0))
    safe = np.where(scale > 0, scale, np.float32(1))
    codes = np.rint(np.clip(blocks / safe[:, None], -127, 127)).astype(np.int8)
    codes[scale == 0] = 0
    out = np.empty((len(blocks), 4 + BLOCK), np.uint8)
    out[:, :4] = scale.astype("<f4").view(np.uint8).reshape(-1, 4)
    out[:, 4:] = codes.view(np.uint8)
    return out.reshape(-1)


def numpy_decode(coded):
    blocks = coded.reshape(-1, 4 + BLOCK)
    scale = blocks[:, :4].copy().view("<f4").reshape(-1)
    return (blocks[:, 4:].view(np.int8).astype(np.float32) * scale[:, None]).reshape(-1)


def numpy_mean(coded):
    acc = numpy_decode(coded[0])
    for c in coded[1:]:
        acc = acc + numpy_decode(c)
    return acc / np.float32(len(coded))


def record(benchmark, group, impl):
    if benchmark.stats is None:  # --benchmark-disable: nothing was timed
        return
    median = benchmark.stats.stats.median
    _medians[(group, impl)] = median
    other = _medians.get((group, "numpy"))
    if impl == "ddpwire" and other is not None:
        benchmark.extra_info["speedup_vs_numpy"] = round(other / median, 3)


@pytest.mark.parametrize("impl", ["numpy", "ddpwire"])
def test_encode(benchmark, impl):
    x, _ = data()
    benchmark.group = "int8 encode, 16 Mi float32"
    if impl == "numpy":
        assert np.array_equal(numpy_encode(x), R.int8_encode(x))
        benchmark.pedantic(numpy_encode, args=(x,), rounds=ROUNDS)
    else:
        out = np.empty(R.int8_size(N), np.uint8)
        benchmark.pedantic(R.int8_encode, args=(x, out), rounds=ROUNDS)
    record(benchmark, benchmark.group, impl)


@pytest.mark.parametrize("impl", ["numpy", "ddpwire"])
def test_decode(benchmark, impl):
    _, coded = data()
    benchmark.group = "int8 decode, 16 Mi elements"
    if impl == "numpy":
        want = numpy_decode(coded[0])
        assert np.array_equal(want.view(np.uint32), R.int8_decode(coded[0]).view(np.uint32))
        benchmark.pedantic(numpy_decode, args=(coded[0],), rounds=ROUNDS)
    else:
        out = np.empty(N, np.float32)
        benchmark.pedantic(R.int8_decode, args=(coded[0], out), rounds=ROUNDS)
    record(benchmark, benchmark.group, impl)


@pytest.mark.parametrize("impl", ["numpy", "ddpwire"])
def test_mean_of_four(benchmark, impl):
    _, coded = data()
    benchmark.group = "int8 mean of 4 encodings, 16 Mi elements"
    if impl == "numpy":
        want = numpy_mean(coded)
        assert np.array_equal(want.view(np.uint32), R.int8_mean(coded).view(np.uint32))
        benchmark.pedantic(numpy_mean, args=(coded,), rounds=ROUNDS)
    else:
        out = np.empty(N, np.float32)
        benchmark.pedantic(R.int8_mean, args=(coded, out), rounds=ROUNDS)
    record(benchmark, benchmark.group, impl)
