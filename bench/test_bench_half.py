"""16-bit gradients: ddpwire.plane.reduce.to_half and mean_half side by side with
the numpy and torch ways of doing the same, in one run, on 64 MiB of float32
(16 Mi elements; 32 MiB per 16-bit buffer).

    python -m pytest -q bench/test_bench_half.py --benchmark-json=half.json

Each ddpwire case runs after its baselines and records, in extra_info, how
many times faster it was than each (``speedup_vs_<impl>``: the baseline's
median time over ddpwire's). Every implementation's result is checked
against ddpwire's bits, NaN-free inputs, so all compute the same thing.
"""
import functools

import numpy as np
import pytest

from ddpwire.plane import reduce as R

try:
    import torch
except ImportError:  # the torch-free CI job still times numpy
    torch = None

N = 64 * 2**20 // 4
ROUNDS = 5
TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}

# baselines first: the ddpwire case of a group divides their medians by its own
TO_CASES = [("fp16", "numpy"), ("fp16", "torch"), ("fp16", "ddpwire"), ("fp16", "ddpwire-1thread"),
            ("bf16", "torch"), ("bf16", "ddpwire"), ("bf16", "ddpwire-1thread")]
MEAN_CASES = [(codec, k, impl) for codec in R.CODECS for k in (2, 4)
              for impl in (("numpy",) if codec == "fp16" else ()) + ("torch", "ddpwire", "ddpwire-1thread")]

_medians = {}


@functools.lru_cache(maxsize=1)
def data():
    rng = np.random.default_rng(1)
    x = rng.standard_normal(N, dtype=np.float32)
    halves = {codec: [R.to_half(rng.standard_normal(N, dtype=np.float32), codec=codec)
                      for _ in range(4)] for codec in R.CODECS}
    return x, halves


def torch_dtype(codec):
    return getattr(torch, TORCH_DTYPES[codec])


def record(benchmark, group, impl):
    if benchmark.stats is None:  # --benchmark-disable: nothing was timed
        return
    median = benchmark.stats.stats.median
    _medians[(group, impl)] = median
    if impl.startswith("ddpwire"):
        for (g, other), m in _medians.items():
            if g == group and not other.startswith("ddpwire"):
                benchmark.extra_info[f"speedup_vs_{other}"] = round(m / median, 3)


def run(benchmark, fn, *args):
    return benchmark.pedantic(fn, args=args, rounds=ROUNDS, iterations=1, warmup_rounds=1)


@pytest.mark.parametrize("codec, impl", TO_CASES, ids=[f"{c}-{i}" for c, i in TO_CASES])
def test_to_half(benchmark, codec, impl):
    if impl == "torch" and torch is None:
        pytest.skip("torch is not installed")
    x, _ = data()
    group = f"to_half {codec} 64 MiB"
    benchmark.group = group
    benchmark.extra_info.update(codec=codec, impl=impl, mib=64)
    want = R.to_half(x, codec=codec)
    if impl == "numpy":
        got = run(benchmark, x.astype, np.float16).view(np.uint16)
    elif impl == "torch":
        t = torch.from_numpy(x)
        got = run(benchmark, t.to, torch_dtype(codec)).view(torch.int16).numpy().view(np.uint16)
    else:
        out = np.empty(N, np.uint16)
        threads = 1 if impl == "ddpwire-1thread" else None
        with R.use_threads(threads):
            got = run(benchmark, functools.partial(R.to_half, codec=codec), x, out)
    np.testing.assert_array_equal(got, want)
    record(benchmark, group, impl)


def numpy_mean_fp16(inputs):
    s = inputs[0].view(np.float16).astype(np.float32)
    for x in inputs[1:]:
        s += x.view(np.float16)
    s /= np.float32(len(inputs))
    return s.astype(np.float16)


def torch_mean(inputs, dtype):
    s = inputs[0].float()
    for x in inputs[1:]:
        s += x
    s /= len(inputs)
    return s.to(dtype)


@pytest.mark.parametrize("codec, k, impl", MEAN_CASES, ids=[f"{c}-k{k}-{i}" for c, k, i in MEAN_CASES])
def test_mean_half(benchmark, codec, k, impl):
    if impl == "torch" and torch is None:
        pytest.skip("torch is not installed")
    inputs = data()[1][codec][:k]
    group = f"mean_half {codec} k={k} 64 MiB"
    benchmark.group = group
    benchmark.extra_info.update(codec=codec, k=k, impl=impl, mib=64)
    want = R.mean_half(inputs, codec=codec)
    if impl == "numpy":
        got = run(benchmark, numpy_mean_fp16, inputs).view(np.uint16)
    elif impl == "torch":
        tensors = [torch.from_numpy(x.view(np.int16)).view(torch_dtype(codec)) for x in inputs]
        got = run(benchmark, torch_mean, tensors, torch_dtype(codec))
        got = got.view(torch.int16).numpy().view(np.uint16)
    else:
        out = np.empty(N, np.uint16)
        threads = 1 if impl == "ddpwire-1thread" else None
        with R.use_threads(threads):
            got = run(benchmark, functools.partial(R.mean_half, codec=codec), inputs, out)
    np.testing.assert_array_equal(got, want)
    record(benchmark, group, impl)
