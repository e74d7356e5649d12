"""Timeouts mean progress: heartbeats alone never hold a session open, in
either direction; bad timeout values are refused; a worker checks what its
coordinator tells it."""
from __future__ import annotations

import math
import socket
import threading
import time

import numpy as np
import pytest

import ddpwire
from ddpwire import Coordinator, Worker, encode_frame

from session_helpers import raw_join, recv_frame, spawn

ADDR = ("127.0.0.1", 0)


def heartbeats(sock: socket.socket, stop: threading.Event, every: float = 0.05) -> None:
    beat = encode_frame(ddpwire.Heartbeat(node_id="hb", timestamp_ms=0))
    while not stop.wait(every):
        try:
            sock.sendall(beat)
        except OSError:
            return


def test_a_worker_sending_only_heartbeats_is_lost_at_the_step_timeout():
    stop = threading.Event()
    with Coordinator(ADDR, expect_workers=1, timeout=0.6) as coord:
        t = spawn(lambda: raw_join(coord.local_addr))
        coord.wait_for_workers()
        raw = t.join_result()
        beater = spawn(lambda: heartbeats(raw, stop))
        try:
            with pytest.raises(ddpwire.WorkerLost, match="heartbeats aside") as info:
                coord.collect_and_reduce(0)
        finally:
            stop.set()
            beater.join_result()
            raw.close()
    assert (info.value.worker_id, info.value.step) == (0, 0)


def fake_coordinator_sending_heartbeats(stop: threading.Event, after=None):
    lsock = socket.create_server(("127.0.0.1", 0))

    def run():
        conn, _ = lsock.accept()
        with conn:
            recv_frame(conn)
            conn.sendall(encode_frame(ddpwire.JoinAccepted(worker_id=0, total_workers=1)))
            if after is not None:
                after(conn)
            heartbeats(conn, stop)
    return lsock, spawn(run)


def test_a_coordinator_sending_only_heartbeats_is_lost_at_the_timeout():
    stop = threading.Event()
    lsock, t = fake_coordinator_sending_heartbeats(stop)
    try:
        w = Worker.connect(lsock.getsockname(), timeout=0.6)
        with pytest.raises(ddpwire.CoordinatorLost, match="heartbeats aside"):
            w.receive_shard()
        w.close()
    finally:
        stop.set()
        t.join_result()
        lsock.close()


@pytest.mark.parametrize("socket_threads", [False, True], ids=["one-loop", "send-thread"])
def test_heartbeats_do_not_extend_a_workers_wait_for_its_average(socket_threads):
    stop = threading.Event()
    lsock, t = fake_coordinator_sending_heartbeats(stop)
    try:
        w = Worker.connect(lsock.getsockname(), timeout=0.6, socket_threads=socket_threads)
        with pytest.raises(ddpwire.CoordinatorLost, match="heartbeats aside") as info:
            w.allreduce(3, np.ones(100, np.float32), 1.0, 1, 1)
        assert info.value.step == 3
    finally:
        stop.set()
        t.join_result()
        lsock.close()


@pytest.mark.parametrize("bad", [math.nan, math.inf, 0, -1.0])
def test_timeouts_must_be_finite_and_positive(bad):
    with pytest.raises(ValueError, match="timeout"):
        Coordinator(ADDR, timeout=bad)
    with pytest.raises(ValueError, match="join_timeout"):
        Coordinator(ADDR, join_timeout=bad)
    with pytest.raises(ValueError, match="handshake_timeout"):
        Coordinator(ADDR, handshake_timeout=bad)
    with pytest.raises(ValueError, match="timeout"):
        Worker.connect(("127.0.0.1", 1), timeout=bad)
    with Coordinator(ADDR) as coord:
        with pytest.raises(ValueError, match="timeout"):
            coord.wait_for_workers(timeout=bad)


def test_the_socket_layer_refuses_a_nan_timeout():
    with socket.create_server(("127.0.0.1", 0)) as lsock, \
            socket.create_connection(lsock.getsockname()) as a:
        conn = ddpwire._core.Connection(a)
        with pytest.raises(ValueError, match="timeout"):
            conn.recv_into(bytearray(4), math.nan)


