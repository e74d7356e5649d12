"""The pipelined allreduce: Coordinator.allreduce (average streamed back while
gradients arrive) and Worker.allreduce (send and receive at once), against
each other and against the classic two-call methods, bit for bit, and what
each side sees when a peer fails in the middle of it."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import ddpwire
from ddpwire import Coordinator, Worker, encode_frame
from ddpwire.wire.messages import GradientPayload, Heartbeat, ShardAssignment

from session_helpers import (
    exact_mean,
    fake_coordinator,
    recv_exact,
    recv_frame,
    spawn,
    start_workers,
    worker_and_raw_peer,
)

ADDR = ("127.0.0.1", 0)
# not a multiple of any ring, slice or socket buffer size
SIZE = 100_003
# small rings: many wrap-arounds and many partial sends per step
RING = 16 * 1024


def gradients_for(n, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(SIZE).astype(np.float32) * np.float32(10.0 ** rng.integers(-3, 3))
            for _ in range(n)]


def expected_loss(n):
    acc = np.float32(0)
    for i in range(n):
        acc = np.float32(acc + np.float32(0.25 * (i + 1)) * np.float32(10 + i))
    return float(acc / np.float32(sum(10 + i for i in range(n))))


def bits(a):
    return np.asarray(a, dtype=np.float32).view(np.uint32)


# one poll loop per step, or socket threads (the coordinator's receiving and
# sending threads per connection, the worker's sending thread)
LOOPS = pytest.mark.parametrize("socket_threads", [False, True], ids=["one-loop", "threads"])

# (coordinator side, worker side)
MODES = [("fused", "classic"), ("fused", "duplex"), ("classic", "duplex")]


@pytest.mark.parametrize("coord_mode,worker_mode", MODES, ids=["-".join(m) for m in MODES])
@pytest.mark.parametrize("n", range(1, 9))
@LOOPS
def test_bit_identical_to_fixed_order_float32(n, coord_mode, worker_mode, socket_threads):
    grads = gradients_for(n, seed=100 + n)
    steps = 2
    with Coordinator(ADDR, topology="star", expect_workers=n, ring_bytes=RING, timeout=30,
                     socket_threads=socket_threads) as coord:
        def body(w):
            got = []
            for step in range(steps):
                g, i = grads[w.worker_id], w.worker_id
                out = np.empty(SIZE, np.float32)
                if worker_mode == "duplex":
                    avg = w.allreduce(step, g, 0.25 * (i + 1), i, 10 + i, out=out)
                else:
                    w.send_gradients(step, g, 0.25 * (i + 1), i, 10 + i)
                    avg = w.receive_averaged(out=out)
                assert avg.gradients is out and avg.step == step
                got.append((out, avg.global_loss))
            return got
        threads = start_workers(coord, n, body, socket_threads=socket_threads)
        results = []
        for step in range(steps):
            if coord_mode == "fused":
                r = coord.allreduce(step)
            else:
                r = coord.collect_and_reduce(step)
                coord.broadcast_averaged(step, r)
            results.append(r)
        per_worker = [t.join_result() for t in threads]
    want = exact_mean(grads)
    loss = expected_loss(n)
    for r in results:
        assert np.array_equal(bits(r.avg_gradients), bits(want))
        assert r.global_loss == loss
        assert r.total_samples == sum(10 + i for i in range(n))
        assert r.total_correct == sum(range(n))
        assert r.worker_losses == [float(np.float32(0.25 * (i + 1))) for i in range(n)]
    for got in per_worker:
        for out, global_loss in got:
            assert np.array_equal(bits(out), bits(want))
            assert global_loss == loss


def test_fused_and_classic_give_the_same_result_in_one_session():
    n = 3
    grads = gradients_for(n, seed=7)
    with Coordinator(ADDR, topology="star", expect_workers=n, ring_bytes=RING) as coord:
        def body(w):
            outs = []
            for step in range(4):
                outs.append(w.allreduce(step, grads[w.worker_id], 1.0, 1, 2).gradients)
            return outs
        threads = start_workers(coord, n, body)
        results = []
        for step in range(4):
            if step % 2:
                r = coord.collect_and_reduce(step)
                coord.broadcast_averaged(step, r)
            else:
                r = coord.allreduce(step)
            results.append(r.avg_gradients)
        outs = [t.join_result() for t in threads]
    for a in results + [o for worker in outs for o in worker]:
        assert np.array_equal(bits(a), bits(results[0]))


@LOOPS
def test_duplex_may_receive_into_its_own_gradients(socket_threads):
    """out is the gradients buffer: every average lands on an element already sent."""
    n = 3
    grads = gradients_for(n, seed=11)
    with Coordinator(ADDR, topology="star", expect_workers=n, ring_bytes=RING, socket_threads=socket_threads) as coord:
        def body(w):
            buf = grads[w.worker_id].copy()
            avg = w.allreduce(0, buf, 1.0, 1, 1, out=buf)
            assert avg.gradients is buf
            return buf
        threads = start_workers(coord, n, body, socket_threads=socket_threads)
        r = coord.allreduce(0)
        outs = [t.join_result() for t in threads]
    want = exact_mean(grads)
    assert np.array_equal(bits(r.avg_gradients), bits(want))
    for out in outs:
        assert np.array_equal(bits(out), bits(want))


def test_fused_block_and_non_block():
    n = 3
    sizes = [40_000, 7, 20_001]
    blocks = gradients_for(n, seed=3)
    non_blocks = [g[:5_003].copy() for g in gradients_for(n, seed=4)]
    with Coordinator(ADDR, topology="star", expect_workers=n, ring_bytes=RING) as coord:
        def body(w):
            i = w.worker_id
            g = blocks[i][: sum(sizes)].copy()
            w.send_block_gradient(5, 2, 4, g, sizes)
            b = w.receive_averaged_block()
            w.send_non_block_gradient(5, 1, non_blocks[i])
            c = w.receive_averaged_non_block()
            return b, c
        threads = start_workers(coord, n, body)
        rb = coord.allreduce_block(5, 2)
        rc = coord.allreduce_non_block(5, 1)
        got = [t.join_result() for t in threads]
    want_b = exact_mean([b[: sum(sizes)] for b in blocks])
    want_c = exact_mean(non_blocks)
    assert np.array_equal(bits(rb.avg_gradients), bits(want_b)) and list(rb.component_sizes) == sizes
    assert np.array_equal(bits(rc.avg_gradients), bits(want_c)) and rc.component == 1
    for b, c in got:
        assert (b.step, b.block_idx, list(b.component_sizes)) == (5, 2, sizes)
        assert np.array_equal(bits(b.gradients), bits(want_b))
        assert (c.step, c.component) == (5, 1)
        assert np.array_equal(bits(c.gradients), bits(want_c))


# ---- a non-finite value halts the fused pass ----

@pytest.mark.parametrize("where", [0, SIZE // 2, SIZE - 1], ids=["start", "middle", "end"])
@pytest.mark.parametrize("worker_mode", ["duplex", "classic"])
@LOOPS
def test_nan_halts_the_fused_pass_and_no_worker_applies_anything(where, worker_mode, socket_threads):
    n, bad_worker, step = 3, 1, 4
    grads = gradients_for(n, seed=where)
    grads[bad_worker][where] = np.nan
    with Coordinator(ADDR, topology="star", expect_workers=n, ring_bytes=RING, timeout=30,
                     socket_threads=socket_threads) as coord:
        def body(w):
            g = grads[w.worker_id]
            if worker_mode == "duplex":
                return w.allreduce(step, g, 1.0, 1, 1)
            w.send_gradients(step, g, 1.0, 1, 1)
            return w.receive_averaged()
        threads = start_workers(coord, n, body, socket_threads=socket_threads)
        with pytest.raises(ddpwire.NonFiniteGradient) as info:
            coord.allreduce(step)
        # every worker learns the session is over (no hang, no average applied)
        for t in threads:
            with pytest.raises(ddpwire.CoordinatorLost):
                t.join_result()
        # and the session is over: a later step raises the halt again
        with pytest.raises(ddpwire.NonFiniteGradient) as again:
            coord.allreduce(step + 1)
        assert (again.value.worker_id, again.value.step) == (bad_worker, step)
    err = info.value
    assert (err.worker_id, err.step, err.index) == (bad_worker, step, where)
    assert np.isnan(err.value)
    assert f"worker {bad_worker}" in str(err) and f"step {step}" in str(err)


@LOOPS
def test_infinity_from_worker_0_is_named(socket_threads):
    grads = gradients_for(2, seed=9)
    grads[0][123] = -np.inf
    with Coordinator(ADDR, topology="star", expect_workers=2, ring_bytes=RING, socket_threads=socket_threads) as coord:
        threads = start_workers(coord, 2, lambda w: w.allreduce(0, grads[w.worker_id], 1.0, 1, 1),
                                socket_threads=socket_threads)
        with pytest.raises(ddpwire.NonFiniteGradient) as info:
            coord.allreduce(0)
        for t in threads:
            with pytest.raises(ddpwire.CoordinatorLost):
                t.join_result()
    assert (info.value.worker_id, info.value.index, info.value.value) == (0, 123, -np.inf)


# ---- lost workers during the fused pass ----

@LOOPS
def test_worker_killed_mid_frame_during_fused_pass(socket_threads):
    with Coordinator(ADDR, topology="star", expect_workers=2, timeout=10, ring_bytes=RING,
                     socket_threads=socket_threads) as coord:
        w0, raw = worker_and_raw_peer(coord, timeout=30, socket_threads=socket_threads)
        g = np.ones(SIZE, np.float32)
        t0 = spawn(lambda: w0.allreduce(2, g, 1.0, 1, 1))
        frame = encode_frame(GradientPayload(step=2, worker_id=1, gradients=g, loss=1.0,
                                             correct=1, total=1))
        raw.sendall(frame[: len(frame) // 2])
        raw.close()
        with pytest.raises(ddpwire.WorkerLost) as info:
            coord.allreduce(2)
        with pytest.raises(ddpwire.CoordinatorLost):
            t0.join_result()
        w0.close()
    assert info.value.worker_id == 1 and info.value.step == 2
    assert "disconnected" in str(info.value)


@LOOPS
def test_silent_worker_during_fused_pass(socket_threads):
    with Coordinator(ADDR, topology="star", expect_workers=2, timeout=0.5, ring_bytes=RING,
                     socket_threads=socket_threads) as coord:
        w0, raw = worker_and_raw_peer(coord, timeout=30, socket_threads=socket_threads)
        g = np.ones(SIZE, np.float32)
        t0 = spawn(lambda: w0.allreduce(0, g, 1.0, 1, 1))
        frame = encode_frame(GradientPayload(step=0, worker_id=1, gradients=g, loss=1.0,
                                             correct=1, total=1))
        raw.sendall(frame[: len(frame) // 2])
        with pytest.raises(ddpwire.WorkerLost) as info:
            coord.allreduce(0)
        with pytest.raises(ddpwire.CoordinatorLost):
            t0.join_result()
        raw.close()
        w0.close()
    assert info.value.worker_id == 1 and info.value.step == 0
    assert "silent for 0.5 s" in str(info.value)


def test_head_errors_come_before_anything_is_sent():
    """A wrong step is found in the heads: nothing went out, connections stay open."""
    with Coordinator(ADDR, topology="star", expect_workers=2, timeout=10) as coord:
        w0, raw = worker_and_raw_peer(coord, timeout=30)
        w0.send_gradients(3, np.ones(10, np.float32), 1.0, 1, 1)
        raw.sendall(encode_frame(GradientPayload(step=4, worker_id=1, gradients=np.ones(10, np.float32),
                                                 loss=1.0, correct=1, total=1)))
        with pytest.raises(ddpwire.GradientMismatch) as info:
            coord.allreduce(3)
        assert info.value.worker_id == 1 and info.value.field == "step"
        # worker 0 is still connected: a Shutdown reaches it
        coord.shutdown_workers()
        with pytest.raises(ddpwire.ShutdownDuringReduce):
            w0.receive_averaged()
        raw.close()
        w0.close()


# ---- the duplex worker against coordinators that misbehave ----

def _duplex_against(behaviour, socket_threads, gradients=None, timeout=10.0):
    lsock, t = fake_coordinator(behaviour)
    w = Worker.connect(lsock.getsockname(), timeout=timeout, socket_threads=socket_threads)
    g = np.arange(1000, dtype=np.float32) if gradients is None else gradients
    try:
        return w, t, w.allreduce(0, g, 1.0, 1, 1)
    finally:
        lsock.close()


@LOOPS
def test_shutdown_after_the_payload_gives_shutdown_during_reduce(socket_threads):
    def behaviour(conn):
        recv_frame(conn)
        conn.sendall(encode_frame(ddpwire.Shutdown()))
    with pytest.raises(ddpwire.ShutdownDuringReduce) as info:
        _duplex_against(behaviour, socket_threads)
    assert info.value.step == 0


@LOOPS
def test_shutdown_before_the_payload_is_read_gives_shutdown_during_reduce(socket_threads):
    """The coordinator answers Shutdown while a big payload is still going
    out: the worker reads it instead of blocking on its send."""
    release = threading.Event()

    def behaviour(conn):
        recv_exact(conn, 100)  # part of the head only
        conn.sendall(encode_frame(ddpwire.Shutdown()))
        release.wait(10)
    big = np.ones(4_000_000, np.float32)  # 16 MB: far more than the socket buffers hold
    try:
        with pytest.raises(ddpwire.ShutdownDuringReduce):
            _duplex_against(behaviour, socket_threads, gradients=big)
    finally:
        release.set()


@LOOPS
def test_heartbeats_before_the_average_are_skipped(socket_threads):
    g = np.arange(1000, dtype=np.float32)

    def behaviour(conn):
        conn.sendall(encode_frame(Heartbeat(node_id="c", timestamp_ms=1)))
        recv_frame(conn)
        conn.sendall(encode_frame(Heartbeat(node_id="c", timestamp_ms=2)))
        conn.sendall(encode_frame(ddpwire.AveragedGradient(step=0, gradients=g * 2, global_loss=0.5)))
        return recv_frame(conn)  # the worker's next frame: the session is still in step
    w, t, avg = _duplex_against(behaviour, socket_threads, gradients=g)
    assert np.array_equal(avg.gradients, g * 2) and avg.global_loss == 0.5 and avg.step == 0
    w._chan.send(ShardAssignment(step=1, shard_start=0, shard_end=1))  # any frame
    assert isinstance(t.join_result(), ShardAssignment)
    w.close()


@pytest.mark.parametrize("reply,error,field", [
    (ddpwire.AveragedGradient(step=1, gradients=np.ones(1000, np.float32), global_loss=0.0),
     ddpwire.GradientMismatch, "step"),
    (ddpwire.AveragedGradient(step=0, gradients=np.ones(999, np.float32), global_loss=0.0),
     ddpwire.GradientMismatch, "gradients length"),
    (ShardAssignment(step=0, shard_start=0, shard_end=1), ddpwire.UnexpectedMessage, None),
    (ddpwire.AveragedNonBlockGradient(step=0, component=0, gradients=np.ones(1000, np.float32)),
     ddpwire.UnexpectedMessage, None),
], ids=["step", "length", "shard", "non-block"])
@LOOPS
def test_wrong_reply_is_a_typed_error(reply, error, field, socket_threads):
    def behaviour(conn):
        recv_frame(conn)
        conn.sendall(encode_frame(reply))
    with pytest.raises(error) as info:
        _duplex_against(behaviour, socket_threads)
    assert info.value.step == 0
    if field is not None:
        assert info.value.field == field


@LOOPS
def test_coordinator_closing_mid_reply_is_coordinator_lost(socket_threads):
    def behaviour(conn):
        recv_frame(conn)
        frame = encode_frame(ddpwire.AveragedGradient(step=0, gradients=np.ones(1000, np.float32),
                                                      global_loss=0.0))
        conn.sendall(frame[:100])
    with pytest.raises(ddpwire.CoordinatorLost) as info:
        _duplex_against(behaviour, socket_threads)
    assert info.value.step == 0


@LOOPS
def test_silent_coordinator_is_coordinator_lost(socket_threads):
    release = threading.Event()

    def behaviour(conn):
        recv_frame(conn)
        release.wait(10)
    try:
        with pytest.raises(ddpwire.CoordinatorLost, match="silent"):
            _duplex_against(behaviour, socket_threads, timeout=0.3)
    finally:
        release.set()


def test_allreduce_refuses_a_mismatched_out():
    lsock, t = fake_coordinator(lambda conn: None)
    w = Worker.connect(lsock.getsockname(), timeout=5)
    with pytest.raises(ValueError, match="out"):
        w.allreduce(0, np.ones(10, np.float32), 1.0, 1, 1, out=np.empty(9, np.float32))
    w.close()
    lsock.close()


def test_block_chosen_by_the_workers_is_followed_and_its_length_may_change():
    """allreduce_block(None, None) averages whichever block worker 0 sends
    next, and does not pin its length (DDP rebuilds its buckets)."""
    sizes = [(0, [3, 2]), (1, [4]), (0, [6])]  # (block_idx, component sizes) in order
    grads = {w: [np.arange(sum(s), dtype=np.float32) * (w + 1) for _, s in sizes] for w in range(2)}
    with Coordinator(ADDR, topology="star", expect_workers=2) as coord:
        def body(w):
            out = []
            for step, ((idx, s), g) in enumerate(zip(sizes, grads[w.worker_id])):
                w.send_block_gradient(step, idx, 2, g, s)
                out.append(w.receive_averaged_block())
            return out
        threads = start_workers(coord, 2, body)
        results = [coord.allreduce_block(None, None) for _ in sizes]
        got = [t.join_result() for t in threads]
    for step, ((idx, s), r) in enumerate(zip(sizes, results)):
        want = exact_mean([grads[0][step], grads[1][step]])
        assert (r.step, r.block_idx, list(r.component_sizes)) == (step, idx, s)
        assert np.array_equal(bits(r.avg_gradients), bits(want))
        for per_worker in got:
            assert np.array_equal(bits(per_worker[step].gradients), bits(want))


def test_a_followed_block_must_be_the_same_block_on_every_worker():
    with Coordinator(ADDR, topology="star", expect_workers=2, timeout=5) as coord:
        def body(w):
            w.send_block_gradient(0, w.worker_id, 2, np.ones(4, np.float32), [4])
        threads = start_workers(coord, 2, body)
        with pytest.raises(ddpwire.GradientMismatch, match="block_idx") as info:
            coord.allreduce_block(None, None)
        for t in threads:
            t.join_result()
    assert (info.value.worker_id, info.value.step) == (1, 0)
