"""One ``torch.distributed.all_reduce`` of 64 MiB of float32 on backend
"ddpwire" against "gloo", side by side in one run, 2 to 4 ranks on this
machine: with every rank on one host, ddpwire's float32 SUM/AVG allreduces
go through shared memory (docs/ddp.md; DDPWIRE_SHM=0 measures its TCP path).

    python -m pytest -q bench/test_bench_torch_allreduce.py \
        --benchmark-json=docs/torch-allreduce-shm.json

DDPWIRE_BENCH_RANKS ("2,3,4"), DDPWIRE_BENCH_MIB (64) and
DDPWIRE_BENCH_ROUNDS (10) change the sweep. Each round is one all_reduce
on every rank at once, timed from the parent's "step" to the last rank's
"done"; ranks run one torch thread each, whatever the backend.
"""
from __future__ import annotations

import os

import pytest

from ddp_procs import Ranks, case_ids, cases

MIB = int(os.environ.get("DDPWIRE_BENCH_MIB", "64"))
ROUNDS = int(os.environ.get("DDPWIRE_BENCH_ROUNDS", "10"))
WARMUP = 2  # the first rounds fault the pages in and set up the segment


@pytest.mark.parametrize("backend,world", cases(), ids=case_ids())
def test_torch_allreduce(benchmark, backend, world):
    benchmark.group = f"{world} ranks, {MIB} MiB"
    ranks = Ranks(backend, world, ["allreduce", str(MIB)])
    try:
        benchmark.extra_info.update(backend=backend, ranks=world, size_bytes=MIB << 20,
                                    shared_memory=os.environ.get("DDPWIRE_SHM", "1") != "0")
        benchmark.pedantic(ranks.step, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    finally:
        ranks.close()
