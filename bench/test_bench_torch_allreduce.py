"""One ``torch.distributed.all_reduce`` of 64 MiB of float32 on backend
"ddpwire" against "gloo", side by side in one run, 2 to 4 ranks on this
machine: with every rank on one host, ddpwire's float32 SUM/AVG allreduces
go through shared memory (docs/ddp.md; DDPWIRE_SHM=0 measures its TCP path).

    python -m pytest -q bench/test_bench_torch_allreduce.py \
        --benchmark-json=bench/results/torch-allreduce-shm.json

DDPWIRE_BENCH_RANKS ("2,3,4"), DDPWIRE_BENCH_MIB (64), or
DDPWIRE_BENCH_BYTES for a small one (e.g. 4: a scalar), and
DDPWIRE_BENCH_ROUNDS (10) change the sweep; DDPWIRE_BENCH_BACKENDS the
cases (bench/ddp_procs.py: "ddpwire-service" keeps every allreduce on the
service). Each round is one all_reduce on every rank at once, timed from
the parent's "step" to the last rank's "done"; ranks run one torch thread
each, whatever the backend.

    DDPWIRE_BENCH_BYTES=4 DDPWIRE_BENCH_ROUNDS=300 \
        DDPWIRE_BENCH_BACKENDS=gloo,ddpwire,ddpwire-service \
        python -m pytest -q bench/test_bench_torch_allreduce.py --benchmark-json=F
"""
from __future__ import annotations

import os

import pytest

from ddp_procs import Ranks, case_ids, cases

MIB = int(os.environ.get("DDPWIRE_BENCH_MIB", "64"))
#: a size in bytes instead (a small allreduce); the old script of
#: $DDPWIRE_BASELINE knows MiB only
BYTES = int(os.environ["DDPWIRE_BENCH_BYTES"]) if os.environ.get("DDPWIRE_BENCH_BYTES") else None
ROUNDS = int(os.environ.get("DDPWIRE_BENCH_ROUNDS", "10"))
WARMUP = 2  # the first rounds fault the pages in and set up the segment


@pytest.mark.parametrize("backend,world", cases(), ids=case_ids())
def test_torch_allreduce(benchmark, backend, world):
    if BYTES is not None and backend == "ddpwire-baseline":
        pytest.skip("the baseline's script takes sizes in MiB only")
    size = f"{MIB} MiB" if BYTES is None else f"{BYTES} B"
    benchmark.group = f"{world} ranks, {size}"
    ranks = Ranks(backend, world, ["allreduce", str(MIB) if BYTES is None else f"{BYTES}B"])
    try:
        benchmark.extra_info.update(backend=backend, ranks=world,
                                    size_bytes=MIB << 20 if BYTES is None else BYTES,
                                    shared_memory=os.environ.get("DDPWIRE_SHM", "1") != "0")
        benchmark.pedantic(ranks.step, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    finally:
        ranks.close()
