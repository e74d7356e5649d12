"""The workers in a coordinator's session, and its one failure path.

The star (:mod:`ddpwire.session.star`), the mesh's control
(:mod:`ddpwire.session.mesh_control`) and elastic membership
(:mod:`ddpwire.session.elastic`) each run a part of a step over the same worker
connections. Those connections, their order, the shards, the vector lengths
a session pinned and the lifecycle live here once, so that every part sees
the same workers (an elastic session changes them between steps) and every
failure ends the session the same way.
"""
from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import time
from typing import ContextManager, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from .. import _core
from . import balance as _balance
from .._core import encode_frame_parts
from .admission import Admitted
from ..wire.channel import Channel, Heartbeats
from .._text import counted
from ..wire.errors import DdpwireError, ProtocolError, WorkerLost
from ..wire.extensions import Extension
from .lifecycle import Lifecycle
from ..wire.messages import ShardAssignment, ShardScale, Shutdown, StepTiming
from .options import SessionOptions
from .sessioninfo import WorkerInfo

__all__ = ["Roster"]

# one logger for the whole coordinator side, whichever module speaks
log = logging.getLogger("ddpwire.coordinator")


class Roster:
    """The coordinator's worker connections (``channels``, in worker order)
    and what every part of a step reads alongside them.

    ``life`` is the coordinator's :class:`~ddpwire.session.lifecycle.Lifecycle`.
    """

    def __init__(self, options: SessionOptions, life: Lifecycle):
        self.channels: List[Channel] = []
        self.workers: List[WorkerInfo] = []
        #: the shards of every step (set when the join completes)
        self.shards: Optional[_balance.Shards] = None
        # Vector lengths are fixed by the first step that sees them: a worker
        # whose model differs is caught on its first gradient.
        self.lengths: Dict[Tuple[object, Optional[int]], int] = {}
        self.assigning = False  # while a step's ShardAssignments go out, one after another
        self.timeout = options.timeout
        self.max_frame = options.max_frame
        self.heartbeat_timeout = options.heartbeat_timeout
        self.heartbeat = options.heartbeat
        self.life = life
        self._beats = Heartbeats(options.heartbeat, lambda: self.channels,
                                 "ddpwire-coordinator-heartbeat")

    def channel(self, worker_id: int) -> Channel:
        """The connection to one worker in the session."""
        for chan in self.channels:
            if chan.peer_id == worker_id:
                return chan
        raise KeyError(f"worker {worker_id} is not in the session")

    def seat(self, admitted: Sequence[Admitted]) -> None:
        """The workers of the completed join, in worker order."""
        self.channels.extend(self.open_channel(a) for a in admitted)
        self.workers.extend(a.info() for a in admitted)

    def open_channel(self, a: Admitted) -> Channel:
        """The channel of a worker that completed the join."""
        chan = Channel(a.sock, timeout=self.timeout, lost=WorkerLost, peer_id=a.worker_id,
                       peer_name=f"worker {a.worker_id} ({a.name()})",
                       max_frame=self.max_frame, heartbeat_timeout=self.heartbeat_timeout)
        if a.keys is not None:
            # the worker sealed its side on reading JoinAccepted, our last clear frame
            chan.conn.seal(*a.keys)
        return chan

    def start_shards(self, admitted: Sequence[Admitted], balance: Union[bool, str], *,
                     weighted: bool, planned: Optional[int]) -> None:
        """The shards, once the join completes: by measured speed when
        ``balance`` asks and every worker reports its compute time (True
        asks always, "auto" only then); the reference's split otherwise.
        ``planned``: the run's steps, where known."""
        timed = [Extension.BALANCE in a.granted for a in admitted]
        # "auto" stays off beside a reference worker: its speed is only seen
        # from when its gradient arrives, its weight applied here
        mode = balance if balance is True or all(timed) else False
        self.shards = _balance.Shards(timed, mode, weighted=weighted,
                                      names=[a.name() for a in admitted], planned=planned)
        for chan, on in zip(self.channels, timed):
            if on:
                self.watch_timing(chan)
        if mode is True:
            log.info("shards follow each worker's measured speed")
        elif mode == "auto":
            log.info("shards follow each worker's measured speed where that is measured "
                     "to shorten the steps (--balance on: always, off: never)")

    def watch_timing(self, chan: Channel) -> None:
        """Feed the StepTiming a timed worker sends to the shards."""
        worker_id = chan.peer_id

        def on_timing(msg: StepTiming) -> None:
            assert self.shards is not None
            why = self.shards.observe(worker_id, msg.step, msg.compute_us, time.perf_counter())
            if why is not None:
                raise ProtocolError(why, worker_id=worker_id, step=msg.step)
        chan.on_timing = on_timing

    # ---- the one failure path ----

    def talking(self, step: Optional[int], *, any_error: bool = False,
                mesh: bool = False) -> ContextManager[None]:
        """Where a call talks to the workers about ``step``: an error there
        ends the session through :meth:`fail`; with ``any_error`` any
        exception does, for a part that leaves the workers inside a frame
        from this coordinator when it is cut short. ``mesh``: a mesh step."""
        def fail(exc: BaseException) -> None:
            self.fail(exc, step, mesh=mesh)
        return self.life.failing(fail, any_error=any_error)

    def fail(self, cause: BaseException, step: Optional[int] = None, *,
             mesh: bool = False) -> bool:
        """End the session on ``cause``, once: keep it (the first cause) for
        every later call, and close the worker connections, which is how the
        workers hear of it: the star's protocol has no error message.
        Returns False when the session had ended already.

        Every connection a frame from here was cut short on closes (its
        worker holds part of a reply that will never end), and when a mesh
        step failed (``mesh``) every connection, so that the workers, who
        wait on each other, all stop at once. A star connection between two
        frames stays open until the coordinator closes, only for the
        Shutdown it may still send there (the reference's way to stop a
        worker; docs/sessions.md)."""
        with self.life.lock:
            if not self.life.record(cause, step=step, worker_id=None):
                return False
            for chan in self.channels:
                if mesh or chan.frame_open:
                    chan.close()
            if all(chan.conn.fileno() < 0 for chan in self.channels):
                self.release()  # nobody left to keep alive
        return True

    def release(self) -> None:
        """Close every worker connection and stop the heartbeat thread
        (with the lifecycle's lock held; once more is harmless)."""
        # the heartbeat thread may be inside a send on a connection closed
        # below: Connection.close() then waits for it to leave the descriptor
        self._beats.stop()
        for chan in self.channels:
            chan.close()
        self._beats.stop(self.timeout)

    # ---- heartbeats ----

    def start_heartbeats(self, node_id: str) -> None:
        """With ``heartbeat`` set, a Heartbeat to each idle worker at that
        interval until :meth:`release` or :meth:`stop`."""
        self._beats.start(node_id)

    # ---- sending to every worker ----

    def assign(self, step: int, *, elastic: bool
               ) -> Tuple[List[Channel], Dict[int, WorkerLost]]:
        """Every worker's ShardAssignment (and a timed worker's ShardScale)
        for ``step``, as the shards planned it. Returns the workers told and,
        in an ``elastic`` session, those lost on the way (else the first
        loss raises)."""
        assert self.shards is not None
        sent: List[Channel] = []
        lost: Dict[int, WorkerLost] = {}
        self.assigning = True
        try:
            for chan in list(self.channels):
                start, end = self.shards.bounds(chan.peer_id)
                msgs: List[object] = [ShardAssignment(step=step, shard_start=start, shard_end=end)]
                if chan.on_timing is not None:
                    msgs.append(ShardScale(step=step, scale=self.shards.scale(chan.peer_id)))
                try:
                    chan.send_all(msgs, step=step)
                except WorkerLost as exc:
                    if not elastic:
                        raise
                    lost[chan.peer_id] = exc
                    continue
                sent.append(chan)
        finally:
            self.assigning = False
        return sent, lost

    def broadcast(self, msg: object, step: int) -> None:
        """``msg`` to every worker at once."""
        parts = encode_frame_parts(msg, max_frame=self.max_frame)
        with self.sending_to_all():
            _core.send_many([c.conn for c in self.channels], parts, self.timeout, step=step,
                            what=f"sending {type(msg).__name__}")

    @contextlib.contextmanager
    def sending_to_all(self) -> Iterator[None]:
        """Hold every worker's send lock: a heartbeat must not land inside a
        frame. Each connection's frame stays open (Channel.frame_open) when
        the block ends in an exception."""
        held: List[Channel] = []
        try:
            for chan in self.channels:
                chan.send_lock.acquire()
                held.append(chan)
                chan.frame_open = True
            yield
            for chan in held:
                chan.frame_open = False
        finally:
            for chan in held:
                chan.send_lock.release()

    # ---- the end ----

    def shutdown(self) -> None:
        """Shutdown to every worker still connected (a lost one is skipped)."""
        for chan in self.channels:
            try:
                chan.send(Shutdown())
            except DdpwireError as exc:
                log.warning("could not send Shutdown to worker %s: %s", chan.peer_id, exc)

    def stop(self, grace: float) -> int:
        """Send Shutdown to every worker whose connection is between two
        frames, then give each up to ``grace`` seconds to hang up. Returns
        how many were told.

        A worker waiting for a shard then ends its run as after the last
        step; one waiting for an average raises ShutdownDuringReduce. A
        connection left inside a frame (an exception cut the frame short) is
        skipped: a Shutdown there would be read as the rest of that frame.
        The wait for the hang-up matters: a worker may still be sending its
        gradients, and closing with them unread would reset the connection,
        failing that send before the worker reads the Shutdown."""
        deadline = time.monotonic() + grace
        self._beats.stop()  # no heartbeat after the Shutdown
        told: List[Channel] = []
        for chan in self.channels:
            try:
                # the heartbeat thread may be inside a frame: it is short, wait
                if chan.send_last(Shutdown(), lock_wait=deadline - time.monotonic(),
                                  timeout=min(grace, self.timeout), what="sending Shutdown"):
                    told.append(chan)
                elif chan.conn.fileno() >= 0:
                    log.info("worker %s: its connection is inside a frame, no Shutdown",
                             chan.peer_id)
            except (DdpwireError, OSError) as exc:
                log.debug("could not send Shutdown to worker %s: %s", chan.peer_id, exc)
        _await_hang_up(told, deadline)
        return len(told)


def _await_hang_up(chans: List[Channel], deadline: float) -> None:
    """Read and drop what each connection still brings until its worker
    closes it, or the deadline passes."""
    sel = selectors.DefaultSelector()
    try:
        for chan in chans:
            try:
                sel.register(chan.conn.sock, selectors.EVENT_READ)
            except (OSError, ValueError):
                continue
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                log.info("%s still connected after the Shutdown",
                         counted(len(sel.get_map()), "worker"))
                return
            for key, _ in sel.select(left):
                try:
                    data = key.fileobj.recv(1 << 16, socket.MSG_DONTWAIT)  # type: ignore
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(key.fileobj)
    finally:
        sel.close()
