"""The state hand-over and the call-off of an elastic session under slow,
silent and hostile peers (issue 39): each failure fails only the joiner or
the source that failed, never the survivors, within the coordinator's
deadlines, which nest inside the workers' (docs/sessions.md).

Workers run in threads over real sockets (tests/test_elastic.py's model:
each step's average is the mean of the step's rows); the hostile ones are
real workers whose sockets then misbehave: a joiner that dies or reads at
a trickle, a source that dies mid-state, lies about its size, or never
answers.
"""
from __future__ import annotations

import hashlib
import select
import socket
import threading
import time
from typing import Any, Callable, List, Optional

import numpy as np
import pytest

from ddpwire import Coordinator, ModelState, PeerLost, Worker, WorkerDropped, WorkerLost
from ddpwire.session import model_state
from ddpwire.session.coordinator import CoordinatorState
from ddpwire.cli.serve import serve

from session_helpers import join_up_to, spawn
from test_elastic import T, check_every_sample_once, full_mean, train

N = 16  # gradient length
#: the coordinator's and every worker's timeout, equal as the docs advise;
#: long enough for a loaded 2-core machine, short enough to show the nesting
TIMEOUT = 6.0
STATE = bytes(range(256)) * (64 * 1024)  # 16 MiB


def state_of(step: int) -> bytes:
    return STATE + bytes([step])


def session_worker(addr, *, on_request: Optional[Callable[[Worker, int], Any]] = None,
                   leave_at: Optional[int] = None, **kw):
    """A worker of the session: it hands ``state_of`` (or, with
    ``on_request``, whatever that does with the StateRequest's step) and
    leaves when handed step ``leave_at``."""
    def leave(w, shard, grad):
        w.close()

    def body():
        w = Worker.connect(addr, 0, "cpu", timeout=TIMEOUT, samples_per_step=T, **kw)
        w.state_source = state_of if on_request is None else (lambda step: on_request(w, step))
        try:
            return train(w, N, leave_at, leave if leave_at is not None else None)
        finally:
            w.close()
    return body


def late_worker(addr, attempts: int = 3):
    """An honest late joiner: the state it took, then its steps. Turned
    away (WorkerDropped), it joins again, as ``ddpwire worker`` does, up to
    ``attempts`` times in all."""
    def body():
        for attempt in range(attempts):
            w = Worker.connect(addr, 0, "cpu", timeout=TIMEOUT, samples_per_step=T)
            try:
                got = w.receive_state()
            except WorkerDropped:
                w.close()
                if attempt == attempts - 1:
                    raise
                continue
            try:
                out = train(w, N, None, None)
                out["joined_with"], out["attempts"] = got, attempt + 1
                return out
            finally:
                w.close()
        raise AssertionError("unreachable")
    return body


def run(bodies: List[Callable[[], Any]], steps: int, on_step, n_workers: int = 3,
        **coord_kwargs: Any):
    """An elastic session of ``bodies`` (started in order), served for
    ``steps``; returns (coordinator, what serve returned or raised, the
    workers' results or exceptions, the coordinator's state before it closed)."""
    coord = Coordinator(("127.0.0.1", 0), n_workers, elastic=True, samples_per_step=T,
                        timeout=TIMEOUT, **coord_kwargs)
    threads = []
    try:
        for i, body in enumerate(bodies):
            threads.append(spawn(body(coord.local_addr)))
            join_up_to(coord, i + 1)
        coord.wait_for_workers()
        try:
            result: Any = serve(coord, steps=steps, total_samples=T,
                                on_step=lambda r: on_step(coord, r, threads))
        except Exception as exc:  # the test says whether it is the right one
            result = exc
        outs = []
        for t in threads:
            try:
                outs.append(t.join_result(4 * TIMEOUT))
            except Exception as exc:
                outs.append(exc)
        state = coord.state
    finally:
        coord.close()
    return coord, result, outs, state


def joins_at(step: int, joiner: Callable[[Any], Callable[[], Any]]):
    """on_step: once ``step`` is averaged, ``joiner`` connects; each step
    boundary after it is held back a little until the joiner is settled
    (taken in, or gone), so that its handshake is in before a boundary of
    the run, whose send_shard_assignments admits it and hands it the state."""
    def on_step(coord, report, threads):
        if report.step == step:
            threads.append(spawn(joiner(coord.local_addr)))
        if report.step >= step and threads[-1].is_alive() and \
                not any(e.joined for e in coord.membership):
            time.sleep(0.1)
    return on_step


def check_survivors(outs, survivors, steps: int) -> None:
    for i in survivors:
        assert isinstance(outs[i], dict), outs[i]
        assert sorted(outs[i]["applied"]) == list(range(steps)), i
        for step, avg in outs[i]["applied"].items():
            np.testing.assert_allclose(avg, full_mean(step, N), atol=2e-6)


