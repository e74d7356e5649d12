"""The star's receive windows (ddpwire.plane.incast, Coordinator(receive_window=))."""
from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from ddpwire import Coordinator, Worker
from ddpwire.plane import incast
from ddpwire.session.star import limit_receive

from session_helpers import reference_allreduce

ADDR = ("127.0.0.1", 0)


def test_windows_cover_a_fast_link_twice_over_and_stay_small():
    # one worker, or no round trip known: the kernel's autotuning
    assert incast.receive_window(200e-6, 1) is None
    assert incast.receive_window(None, 4) is None
    assert incast.receive_window(0.0, 4) is None
    # a switch's round trip: the floor
    assert incast.receive_window(25e-6, 4) == incast.FLOOR
    # 200 µs, 4 workers: together 2 x 10 Gbit/s x 200 µs = 500 kB
    assert incast.receive_window(200e-6, 4) == 125_000
    assert incast.receive_window(200e-6, 2) == 250_000
    # a long path: more than autotuning gives anyway, left to it
    assert incast.receive_window(20e-3, 4) is None


@pytest.mark.skipif(not hasattr(socket, "TCP_INFO"), reason="the kernel reports no TCP_INFO here")
def test_the_round_trip_of_a_loopback_connection_is_measured():
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        conn, _ = server.accept()
        with client, conn:
            for _ in range(3):
                client.sendall(b"x")
                conn.recv(1)
                conn.sendall(b"y")
                client.recv(1)
            rtt = incast.round_trip(conn)
    assert rtt is not None and 0 < rtt < 0.5


class _Admitted:
    def __init__(self, worker_id, address):
        self.worker_id = worker_id
        self.address = (address, 40000 + worker_id)
        self.sock = object()


@pytest.mark.parametrize("mesh,addresses,want", [
    (False, ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"], [125_000] * 4),
    (False, ["10.0.0.2", "127.0.0.1"], [250_000]),  # the loopback worker is left alone
    (True, ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"], []),  # no star, no incast
])
def test_auto_limits_the_star_s_connections_to_other_hosts(monkeypatch, mesh, addresses, want):
    limited = []
    monkeypatch.setattr(incast, "round_trip", lambda sock: 200e-6)
    monkeypatch.setattr(incast, "limit_receive", lambda sock, window: limited.append(window))
    limit_receive([_Admitted(i, a) for i, a in enumerate(addresses)], "auto", mesh)
    assert limited == want


def test_a_window_given_is_set_on_every_connection_and_none_sets_nothing(monkeypatch):
    limited = []
    monkeypatch.setattr(incast, "limit_receive", lambda sock, window: limited.append(window))
    admitted = [_Admitted(0, "127.0.0.1"), _Admitted(1, "10.0.0.3")]
    for window, want in [(65536, [65536, 65536]), (None, [])]:
        limited.clear()
        limit_receive(admitted, window, True)
        assert limited == want


def rcvbuf_for(window):
    """What the kernel reports for a socket whose buffer was set to ``window``."""
    with socket.socket() as s:
        incast.limit_receive(s, window)
        return s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)


@pytest.mark.parametrize("topology", ["star", "auto"])
def test_a_small_window_keeps_the_average_exact(topology, monkeypatch):
    monkeypatch.setenv("DDPWIRE_SHM", "0")
    n, count, window = 3, 300_003, incast.FLOOR
    rng = np.random.default_rng(7)
    grads = [rng.standard_normal(count).astype(np.float32) for _ in range(n)]
    results, errors = {}, []
    coord = Coordinator(ADDR, n, timeout=20.0, topology=topology, receive_window=window)

    def run():
        try:
            with Worker.connect(coord.local_addr, timeout=20.0) as w:
                out = np.empty(count, dtype=np.float32)
                for step in range(2):
                    w.allreduce(step, grads[w.worker_id], 1.0, 1, 1, out=out)
                results[w.worker_id] = out
        except BaseException as exc:  # handed to the test
            errors.append(exc)

    threads = [threading.Thread(target=run, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    try:
        coord.wait_for_workers()
        for chan in coord._roster.channels:
            assert chan.conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) == \
                rcvbuf_for(window)
        for step in range(2):
            coord.allreduce(step)
    finally:
        for t in threads:
            t.join(60)
        coord.close()
    assert not errors, errors
    want = reference_allreduce(grads).view(np.uint32)
    for i in range(n):
        assert np.array_equal(results[i].view(np.uint32), want)


@pytest.mark.parametrize("bad", ["big", 4096, incast.FLOOR - 1, 1 << 31, True, 65536.0])
def test_receive_window_argument_is_checked(bad):
    with pytest.raises(ValueError, match="receive_window"):
        Coordinator(ADDR, 1, receive_window=bad)