def joined_worker(answer_join, then=None):
    """A Worker against a fake coordinator that answers ``answer_join`` and
    then sends ``then`` (a list of messages)."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def run():
        conn, _ = lsock.accept()
        with conn:
            recv_frame(conn)
            conn.sendall(encode_frame(answer_join))
            for msg in then or []:
                conn.sendall(encode_frame(msg))
            conn.settimeout(10)
            while conn.recv(65536):
                pass
    t = spawn(run)
    return lsock, t


@pytest.mark.parametrize("accepted,field", [
    (ddpwire.JoinAccepted(worker_id=5, total_workers=2), "worker_id 5 is not below total_workers 2"),
    (ddpwire.JoinAccepted(worker_id=0, total_workers=0), "total_workers is 0"),
])
def test_a_worker_refuses_an_impossible_join_accepted(accepted, field):
    lsock, t = joined_worker(accepted)
    with pytest.raises(ddpwire.ProtocolError, match=field):
        Worker.connect(lsock.getsockname(), timeout=5)
    t.join_result()
    lsock.close()


def test_a_worker_refuses_a_shard_that_ends_before_it_starts():
    lsock, t = joined_worker(ddpwire.JoinAccepted(worker_id=0, total_workers=1),
                             [ddpwire.ShardAssignment(step=2, shard_start=10, shard_end=5)])
    w = Worker.connect(lsock.getsockname(), timeout=5)
    with pytest.raises(ddpwire.ProtocolError, match="shard_start 10 is past shard_end 5") as info:
        w.receive_shard()
    assert info.value.step == 2
    w.close()
    t.join_result()
    lsock.close()


@pytest.mark.parametrize("path", ["receive_averaged", "allreduce"])
def test_a_worker_refuses_a_non_finite_average(path):
    avg = np.ones(64, np.float32)
    avg[17] = np.nan
    lsock, t = joined_worker(ddpwire.JoinAccepted(worker_id=0, total_workers=1),
                             [ddpwire.AveragedGradient(step=1, gradients=avg, global_loss=0.5)])
    w = Worker.connect(lsock.getsockname(), timeout=5)
    grads = np.zeros(64, np.float32)
    with pytest.raises(ddpwire.NonFiniteGradient) as info:
        if path == "allreduce":
            w.allreduce(1, grads, 1.0, 1, 1)
        else:
            w.send_gradients(1, grads, 1.0, 1, 1)
            w.receive_averaged()
    assert (info.value.index, info.value.source, info.value.step) == (17, "average", 1)
    w.close()
    t.join_result()
    lsock.close()


def test_close_while_another_thread_is_blocked_defers_the_descriptor():
    """close() from one thread while another is inside a GIL-free receive on
    the same connection: the receive fails at once with the lost error, and
    the descriptor stays open until it has left, so its number cannot be
    handed to a new socket under it."""
    with socket.create_server(("127.0.0.1", 0)) as lsock, \
            socket.create_connection(lsock.getsockname()) as a:
        peer, _ = lsock.accept()
        with peer:
            conn = ddpwire._core.Connection(a, lost=ddpwire.WorkerLost, peer_id=3)
            blocked = spawn(lambda: conn.recv_into(bytearray(16), 30.0, step=7))
            time.sleep(0.2)  # it is waiting in poll()
            conn.close()
            with pytest.raises(ddpwire.WorkerLost) as info:
                blocked.join_result(timeout=10)
            assert (info.value.worker_id, info.value.step) == (3, 7)
            assert a.fileno() == -1  # closed once the receive had left
            with pytest.raises(ddpwire.WorkerLost, match="closed"):
                conn.recv_into(bytearray(1), 1.0)


def test_close_during_a_send_thread_waits_for_it():
    """An Exchange's sending thread holds the connection: close() only shuts
    it down, and the descriptor is closed when the Exchange lets go."""
    with socket.create_server(("127.0.0.1", 0)) as lsock, \
            socket.create_connection(lsock.getsockname()) as a:
        peer, _ = lsock.accept()
        with peer:
            conn = ddpwire._core.Connection(a)
            # far more than the socket buffers hold, and nobody reads it
            ex = ddpwire._core.Exchange(conn, [bytes(64 << 20)], 30.0, send_thread=True)
            conn.close()
            assert a.fileno() != -1  # still the thread's
            ex.abandon()
            assert a.fileno() == -1
