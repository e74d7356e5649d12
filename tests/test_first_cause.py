"""The first cause survives: once a failure ends a session, every later call
on that side raises that same failure (its type, worker and step), not
whatever a closed socket says then.

Real Coordinators and Workers over loopback, the workers as threads. Each
test makes one failure happen (a worker lost mid-step on the star and on
the mesh, the coordinator gone, a NaN halt, a mismatch), keeps the first
error each side raised, then makes every session call on that side again.
"""
from __future__ import annotations

import enum
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import pytest

from ddpwire import Coordinator, Worker, encode_frame
from ddpwire.session.coordinator import CoordinatorState
from ddpwire.wire.errors import (
    CoordinatorLost,
    DdpwireError,
    GradientMismatch,
    NonFiniteGradient,
    PeerLost,
    ShutdownDuringReduce,
    WorkerLost,
)
from ddpwire.session.lifecycle import Lifecycle
from ddpwire.wire.messages import AveragedGradient, GradientPayload
from ddpwire.session.worker import WorkerState

from mesh_session import Session, gradients
from session_helpers import fake_coordinator, recv_frame, spawn, start_workers, worker_and_raw_peer

ADDR = ("127.0.0.1", 0)
COUNT = 50_000
LATER = 9  # the step every later call names: never the step that failed

#: every session call of a worker, made after its session ended
WORKER_CALLS: Dict[str, Callable[[Worker], Any]] = {
    "receive_shard": lambda w: w.receive_shard(),
    "send_gradients": lambda w: w.send_gradients(LATER, np.ones(COUNT, np.float32), 1.0, 1, 1),
    "receive_averaged": lambda w: w.receive_averaged(),
    "allreduce": lambda w: w.allreduce(LATER, np.ones(COUNT, np.float32), 1.0, 1, 1),
    "send_block_gradient": lambda w: w.send_block_gradient(LATER, 0, 1, np.ones(4, np.float32),
                                                           [4]),
    "receive_averaged_block": lambda w: w.receive_averaged_block(),
}

#: every session call of a coordinator, made after its session ended
COORDINATOR_CALLS: Dict[str, Callable[[Coordinator], Any]] = {
    "send_shard_assignments": lambda c: c.send_shard_assignments(LATER),
    "allreduce": lambda c: c.allreduce(LATER),
    "collect_and_reduce": lambda c: c.collect_and_reduce(LATER),
    "allreduce_block": lambda c: c.allreduce_block(LATER, 0),
    "allreduce_non_block": lambda c: c.allreduce_non_block(LATER, 1),
}


def later_errors(target: Any, calls: Dict[str, Callable[[Any], Any]]
                 ) -> List[Tuple[str, Optional[BaseException]]]:
    """What each of ``calls`` raises on ``target`` (None: it returned)."""
    out: List[Tuple[str, Optional[BaseException]]] = []
    for name, call in calls.items():
        try:
            call(target)
        except BaseException as exc:  # kept for the test thread
            out.append((name, exc))
        else:
            out.append((name, None))
    return out


def first_then_later(w: Worker, step: Callable[[], Any]):
    """A worker body's end: ``step`` must fail; its error, and what every
    later call raises then."""
    try:
        step()
    except DdpwireError as exc:
        return exc, later_errors(w, WORKER_CALLS)
    raise AssertionError(f"worker {w.worker_id}: the step did not fail")


def assert_same_cause(first: BaseException,
                      later: List[Tuple[str, Optional[BaseException]]]) -> None:
    """Every later call raised the first error again: the same type, text,
    worker and step, chained to the first one."""
    for name, exc in later:
        assert exc is not None, f"{name} returned after {first!r}"
        assert type(exc) is type(first), f"{name}: {exc!r} after {first!r}"
        assert (exc.worker_id, exc.step) == (first.worker_id, first.step), \
            f"{name}: {exc!r} after {first!r}"
        assert str(exc) == str(first), name
        assert exc is first or exc.__cause__ is first, f"{name}: not chained to the first"


