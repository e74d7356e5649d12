"""Strangers on a worker's mesh port (ddpwire.plane.mesh): silent, garbage and
flooding connections are handshaken beside the expected peers, each under
its own short deadline, and dropped by address without costing the session.

Real Coordinators and Workers (threads) over loopback TCP, or real
Mesh.connect calls; the averages are compared bit for bit with the tests'
reference (tests/session_helpers.py).
"""
from __future__ import annotations

import logging
import socket
import threading
import time

import numpy as np
import pytest

from ddpwire.plane import mesh as meshmod
from ddpwire.wire.extensions import Codec
from ddpwire.wire.messages import MeshPeers

from mesh_session import TIMEOUT, Session, bits, flat_steps, gradients
from session_helpers import reference_allreduce

SILENT = 6  # at the old 5 s each, one after another, they outlast TIMEOUT
GARBAGE = (b"GET / HTTP/1.1\r\nHost: worker\r\n\r\n",
           bytes(range(251, 0, -7)) * 3)  # a length prefix far past a PeerHello's


@pytest.fixture(params=["links", "shared"])
def data_plane(request, monkeypatch):
    """Both data planes open the links first (the shared one for its set-up)."""
    monkeypatch.setenv("DDPWIRE_SHM", "0" if request.param == "links" else "1")
    return request.param


class Strangers:
    """Connections that are no worker's: silent ones, and ones that send
    bytes of no PeerHello, kept open until the test ends."""

    def __init__(self) -> None:
        self.socks = []
        self.lock = threading.Lock()

    def open(self, address, silent=SILENT, garbage=GARBAGE):
        """Connect to ``address``; False once the worker stopped listening."""
        try:
            for i in range(silent + len(garbage)):
                sock = socket.create_connection(address, timeout=TIMEOUT)
                with self.lock:
                    self.socks.append(sock)
                if i >= silent:
                    sock.sendall(garbage[i - silent])
        except OSError:  # refused or reset: the listener has closed, the links are open
            return False
        return True

    def names(self):
        with self.lock:
            return ["%s:%d" % s.getsockname()[:2] for s in self.socks]

    def closed_by_the_worker(self) -> bool:
        """Whether every stranger's connection was ended from the other side
        within TIMEOUT (read to its end, or reset: a garbage sender's unread
        bytes, or a connection the listener never accepted)."""
        with self.lock:
            socks = list(self.socks)
        for sock in socks:
            sock.settimeout(TIMEOUT)
            try:
                while sock.recv(4096):
                    pass
            except ConnectionResetError:
                continue
            except socket.timeout:
                return False
        return True

    def close(self) -> None:
        with self.lock:
            for sock in self.socks:
                sock.close()
            self.socks.clear()


def _mesh_messages(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "ddpwire.mesh"]


def test_silent_and_garbage_connections_on_mesh_ports_do_not_end_the_session(data_plane,
                                                                              caplog):
    caplog.set_level(logging.WARNING, logger="ddpwire.mesh")
    n, steps, count = 3, 3, 10_007
    grads = gradients(n, count, seed=39)
    strangers = {w: Strangers() for w in range(n)}
    later = Strangers()
    # every worker's strangers are queued on its port before any worker
    # dials; more arrive while the links open
    queued = threading.Barrier(n, timeout=TIMEOUT)
    flat = flat_steps(grads, steps)
    openers = []

    def body(w):
        address = w._mesh_step.listener.getsockname()[:2]
        strangers[w.worker_id].open(address)
        queued.wait()
        t = threading.Thread(target=later.open, args=(address, 2, GARBAGE[:1]), daemon=True)
        openers.append(t)
        t.start()
        return flat(w)

    s = Session(n, body)
    try:
        for step in range(steps):
            s.coord.allreduce(step)
    finally:
        s.join()
        for t in openers:
            t.join(TIMEOUT)
    try:
        assert not s.errors, s.errors
        want = reference_allreduce(grads)
        for w in range(n):
            out, _loss = s.results[w]
            assert np.array_equal(bits(out), bits(want)), w
        for group in (*strangers.values(), later):
            assert group.closed_by_the_worker()
        # a worker that accepts links (not worker 0, which only dials)
        # accepted its strangers ahead of its peers: each is logged by its
        # address, and no worker is named for it
        logged = "\n".join(_mesh_messages(caplog))
        for w in range(1, n):
            for name in strangers[w].names():
                assert name in logged
        assert "did not open its mesh link" not in logged
    finally:
        for group in (*strangers.values(), later):
            group.close()


def _two_listeners():
    key = bytes(range(32))
    listeners = [meshmod.listen("127.0.0.1") for _ in range(2)]
    table = MeshPeers(key=key, codec=int(Codec.FLOAT32), shared_memory=0,
                      peers=meshmod.format_peers([l.getsockname()[:2] for l in listeners]))
    return listeners, table


def _connect(listeners, table, meshes, errors, i):
    def run():
        try:
            meshes[i] = meshmod.Mesh.connect(listeners[i], table, i, 2, timeout=TIMEOUT,
                                             max_frame=1 << 20)
        except BaseException as exc:  # handed to the test
            errors[i] = exc
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _one_step(meshes):
    grads = gradients(2, 257, seed=9)
    outs = [np.empty(257, np.float32) for _ in range(2)]

    def step(i):
        meshes[i].reduce_scatter(0, grads[i], time.monotonic() + TIMEOUT)
        meshes[i].allgather(0, outs[i], time.monotonic() + TIMEOUT)

    threads = [threading.Thread(target=step, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3 * TIMEOUT)
        assert not t.is_alive(), "a mesh step hung"
    want = reference_allreduce(grads)
    assert all(np.array_equal(bits(o), bits(want)) for o in outs)


def test_a_silent_stranger_is_dropped_at_its_own_deadline_while_the_wait_goes_on(monkeypatch,
                                                                                 caplog):
    caplog.set_level(logging.WARNING, logger="ddpwire.mesh")
    monkeypatch.setattr(meshmod, "HELLO_TIMEOUT", 0.05)
    listeners, table = _two_listeners()
    strangers = Strangers()
    meshes, errors = {}, {}
    try:
        strangers.open(listeners[1].getsockname()[:2], silent=1, garbage=())
        one = _connect(listeners, table, meshes, errors, 1)
        # worker 1 ends the stranger while it still waits for worker 0,
        # which dials only then
        assert strangers.closed_by_the_worker()
        zero = _connect(listeners, table, meshes, errors, 0)
        for t in (one, zero):
            t.join(3 * TIMEOUT)
        assert not errors, errors
        assert set(meshes) == {0, 1}
        logged = "\n".join(_mesh_messages(caplog))
        assert strangers.names()[0] in logged and "no PeerHello" in logged
        _one_step(meshes)
    finally:
        for m in meshes.values():
            m.close()
        strangers.close()


def test_a_flood_of_silent_connections_cannot_crowd_out_a_peer(monkeypatch):
    monkeypatch.setattr(meshmod, "MAX_PENDING", 2)
    listeners, table = _two_listeners()
    strangers = Strangers()
    meshes, errors = {}, {}
    try:
        # more strangers than may handshake at once, all queued ahead of worker 0
        strangers.open(listeners[1].getsockname()[:2], silent=5, garbage=())
        threads = [_connect(listeners, table, meshes, errors, i) for i in (1, 0)]
        for t in threads:
            t.join(3 * TIMEOUT)
        assert not errors, errors
        assert set(meshes) == {0, 1}
        assert strangers.closed_by_the_worker()
        _one_step(meshes)
    finally:
        for m in meshes.values():
            m.close()
        strangers.close()
