"""A stopped worker is the one the mesh names, never the live worker that
waits for it, however busy that worker or the machine is (issue 39, item
10; docs/sessions.md, "The mesh: who averages, and what fails how").

The deadlines nest: the coordinator waits on a worker that may itself wait
on a peer, so it listens for that worker's accusation as long as the
worker's wait can last (:func:`ddpwire.plane.deadlines.accusation_wait`), and
the worker's wait on its peers, the opening of its links at the first step
included, ends ``timeout`` after it read the coordinator's last message,
not ``timeout`` after it came to its step.

Where the timing is the point the clock is faked (the coordinator's
collect) or the worker's wait is checked against the deadline it was given
(its links); the processes at the end stop a real worker with SIGSTOP
while every core is kept busy.
"""
from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest

from ddpwire import Coordinator, WorkerLost, encode_frame
from ddpwire.plane import shm
from ddpwire.plane import mesh as meshmod
from ddpwire.session import mesh_control
from ddpwire.wire.channel import Channel
from ddpwire.plane.deadlines import accusation_wait
from ddpwire.session.mesh_control import MESH_BLAME_GRACE, MeshControl
from ddpwire.plane.mesh_step import MeshStep
from ddpwire.wire.messages import CollectiveError, MeshPeers
from ddpwire.session.options import CoordinatorOptions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TIMEOUT = 4.0
#: how long the honest worker is busy: past the coordinator's old grace
#: (so the code before the fix names it every time), well within TIMEOUT
BUSY = MESH_BLAME_GRACE + 0.5


# ---- the worker: its links open within the step's deadline ----

class _Stop(Exception):
    pass


def _mesh_step(since_ago: float, timeout: float = TIMEOUT):
    """A worker 0's MeshStep whose coordinator last spoke ``since_ago``
    seconds ago, before its first step (no links yet)."""
    chan = types.SimpleNamespace(timeout=timeout, last_message_at=time.monotonic() - since_ago,
                                 max_frame=1 << 20, send_lock=threading.Lock())
    listener = socket.socket()
    step = MeshStep(chan, 0, listener, None)  # type: ignore[arg-type]
    step.table = MeshPeers(key=bytes(32), codec=0, shared_memory=0,
                           peers="127.0.0.1:1,127.0.0.1:2")
    return step, chan, listener


def _no_upload(step, gradients):
    raise _Stop()


def test_a_worker_opens_its_links_within_the_steps_deadline_not_a_timeout_from_now(monkeypatch):
    # the worker read its shard 2.5 s ago (it computed since): waiting for a
    # peer to open its link is waiting for the peer's part of the step, so
    # it ends with the step's deadline, 1.5 s from now, not 4 s from now
    given = {}

    def connect(listener, table, worker_id, world, *, timeout, **kwargs):
        given["timeout"] = timeout
        link = types.SimpleNamespace(timeout=timeout)
        return types.SimpleNamespace(timeout=timeout, links=[None, link],
                                     coordinator_frame_open=False, close=lambda: None)

    monkeypatch.setattr(meshmod.Mesh, "connect", staticmethod(connect))
    step, chan, listener = _mesh_step(2.5)
    try:
        with pytest.raises(_Stop):
            step.send(0, np.zeros(4, np.float32), 0.0, 0, 0, 2, _no_upload)
    finally:
        listener.close()
    assert 0 < given["timeout"] <= TIMEOUT - 2.5, given
    # only the opening is bounded by the step: later waits on the links
    # keep the session's timeout as their silence limit
    assert step.mesh.timeout == TIMEOUT
    assert step.mesh.links[1].timeout == TIMEOUT


def test_a_peer_that_never_opens_its_link_is_named_at_the_steps_deadline(monkeypatch):
    # the opening runs out with the step (the stand-in waits exactly what it
    # is given, as the links' opening does for a peer that never answers):
    # the peer is named in the step's terms
    def connect(listener, table, worker_id, world, *, timeout, **kwargs):
        time.sleep(timeout)
        raise WorkerLost(f"worker 1 did not open its mesh link within {timeout:g} s",
                         worker_id=1)

    monkeypatch.setattr(meshmod.Mesh, "connect", staticmethod(connect))
    step, chan, listener = _mesh_step(TIMEOUT - 0.2)
    try:
        with pytest.raises(WorkerLost) as info:
            step.send(3, np.zeros(4, np.float32), 0.0, 0, 0, 2, _no_upload)
    finally:
        listener.close()
    assert time.monotonic() < chan.last_message_at + TIMEOUT + 1.0
    assert info.value.worker_id == 1 and info.value.step == 3, info.value
    assert "worker 1 did not open its mesh link within 4 s of the coordinator's last message" \
        in str(info.value)


