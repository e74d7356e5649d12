"""The reference worker client's tests and the reference coordinator's own,
as pytest, against ddpwire's Coordinator and Worker."""
from __future__ import annotations

import numpy as np
import pytest

import ddpwire
from ddpwire import Coordinator, Worker

from session_helpers import spawn

ADDR = ("127.0.0.1", 0)


def test_worker_connect_and_join():
    with Coordinator(ADDR, topology="star", expect_workers=1) as coord:
        t = spawn(lambda: Worker.connect(coord.local_addr, 1, "cpu"))
        coord.wait_for_workers()
        client = t.join_result()
        assert client.worker_id == 0
        assert client.total_workers == 1
        assert coord.worker_count == 1
        assert coord.workers[0].backend == "cpu" and coord.workers[0].gpu_count == 1
        client.close()


def test_worker_block_gradient_roundtrip():
    sizes = [4, 2, 2, 4, 8, 8, 8, 1, 1]
    total = sum(sizes)
    grads = (np.arange(total, dtype=np.float32) * np.float32(0.1)).astype(np.float32)
    with Coordinator(ADDR, topology="star", expect_workers=1) as coord:
        def worker():
            with Worker.connect(coord.local_addr, 1, "cuda") as client:
                client.send_block_gradient(0, 5, 24, grads, sizes)
                return client.receive_averaged_block()
        t = spawn(worker)
        coord.wait_for_workers()
        result = coord.collect_and_reduce_block(0, 5)
        assert result.block_idx == 5
        assert len(result.avg_gradients) == total
        assert list(result.component_sizes) == sizes
        coord.broadcast_averaged_block(0, result)
        avg = t.join_result()
    assert avg.step == 0 and avg.block_idx == 5
    assert list(avg.component_sizes) == sizes
    # one worker: the average is its own gradient, bit for bit
    assert np.array_equal(avg.gradients.view(np.uint32), grads.view(np.uint32))


def test_worker_non_block_gradient_roundtrip():
    grads = np.array([1.0, 2.0, 3.0, 4.0, 5.0], dtype=np.float32)
    with Coordinator(ADDR, topology="star", expect_workers=1) as coord:
        def worker():
            with Worker.connect(coord.local_addr, 1, "cuda") as client:
                client.send_non_block_gradient(0, 0, grads)
                return client.receive_averaged_non_block()
        t = spawn(worker)
        coord.wait_for_workers()
        result = coord.collect_and_reduce_non_block(0, 0)
        assert result.component == 0
        coord.broadcast_averaged_non_block(0, result)
        avg = t.join_result()
    assert avg.step == 0 and avg.component == 0
    assert np.array_equal(avg.gradients, grads)


def test_two_worker_block_allreduce():
    sizes = [2, 1, 1, 2, 2, 2, 2, 1, 1]
    total = sum(sizes)
    with Coordinator(ADDR, topology="star", expect_workers=2) as coord:
        def worker(value):
            def run():
                with Worker.connect(coord.local_addr, 1, "cuda") as client:
                    client.send_block_gradient(0, 0, 1, np.full(total, value, np.float32), sizes)
                    return client.worker_id, client.receive_averaged_block()
            return run
        t0 = spawn(worker(1.0))
        t1 = spawn(worker(3.0))
        coord.wait_for_workers()
        result = coord.collect_and_reduce_block(0, 0)
        coord.broadcast_averaged_block(0, result)
        for t in (t0, t1):
            _, avg = t.join_result()
            assert np.array_equal(avg.gradients, np.full(total, 2.0, np.float32))


def test_worker_full_training_step():
    with Coordinator(ADDR, topology="star", expect_workers=1) as coord:
        def worker():
            with Worker.connect(coord.local_addr, 1, "cpu") as client:
                shard = client.receive_shard()
                assert (shard.step, shard.shard_start, shard.shard_end) == (0, 0, 50)
                client.send_gradients(0, np.array([1.0, 2.0, 3.0], np.float32), 0.5, 48, 50)
                avg = client.receive_averaged()
                assert client.receive_shard() is None
                return avg
        t = spawn(worker)
        coord.wait_for_workers()
        coord.set_total_samples(50)
        coord.send_shard_assignments(0)
        result = coord.collect_and_reduce(0)
        assert (result.total_correct, result.total_samples) == (48, 50)
        coord.broadcast_averaged(0, result)
        coord.shutdown_workers()
        avg = t.join_result()
    assert avg.step == 0
    assert avg.gradients.tolist() == [1.0, 2.0, 3.0]
    assert avg.global_loss == pytest.approx(0.5, abs=1e-6)


# ---- the reference coordinator's own tests ----

def test_coordinator_accepts_workers():
    with Coordinator(ADDR, topology="star", expect_workers=2) as coord:
        ts = [spawn(lambda: Worker.connect(coord.local_addr, 0, "cpu", node_id=f"n{i}")) for i in range(2)]
        infos = coord.wait_for_workers()
        workers = [t.join_result() for t in ts]
        assert sorted(w.worker_id for w in workers) == [0, 1]
        assert [i.worker_id for i in infos] == [0, 1]
        assert all(w.total_workers == 2 for w in workers)
        for w in workers:
            w.close()


def test_coordinator_shards_and_reduces_two_workers():
    with Coordinator(ADDR, topology="star", expect_workers=2) as coord:
        def worker():
            with Worker.connect(coord.local_addr, 0, "cpu") as w:
                shard = w.receive_shard()
                g = np.full(4, float(w.worker_id + 1), np.float32)
                w.send_gradients(shard.step, g, 1.0 + w.worker_id, 10 * (w.worker_id + 1),
                                 shard.shard_end - shard.shard_start)
                return w.worker_id, shard, w.receive_averaged()
        ts = [spawn(worker), spawn(worker)]
        coord.wait_for_workers()
        coord.set_total_samples(100)
        coord.send_shard_assignments(7)
        result = coord.collect_and_reduce(7)
        coord.broadcast_averaged(7, result)
        out = sorted(t.join_result() for t in ts)
    assert [(s.shard_start, s.shard_end) for _, s, _ in out] == [(0, 50), (50, 100)]
    for _, _, avg in out:
        assert avg.step == 7
        assert avg.gradients.tolist() == [1.5] * 4
        # (1.0 * 50 + 2.0 * 50) / 100
        assert avg.global_loss == pytest.approx(1.5)
    assert (result.total_correct, result.total_samples) == (30, 100)


def test_coordinator_halts_on_nan():
    with Coordinator(ADDR, topology="star", expect_workers=2) as coord:
        def worker(bad):
            def run():
                with Worker.connect(coord.local_addr, 0, "cpu", node_id="bad" if bad else "good") as w:
                    g = np.ones(1000, np.float32)
                    if bad:
                        g[617] = np.nan
                    w.send_gradients(0, g, 1.0, 1, 1)
                    try:
                        w.receive_averaged()
                    except ddpwire.DdpwireError as exc:
                        return exc
            return run
        threads = [spawn(worker(False)), spawn(worker(True))]
        coord.wait_for_workers()
        bad_id = next(i.worker_id for i in coord.workers if i.node_id == "bad")
        with pytest.raises(ddpwire.NonFiniteGradient) as info:
            coord.collect_and_reduce(0)
        assert info.value.worker_id == bad_id and info.value.step == 0
        assert info.value.index == 617
        assert f"worker {bad_id}" in str(info.value) and "step 0" in str(info.value)
        # nothing was broadcast: the workers see the coordinator leave
        coord.close()
        for t in threads:
            assert isinstance(t.join_result(), ddpwire.CoordinatorLost)
