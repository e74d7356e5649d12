"""What a DDP step of bench/ddp_step.py's model costs without the network:
forward, backward and the SGD step, each rank alone on its process, N ranks
at once on this machine's cores (as the cluster's ranks share them), beside
the float32 -> bfloat16 -> float32 round trip of the whole gradient that a
16-bit bucket pays in some form on every rank: torch's (``.to``) and
ddpwire's C kernels (``to_half``, ``from_half``, as the rank links run them).

    python -m pytest -q bench/test_bench_ddp_compute.py --benchmark-json=bench/results/ddp-compute.json

It bounds what the network leaves: a cluster step can be no shorter than
its ranks' compute plus the link's time for their bytes, whatever the
backend. DDPWIRE_BENCH_RANKS="1,4" picks the rank counts. One round is one
step of every rank at once; each phase's median over ranks and rounds is in
extra_info (seconds).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time

import pytest

from ddp_step import BATCH, WIDTHS, _model

RANKS = [int(n) for n in os.environ.get("DDPWIRE_BENCH_RANKS", "1,2,4").split(",")]
ROUNDS = 10
WARMUP = 3
PHASES = ("forward", "backward", "optimizer", "bf16_round_trip", "ddpwire_bf16_round_trip")


def _rank(steps: int, go, done) -> None:
    import numpy as np
    import torch

    from ddpwire import _core

    torch.set_num_threads(1)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, WIDTHS[0], generator=gen)
    y = torch.randint(0, WIDTHS[-1], (BATCH,), generator=gen)
    for _ in range(steps):
        go.get()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        t4 = time.perf_counter()
        flat.to(torch.bfloat16).float()
        t5 = time.perf_counter()
        grads = flat.numpy()
        half = _core.to_half(grads, np.empty(len(grads), np.uint16), codec="bf16")
        _core.from_half(half, grads, codec="bf16")
        t6 = time.perf_counter()
        done.put((t1 - t0, t2 - t1, t3 - t2, t5 - t4, t6 - t5))


@pytest.mark.parametrize("ranks", RANKS, ids=[f"N{n}" for n in RANKS])
def test_ddp_compute(benchmark, ranks):
    benchmark.group = "DDP compute"
    ctx = mp.get_context("spawn")
    go, done = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(WARMUP + ROUNDS, go, done)) for _ in range(ranks)]
    for p in procs:
        p.start()
    seen = []

    def step() -> None:
        for _ in procs:
            go.put(True)
        seen.append([done.get(timeout=120) for _ in procs])

    try:
        benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    finally:
        for p in procs:
            p.join(60)
    timed = [t for rnd in seen[WARMUP:] for t in rnd]
    assert len(timed) == ROUNDS * ranks
    benchmark.extra_info.update(ranks=ranks, **{
        name: statistics.median(t[k] for t in timed) for k, name in enumerate(PHASES)})