def test_a_worker_that_comes_to_its_first_step_past_the_deadline_names_itself(monkeypatch):
    monkeypatch.setattr(meshmod.Mesh, "connect", staticmethod(
        lambda *a, **k: pytest.fail("no link is opened past the step's deadline")))
    step, chan, listener = _mesh_step(TIMEOUT + 0.5)
    try:
        with pytest.raises(WorkerLost) as info:
            step.send(0, np.zeros(4, np.float32), 0.0, 0, 0, 2, _no_upload)
    finally:
        listener.close()
    assert info.value.worker_id == 0 and "came to its part of mesh step 0" in str(info.value)


# ---- the coordinator: it listens as long as a waiting worker waits ----

class _Clock:
    """mesh_control's clock: the real one, moved forward in jumps whenever
    the collect would sleep with nothing to read (never behind the real
    one, so a deadline handed to a socket read is never early)."""

    def __init__(self):
        self.offset = 0.0

    def monotonic(self):
        return time.monotonic() + self.offset

    perf_counter = staticmethod(time.perf_counter)


class _Selector:
    """A selector whose wait jumps the clock to the next thing the fake
    workers send (or the wait's end), so a step's minutes take no time and
    the order of events is fixed."""

    def __init__(self, clock, script):
        self.clock = clock
        self.script = script  # [(clock time, action)], in order
        self.real = selectors.DefaultSelector()

    def _fire(self):
        fired = False
        while self.script and self.script[0][0] <= self.clock.monotonic():
            self.script.pop(0)[1]()
            fired = True
        return fired

    def select(self, timeout=None):
        if self._fire():
            return self.real.select(5.0)
        events = self.real.select(0)
        if events:
            return events
        due = self.script[0][0] if self.script else float("inf")
        self.clock.offset += max(0.0, min(timeout, due - self.clock.monotonic()))
        return self.real.select(5.0) if self._fire() else []

    def register(self, *args):
        return self.real.register(*args)

    def unregister(self, sock):
        return self.real.unregister(sock)

    def get_map(self):
        return self.real.get_map()

    def close(self):
        self.real.close()


def _pair():
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname()[:2])
        b, _ = server.accept()
    a.setblocking(False)
    return a, b


def _collect(monkeypatch, accuse_after, timeout=5.0, step=2):
    """A coordinator's collect of ``step``'s reports from two workers: worker
    1 stopped (sends nothing), worker 0, waiting on it, accuses it
    ``accuse_after`` seconds past the coordinator's deadline (None: never).
    Returns the WorkerLost raised and how long past the deadline the
    collect ended (on the faked clock)."""
    clock = _Clock()
    socks = [_pair() for _ in range(2)]
    chans = [Channel(c, timeout=timeout, lost=WorkerLost, peer_id=w,
                     peer_name=f"worker {w} (test)") for w, (c, _) in enumerate(socks)]
    start = clock.monotonic()
    deadline = start + timeout
    script = []
    if accuse_after is not None:
        accusation = encode_frame(CollectiveError(
            seq=step, worker_id=1, detail="worker 1 (mesh link) silent past the deadline"))
        script.append((deadline + accuse_after, lambda: socks[0][1].sendall(accusation)))
    monkeypatch.setattr(mesh_control, "time", clock)
    monkeypatch.setattr(mesh_control, "selectors", types.SimpleNamespace(
        DefaultSelector=lambda: _Selector(clock, script), EVENT_READ=selectors.EVENT_READ))
    roster = types.SimpleNamespace(channels=chans, timeout=timeout, heartbeat_timeout=None,
                                   shards=None, lengths={})
    control = MeshControl(roster, None, CoordinatorOptions())  # type: ignore[arg-type]
    try:
        with pytest.raises(WorkerLost) as info:
            control._reports(step, None)
        ended = clock.monotonic() - deadline
    finally:
        for c, w in socks:
            c.close()
            w.close()
    return info.value, ended


@pytest.mark.parametrize("accuse_after", [0.01, MESH_BLAME_GRACE + 0.5, 2 * MESH_BLAME_GRACE + 1,
                                          5.0 - 0.05],
                         ids=["at-once", "past-the-old-grace", "well-past-it", "at-its-wait's-end"])
def test_the_coordinator_hears_a_waiting_workers_accusation_for_as_long_as_it_waits(
        monkeypatch, accuse_after):
    # worker 0 read the coordinator's last message late (busy between two
    # steps, or on a loaded machine) and so gives up on the stopped worker 1
    # that much past the coordinator's deadline: still within its own wait,
    # which the coordinator's listening spans
    exc, ended = _collect(monkeypatch, accuse_after)
    assert exc.worker_id == 1 and exc.step == 2, exc
    assert "as worker 0 saw it" in str(exc)
    assert accuse_after <= ended < accuse_after + 0.5  # raised once it heard, not later


