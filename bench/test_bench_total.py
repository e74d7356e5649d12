"""Sum of k float32 buffers (the SUM collective's arithmetic):
ddpwire.plane.reduce.total in one pass, side by side in one run with the k-pass
way the shared-memory allreduce took before it (a copy, then one
accumulate per later input: out is written k times and read k - 1 times)
and with numpy doing the same k passes. All three give the same bits.

    python -m pytest -q bench/test_bench_total.py --benchmark-json=total.json
    python bench/report.py total.json

The sizes are a 64 MiB gradient's slice at 3 and 2 ranks (the part each rank
sums in the shared-memory allreduce) and the whole vector; one thread, as
each rank of the allreduce has its own core or less.
"""
import functools

import numpy as np
import pytest

from ddpwire.plane import reduce as R

SIZES_MIB = [21, 32, 64]
KS = [2, 3, 4]
IMPLS = ["ddpwire", "ddpwire-passes", "numpy"]
ROUNDS = 7

CASES = [(mib, k, impl) for mib in SIZES_MIB for k in KS for impl in IMPLS]


@functools.lru_cache(maxsize=1)
def buffers(mib):
    n = mib * 2**20 // 4
    rng = np.random.default_rng(mib)
    return [rng.standard_normal(n, dtype=np.float32) for _ in range(max(KS))], \
        np.ones(n, dtype=np.float32)


def passes(inputs, out, accumulate):
    np.copyto(out, inputs[0])
    for x in inputs[1:]:
        accumulate(out, x)


def numpy_add(out, x):
    np.add(out, x, out=out)


@pytest.mark.parametrize("mib, k, impl", CASES, ids=[f"{m}MiB-k{k}-{i}" for m, k, i in CASES])
def test_total(benchmark, mib, k, impl):
    inputs, out = buffers(mib)
    inputs = inputs[:k]
    benchmark.group = f"total k={k} {mib} MiB"
    benchmark.extra_info.update(op="total", mib=mib, k=k, impl=impl,
                                bytes_moved=(k + 1) * out.nbytes)
    run = functools.partial(benchmark.pedantic, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    with R.use_threads(1):
        if impl == "ddpwire":
            run(R.total, args=(inputs,), kwargs={"out": out})
        elif impl == "ddpwire-passes":
            run(passes, args=(inputs, out, R.accumulate))
        else:
            run(passes, args=(inputs, out, numpy_add))
    want = np.empty_like(out)
    passes(inputs, want, numpy_add)
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))