def until_told(w: Worker, wake: threading.Event) -> None:
    """A stalled worker: it wakes when the coordinator drops it (a
    StepAborted naming it, then the end of the stream: a StepAborted for
    another worker does not wake it) or the test ends."""
    poller = select.poll()
    poller.register(w.channel.conn.sock, select.POLLRDHUP)
    while not wake.is_set() and not poller.poll(100):
        pass


def small_pieces(monkeypatch, size: int = 1 << 20) -> None:
    """The state in pieces of ``size`` bytes (16 of them): the relay is cut
    between pieces, not only inside one."""
    monkeypatch.setattr(model_state, "STATE_PIECE", size)


# ---- the joiner fails ----

def dying_joiner(pieces: int):
    """Joins, reads ``pieces`` of its state, and dies (its socket reset)."""
    def make(addr):
        def body():
            w = Worker.connect(addr, 0, "cpu", timeout=TIMEOUT, samples_per_step=T)
            for _ in range(pieces):
                w.channel.expect([ModelState])
            sock = w.channel.conn.sock
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            w.close()
            return "died"
        return body
    return make


@pytest.mark.parametrize("topology", ["auto", "star"])
def test_a_joiner_that_dies_mid_state_fails_alone(monkeypatch, topology):
    small_pieces(monkeypatch)
    steps = 12
    coord, result, outs, state = run([session_worker, session_worker,
                               lambda a: session_worker(a, leave_at=1)],
                              steps, joins_at(1, dying_joiner(2)), topology=topology)
    assert isinstance(result, list), result  # the run went on to its end
    check_survivors(outs, [0, 1], steps)
    check_every_sample_once(coord, steps)
    assert [(e.worker_id, e.joined) for e in coord.membership] == [(2, False)]


def trickling_joiner(addr, reading: Optional[threading.Event] = None,
                     hurry: Optional[threading.Event] = None):
    """Joins, then reads its 16 MiB state 4 KiB at a time, slowly
    (``reading`` set once the first bytes are in), and at full speed once
    ``hurry`` is set (to find what follows what is buffered)."""
    def body():
        w = Worker.connect(addr, 0, "cpu", timeout=TIMEOUT, samples_per_step=T)
        sock = w.channel.conn.sock
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(4 * TIMEOUT)
        got, until = 0, time.monotonic() + 2 * TIMEOUT  # what it has buffered, unread
        try:
            while time.monotonic() < until:
                data = sock.recv(4096)
                if not data:
                    return ("closed", got)
                got += len(data)
                if reading is not None:
                    reading.set()
                if hurry is None or not hurry.is_set():
                    time.sleep(0.01)
            return ("gave up", got)
        except OSError:
            return ("reset", got)
        finally:
            w.close()
    return body


def test_a_joiner_that_reads_at_a_trickle_is_cut_off_not_the_survivors():
    steps = 12
    coord, result, outs, state = run([session_worker, session_worker,
                               lambda a: session_worker(a, leave_at=1)],
                              steps, joins_at(1, trickling_joiner))
    assert isinstance(result, list), result
    check_survivors(outs, [0, 1], steps)
    check_every_sample_once(coord, steps)
    how, got = outs[3]
    assert got < len(STATE)  # cut off, not waited for
    assert [(e.worker_id, e.joined) for e in coord.membership] == [(2, False)]


def test_closing_the_coordinator_mid_hand_over_closes_the_joiner_too():
    """close() from another thread while a joiner is handed the state: the
    joiner's connection ends at once, not at the joiner's own timeout."""
    reading, hurry = threading.Event(), threading.Event()

    def close_when_reading(coord):
        reading.wait(4 * TIMEOUT)
        coord.close()
        hurry.set()

    def on_step(coord, report, threads):
        if report.step == 1:
            spawn(lambda: close_when_reading(coord))
        joins_at(1, lambda a: trickling_joiner(a, reading, hurry))(coord, report, threads)
    coord, result, outs, state = run([session_worker, session_worker,
                                      lambda a: session_worker(a, leave_at=1)], 12, on_step)
    assert reading.is_set()
    assert isinstance(result, Exception), result  # closed under serve
    how, got = outs[3]
    assert how in ("closed", "reset") and got < len(STATE)


# ---- the source fails ----

def source_dying_after_one_piece(w: Worker, step: int) -> bytes:
    """Sends 1 of 3 pieces of a state, then dies."""
    data = state_of(step)
    third = len(data) // 3
    w.channel.send(ModelState(step=step, total=len(data), digest=hashlib.sha256(data).digest(),
                              data=data[:third]), step=step)
    w.channel.conn.sock.shutdown(socket.SHUT_RDWR)
    raise ConnectionAbortedError("the hostile source hung up")


def source_without_end(stop: threading.Event):
    def on_request(w: Worker, step: int) -> bytes:
        """Declares a state of 2**63 bytes and streams it, a piece every 10 ms."""
        piece = bytes(64 << 10)
        while not stop.is_set():
            w.channel.send(ModelState(step=step, total=2**63, digest=bytes(32), data=piece),
                           step=step)
            time.sleep(0.01)
        raise ConnectionAbortedError("the hostile source stopped")
    return on_request