def test_when_no_silent_worker_says_anything_the_wait_ends_with_the_waits_it_spans(monkeypatch):
    # every silent worker stalled: the lowest is named, once a waiting
    # worker would have spoken (accusation_wait past the deadline), no later
    exc, ended = _collect(monkeypatch, None)
    assert exc.worker_id == 0 and "silent" in str(exc)
    assert accusation_wait(5.0) <= ended < accusation_wait(5.0) + 0.5


def test_the_coordinator_listens_at_least_as_long_as_a_worker_waits():
    for timeout in (0.5, 5.0, 120.0):
        assert accusation_wait(timeout) >= timeout


# ---- real processes: a worker stopped (SIGSTOP) on a busy machine ----

WORKER = r"""
import os, signal, sys, time
import numpy as np
from ddpwire import Worker

port, timeout, stop, busy, where = sys.argv[1:6]
stop, busy = int(stop), float(busy)
w = Worker.connect(("127.0.0.1", int(port)), timeout=float(timeout), node_id=str(os.getpid()))
print("worker", w.worker_id, flush=True)
g = np.full(1000, w.worker_id + 1.0, np.float32)
step = 0
try:
    while True:
        if where == "between" and w.worker_id == 0 and step == stop:
            time.sleep(busy)  # busy between two steps: its shard waits, unread
        shard = w.receive_shard()
        if shard is None:
            break
        if shard.step == stop:
            if w.worker_id == 1:
                os.kill(os.getpid(), signal.SIGSTOP)  # holds its shard, sends nothing
            elif where == "compute":
                time.sleep(busy)  # computes its gradient
        w.allreduce(shard.step, g, 1.0, 1, 4)
        print("step", shard.step, flush=True)
        step = shard.step + 1
except Exception as exc:
    print("error", type(exc).__name__, getattr(exc, "worker_id", None),
          getattr(exc, "step", None), exc, flush=True)
finally:
    w.close()
"""


@pytest.fixture
def busy_machine():
    """One busy process per core for the test's duration (issue 39: the
    wrong blame came on a machine kept busy by another process per core)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                              stdin=subprocess.DEVNULL)
             for _ in range(min(cores or 1, 16))]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def _finish(procs, stalled):
    outs = []
    for p in procs:
        if p.pid == stalled:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
    for p in procs:
        try:
            outs.append(p.communicate(timeout=6 * TIMEOUT)[0])
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
            outs.append(p.communicate()[0])
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("shared_memory", [False, True], ids=["tcp", "shm"])
@pytest.mark.parametrize("where,stop", [("compute", 0), ("between", 1)],
                         ids=["busy-before-its-first-step", "busy-between-two-steps"])
def test_a_stopped_worker_is_named_not_the_busy_one_waiting_for_it(busy_machine, where, stop,
                                                                    shared_memory):
    # two workers, the coordinator's timeout short; worker 1 stops itself
    # once it holds its shard. Worker 0 is busy for longer than the old
    # grace: computing before its first step (the links open in that step),
    # or between two steps before it reads its shard. Either way it waits
    # on worker 1 until TIMEOUT after it read the coordinator's last
    # message, and the coordinator hears it name worker 1.
    if shared_memory and (not shm.enabled() or not os.path.isdir("/dev/shm")):
        pytest.skip("no POSIX shared memory here")
    coord = Coordinator(("127.0.0.1", 0), 2, timeout=TIMEOUT, join_timeout=60,
                        topology="mesh", shared_memory=shared_memory)
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("DDPWIRE_SHM", None)
    args = [str(coord.local_addr[1]), str(TIMEOUT), str(stop), str(BUSY), where]
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, *args], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    stalled = None
    try:
        coord.wait_for_workers()
        stalled = int(coord.workers[1].node_id)
        coord.set_total_samples(8)
        for step in range(stop):
            coord.send_shard_assignments(step)
            coord.allreduce(step)
        coord.send_shard_assignments(stop)
        with pytest.raises(WorkerLost) as info:
            coord.allreduce(stop)
    finally:
        coord.close()
        if stalled is None:  # the join failed: nobody is stopped yet
            for p in procs:
                p.kill()
        outs = _finish(procs, stalled)
    assert info.value.worker_id == 1 and info.value.step == stop, (info.value, outs)
    assert "as worker 0 saw it" in str(info.value), (info.value, outs)
    worker0 = next(text for text in outs if text.startswith("worker 0"))
    assert f"error WorkerLost 1 {stop}" in worker0, worker0
