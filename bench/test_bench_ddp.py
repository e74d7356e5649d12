"""One DDP training step (forward, backward with DDP's bucketed allreduce,
SGD step) of a ~25M-parameter model on backend "ddpwire" against "gloo",
side by side in one run, 2 to 4 ranks on loopback.

    python -m pytest -q bench/test_bench_ddp.py --benchmark-json=docs/ddp-bench.json
    python bench/report_ddp.py docs/ddp-bench.json

DDPWIRE_BENCH_RANKS="2" restricts the rank counts. Each round is one step
of every rank at once, timed from the parent's "step" to the last rank's
"done". Ranks run one torch thread each, whatever the backend.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROUNDS = int(os.environ.get("DDPWIRE_BENCH_ROUNDS", "8"))
WARMUP = 2  # DDP rebuilds its buckets after the first step
RANKS = [int(x) for x in os.environ.get("DDPWIRE_BENCH_RANKS", "2,3,4").split(",") if x.strip()]
BACKENDS = ("gloo", "ddpwire")
CASES = [pytest.param(b, n, id=f"N{n}-{b}") for n in RANKS for b in BACKENDS]


class Ranks:
    """N rank processes of bench/ddp_procs.py on one backend."""

    def __init__(self, backend: str, world: int) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        root = str(HERE.parent)
        self.procs = []
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                       PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
            self.procs.append(subprocess.Popen([sys.executable, str(HERE / "ddp_procs.py"), backend],
                                               env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                               text=True, bufsize=1))
        self.params = [self._answer(p, "ready") for p in self.procs][0]

    @staticmethod
    def _answer(p: subprocess.Popen, word: str) -> str:
        line = p.stdout.readline()
        if not line.startswith(word):
            raise RuntimeError(f"rank answered {line!r}, expected {word!r} (exit {p.poll()})")
        return line.split()[1] if len(line.split()) > 1 else ""

    def step(self) -> None:
        for p in self.procs:
            p.stdin.write("step\n")
        for p in self.procs:
            self._answer(p, "done")

    def close(self) -> None:
        for p in self.procs:
            try:
                p.stdin.write("quit\n")
                p.stdin.close()
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.mark.parametrize("backend,world", CASES)
def test_ddp_step(benchmark, backend, world):
    benchmark.group = f"{world} ranks"
    ranks = Ranks(backend, world)
    try:
        benchmark.extra_info.update(backend=backend, ranks=world, parameters=int(ranks.params))
        benchmark.pedantic(ranks.step, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    finally:
        ranks.close()
