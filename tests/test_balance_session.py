"""Shards by measured speed in real sessions (sockets, worker threads): the
shards follow the workers' speeds, the average is the sample-weighted mean
(the full batch's) on every path, equal shards keep the reference's bits,
and a count that disagrees with its shard is named."""
from __future__ import annotations

import io
import json
import threading
import time

import numpy as np
import pytest

import ddpwire
from ddpwire import Coordinator, Worker
from ddpwire import encode_frame
from ddpwire.wire.errors import GradientMismatch
from ddpwire.session.metrics import MetricsFile
from ddpwire.session.progress import ProgressBar
from ddpwire.cli.serve import serve

from session_helpers import raw_join, recv_frame, reference_allreduce, spawn

ADDR = ("127.0.0.1", 0)
TIMEOUT = 20.0
TOTAL = 240   # samples per step
LENGTH = 3000  # gradient elements
PER_SAMPLE = np.random.default_rng(7).standard_normal((TOTAL, LENGTH)).astype(np.float32)
FULL_BATCH = PER_SAMPLE.astype(np.float64).mean(axis=0)


def shard_mean(start: int, end: int) -> np.ndarray:
    """The mean gradient of a shard, as a worker computes it."""
    if end == start:
        return np.zeros(LENGTH, dtype=np.float32)
    return PER_SAMPLE[start:end].astype(np.float64).mean(axis=0).astype(np.float32)


class Run:
    """A coordinator and worker threads training ``steps`` steps, each
    worker taking ``seconds_per_sample[i]`` per sample of its shard (and
    ``after[i]`` seconds after each average, outside its compute: a slow
    optimizer step)."""

    def __init__(self, seconds_per_sample, steps, *, per_block=False, lie=None,
                 coordinator=None, worker=None, after=None):
        n = len(seconds_per_sample)
        self.coord = Coordinator(ADDR, n, timeout=TIMEOUT, join_timeout=TIMEOUT,
                                 per_block=per_block or None, **(coordinator or {}))
        self.shards = {}    # (worker, step) -> (start, end)
        self.averages = {}  # (worker, step) -> the average it received
        self.errors = {}
        self.threads = []
        self.per_block = per_block
        self.lie = lie
        self.after = after or [0.0] * n
        for i in range(n):
            t = threading.Thread(target=self._worker, args=(seconds_per_sample, worker or {}),
                                 daemon=True)
            self.threads.append(t)
            t.start()
            self.coord.wait_for_workers(count=i + 1)  # worker ids in thread order
        self.coord.wait_for_workers()
        self.reports = []
        try:
            serve(self.coord, steps=steps, total_samples=TOTAL, per_block=per_block,
                  num_blocks=1, non_block_components=(0,) if per_block else (),
                  on_step=self.reports.append)
        finally:
            for t in self.threads:
                t.join(3 * TIMEOUT)
                assert not t.is_alive(), "a worker thread hung"
            self.coord.close()

    def _worker(self, seconds_per_sample, connect):
        try:
            with Worker.connect(self.coord.local_addr, timeout=TIMEOUT,
                                per_block=self.per_block or None, **connect) as w:
                while True:
                    shard = w.receive_shard()
                    if shard is None:
                        return
                    start, end = shard.shard_start, shard.shard_end
                    time.sleep((end - start) * seconds_per_sample[w.worker_id])
                    g = shard_mean(start, end)
                    total = end - start
                    if self.lie is not None and self.lie == (w.worker_id, shard.step):
                        total += 1
                    if self.per_block:
                        w.send_block_gradient(shard.step, 0, 1, g, [LENGTH])
                        avg = w.receive_averaged_block().gradients
                        w.send_non_block_gradient(shard.step, 0, g[:100])
                        head = w.receive_averaged_non_block().gradients
                        assert np.array_equal(np.asarray(head).view(np.uint32),
                                              np.asarray(avg)[:100].view(np.uint32))
                    else:
                        avg = w.allreduce(shard.step, g, 1.0, 0, total).gradients
                    self.shards[w.worker_id, shard.step] = (start, end)
                    self.averages[w.worker_id, shard.step] = np.array(avg, copy=True)
                    time.sleep(self.after[w.worker_id])
        except BaseException as exc:  # handed to the test
            self.errors[threading.current_thread().name] = exc


