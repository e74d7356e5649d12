"""One DDP training step (forward, backward with DDP's bucketed allreduce,
SGD step) of a ~25M-parameter model on backend "ddpwire" against "gloo",
side by side in one run, 2 to 4 ranks on loopback.

    python -m pytest -q bench/test_bench_ddp.py --benchmark-json=bench/results/ddp-bench.json
    python bench/report_ddp.py bench/results/ddp-bench.json

DDPWIRE_BENCH_RANKS="2" restricts the rank counts. Each round is one step
of every rank at once, timed from the parent's "step" to the last rank's
"done". Ranks run one torch thread each, whatever the backend.
"""
from __future__ import annotations

import os

import pytest

from ddp_procs import Ranks, case_ids, cases
ROUNDS = int(os.environ.get("DDPWIRE_BENCH_ROUNDS", "8"))
WARMUP = 2  # DDP rebuilds its buckets after the first step


@pytest.mark.parametrize("backend,world", cases(), ids=case_ids())
def test_ddp_step(benchmark, backend, world):
    benchmark.group = f"{world} ranks"
    ranks = Ranks(backend, world)
    try:
        benchmark.extra_info.update(backend=backend, ranks=world, parameters=int(ranks.size))
        benchmark.pedantic(ranks.step, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    finally:
        ranks.close()
