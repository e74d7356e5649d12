"""A worker's connection to its coordinator: its state, and its one failure path.

The worker's side of :mod:`ddpwire.session.roster`. A :class:`~ddpwire.Worker`'s
calls run their parts (:mod:`ddpwire.session.shard_inbox` between steps,
:mod:`ddpwire.plane.star_step` through the coordinator, :mod:`ddpwire.plane.mesh_step`
on the mesh) inside :meth:`Uplink.talking`, and move the state only
through here: an error in any part ends the session the same way, closing
everything once and keeping the first cause.
"""
from __future__ import annotations

import enum
import logging
import socket
import threading
from typing import ContextManager, Dict, FrozenSet, Optional

from .._text import counted
from ..wire.channel import Channel, Heartbeats
from ..wire.errors import CoordinatorLost, DdpwireError, MembershipChanged, NonFiniteGradient
from .lifecycle import Lifecycle
from ..plane.mesh_step import MeshStep
from ..wire.messages import NO_WORKER, CollectiveError, StepAborted
from ..plane.star_step import Owed, StarStep

__all__ = ["Uplink", "WorkerState"]

log = logging.getLogger("ddpwire.worker")


class WorkerState(enum.Enum):
    """Where a :class:`~ddpwire.Worker`'s session stands (its ``state``).

    JOINED: admitted; when the mesh was granted, the coordinator's peer
    table is still due (the first call reads it). READY: between steps.
    IN_STEP: gradients sent, their average not yet received. FAILED: an
    error ended the session (the worker's ``failure``); every link is
    closed and every later call raises that error again. CLOSED: the
    worker's ``close`` ran. The session only moves forward: READY and
    IN_STEP take turns, step after step, and nothing leaves FAILED but
    CLOSED, or CLOSED at all.
    """

    JOINED = "joined"
    READY = "ready"
    IN_STEP = "in step"
    FAILED = "failed"
    CLOSED = "closed"


_WORKER_MOVES: Dict[WorkerState, FrozenSet[WorkerState]] = {
    WorkerState.JOINED: frozenset({WorkerState.READY, WorkerState.FAILED, WorkerState.CLOSED}),
    WorkerState.READY: frozenset({WorkerState.IN_STEP, WorkerState.FAILED, WorkerState.CLOSED}),
    WorkerState.IN_STEP: frozenset({WorkerState.READY, WorkerState.FAILED, WorkerState.CLOSED}),
    WorkerState.FAILED: frozenset({WorkerState.CLOSED}),
    WorkerState.CLOSED: frozenset(),
}