# (name, coordinator keywords, tolerance of the weighted mean)
PATHS = [
    ("star", dict(topology="star"), 1e-6),
    ("star-threads", dict(topology="star", socket_threads=True), 1e-6),
    ("mesh", dict(topology="mesh", shared_memory=False), 1e-6),
    ("mesh-shm", dict(topology="mesh"), 1e-6),
    ("mesh-bf16", dict(topology="mesh", compression="bf16"), 2e-2),
    ("mesh-fp16", dict(topology="mesh", compression="fp16"), 4e-3),
]


@pytest.mark.parametrize("name,coordinator,tol", PATHS, ids=[p[0] for p in PATHS])
def test_shards_follow_speed_and_the_average_is_the_full_batch_s(name, coordinator, tol):
    # each move waits for its new size to be measured 3 times: two moves
    steps = 12
    run = Run([1e-4, 4e-4], steps, coordinator=dict(balance=True, **coordinator))
    assert not run.errors, run.errors
    first = run.shards[0, 0], run.shards[1, 0]
    assert first == ((0, TOTAL // 2), (TOTAL // 2, TOTAL))  # nothing measured yet
    fast, slow = (run.shards[w, steps - 1] for w in (0, 1))
    # four times as fast: four fifths of the samples, give or take noise
    assert abs((fast[1] - fast[0]) - 0.8 * TOTAL) <= 0.1 * TOTAL, run.shards
    assert fast[1] == slow[0] and slow[1] == TOTAL
    for step in range(steps):
        got = run.averages[0, step]
        assert np.array_equal(got.view(np.uint32), run.averages[1, step].view(np.uint32))
        np.testing.assert_allclose(got, FULL_BATCH, rtol=tol, atol=tol)
    # equal shards: the reference's bits, the scale was exactly 1
    step0 = [shard_mean(*run.shards[w, 0]) for w in (0, 1)]
    if "16" not in name:  # the 16-bit codecs round, the reference does not
        assert np.array_equal(run.averages[0, 0].view(np.uint32),
                              reference_allreduce(step0).view(np.uint32))
    # and unequal ones are not the plain mean of the shard means
    last = [shard_mean(*run.shards[w, steps - 1]) for w in (0, 1)]
    assert not np.allclose(reference_allreduce(last), FULL_BATCH, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("topology", ["star", "mesh"])
def test_a_worker_s_time_outside_its_compute_is_taken_off_its_shard(topology):
    """Two workers of one speed (0.2 ms a sample), one spending 20 ms after
    every average outside its compute (a slow optimizer step): the shards
    end alike net of it, r * (t - 0.02) against r * t, 70 and 170 samples
    of 240, where compute times alone would keep 120 each."""
    run = Run([2e-4, 2e-4], 14, coordinator=dict(balance=True, topology=topology,
                                                  shared_memory=False),
              after=[0.0, 0.020])
    assert not run.errors, run.errors
    late = [run.shards[1, step][1] - run.shards[1, step][0] for step in range(10, 14)]
    assert max(late) < 100, late
    b = run.coord.shards.balancer
    assert b.before[1] > b.before[0] + 0.010, (b.before, b.after)
    for step in range(14):
        np.testing.assert_allclose(run.averages[0, step], FULL_BATCH, rtol=1e-6, atol=1e-6)
    # the step waited for the worker whose part came in last
    report = run.reports[-1]
    assert report.waited_for == max(report.workers, key=lambda w: w.arrival).worker_id


def test_per_block_and_non_block_steps_are_weighted_too():
    steps = 12
    run = Run([1e-4, 4e-4], steps, per_block=True, coordinator=dict(balance=True))
    assert not run.errors, run.errors
    size = run.shards[0, steps - 1][1] - run.shards[0, steps - 1][0]
    assert size > 0.65 * TOTAL, run.shards
    for step in range(steps):
        np.testing.assert_allclose(run.averages[1, step], FULL_BATCH, rtol=1e-6, atol=1e-6)


def test_three_workers_at_full_half_and_quarter_speed():
    # 40, 80 and 160 ms at equal shards: at 8, 16 and 32 ms the workers' own
    # times were within a loaded machine's jitter (a full suite beside a CI
    # run on 2 cores), and the model's error kept equal shards for all 12
    # steps, as it should where speeds do not stand out of the noise
    run = Run([5e-4, 1e-3, 2e-3], 12, coordinator=dict(balance=True, topology="mesh",
                                                        shared_memory=False))
    assert not run.errors, run.errors
    sizes = [run.shards[w, 11][1] - run.shards[w, 11][0] for w in range(3)]
    assert sizes[0] > sizes[1] > sizes[2] > 0, sizes
    np.testing.assert_allclose(run.averages[2, 11], FULL_BATCH, rtol=1e-6, atol=1e-6)


def test_without_balance_the_shards_and_bits_are_the_reference_s():
    run = Run([1e-4, 4e-4], 3, coordinator=dict(topology="star"))
    assert not run.errors, run.errors
    for step in range(3):
        assert run.shards[0, step] == (0, TOTAL // 2)
        want = reference_allreduce([shard_mean(*run.shards[w, step]) for w in (0, 1)])
        assert np.array_equal(run.averages[0, step].view(np.uint32), want.view(np.uint32))
    # the timings show all the same: worker 1 is the one waited for
    assert [r.waited_for for r in run.reports] == [1, 1, 1]


@pytest.mark.parametrize("topology", ["star", "mesh"])
def test_a_count_that_disagrees_with_its_shard_is_named(topology):
    with pytest.raises(GradientMismatch) as info:
        Run([1e-4, 4e-4], 12, lie=(1, 10),
            coordinator=dict(balance=True, topology=topology, shared_memory=False))
    err = info.value
    assert err.worker_id == 1 and err.step == 10
    assert "total (for a shard of" in str(err)


def test_a_reference_worker_is_timed_by_arrival_and_weighted_in_the_star():
    """balance=True beside a worker that speaks only the reference protocol
    (a bare socket here): its speed is seen from when its gradient arrives,
    its weight applied as the coordinator sums, and it needs no change."""
    steps = 12
    coord = Coordinator(ADDR, 2, timeout=TIMEOUT, join_timeout=TIMEOUT, balance=True)
    got = {}

    def fast():
        with Worker.connect(coord.local_addr, timeout=TIMEOUT) as w:
            while (shard := w.receive_shard()) is not None:
                start, end = shard.shard_start, shard.shard_end
                time.sleep((end - start) * 1e-4)
                avg = w.allreduce(shard.step, shard_mean(start, end), 1.0, 0, end - start)
                got[0, shard.step] = ((start, end), np.array(avg.gradients, copy=True))

    def reference(sock):
        while isinstance(msg := recv_frame(sock), ddpwire.ShardAssignment):
            start, end = msg.shard_start, msg.shard_end
            time.sleep((end - start) * 4e-4)
            sock.sendall(encode_frame(ddpwire.GradientPayload(
                step=msg.step, worker_id=1, gradients=shard_mean(start, end), loss=1.0,
                correct=0, total=end - start)))
            avg = recv_frame(sock)
            got[1, msg.step] = ((start, end), np.array(avg.gradients, copy=True))
        assert isinstance(msg, ddpwire.Shutdown)
        sock.close()

    try:
        a = spawn(fast)
        coord.wait_for_workers(count=1)
        b = spawn(lambda: reference(raw_join(coord.local_addr)))
        coord.wait_for_workers()
        assert coord.shards.balance and coord.shards.timed == [True, False]
        serve(coord, steps=steps, total_samples=TOTAL)
        a.join_result()
        b.join_result()
    finally:
        coord.close()
    (start, end), _ = got[1, steps - 1]
    assert abs((end - start) - 0.2 * TOTAL) <= 0.1 * TOTAL, got.keys()
    for step in range(steps):
        assert np.array_equal(got[0, step][1].view(np.uint32), got[1, step][1].view(np.uint32))
        np.testing.assert_allclose(got[1, step][1], FULL_BATCH, rtol=1e-6, atol=1e-6)


def test_balance_auto_keeps_equal_shards_beside_a_reference_worker():
    coord = Coordinator(ADDR, 2, timeout=TIMEOUT, join_timeout=TIMEOUT, balance="auto",
                        samples_per_step=TOTAL)
    try:
        good = spawn(lambda: Worker.connect(coord.local_addr, timeout=TIMEOUT))
        coord.wait_for_workers(count=1)
        raw = spawn(lambda: raw_join(coord.local_addr))
        coord.wait_for_workers()
        w, sock = good.join_result(), raw.join_result()
        assert coord.shards is not None and not coord.shards.balance
        coord.send_shard_assignments(0)
        shard = w.receive_shard()
        assert (shard.shard_start, shard.shard_end) == (0, TOTAL // 2)
        msg = recv_frame(sock)  # the reference peer sees its assignment and nothing else
        assert isinstance(msg, ddpwire.ShardAssignment) and msg.shard_start == TOTAL // 2
        sock.settimeout(0.2)
        with pytest.raises(OSError):
            sock.recv(1)
        w.close()
        sock.close()
    finally:
        coord.close()


@pytest.mark.parametrize("steps,planned", [(None, None), (0, None), (500, 500)])
def test_the_trials_budget_knows_the_run_s_planned_steps(steps, planned):
    """The steps the coordinator grants (``--steps``) bound the trials'
    budget (ddpwire.session.guard); a run of unknown length keeps the default."""
    from ddpwire.wire.extensions import Extension, encode_u64
    extensions = None if steps is None else {Extension.STEPS: encode_u64(steps)}
    coord = Coordinator(ADDR, 2, timeout=TIMEOUT, join_timeout=TIMEOUT, balance="auto",
                        samples_per_step=TOTAL, extensions=extensions)
    try:
        joins = [spawn(lambda: Worker.connect(coord.local_addr, timeout=TIMEOUT))
                 for _ in range(2)]
        coord.wait_for_workers()
        assert coord.shards is not None and coord.shards.balancer.guard is not None
        assert coord.shards.balancer.guard.planned == planned
        for j in joins:
            j.join_result().close()
    finally:
        coord.close()


def test_a_steps_entry_that_is_no_u64_is_refused_before_listening():
    from ddpwire.wire.errors import OptionError
    from ddpwire.wire.extensions import Extension
    with pytest.raises(OptionError, match="steps entry .* got 3 bytes"):
        Coordinator(ADDR, 2, extensions={Extension.STEPS: b"abc"})


def test_the_table_and_the_metrics_name_the_worker_held_back(tmp_path):
    run = Run([1e-4, 1e-4, 8e-4], 4, coordinator=dict(topology="star"))
    assert not run.errors, run.errors
    path = tmp_path / "metrics.jsonl"
    with MetricsFile(str(path)) as metrics:
        for report in run.reports:
            metrics.write(report)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == 4
    assert [x["waited_for"] for x in lines] == [2, 2, 2, 2]
    assert [w["shard"] for w in lines[0]["workers"]] == [80, 80, 80]
    slow = lines[-1]["workers"][2]
    assert slow["compute_s"] > 0.05 and slow["wait_s"] == 0.0
    assert lines[-1]["workers"][0]["wait_s"] > 0.03
    assert lines[-1]["exchange_s"] == pytest.approx(lines[-1]["step_time_s"] - slow["compute_s"])

    class Tty(io.StringIO):
        def isatty(self):
            return True
    out = Tty()
    bar = ProgressBar(4, stream=out, redraw=0.0)
    for report in run.reports:
        bar.update(report)
    text = out.getvalue()
    last = text.split("\x1b[3F")[-1]  # the final redraw: the bar and three rows
    rows = [x for x in last.split("\n") if "worker" in x]
    assert len(rows) == 3 and "<- the step waited for it" in rows[2], last
    assert all("<-" not in x for x in rows[:2])

    plain = io.StringIO()
    bar = ProgressBar(4, stream=plain, every=0.0)
    for report in run.reports:
        bar.update(report)
    assert plain.getvalue().count("waited for worker 2") == 4
