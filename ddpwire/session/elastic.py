"""Membership that follows the machines: an elastic session's losses and joins.

A coordinator with ``elastic=True`` keeps its session going when a worker is
lost: the step is called off on every survivor before any of them applies
any of it (StepAborted, docs/extensions.md) and redone by the survivors with
all of its samples; a worker that joins later, into a free slot, is handed
the model's state by a worker in the session and takes part from the next
step (docs/sessions.md, "Membership that follows the machines").
"""
from __future__ import annotations

import socket
import time
from typing import Dict, List, Optional, Set, Tuple

import numpy as np

from .. import _core
from .._core import encode_frame_parts
from .._text import counted
from .admission import Admission, Admitted
from ..wire.channel import Channel
from ..plane.deadlines import BOUNDARY_SHARE
from ..wire.errors import DdpwireError, JoinTimeout, MembershipChanged, WorkerLost
from ..wire.extensions import Extension, encode_u64
from .handover import relay
from ..wire.messages import AveragedGradient, StepAborted
from .options import CoordinatorOptions
from .results import MEMBERSHIP_RECORD, MembershipEvent, ReduceResult
from .roster import Roster, log
from .star import FLAT, Star

__all__ = ["Membership"]


class Membership:
    """Who takes part in an elastic session's steps, over ``roster``.

    ``min_workers``: below it the session ends as without ``elastic``;
    ``join_timeout`` bounds the wait for joiners to bring it back. The join
    stays open between steps through :attr:`late`, the coordinator's
    :class:`~ddpwire.session.admission.Admission` once its first join completed.
    """

    def __init__(self, roster: Roster, star: Star, config: CoordinatorOptions):
        self.roster = roster
        self.star = star
        self.elastic = elastic = config.elastic
        self.min_workers = config.min_workers or 1
        self.join_timeout = config.join_timeout
        #: each worker that left or joined (:class:`ddpwire.session.results.MembershipEvent`)
        self.events: List[MembershipEvent] = []
        #: every averaged step's shards, ``(step, {worker_id: (start, end)})``
        #: (None outside an elastic session): each sample of a step once
        self.shard_log: Optional[List[Tuple[int, Dict[int, Tuple[int, int]]]]] = \
            [] if elastic else None
        #: the join, open between steps (None until the first join completes)
        self.late: Optional[Admission] = None
        self.next_step = 0  # the step after the last one averaged
        self._dropped: List[Channel] = []  # told, half-closed, read until they hang up
        #: joiners admitted and not yet in the roster (being handed the state)
        self._joining: List[Channel] = []
        #: when the work between two steps must be done (BOUNDARY_SHARE);
        #: None while a step runs
        self._boundary: Optional[float] = None

    def open(self, admission: Admission) -> None:
        """The first join completed: it goes on between steps, for workers
        that come late or come back. A coordinator that resumes a run goes
        on from the step its workers agreed on."""
        self.late = admission
        if admission.resume:
            self.next_step = admission.resume_step or 0
            log.info("resuming the run at step %d, where its workers are", self.next_step)
        admission.resume = False  # a later joiner is handed the state

    def close_dropped(self) -> None:
        """Close the connections of the workers dropped and not yet gone."""
        for chan in self._dropped:
            chan.close()
        self._dropped = []

    @property
    def first_step(self) -> int:
        """The step a resumed run goes on from, as its workers said at the
        join (0 before they have joined, or when none said)."""
        late = self.late
        return 0 if late is None or late.resume_step is None else late.resume_step

    def close_late(self) -> None:
        """Close the join that stays open between steps (if it is), and the
        joiners being handed the state."""
        for chan in list(self._joining):
            chan.reset()
        if self.late is not None:
            self.late.close_late()

    def _boundary_by(self) -> float:
        """The deadline of the work between two steps (BOUNDARY_SHARE),
        from now when none runs yet."""
        if self._boundary is None:
            self._boundary = time.monotonic() + BOUNDARY_SHARE * self.roster.timeout
        return self._boundary

    def assign(self, step: int, total: int, expect_workers: int) -> None:
        """Send every worker its shard of ``total`` samples for ``step``;
        in an elastic session, take in the workers that joined since the
        last step first, and call the step off for a worker lost here."""
        roster = self.roster
        assert roster.shards is not None
        self.reap()
        self._boundary_by()
        with roster.talking(step):
            if self.late is not None:
                self.admit(step, 0.0, expect_workers)
            self._check_enough(step)
        roster.shards.plan(step, total, time.perf_counter())
        for note in roster.shards.notes():
            log.warning("%s", note)
        with roster.talking(step):
            sent, lost = roster.assign(step, elastic=self.elastic)
            self._boundary = None
            if lost:
                # those told already compute the step: it is called off for them
                self.call_off(step, lost, sent, [None] * len(sent), None)

    # ---- a step ----

    def average(self, step: int, out: Optional[np.ndarray], reply: bool) -> ReduceResult:
        """A flat step that a lost worker calls off instead of ending the
        session: the heads, then every element summed (no reply streams
        out meanwhile: a survivor holding part of an average could not be
        told to drop it), then the average to each worker in turn. A loss
        before the average is complete calls the step off
        (:meth:`call_off`, MembershipChanged); one while it goes out only
        drops that worker, and the step stands."""
        roster = self.roster
        with roster.talking(step):
            chans = list(roster.channels)
            heads: list = []
            try:
                # the poll loop: its byte counts say where each frame stands
                result, _ = self.star.stream(FLAT, step, None, out, False, pinned=True,
                                             heads_into=heads, socket_threads=False)
            except WorkerLost as exc:
                # lost during the heads (those not read yet are None) or the
                # sum (how far each frame was read rides on the error)
                assert exc.worker_id is not None, exc
                self.call_off(step, {int(exc.worker_id): exc}, chans,
                              heads + [None] * (len(chans) - len(heads)),
                              getattr(exc, "received", None))
            assert self.shard_log is not None and roster.shards is not None
            self.shard_log.append((step, {c.peer_id: roster.shards.bounds(c.peer_id)
                                          for c in chans}))
            self.next_step = step + 1
            sent_at = time.perf_counter()
            if reply:
                self._send_each(AveragedGradient(step=step, gradients=result.avg_gradients,
                                                 global_loss=result.global_loss), step)
        result.reduce_time += time.perf_counter() - sent_at
        return result  # type: ignore[return-value]

    def call_off(self, step: int, lost: Dict[int, WorkerLost], chans: List[Channel],
                 heads: list, received: Optional[List[int]]) -> None:
        """Call ``step`` off after losing ``lost``: drop them, tell every
        survivor (StepAborted), read the rest of each survivor's gradient
        frame for the step (``chans`` were sent the step's shards; ``heads``
        and ``received``, where known, say how far each was read), so that
        every connection is between two frames and nothing of the step was
        applied. The survivors' wait for their next shard starts at the
        StepAborted: all of this ends within BOUNDARY_SHARE of the timeout
        after it, and a survivor that cannot finish its frame by then is
        dropped too, as is one lost meanwhile. Raises MembershipChanged;
        with fewer than ``min_workers`` left, once joiners have brought them
        back (waiting up to half of what is left of that share, or
        ``join_timeout`` when shorter), else the first WorkerLost."""
        roster = self.roster
        gone: Dict[int, WorkerLost] = {}
        told: Set[int] = set()
        drained: Set[int] = set()
        fresh = dict(lost)
        while fresh:
            for w, exc in fresh.items():
                gone[w] = exc
                self._drop(w, step, exc, committed=False)
            fresh = {}
            # each StepAborted restarts the survivors' wait, and this with it
            self._boundary = deadline = \
                time.monotonic() + BOUNDARY_SHARE * roster.timeout
            for w in sorted(set(gone) - told):
                told.add(w)
                for chan in roster.channels:
                    try:
                        chan.send(StepAborted(step=step, worker_id=w,
                                              workers=len(roster.channels)), step=step)
                    except WorkerLost as exc:
                        fresh.setdefault(chan.peer_id, exc)
            for chan, head, got in zip(chans, heads, received or [0] * len(chans)):
                if chan.peer_id in gone or chan.peer_id in fresh or chan.peer_id in drained:
                    continue
                try:
                    chan.discard_gradients(head, got, deadline=deadline, step=step)
                    drained.add(chan.peer_id)
                except WorkerLost as exc:
                    fresh[chan.peer_id] = exc
        if len(roster.channels) < self.min_workers and self.late is not None:
            log.warning("step %d: %s left, fewer than min_workers (%d): waiting for workers to "
                        "join", step, counted(len(roster.channels), "worker"), self.min_workers)
            # half of what is left: the other half hands the joiners the state
            left = max(0.0, self._boundary_by() - time.monotonic())
            self.admit(step, min(self.join_timeout, left / 2), self.min_workers)
        if len(roster.channels) < self.min_workers:
            # nobody will send them anything more: closing tells them at once
            for chan in roster.channels:
                chan.close()
            first = next(iter(lost.values()))
            raise first.__class__(
                f"{first.message}; {counted(len(roster.channels), 'worker')} left, fewer "
                f"than min_workers ({self.min_workers})", worker_id=first.worker_id, step=step)
        raise MembershipChanged(sorted(gone), len(roster.channels), step=step,
                                why="; ".join(e.message for e in gone.values()))

    def _drop(self, worker_id: int, step: int, exc: DdpwireError, *, committed: bool) -> None:
        """Take a lost worker out of the session: no more shards, no place
        in any later sum. One that may only be stalled (a stopped process)
        is told it was dropped, and its connection half-closed, so that
        resumed it reads StepAborted naming itself, not a reset."""
        roster = self.roster
        chan = next((c for c in roster.channels if c.peer_id == worker_id), None)
        if chan is None:
            return
        roster.channels = [c for c in roster.channels if c is not chan]
        roster.workers = [i for i in roster.workers if i.worker_id != worker_id]
        assert roster.shards is not None
        roster.shards.drop(worker_id)
        if self.late is not None:
            self.late.release(worker_id)
        event = MembershipEvent(step, worker_id, exc.message, len(roster.channels), committed,
                                name=roster.shards.names[worker_id])
        self.events.append(event)
        log.warning("%s", event.describe(), extra={MEMBERSHIP_RECORD: True})
        try:
            # a heartbeat may be going out: it is short, and a frame of its own
            told = chan.send_last(StepAborted(step=step, worker_id=worker_id,
                                              workers=len(roster.channels)),
                                  lock_wait=1.0, timeout=1.0, what="telling a dropped worker")
        except (DdpwireError, OSError):
            told = False
        if not told:
            chan.close()  # inside a frame, or gone: closing is all it can be told
            return
        self._dropped.append(chan)

    def _send_each(self, msg: object, step: int) -> None:
        """``msg`` to every worker, one connection after another: a worker
        lost meanwhile is dropped and the others still get all of it."""
        roster = self.roster
        parts = encode_frame_parts(msg, max_frame=roster.max_frame)
        lost: Dict[int, WorkerLost] = {}
        for chan in list(roster.channels):
            with chan.send_lock:
                chan.frame_open = True
                try:
                    _core.send_many([chan.conn], parts, roster.timeout, step=step,
                                    what=f"sending {type(msg).__name__}")
                except WorkerLost as exc:
                    lost[chan.peer_id] = exc  # its frame stays open: it is closed
                    continue
                chan.frame_open = False
        for w, exc in lost.items():
            self._drop(w, step, exc, committed=True)
        if len(roster.channels) < self.min_workers:
            raise WorkerLost(f"{counted(len(roster.channels), 'worker')} left after step "
                             f"{step}, fewer than min_workers ({self.min_workers})", step=step)

    # ---- between steps ----

    def wait(self, limit: float, want: int) -> None:
        """wait_for_workers between two steps: admit late joiners (each
        handed the model's state, :meth:`admit`) until ``want`` take part;
        JoinTimeout after ``limit`` seconds."""
        deadline = time.monotonic() + limit
        step = self.next_step
        with self.roster.talking(step):
            while len(self.roster.channels) < want:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise JoinTimeout(f"{len(self.roster.channels)} of {counted(want, 'worker')} "
                                      f"in the session within {limit:g} s")
                self.admit(step, left, want)
                self._check_enough(step)  # a source dropped during a hand-over

    def admit(self, step: int, timeout: float, until: int) -> None:
        """Take in the workers that completed the join since the last step
        (waiting up to ``timeout`` for ``until`` to take part): each receives
        the model's state before ``step`` from a worker in the session
        (:meth:`_hand_state`, by the step boundary's deadline, or within
        BOUNDARY_SHARE of the timeout outside one) and takes part from
        ``step`` on. One that cannot take it is told it was dropped (it may
        join again) and its slot freed; a source that fails is dropped."""
        roster = self.roster
        assert self.late is not None and roster.shards is not None
        self.late.grants[Extension.ELASTIC] = encode_u64(step)
        admitted = self.late.admit_late(timeout, until)
        joining = [(a, roster.open_channel(a)) for a in admitted]
        self._joining = [chan for _, chan in joining]
        try:
            for a, chan in joining:
                deadline = (self._boundary if self._boundary is not None
                            else time.monotonic() + BOUNDARY_SHARE * roster.timeout)
                why = self._hand_state(step, chan, deadline)
                self._joining.remove(chan)
                if why is None:
                    self._take_in(step, a, chan)
                else:
                    self._turn_away(step, a.worker_id, chan, why)
        finally:
            for a, chan in joining:
                if chan in self._joining:  # cut short by an error of the session's
                    chan.reset()
                    self.late.release(a.worker_id)
            self._joining = []

    def _take_in(self, step: int, a: Admitted, chan: Channel) -> None:
        """A joiner that has the model's state takes part from ``step`` on."""
        roster = self.roster
        assert roster.shards is not None
        roster.channels = sorted(roster.channels + [chan], key=lambda c: c.peer_id)
        roster.workers = sorted(roster.workers + [a.info()], key=lambda i: i.worker_id)
        timed = Extension.BALANCE in a.granted
        roster.shards.add(a.worker_id, timed, a.name())
        if timed:
            roster.watch_timing(chan)
        event = MembershipEvent(step, a.worker_id, f"joined from {a.name()}",
                                len(roster.channels), False, joined=True, name=a.name())
        self.events.append(event)
        # a join is the session doing what it is for: no warning
        log.info("%s", event.describe(), extra={MEMBERSHIP_RECORD: True})

    def _turn_away(self, step: int, worker_id: int, chan: Channel, why: str) -> None:
        """A joiner that could not take the model's state: told it was
        dropped (a ``ddpwire worker`` joins again by itself), its slot free."""
        assert self.late is not None
        log.warning("worker %d joined before step %d but could not take the model's state: %s",
                    worker_id, step, why)
        try:
            chan.send_last(StepAborted(step=step, worker_id=worker_id,
                                       workers=len(self.roster.channels)),
                           lock_wait=0.0, timeout=1.0, what="turning a joiner away")
        except (DdpwireError, OSError):
            # inside a frame, or gone: the end is all it can be told, and at
            # once, not after the rest of a state it reads slowly
            chan.reset()
        chan.close()
        self.late.release(worker_id)

    def _hand_state(self, step: int, joiner: Channel, deadline: float) -> Optional[str]:
        """Relay the model's state before ``step`` from a worker in the
        session to ``joiner`` (ddpwire.session.handover), asked of each in turn
        until one has handed all of it, within the first half of the time
        to ``deadline`` (the second half reads out what a failed relay
        leaves). A source must begin answering within a third of the time
        left, and another is asked only while half the relay's time is left
        (a source cut off by the deadline leaves none: the joiner is turned
        away, rather than another source dropped for want of time). A
        source that fails is dropped, and a joiner that had some of its
        pieces is told to start over (StepAborted naming that source).
        Returns None once the joiner has the state, else why not."""
        start = time.monotonic()
        relay_by = start + (deadline - start) / 2
        why = "no worker in the session to take it from"
        sources = list(self.roster.channels)
        for i, source in enumerate(sources):
            now = time.monotonic()
            if i and relay_by - now < (relay_by - start) / 2:
                why += "; no time left to ask another before the step"
                break
            last = i == len(sources) - 1
            out = relay(source, joiner, step, deadline=relay_by, read_out_by=deadline,
                        first_by=relay_by if last else now + (relay_by - now) / 3)
            if out.source_failed is not None:
                self._drop(source.peer_id, step, out.source_failed, committed=True)
            if out.joiner_failed is not None:
                return out.joiner_failed.message
            if out.complete:
                return None
            assert out.source_failed is not None
            why = (f"worker {source.peer_id} could not hand it over "
                   f"({out.source_failed.message})")
            if out.pieces_sent:
                try:
                    joiner.send(StepAborted(step=step, worker_id=source.peer_id,
                                            workers=len(self.roster.channels)),
                                step=step, deadline=relay_by)
                except DdpwireError as exc:
                    return exc.message
        return why

    def _check_enough(self, step: int) -> None:
        """Fewer than ``min_workers`` left (a source dropped during a
        hand-over): the session ends with the WorkerLost as without
        ``elastic``, naming the last worker dropped."""
        roster = self.roster
        if len(roster.channels) >= self.min_workers:
            return
        for chan in roster.channels:
            chan.close()
        last = next((e for e in reversed(self.events) if not e.joined), None)
        raise WorkerLost(f"{counted(len(roster.channels), 'worker')} left before step {step}, "
                         f"fewer than min_workers ({self.min_workers})"
                         + (f"; worker {last.worker_id}: {last.why}" if last else ""),
                         worker_id=None if last is None else last.worker_id, step=step)

    def reap(self) -> None:
        """Read and drop what the dropped workers still send; close those that
        hung up (closing one with bytes unread would reset it before it read
        that it was dropped)."""
        keep = []
        for chan in self._dropped:
            sock = chan.conn.sock
            try:
                while True:
                    data = sock.recv(1 << 16, socket.MSG_DONTWAIT)
                    if not data:
                        break
            except (BlockingIOError, InterruptedError):
                keep.append(chan)
                continue
            except OSError:
                pass
            chan.close()
        self._dropped = keep
