"""What ``--balance auto`` costs the coordinator a step, beside ``off``, in the
same run (issue 38, stop 55): the shards' bookkeeping of one step as the
coordinator does it (``Shards.plan``, each worker's bounds and scale, its
arrival and StepTiming, the progress table's timings), on synthetic times
of identical workers, no sockets. ``plan`` is on the step's critical path (the shards go out after
it); the StepTimings come in while the workers compute.

    PYTHONPATH=$PWD python -m pytest -q bench/test_bench_shards.py \\
        --benchmark-json=bench/results/shards-step-<commit>.json

To measure an older commit with this file (the bookkeeping's API is the
same), run it from outside both checkouts with PYTHONPATH at the older
one's built tree: ``python -m`` puts the working directory ahead of
PYTHONPATH (the command in bench/results/README.md, stop 57).

The ratio auto/off is printed and kept in each benchmark's extra_info.
"""
from __future__ import annotations

import random

import pytest

from ddpwire.session.balance import Shards

STEPS = 3000
TOTAL = 64
#: seconds a step of the demo MLP at 64 samples takes here, two workers (about 1 ms)
STEP_S = 0.0015


def steps(mode, workers: int) -> float:
    """STEPS steps of the bookkeeping; returns the synthetic clock's end."""
    shards = Shards([True] * workers, mode, planned=STEPS)
    rng = random.Random(0)
    now = 0.0
    for step in range(STEPS):
        now += STEP_S
        shards.plan(step, TOTAL, now)
        for w in range(workers):  # what the ShardAssignment and ShardScale carry
            shards.bounds(w)
            shards.scale(w)
        for w in range(workers):
            shards.arrived(w, now + 0.001 + rng.random() * 1e-4)
            shards.observe(w, step, int((0.0009 + rng.random() * 1e-4) * 1e6), now + 0.0011)
        shards.timings()
    return now


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("mode", ["auto", "off"])
def test_shards_step(benchmark, mode, workers):
    benchmark.pedantic(steps, args=("auto" if mode == "auto" else False, workers),
                       rounds=7, iterations=1, warmup_rounds=1)
    benchmark.extra_info.update(mode=mode, workers=workers, steps=STEPS,
                                us_per_step=benchmark.stats.stats.median / STEPS * 1e6)
    print(f"\n{mode} {workers} workers: {benchmark.extra_info['us_per_step']:.1f} us a step",
          flush=True)