def assert_coordinator_keeps(coord: Coordinator, first: DdpwireError) -> None:
    assert coord.state is CoordinatorState.FAILED and coord.failure is first
    assert_same_cause(first, later_errors(coord, COORDINATOR_CALLS))


@pytest.fixture(params=["links", "shared"])
def data_plane(request, monkeypatch):
    """A mesh test on both data planes: the links, and the shared segment."""
    monkeypatch.setenv("DDPWIRE_SHM", "0" if request.param == "links" else "1")
    return request.param


# ---- a worker lost mid-step ----

def test_a_worker_lost_mid_step_on_the_star_is_what_every_later_call_raises():
    g = np.ones(COUNT, np.float32)
    with Coordinator(ADDR, topology="star", expect_workers=2, timeout=5) as coord:
        w0, raw = worker_and_raw_peer(coord, timeout=5)
        with w0:
            t = spawn(lambda: first_then_later(w0, lambda: w0.allreduce(2, g, 1.0, 1, 1)))
            frame = encode_frame(GradientPayload(step=2, worker_id=1, gradients=g, loss=1.0,
                                                 correct=1, total=1))
            raw.sendall(frame[: len(frame) // 2])
            raw.close()  # worker 1 dies inside its gradient
            with pytest.raises(WorkerLost) as info:
                coord.allreduce(2)
            first, later = t.join_result()
            assert w0.state is WorkerState.FAILED and w0.failure is first
        lost = info.value
        assert (lost.worker_id, lost.step) == (1, 2)
        assert_coordinator_keeps(coord, lost)
    # the coordinator closed worker 0's connection inside the average
    assert isinstance(first, CoordinatorLost) and (first.worker_id, first.step) == (0, 2)
    assert_same_cause(first, later)


@pytest.mark.parametrize("share", [0.0, 0.25], ids=["mesh", "coordinator-share"])
def test_a_worker_lost_mid_step_on_the_mesh_is_what_every_later_call_raises(share, data_plane):
    grads = gradients(3, 60_000, seed=4)
    steps_done = threading.Barrier(3)

    def body(w):
        g = grads[w.worker_id]
        w.allreduce(0, g, 1.0, 1, 1)
        steps_done.wait(30)
        if w.worker_id == 1:
            return "left"  # closes its links and its coordinator connection
        return first_then_later(w, lambda: w.allreduce(1, g, 1.0, 1, 1))

    s = Session(3, body, coordinator={"coordinator_share": share}, timeout=5.0)
    try:
        s.coord.allreduce(0)
        with pytest.raises(WorkerLost) as info:
            s.coord.allreduce(1)
        assert (info.value.worker_id, info.value.step) == (1, 1)
        assert_coordinator_keeps(s.coord, info.value)
    finally:
        s.join()
    assert not s.errors, s.errors
    for wid in (0, 2):
        first, later = s.results[wid]
        assert isinstance(first, PeerLost) and first.step == 1, repr(first)
        assert_same_cause(first, later)


# ---- the coordinator gone ----

def test_the_coordinator_gone_on_the_star_is_what_every_later_call_raises():
    g = np.ones(COUNT, np.float32)
    with Coordinator(ADDR, topology="star", expect_workers=1, timeout=5) as coord:
        def body(w):
            shard = w.receive_shard()
            return first_then_later(w, lambda: (w.send_gradients(shard.step, g, 1.0, 1, 1),
                                                w.receive_averaged()))
        t = start_workers(coord, 1, body, timeout=5)[0]
        coord.set_total_samples(4)
        coord.send_shard_assignments(0)
        coord.collect_and_reduce(0)  # every byte read: the close is a clean FIN
        coord.close()
        first, later = t.join_result()
    assert coord.state is CoordinatorState.CLOSED and coord.failure is None
    assert isinstance(first, CoordinatorLost) and (first.worker_id, first.step) == (0, 0)
    assert_same_cause(first, later)


def test_the_coordinator_gone_mid_mesh_step_is_what_every_later_call_raises(data_plane):
    grads = gradients(2, 30_000, seed=5)
    s = Session(2, lambda w: first_then_later(
        w, lambda: w.allreduce(0, grads[w.worker_id], 1.0, 1, 1)), timeout=5.0)
    try:
        s.coord.collect_and_reduce(0)  # the reports are in; no go-ahead follows
        s.coord.close()
    finally:
        s.join()
    assert not s.errors, s.errors
    for wid in (0, 1):
        first, later = s.results[wid]
        assert isinstance(first, CoordinatorLost) and (first.worker_id, first.step) == (wid, 0)
        assert_same_cause(first, later)


def test_a_worker_that_finds_the_coordinator_gone_between_steps_keeps_that():
    lsock, t = fake_coordinator(lambda conn: None)  # closes right after the join
    w = Worker.connect(lsock.getsockname(), timeout=5)
    try:
        with pytest.raises(CoordinatorLost) as info:
            w.receive_shard()
        assert_same_cause(info.value, later_errors(w, WORKER_CALLS))
    finally:
        w.close()
        lsock.close()
    assert w.state is WorkerState.CLOSED and w.failure is info.value


# ---- a NaN halt ----

def test_a_nan_halt_on_the_star_is_what_every_later_call_raises():
    grads = [np.ones(COUNT, np.float32), np.ones(COUNT, np.float32)]
    grads[1][123] = np.nan
    with Coordinator(ADDR, topology="star", expect_workers=2, timeout=5) as coord:
        threads = start_workers(coord, 2, lambda w: first_then_later(
            w, lambda: w.allreduce(0, grads[w.worker_id], 1.0, 1, 1)), timeout=5)
        with pytest.raises(NonFiniteGradient) as info:
            coord.allreduce(0)
        halt = info.value
        assert (halt.worker_id, halt.step, halt.index) == (1, 0, 123)
        assert_coordinator_keeps(coord, halt)
        results = [t.join_result() for t in threads]
    for wid, (first, later) in enumerate(results):
        # the average was cut short: the workers only see the close
        assert isinstance(first, CoordinatorLost) and (first.worker_id, first.step) == (wid, 0)
        assert_same_cause(first, later)


def test_a_nan_halt_then_shutdown_on_the_star_is_what_every_later_call_raises():
    # the two-call path sends nothing before every gradient is checked: the
    # workers' connections stay open for the Shutdown that stops them
    grads = [np.ones(COUNT, np.float32), np.ones(COUNT, np.float32)]
    grads[0][7] = np.inf

    def body(w):
        w.send_gradients(0, grads[w.worker_id], 1.0, 1, 1)
        return first_then_later(w, w.receive_averaged)

    with Coordinator(ADDR, topology="star", expect_workers=2, timeout=5) as coord:
        threads = start_workers(coord, 2, body, timeout=5)
        with pytest.raises(NonFiniteGradient) as info:
            coord.collect_and_reduce(0)
        coord.shutdown_workers()
        assert_coordinator_keeps(coord, info.value)
        results = [t.join_result() for t in threads]
    assert (info.value.worker_id, info.value.step) == (0, 0)
    for wid, (first, later) in enumerate(results):
        assert isinstance(first, ShutdownDuringReduce) and (first.worker_id, first.step) == (wid, 0)
        assert_same_cause(first, later)


def test_a_nan_halt_on_the_mesh_is_what_every_later_call_raises(data_plane):
    grads = gradients(3, 12_000, seed=1)
    grads[2][7_002] = np.nan
    s = Session(3, lambda w: first_then_later(
        w, lambda: w.allreduce(0, grads[w.worker_id], 1.0, 1, 1)), timeout=5.0)
    try:
        with pytest.raises(NonFiniteGradient) as info:
            s.coord.allreduce(0)
        assert (info.value.worker_id, info.value.step) == (2, 0)
        assert_coordinator_keeps(s.coord, info.value)
    finally:
        s.join()
    assert not s.errors, s.errors
    for wid in range(3):
        first, later = s.results[wid]
        assert isinstance(first, NonFiniteGradient) and (first.worker_id, first.step) == (2, 0)
        assert_same_cause(first, later)


# ---- a mismatch ----

def test_a_step_mismatch_on_the_star_is_what_every_later_call_raises():
    def body(w):
        step = 5 if w.worker_id == 1 else 4
        w.send_gradients(step, np.ones(COUNT, np.float32), 1.0, 1, 1)
        return first_then_later(w, w.receive_averaged)

    with Coordinator(ADDR, topology="star", expect_workers=2, timeout=5) as coord:
        threads = start_workers(coord, 2, body, timeout=5)
        with pytest.raises(GradientMismatch) as info:
            coord.collect_and_reduce(4)
        bad = info.value
        assert (bad.field, bad.worker_id, bad.step) == ("step", 1, 4)
        assert_coordinator_keeps(coord, bad)
        coord.close()  # the workers hear it
        results = [t.join_result() for t in threads]
    for wid, (first, later) in enumerate(results):
        assert isinstance(first, CoordinatorLost) and first.worker_id == wid
        assert first.step == (5 if wid == 1 else 4)
        assert_same_cause(first, later)


def test_an_average_for_another_step_is_what_every_later_call_raises():
    release = threading.Event()

    def behaviour(conn):
        recv_frame(conn)  # the step-0 gradients
        conn.sendall(encode_frame(AveragedGradient(step=1, gradients=np.ones(COUNT, np.float32),
                                                   global_loss=0.0)))
        release.wait(30)  # the connection stays open: the worker closes it

    lsock, t = fake_coordinator(behaviour)
    w = Worker.connect(lsock.getsockname(), timeout=2)
    try:
        w.send_gradients(0, np.ones(COUNT, np.float32), 1.0, 1, 1)
        with pytest.raises(GradientMismatch) as info:
            w.receive_averaged()
        assert (info.value.field, info.value.worker_id, info.value.step) == ("step", 0, 0)
        assert_same_cause(info.value, later_errors(w, WORKER_CALLS))
    finally:
        release.set()
        w.close()
        t.join_result()
        lsock.close()


def test_gradients_of_different_lengths_on_the_mesh_are_what_every_later_call_raises(data_plane):
    grads = [np.ones(1000, np.float32), np.ones(1001, np.float32)]
    s = Session(2, lambda w: first_then_later(
        w, lambda: w.allreduce(0, grads[w.worker_id], 1.0, 1, 1)), timeout=5.0)
    try:
        with pytest.raises((WorkerLost, GradientMismatch)) as info:
            s.coord.allreduce(0)
        assert info.value.step == 0
        assert_coordinator_keeps(s.coord, info.value)
    finally:
        s.join()
    assert not s.errors, s.errors
    firsts = [s.results[wid][0] for wid in (0, 1)]
    assert any(isinstance(f, GradientMismatch) for f in firsts), firsts
    for first, later in s.results.values():
        assert first.step == 0
        assert_same_cause(first, later)


# ---- a call that overlaps the failure ----

def test_a_receive_under_way_when_the_sender_fails_raises_the_first_cause():
    """The per-block mode sends from one thread while another receives: when
    the coordinator goes, whichever of the two fails first is the cause, and
    the other raises that too, not the closed socket it woke up to."""
    release = threading.Event()

    def behaviour(conn):
        recv_frame(conn)  # block 0's gradients, then gone
        release.wait(30)

    lsock, t = fake_coordinator(behaviour)
    w = Worker.connect(lsock.getsockname(), timeout=5)
    try:
        receiving = spawn(lambda: first_then_later(w, w.receive_averaged_block))
        block = np.ones(COUNT, np.float32)
        w.send_block_gradient(0, 0, 1, block, [COUNT])
        release.set()  # the fake coordinator closes now
        try:
            for _ in range(1000):  # a send fails once the close has come back
                w.send_block_gradient(0, 0, 1, block, [COUNT])
        except DdpwireError as exc:
            sent = exc
        else:
            raise AssertionError("the sends went on after the coordinator closed")
        first, later = receiving.join_result()
        cause = w.failure
        assert cause is not None and w.state is WorkerState.FAILED
        for exc in (sent, first):
            assert exc is cause or exc.__cause__ is cause, (exc, cause)
        assert isinstance(cause, CoordinatorLost) and (cause.worker_id, cause.step) == (0, 0)
        assert_same_cause(cause, later)
    finally:
        release.set()
        w.close()
        t.join_result()
        lsock.close()


# ---- the states ----

def test_the_states_run_forward_on_both_sides():
    with Coordinator(ADDR, topology="star", expect_workers=1, timeout=5) as coord:
        assert coord.state is CoordinatorState.JOINING
        seen: List[WorkerState] = []

        def body(w):
            seen.append(w.state)
            w.receive_shard()
            seen.append(w.state)
            w.send_gradients(0, np.ones(8, np.float32), 1.0, 1, 1)
            seen.append(w.state)
            w.receive_averaged()
            seen.append(w.state)
            return w
        t = start_workers(coord, 1, body, timeout=5)[0]
        assert coord.state is CoordinatorState.READY
        coord.set_total_samples(1)
        coord.send_shard_assignments(0)
        coord.broadcast_averaged(0, coord.collect_and_reduce(0))
        w = t.join_result()
        assert seen == [WorkerState.JOINED, WorkerState.READY, WorkerState.IN_STEP,
                        WorkerState.READY]
        assert w.state is WorkerState.CLOSED and w.failure is None
        with pytest.raises(DdpwireError, match="worker 0 is closed"):
            w.receive_shard()
        with pytest.raises(WorkerLost) as info:
            coord.collect_and_reduce(1)  # the worker left: the session fails
        assert coord.state is CoordinatorState.FAILED
        assert coord.failure is info.value
    assert coord.state is CoordinatorState.CLOSED and coord.failure is info.value
    with pytest.raises(WorkerLost) as again:
        coord.allreduce(2)
    assert again.value.__cause__ is info.value


def test_a_lifecycle_refuses_every_move_back():
    class S(enum.Enum):
        A = 1
        B = 2
        FAILED = 3
        CLOSED = 4

    moves = {S.A: frozenset({S.B, S.FAILED, S.CLOSED}), S.B: frozenset({S.FAILED, S.CLOSED}),
             S.FAILED: frozenset({S.CLOSED}), S.CLOSED: frozenset()}
    life = Lifecycle(S.A, moves, failed=S.FAILED, closed=S.CLOSED, owner="the test")
    life.move(S.B)
    with pytest.raises(AssertionError, match="B cannot become A"):
        life.move(S.A)
    cause = WorkerLost("gone", worker_id=3, step=7)
    assert life.record(cause, step=8, worker_id=None)
    assert life.failure is cause and (cause.worker_id, cause.step) == (3, 7)
    assert not life.record(WorkerLost("later", worker_id=4, step=9), step=9, worker_id=None)
    for back in (S.A, S.B):
        with pytest.raises(WorkerLost) as info:
            life.move(back)  # a session another thread ended: its failure
        assert info.value.__cause__ is cause
    life.move(S.CLOSED)
    with pytest.raises(WorkerLost):
        life.move(S.FAILED)
    assert life.state is S.CLOSED


def test_an_interruption_inside_a_frame_is_kept_as_an_error_naming_it():
    life = Lifecycle(WorkerState.READY, {WorkerState.READY: frozenset({WorkerState.FAILED}),
                                         WorkerState.FAILED: frozenset()},
                     failed=WorkerState.FAILED, closed=WorkerState.CLOSED, owner="worker 2")
    interrupt = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt) as info:
        with life.failing(lambda exc: life.record(exc, step=5, worker_id=2), any_error=True):
            raise interrupt
    assert info.value is interrupt  # the interruption itself goes on up
    kept = life.failure
    assert type(kept) is DdpwireError and (kept.worker_id, kept.step) == (2, 5)
    assert kept.__cause__ is interrupt and "KeyboardInterrupt" in str(kept)
    with pytest.raises(DdpwireError) as again:
        life.check()
    assert again.value.__cause__ is kept
