"""Mean of k float32 buffers: ddpwire.plane.reduce.mean side by side with numpy and
with a plain memcpy moving the same number of bytes (the machine's memory
bandwidth limit), in one run.

    python -m pytest -q bench/test_bench_reduce.py --benchmark-json=bench.json
    python bench/report.py bench.json

Bytes moved by a mean of k buffers of S bytes: k*S read + S written. The
memcpy copies (k+1)*S/2 bytes, so it too reads plus writes (k+1)*S.
"""
import ctypes
import functools

import numpy as np
import pytest

from ddpwire.plane import reduce as R

SIZES_MIB = [1, 16, 64, 256]
KS = [2, 4, 8]
IMPLS = ["ddpwire", "ddpwire-1thread", "numpy", "memcpy"]
ROUNDS = {1: 40, 16: 8, 64: 5, 256: 3}

CASES = [(mib, k, impl) for mib in SIZES_MIB for k in KS for impl in IMPLS]


@functools.lru_cache(maxsize=1)  # one size alive at a time: 9 x 256 MiB is enough
def buffers(mib):
    n = mib * 2**20 // 4
    rng = np.random.default_rng(mib)
    inputs = [rng.standard_normal(n, dtype=np.float32) for _ in range(max(KS))]
    return inputs, np.ones(n, dtype=np.float32)


def numpy_mean(inputs, out):
    np.add(inputs[0], inputs[1], out=out)
    for x in inputs[2:]:
        np.add(out, x, out=out)
    np.divide(out, np.float32(len(inputs)), out=out)


@pytest.mark.parametrize("mib, k, impl", CASES, ids=[f"{m}MiB-k{k}-{i}" for m, k, i in CASES])
def test_mean(benchmark, mib, k, impl):
    inputs, out = buffers(mib)
    inputs = inputs[:k]
    size = out.nbytes
    benchmark.group = f"mean k={k} {mib} MiB"
    benchmark.extra_info.update(mib=mib, k=k, impl=impl, bytes_moved=(k + 1) * size)
    run = functools.partial(benchmark.pedantic, rounds=ROUNDS[mib], iterations=1, warmup_rounds=1)
    if impl == "memcpy":
        nbytes = (k + 1) * size // 2
        src = np.ones(nbytes, dtype=np.uint8)
        dst = np.ones(nbytes, dtype=np.uint8)
        run(ctypes.memmove, args=(dst.ctypes.data, src.ctypes.data, nbytes))
        assert dst[-1] == 1
        return
    if impl == "numpy":
        run(numpy_mean, args=(inputs, out))
    elif impl == "ddpwire-1thread":
        with R.use_threads(1):
            run(R.mean, args=(inputs,), kwargs={"out": out})
    else:
        run(R.mean, args=(inputs,), kwargs={"out": out})
    # every implementation here computes the same bits
    want = np.empty_like(out)
    numpy_mean(inputs, want)
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))