@pytest.mark.parametrize("liar", ["dies after one piece", "streams without end"])
def test_a_source_that_fails_mid_state_is_dropped_and_the_joiner_starts_over(liar):
    stop = threading.Event()
    hostile = (source_dying_after_one_piece if liar == "dies after one piece"
               else source_without_end(stop))
    steps = 12
    try:
        coord, result, outs, state = run([lambda a: session_worker(a, on_request=hostile),
                                   session_worker, lambda a: session_worker(a, leave_at=1)],
                                  steps, joins_at(1, late_worker))
    finally:
        stop.set()
    assert isinstance(result, list), result
    late = outs[3]
    assert isinstance(late, dict), late
    at = late["joined_with"][0]
    assert late["joined_with"] == (at, state_of(at))  # worker 1's, whole
    assert sorted(late["applied"]) == list(range(at, steps))
    check_survivors(outs, [1], steps)
    check_every_sample_once(coord, steps)
    # turned away once it may come back into worker 0's slot
    assert [(e.worker_id, e.joined) for e in coord.membership][:2] == [(2, False), (0, False)]
    assert [e.joined for e in coord.membership] == [False, False, True]


def test_a_source_that_never_answers_is_dropped_in_time_for_another():
    wake = threading.Event()

    def silent(w: Worker, step: int) -> bytes:
        until_told(w, wake)
        raise ConnectionAbortedError("the silent source woke up")
    steps = 12
    try:
        coord, result, outs, state = run([lambda a: session_worker(a, on_request=silent),
                                   session_worker, lambda a: session_worker(a, leave_at=1)],
                                  steps, joins_at(1, late_worker))
    finally:
        wake.set()
    assert isinstance(result, list), result
    at = outs[3]["joined_with"][0]
    assert outs[3]["joined_with"] == (at, state_of(at))
    check_survivors(outs, [1], steps)
    check_every_sample_once(coord, steps)
    assert [(e.worker_id, e.joined) for e in coord.membership] == \
        [(2, False), (0, False), (2, True)]


def test_the_last_worker_silent_ends_the_run_with_worker_lost_and_turns_the_joiner_away():
    """Items 5 and 6: the only worker left never answers the StateRequest;
    the session ends with a typed WorkerLost (not a ValueError), FAILED,
    and the joiner hears at once that it was turned away."""
    wake = threading.Event()

    def silent(w: Worker, step: int) -> bytes:
        until_told(w, wake)
        raise ConnectionAbortedError("the silent source woke up")
    try:
        coord, result, outs, state = run([lambda a: session_worker(a, on_request=silent),
                                   lambda a: session_worker(a, leave_at=1)],
                                  12, joins_at(1, lambda a: late_worker(a, attempts=1)),
                                  n_workers=2)
    finally:
        wake.set()
    assert isinstance(result, WorkerLost), result
    assert "fewer than min_workers" in str(result) and result.worker_id == 0
    assert state is CoordinatorState.FAILED
    assert isinstance(outs[2], WorkerDropped), outs[2]  # told, not left to time out


# ---- calling a step off ----

@pytest.mark.parametrize("stalled", [1, 2])
def test_a_survivor_outlives_the_call_off_of_a_stalled_worker(stalled):
    """In step 1 one worker hangs up while the other is stalled before its
    gradient. Worker 2 stalled: worker 1's loss calls the step off, and the
    coordinator reads the rest of each survivor's frame within its share of
    the timeout, so survivor 0, whose wait for the redo began at the same
    StepAborted, is never lost. Worker 1 stalled: the coordinator waits its
    whole timeout for its gradient, and survivor 0, which waits for the
    answer to its own, waits longer by design."""
    wake = threading.Event()

    def stall(w, shard, grad):
        until_told(w, wake)
        try:
            w.allreduce(shard.step, grad, 0.5, 0, shard.shard_end - shard.shard_start)
        except PeerLost as exc:
            return exc

    def hang_up(w, shard, grad):
        time.sleep(0.2)  # worker 0 has sent, worker 1 stalls
        w.close()

    def faulty(fault):
        def make(addr):
            def body():
                w = Worker.connect(addr, 0, "cpu", timeout=TIMEOUT, samples_per_step=T)
                try:
                    return train(w, N, 1, fault)
                finally:
                    w.close()
            return body
        return make
    steps = 5
    try:
        faults = [faulty(stall), faulty(hang_up)] if stalled == 1 else \
            [faulty(hang_up), faulty(stall)]
        coord, result, outs, state = run([session_worker] + faults, steps,
                                  lambda c, r, t: None)
    finally:
        wake.set()
    assert isinstance(result, list), result
    check_survivors(outs, [0], steps)
    check_every_sample_once(coord, steps)
    assert sorted(e.worker_id for e in coord.membership) == [1, 2]
