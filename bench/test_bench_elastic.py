"""Elastic sessions (issue 20): how long from a worker's loss to the next
committed step, how fast a joiner takes the model's state, and what the
elastic star's collect-then-send costs against the streaming star.

Workers are processes (bench/elastic_worker.py, numpy only) on loopback;
the coordinator runs here, heartbeats every 0.2 s, a worker declared lost
after 1 s of silence (``HEARTBEAT_TIMEOUT``), the step timeout 30 s.

- ``test_recovery[sigkill|sigstop]``: 3 workers, a 4 MiB vector; worker 1
  is killed (SIGKILL: its connection closes) or stopped (SIGSTOP: it falls
  silent) right after step 9; ``recovery_s`` is from that signal to the end
  of the next committed step (the redone step 10, averaged by the other
  two), beside the median step time of the same run. Goal: within the
  heartbeat timeout plus 1 s.
- ``test_state_transfer``: 2 workers, one leaves; a third joins late and
  takes a 100 MiB state (a worker's StateRequest answer relayed by the
  coordinator, its SHA-256 checked); ``state_mib_per_s`` from the joiner's
  own clock, beside the rate of a flat step of 91.6 MiB (24M float32, within
  the default frame limit) in the same run.
- ``test_step[elastic|streaming]``: the flat step of 2 workers with a
  16 MiB vector, an elastic session (the whole sum, then the average to one
  worker after another) against the plain star (the average streamed back
  while the gradients arrive), median of 20 steps after 3.

    PYTHONPATH=$PWD python -m pytest bench/test_bench_elastic.py -p no:cacheprovider \\
        --benchmark-json bench/results/bench-elastic.json -q
"""
from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest

from ddpwire import Coordinator
from ddpwire.cli.serve import serve

HERE = Path(__file__).resolve().parent
WORKER = HERE / "elastic_worker.py"
HEARTBEAT, HEARTBEAT_TIMEOUT = 0.2, 1.0
ENV = dict(os.environ, PYTHONPATH=str(HERE.parent))


def start(coord: Coordinator, n: int, mib: int, late: bool = False) -> subprocess.Popen:
    host, port = coord.local_addr
    return subprocess.Popen([sys.executable, str(WORKER), host, str(port), str(n), str(mib)]
                            + (["late"] if late else []), env=ENV, stdout=subprocess.PIPE,
                            text=True)


def session(workers: int, **kw) -> Coordinator:
    return Coordinator(("127.0.0.1", 0), workers, timeout=30.0, heartbeat=HEARTBEAT,
                       heartbeat_timeout=HEARTBEAT_TIMEOUT, samples_per_step=12, **kw)


def stop_all(procs: List[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(30)


@pytest.mark.parametrize("fault", ["sigkill", "sigstop"])
def test_recovery(benchmark, fault):
    n, at, steps = 1 << 20, 10, 30

    def run():
        coord = session(3, elastic=True)
        procs = []
        try:
            for i in range(3):
                procs.append(start(coord, n, 0))
                coord.wait_for_workers(count=i + 1)
            ends, signalled = {}, {}

            def on_step(report):
                ends.setdefault(report.step, time.perf_counter())
                if report.step == at - 1:
                    signalled["t"] = time.perf_counter()
                    os.kill(procs[1].pid, signal.SIGKILL if fault == "sigkill" else signal.SIGSTOP)
            serve(coord, steps=steps, total_samples=12, on_step=on_step)
        finally:
            stop_all(procs)
            coord.close()
        steady = [ends[s + 1] - ends[s] for s in range(1, at - 1)]
        return ends[at] - signalled["t"], statistics.median(steady), coord.membership
    recovery, step, events = benchmark.pedantic(run, rounds=1, iterations=1)
    assert [(e.step, e.worker_id) for e in events] == [(at, 1)]
    benchmark.extra_info.update(
        fault=fault, recovery_s=recovery, step_median_s=step,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT, goal_s=HEARTBEAT_TIMEOUT + 1.0,
        met=recovery <= HEARTBEAT_TIMEOUT + 1.0, vector_mib=4 * n / 2**20, lost_why=events[0].why)


def test_state_transfer(benchmark):
    mib, n = 100, 24_000_000  # the flat step: 91.6 MiB, under the 100 MB frame limit

    def run():
        coord = session(2, elastic=True)
        procs = []
        try:
            for i in range(2):
                procs.append(start(coord, n, mib))
                coord.wait_for_workers(count=i + 1)
            times = []

            def on_step(report):
                times.append(report.step_time)
                if report.step == 1:
                    os.kill(procs[1].pid, signal.SIGKILL)
                if report.step == 3:
                    procs.append(start(coord, n, mib, late=True))
                    coord.wait_for_workers(count=2, timeout=120)
            serve(coord, steps=6, total_samples=12, on_step=on_step)
            line = procs[2].stdout.readline().split()
        finally:
            stop_all(procs)
            coord.close()
        assert line[0] == "state" and int(line[1]) == mib << 20
        return float(line[2]), min(times[:2]), coord.membership
    seconds, step, events = benchmark.pedantic(run, rounds=1, iterations=1)
    assert [e.joined for e in events] == [False, True]
    flat_rate = 4 * n / 2**20 / step
    benchmark.extra_info.update(state_mib=mib, state_s=seconds, state_mib_per_s=mib / seconds,
                                flat_step_mib=4 * n / 2**20, flat_step_s=step,
                                flat_step_mib_per_s=flat_rate,
                                state_rate_to_flat_step=mib / seconds / flat_rate)


@pytest.mark.parametrize("kind", ["elastic", "streaming"])
def test_step(benchmark, kind):
    n, warm, measured = 4 << 20, 3, 20

    def run():
        coord = session(2, elastic=kind == "elastic", topology="star")
        procs = []
        try:
            for i in range(2):
                procs.append(start(coord, n, 0))
                coord.wait_for_workers(count=i + 1)
            reports = serve(coord, steps=warm + measured, total_samples=12)
        finally:
            stop_all(procs)
            coord.close()
        return statistics.median(r.step_time for r in reports[warm:])
    median = benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update(kind=kind, step_median_s=median, vector_mib=4 * n / 2**20)