class Uplink:
    """Worker ``worker_id``'s session over ``chan``, in a session of
    ``total_workers``: :attr:`life` (its state and first failure), its
    heartbeats (every ``heartbeat`` seconds, None for none) and the two
    ways a step runs, which a failure closes: :attr:`mesh` (on the mesh
    port ``listener`` when the coordinator granted it, its links sending
    under ``congestion``) and :attr:`star` (``elastic``: a step may be
    called off; ``socket_threads``: how a flat step's exchange runs)."""

    def __init__(self, chan: Channel, worker_id: int, total_workers: int, *,
                 heartbeat: Optional[float], node_id: str, listener: Optional[socket.socket],
                 congestion: Optional[str], elastic: bool,
                 socket_threads: Optional[bool]) -> None:
        self.chan = chan
        self.worker_id = worker_id
        #: the workers in the session (an elastic session's change between steps)
        self.total_workers = total_workers
        self.life: Lifecycle[WorkerState] = Lifecycle(
            WorkerState.JOINED, _WORKER_MOVES, failed=WorkerState.FAILED,
            closed=WorkerState.CLOSED, owner=f"worker {worker_id}")
        # The mesh (docs/extensions.md): granted at the join, its peer table
        # arrives once every worker has joined, ahead of anything else; the
        # links open at the first flat step.
        self.mesh = MeshStep(chan, worker_id, listener, congestion)
        # the replies the coordinator owes, changed with the state under its lock
        self.star = StarStep(chan, worker_id, self.life.lock, elastic=elastic,
                             socket_threads=socket_threads)
        self._topology_lock = threading.Lock()
        self._beats = Heartbeats(heartbeat, lambda: (chan,), "ddpwire-worker-heartbeat")
        self._beats.start(node_id)

    def enter(self) -> None:
        """What every call checks first: the session's failure, or that it
        is closed; then it leaves JOINED, reading the MeshPeers a
        coordinator that granted the mesh sends before anything else (once;
        the per-block threads may race here)."""
        self.life.check()
        if self.life.state is not WorkerState.JOINED:
            return
        with self._topology_lock:
            if self.life.state is not WorkerState.JOINED:
                return
            with self.talking(None):
                self.mesh.read_table()
            self.life.move(WorkerState.READY)

    # ---- a step's replies: IN_STEP while any is owed ----

    def owe(self, reply: Optional[Owed] = None) -> None:
        """A step's gradients went out: IN_STEP until its reply is in.
        ``reply`` is a star reply queued for a later receive; None where the
        call itself takes the reply (the star's duplex allreduce) or the
        mesh step records it (:attr:`MeshStep.sent`)."""
        with self.life.lock:
            self.life.move(WorkerState.IN_STEP)
            if reply is not None:
                self.star.owed.append(reply)

    def settled(self) -> None:
        """A reply came in whole: READY once nothing more is owed (a
        per-block sender may have queued another meanwhile)."""
        with self.life.lock:
            if not self.star.owed and self.mesh.sent is None:
                self.life.move(WorkerState.READY)

    def membership_changed(self, msg: StepAborted) -> MembershipChanged:
        """What the call a step was called off in raises: the step is to be
        computed again, by the workers left, on the shard that comes next."""
        self.total_workers = msg.workers
        # the session goes on as it should: news for this worker, not trouble
        log.info("worker %d: worker %d was lost during step %d; computing it again with %s",
                    self.worker_id, msg.worker_id, msg.step, counted(msg.workers, "worker"))
        return MembershipChanged([msg.worker_id], msg.workers, step=msg.step,
                                 worker_id=self.worker_id)

    # ---- the one failure path ----

    def talking(self, step: Optional[int], *, any_error: bool = False,
                tell: bool = False) -> ContextManager[None]:
        """Where a call talks to a peer about ``step``: an error there
        ends the session through :meth:`fail` (``any_error``: any
        exception, where one may leave a frame cut short; ``tell``: a mesh
        step, whose failure the coordinator is told of)."""
        def fail(exc: BaseException) -> None:
            self.fail(exc, step, tell=tell)
        return self.life.failing(fail, any_error=any_error)

    def fail(self, cause: BaseException, step: Optional[int] = None, *,
             tell: bool = False) -> bool:
        """End the session on ``cause``, once: keep it (the first cause) for
        every later call, and close everything this worker holds. Returns
        False when the session had ended already, whatever ended it.

        The links to the other workers close first, which tells every peer
        at once. With ``tell`` (a failed mesh step), a failure on a link to
        another worker is first told to the coordinator, a CollectiveError
        naming that worker, where it would otherwise only see this worker
        leave; but only between two frames on that connection: inside one
        (a GradientPayload of the coordinator's share cut short) the
        coordinator would read the CollectiveError as gradient bytes, and
        closing is all it can be told. The coordinator's own loss, and a
        halt it decided, it needs no telling of."""
        with self.life.lock:
            blamed = getattr(cause, "worker_id", None)
            if not self.life.record(cause, step=step, worker_id=self.worker_id):
                return False
            cut = self.chan.frame_open or self.mesh.frame_open
            self.mesh.close()
            worth_telling = isinstance(cause, DdpwireError) and \
                not isinstance(cause, (CoordinatorLost, NonFiniteGradient))
            if tell and not cut and worth_telling and step is not None:
                # the message alone: the CollectiveError carries the worker and
                # the step, and the coordinator's error names them again
                try:
                    self.chan.send(CollectiveError(
                        seq=step, worker_id=NO_WORKER if blamed is None else blamed,
                        detail=cause.message[:1000]), step=step)
                except DdpwireError:
                    pass  # the coordinator is gone too: closing says the rest
            self._release()
        return True

    def close(self) -> None:
        """CLOSED: close what is open still (after a failure, nothing is)."""
        with self.life.lock:
            state = self.life.state
            if state is WorkerState.CLOSED:
                return
            self.life.move(WorkerState.CLOSED)
            if state is not WorkerState.FAILED:
                self._release()

    def _release(self) -> None:
        """Close what the session holds: its links, its listener, its
        connection to the coordinator, its heartbeat thread (once, by the
        move to FAILED or to CLOSED, with the lifecycle's lock held)."""
        self._beats.stop()
        self.mesh.close()
        self.chan.close()
        self._beats.stop(self.chan.timeout)  # the close above wakes one blocked in its send
