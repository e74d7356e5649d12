"""Coordinator and Worker over loopback: averages against numpy, bad peers,
lost peers, and the GIL released while blocked."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import ddpwire
from ddpwire import Coordinator, Worker, encode_frame
from ddpwire.wire.messages import (
    GradientPayload,
    ShardAssignment,
)

from session_helpers import (
    exact_mean,
    fake_coordinator,
    recv_frame,
    spawn,
    start_workers,
    worker_and_raw_peer,
)

ADDR = ("127.0.0.1", 0)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("socket_threads", [False, True], ids=["one-loop", "threads"])
def test_average_matches_reference_arithmetic(n, socket_threads):
    rng = np.random.default_rng(n)
    size = 300_001  # not a multiple of any ring or slice size
    grads = [rng.standard_normal(size).astype(np.float32) * np.float32(10.0 ** rng.integers(-3, 3))
             for _ in range(n)]
    with Coordinator(ADDR, topology="star", expect_workers=n, ring_bytes=64 * 1024,
                     socket_threads=socket_threads) as coord:
        def body(w):
            w.send_gradients(3, grads[w.worker_id], 0.25 * (w.worker_id + 1), w.worker_id, 10)
            out = np.empty(size, np.float32)
            avg = w.receive_averaged(out=out)
            assert avg.gradients is out
            return avg
        threads = start_workers(coord, n, body)
        result = coord.collect_and_reduce(3)
        coord.broadcast_averaged(3, result)
        avgs = [t.join_result() for t in threads]
    want = exact_mean(grads)
    assert np.array_equal(result.avg_gradients.view(np.uint32), want.view(np.uint32))
    ref64 = np.mean(np.stack(grads).astype(np.float64), axis=0)
    assert np.allclose(result.avg_gradients, ref64, rtol=1e-5, atol=1e-5)
    for avg in avgs:
        assert np.array_equal(avg.gradients.view(np.uint32), want.view(np.uint32))
    losses = [np.float32(0.25 * (i + 1)) for i in range(n)]
    acc = np.float32(0)
    for l in losses:
        acc = np.float32(acc + l * np.float32(10))
    assert result.global_loss == float(acc / np.float32(10 * n))
    assert result.total_correct == sum(range(n)) and result.total_samples == 10 * n


def test_uneven_shards():
    with Coordinator(ADDR, topology="star", expect_workers=3) as coord:
        threads = start_workers(coord, 3, lambda w: w.receive_shard())
        coord.set_total_samples(10)
        coord.send_shard_assignments(0)
        shards = sorted((s.shard_start, s.shard_end) for s in (t.join_result() for t in threads))
    assert shards == [(0, 3), (3, 6), (6, 10)]


GOOD = {
    "flat": lambda w: w.send_gradients(4, np.ones(8, np.float32), 1.0, 1, 1),
    "block": lambda w: w.send_block_gradient(4, 2, 3, np.ones(3, np.float32), [1, 2]),
    "non_block": lambda w: w.send_non_block_gradient(4, 1, np.ones(5, np.float32)),
}
COLLECT = {
    "flat": lambda c: c.collect_and_reduce(4),
    "block": lambda c: c.collect_and_reduce_block(4, 2),
    "non_block": lambda c: c.collect_and_reduce_non_block(4, 1),
}


def _one_bad_worker(send_bad, kind, expect_exc, n=2):
    """Worker 0 sends a good step-4 gradient of this kind; worker 1 sends what
    send_bad(w) sends, and the coordinator collects that kind."""
    collect = COLLECT[kind]
    with Coordinator(ADDR, topology="star", expect_workers=n, timeout=5) as coord:
        def body(w):
            (send_bad if w.worker_id == 1 else GOOD[kind])(w)
        threads = start_workers(coord, n, body)
        with pytest.raises(expect_exc) as info:
            collect(coord)
        for t in threads:
            t.join(10)
    assert info.value.worker_id == 1, str(info.value)
    assert info.value.step == 4
    return info.value


def test_step_mismatch():
    exc = _one_bad_worker(lambda w: w.send_gradients(5, np.ones(8, np.float32), 1.0, 1, 1),
                          "flat", ddpwire.GradientMismatch)
    assert exc.field == "step" and (exc.expected, exc.got) == (4, 5)


def test_wrong_message_type():
    exc = _one_bad_worker(lambda w: w.send_non_block_gradient(4, 0, np.ones(8, np.float32)),
                          "flat", ddpwire.UnexpectedMessage)
    assert exc.expected == "GradientPayload" and exc.got == "NonBlockGradientPayload"


def test_length_mismatch():
    exc = _one_bad_worker(lambda w: w.send_gradients(4, np.ones(9, np.float32), 1.0, 1, 1),
                          "flat", ddpwire.GradientMismatch)
    assert (exc.expected, exc.got) == (8, 9)


def test_component_sizes_mismatch():
    exc = _one_bad_worker(lambda w: w.send_block_gradient(4, 2, 3, np.ones(3, np.float32), [2, 1]),
                          "block", ddpwire.GradientMismatch)
    assert exc.field == "component_sizes"


def test_component_sizes_not_adding_up():
    exc = _one_bad_worker(lambda w: w.send_block_gradient(4, 2, 3, np.ones(3, np.float32), [1, 1]),
                          "block", ddpwire.GradientMismatch)
    assert "component_sizes" in exc.field


def test_block_idx_mismatch():
    exc = _one_bad_worker(lambda w: w.send_block_gradient(4, 1, 3, np.ones(3, np.float32), [1, 2]),
                          "block", ddpwire.GradientMismatch)
    assert exc.field == "block_idx"


def test_component_mismatch():
    exc = _one_bad_worker(lambda w: w.send_non_block_gradient(4, 2, np.ones(5, np.float32)),
                          "non_block", ddpwire.GradientMismatch)
    assert exc.field == "component"


def test_flat_length_fixed_after_first_step():
    with Coordinator(ADDR, topology="star", expect_workers=1, timeout=5) as coord:
        def body(w):
            w.send_gradients(0, np.ones(4, np.float32), 1.0, 1, 1)
            w.receive_averaged()
            w.send_gradients(1, np.ones(5, np.float32), 1.0, 1, 1)
        t = start_workers(coord, 1, body)[0]
        coord.broadcast_averaged(0, coord.collect_and_reduce(0))
        with pytest.raises(ddpwire.GradientMismatch) as info:
            coord.collect_and_reduce(1)
        t.join_result()
    assert (info.value.expected, info.value.got, info.value.worker_id) == (4, 5, 0)


def test_worker_killed_mid_frame():
    with Coordinator(ADDR, topology="star", expect_workers=2, timeout=10) as coord:
        w0, raw = worker_and_raw_peer(coord)
        w0.send_gradients(2, np.ones(100_000, np.float32), 1.0, 1, 1)
        frame = encode_frame(GradientPayload(step=2, worker_id=1, gradients=np.ones(100_000, np.float32),
                                             loss=1.0, correct=1, total=1))
        raw.sendall(frame[: len(frame) // 2])
        raw.close()
        with pytest.raises(ddpwire.WorkerLost) as info:
            coord.collect_and_reduce(2)
        w0.close()
    assert info.value.worker_id == 1 and info.value.step == 2
    assert "disconnected" in str(info.value)


def test_worker_that_never_sends():
    with Coordinator(ADDR, topology="star", expect_workers=2, timeout=0.5) as coord:
        w0, raw = worker_and_raw_peer(coord)
        w0.send_gradients(0, np.ones(10, np.float32), 1.0, 1, 1)
        with pytest.raises(ddpwire.WorkerLost) as info:
            coord.collect_and_reduce(0)
        raw.close()
        w0.close()
    assert info.value.worker_id == 1 and info.value.step == 0
    assert "silent" in str(info.value) and "waiting for GradientPayload" in str(info.value)


@pytest.mark.parametrize("socket_threads", [False, True], ids=["one-loop", "threads"])
def test_worker_silent_mid_stream(socket_threads):
    """Worker 1 sends its head and half its elements, then stops: the
    streaming reduce must time out on it, not hang."""
    with Coordinator(ADDR, topology="star", expect_workers=2, timeout=0.5, ring_bytes=4096,
                     socket_threads=socket_threads) as coord:
        w0, raw = worker_and_raw_peer(coord)
        g = np.ones(50_000, np.float32)
        sender = spawn(lambda: w0.send_gradients(0, g, 1.0, 1, 1))
        frame = encode_frame(GradientPayload(step=0, worker_id=1, gradients=g, loss=1.0, correct=1, total=1))
        raw.sendall(frame[: len(frame) // 2])
        with pytest.raises(ddpwire.WorkerLost) as info:
            coord.collect_and_reduce(0)
        raw.close()
        w0.close()
        sender.join(5)
    assert info.value.worker_id == 1


def test_join_timeout():
    with Coordinator(ADDR, topology="star", expect_workers=2) as coord:
        with pytest.raises(ddpwire.JoinTimeout, match="0 of 2"):
            coord.wait_for_workers(timeout=0.3)


def test_stray_connection_does_not_block_join():
    with Coordinator(ADDR, topology="star", expect_workers=1, timeout=0.5) as coord:
        stray = socket.create_connection(coord.local_addr)
        stray.sendall(b"GET / HTTP/1.0\r\n\r\n")
        t = spawn(lambda: Worker.connect(coord.local_addr, 0, "cpu"))
        coord.wait_for_workers(timeout=10)
        w = t.join_result()
        assert w.worker_id == 0
        w.close()
        stray.close()


def test_coordinator_killed_mid_step():
    def behaviour(conn):
        conn.sendall(encode_frame(ShardAssignment(step=0, shard_start=0, shard_end=10)))
        recv_frame(conn)  # the gradients
        avg = encode_frame(ddpwire.AveragedGradient(step=0, gradients=np.ones(1000, np.float32),
                                                   global_loss=0.0))
        conn.sendall(avg[:100])
        conn.close()
    lsock, t = fake_coordinator(behaviour)
    w = Worker.connect(lsock.getsockname(), timeout=10)
    shard = w.receive_shard()
    w.send_gradients(shard.step, np.ones(1000, np.float32), 1.0, 1, 1)
    with pytest.raises(ddpwire.CoordinatorLost) as info:
        w.receive_averaged()
    assert info.value.step == 0
    w.close()
    lsock.close()


def test_coordinator_silent():
    done = threading.Event()
    lsock, t = fake_coordinator(lambda conn: done.wait(10))
    w = Worker.connect(lsock.getsockname(), timeout=0.3)
    with pytest.raises(ddpwire.CoordinatorLost, match="silent"):
        w.receive_shard()
    done.set()
    w.close()
    lsock.close()


def test_shutdown_during_reduce():
    lsock, t = fake_coordinator(lambda conn: (recv_frame(conn), conn.sendall(encode_frame(ddpwire.Shutdown()))))
    w = Worker.connect(lsock.getsockname(), timeout=5)
    w.send_gradients(0, np.ones(3, np.float32), 1.0, 1, 1)
    with pytest.raises(ddpwire.ShutdownDuringReduce):
        w.receive_averaged()
    w.close()
    lsock.close()


def test_connect_retries_until_coordinator_is_up():
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    t = spawn(lambda: Worker.connect(("127.0.0.1", port), 0, "cpu", timeout=10))
    time.sleep(0.3)  # the worker is retrying refused connections meanwhile
    with Coordinator(("127.0.0.1", port), expect_workers=1) as coord:
        coord.wait_for_workers(timeout=10)
        w = t.join_result()
        assert w.worker_id == 0
        w.close()


def test_connect_gives_up_at_deadline():
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    with pytest.raises(ddpwire.JoinTimeout, match="could not reach"):
        Worker.connect(("127.0.0.1", port), timeout=0.3)


def test_port_in_use_is_a_clear_error():
    with Coordinator(ADDR, topology="star", expect_workers=1) as coord:
        with pytest.raises(OSError, match="address already in use"):
            Coordinator(coord.local_addr, expect_workers=1)


def test_other_threads_run_while_receive_blocks():
    """The receive waits with the GIL released: a pure-Python loop in another
    thread keeps going meanwhile."""
    with Coordinator(ADDR, topology="star", expect_workers=1) as coord:
        t = spawn(lambda: Worker.connect(coord.local_addr, 0, "cpu"))
        coord.wait_for_workers()
        w = t.join_result()
        counter = [0]
        stop = threading.Event()

        def spin():
            while not stop.is_set():
                counter[0] += 1
        blocked = spawn(w.receive_shard)
        time.sleep(0.05)
        spinner = threading.Thread(target=spin, daemon=True)
        spinner.start()
        time.sleep(0.5)
        during = counter[0]
        assert blocked.is_alive()
        coord.set_total_samples(4)
        coord.send_shard_assignments(0)
        assert blocked.join_result().step == 0
        stop.set()
        spinner.join()
        w.close()
    assert during > 10_000


def test_heartbeats_detect_a_silent_worker_sooner_than_the_timeout():
    with Coordinator(ADDR, topology="star", expect_workers=2, timeout=60, heartbeat=0.1, heartbeat_timeout=0.5) as coord:
        w0, raw = worker_and_raw_peer(coord, heartbeat=0.1)  # the raw peer sends no heartbeats
        time.sleep(0.8)  # worker 0 "computes" past the heartbeat timeout, heartbeating
        w0.send_gradients(0, np.ones(10, np.float32), 1.0, 1, 1)
        with pytest.raises(ddpwire.WorkerLost) as info:
            coord.collect_and_reduce(0)
        raw.close()
        w0.close()
    assert info.value.worker_id == 1
    assert "silent" in str(info.value) and "waiting for GradientPayload" in str(info.value)  # the heartbeat timeout, not the 60 s one


def test_heartbeats_keep_a_slow_step_alive():
    with Coordinator(ADDR, topology="star", expect_workers=1, timeout=60, heartbeat=0.05, heartbeat_timeout=0.3) as coord:
        def body(w):
            shard = w.receive_shard()  # waits longer than the heartbeat timeout
            time.sleep(0.6)
            w.send_gradients(shard.step, np.ones(4, np.float32), 1.0, 1, 1)
            return w.receive_averaged()
        t = spawn(lambda: _run_worker(coord, body, heartbeat=0.05, heartbeat_timeout=0.3))
        coord.wait_for_workers()
        time.sleep(0.6)
        coord.set_total_samples(1)
        coord.send_shard_assignments(0)
        coord.broadcast_averaged(0, coord.collect_and_reduce(0))
        assert t.join_result().gradients.tolist() == [1.0] * 4


def _run_worker(coord, body, **kw):
    with Worker.connect(coord.local_addr, 0, "cpu", **kw) as w:
        return body(w)


def test_ctrl_c_interrupts_a_blocked_receive(tmp_path):
    script = textwrap.dedent("""
        import sys, time
        from ddpwire import Coordinator, Worker
        import threading
        coord = Coordinator(("127.0.0.1", 0), expect_workers=1)
        t = threading.Thread(target=coord.wait_for_workers, daemon=True); t.start()
        w = Worker.connect(coord.local_addr, timeout=600)
        print("blocked", flush=True)
        try:
            w.receive_shard()
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            sys.exit(3)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "blocked"
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 3
        assert proc.stdout.readline().strip() == "interrupted"
    finally:
        proc.kill()


