"""The cost of socket threads on small vectors: one pipelined step
(Coordinator.allreduce and Worker.allreduce, two workers in threads of the
benchmark process, over loopback) with one poll loop per side against
socket threads on both sides, side by side in one run. Below the size where the
copies dominate, what is left is starting and joining the threads; this is
the figure behind the default's 1 MiB threshold (Coordinator socket_threads).

    python -m pytest -q bench/test_bench_socket_threads.py --benchmark-group-by=group

Read "threads / one loop" as the ratio of the two medians in each group.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from ddpwire import Coordinator, Worker

WORKERS = 2
ROUNDS = 200


class Session:
    """A coordinator and WORKERS workers that run allreduce steps in lockstep."""

    def __init__(self, count: int, socket_threads: bool) -> None:
        self.coord = Coordinator(("127.0.0.1", 0), expect_workers=WORKERS, timeout=60,
                                 socket_threads=socket_threads)
        self.socket_threads = socket_threads
        self.out = np.empty(count, np.float32)
        self.step = 0
        self.errors: list = []
        self.threads = []
        grads = np.ones(count, np.float32)

        for _ in range(WORKERS):
            t = threading.Thread(target=self._worker, args=(grads, count), daemon=True)
            t.start()
            self.threads.append(t)
        self.coord.wait_for_workers()

    def _worker(self, grads: np.ndarray, count: int) -> None:
        try:
            with Worker.connect(self.coord.local_addr, timeout=60,
                                socket_threads=self.socket_threads) as w:
                out = np.empty(count, np.float32)
                step = 0
                while True:
                    if w.receive_shard() is None:
                        return
                    w.allreduce(step, grads, 1.0, 1, 1, out=out)
                    step += 1
        except BaseException as exc:  # reported by close()
            self.errors.append(exc)

    def run_step(self) -> None:
        self.coord.set_total_samples(WORKERS)
        self.coord.send_shard_assignments(self.step)
        self.coord.allreduce(self.step, out=self.out)
        self.step += 1

    def close(self) -> None:
        self.coord.shutdown_workers()
        for t in self.threads:
            t.join(30)
        self.coord.close()
        assert not self.errors, self.errors
        assert np.array_equal(self.out, np.ones_like(self.out))


@pytest.mark.parametrize("socket_threads", [False, True], ids=["one-loop", "threads"])
@pytest.mark.parametrize("kib", [4, 64, 1024])
def test_step_with_and_without_socket_threads(benchmark, kib, socket_threads):
    session = Session(kib * 256, socket_threads)
    benchmark.group = f"{kib} KiB, N = {WORKERS}"
    benchmark.extra_info.update(kib=kib, socket_threads=socket_threads, workers=WORKERS)
    try:
        benchmark.pedantic(session.run_step, rounds=ROUNDS, warmup_rounds=10, iterations=1)
    finally:
        session.close()