def test_frames_over_the_reference_limit_need_max_frame_on_both_sides():
    """Above 100 MB a frame is refused on send unless max_frame is raised, and
    then it flows both ways."""
    n = 100_000_000 // 4 + 16
    grads = np.ones(n, np.float32)
    with Coordinator(ADDR, topology="star", expect_workers=1, timeout=60) as coord:
        t = spawn(lambda: Worker.connect(coord.local_addr, 0, "cpu", timeout=60))
        coord.wait_for_workers()
        w = t.join_result()
        with pytest.raises(ddpwire.FrameTooLarge):
            w.send_gradients(0, grads, 1.0, 1, 1)
        w.close()
    big = 2 * 4 * n
    with Coordinator(ADDR, topology="star", expect_workers=1, timeout=60, max_frame=big) as coord:
        def body():
            with Worker.connect(coord.local_addr, 0, "cpu", timeout=60, max_frame=big) as w:
                w.send_gradients(0, grads, 1.0, 1, 1)
                return w.receive_averaged().gradients
        t = spawn(body)
        coord.wait_for_workers()
        coord.broadcast_averaged(0, coord.collect_and_reduce(0))
        assert np.array_equal(t.join_result(), grads)


def test_stop_workers_sends_shutdown_between_frames_only():
    # worker 1's gradient is far larger than the socket buffers: it is still
    # being sent when the Shutdown goes out, and must still get through
    big = np.ones(8 << 20, np.float32)

    def body(w):
        shard = w.receive_shard()
        w.send_gradients(shard.step, big, 1.0, 1, 1)
        return w.receive_averaged()

    with Coordinator(ADDR, 2, timeout=30, topology="star") as coord:
        threads = start_workers(coord, 2, body)
        coord.wait_for_workers()
        coord.send_shard_assignments(0)
        assert not coord.mid_frame
        # as if an exception had cut a frame to worker 0 short
        coord.channel(0).frame_open = True
        assert coord.mid_frame
        assert coord.stop_workers(grace=20) == 1
    with pytest.raises(ddpwire.ShutdownDuringReduce):
        threads[1].join_result()
    with pytest.raises(ddpwire.CoordinatorLost):  # told nothing: it only sees the close
        threads[0].join_result()
