"""The star: every worker's gradient averaged by the coordinator as it streams in.

The protocol's own averaging (protocol.md, "Session semantics"), for every
message kind (flat, per-block, non-block): the heads are read and checked
first, then the elements are summed straight out of the sockets through a
ring (:func:`ddpwire._core.allreduce_stream`), and with a reply each
element range goes back out as soon as every worker's part of it is in, so
memory stays at about one vector whatever the number of workers.
"""
from __future__ import annotations

import select
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np

from .. import _core
from ..plane import incast as _incast
from ..plane import socket_threads as _socket_threads
from .._core import encode_frame_parts
from .admission import Admitted
from ..wire.channel import message_name, result_buffer
from ..wire.errors import GradientMismatch, NonFiniteGradient, UnexpectedMessage, WorkerLost
from .launch import is_loopback
from ..wire.messages import (
    AveragedBlockGradient,
    AveragedGradient,
    AveragedNonBlockGradient,
    BlockGradientPayload,
    CollectiveError,
    GradientPayload,
    NO_WORKER,
    NonBlockGradientPayload,
)
from .results import BlockReduceResult, NonBlockReduceResult, ReduceResult
from .roster import Roster, log

__all__ = ["Kind", "FLAT", "BLOCK", "NON_BLOCK", "Star", "limit_receive"]

AnyResult = Union[ReduceResult, BlockReduceResult, NonBlockReduceResult]


@dataclass(frozen=True)
class Kind:
    """One kind of gradient message the coordinator averages: what it
    receives, what identifies one vector of it within a step (None, the
    block index or the component) and what it answers."""

    payload: type
    key: Optional[str]
    reply: type


FLAT = Kind(GradientPayload, None, AveragedGradient)
BLOCK = Kind(BlockGradientPayload, "block_idx", AveragedBlockGradient)
NON_BLOCK = Kind(NonBlockGradientPayload, "component", AveragedNonBlockGradient)


def limit_receive(admitted: Sequence[Admitted], setting: Union[str, int, None],
                  mesh: bool) -> None:
    """Each worker connection's receive window (the coordinator's
    ``receive_window``): under the star every worker streams into this
    coordinator's link at once (:mod:`ddpwire.plane.incast`)."""
    if setting is None:
        return
    for a in admitted:
        if setting != "auto":
            window: Optional[int] = setting  # type: ignore[assignment]
        elif mesh or is_loopback(a.address[0]):
            continue  # no N-to-1 stream here, or no link to share
        else:
            window = _incast.receive_window(_incast.round_trip(a.sock), len(admitted))
        if window is not None:
            _incast.limit_receive(a.sock, window)
            log.info("worker %d: receive window %d bytes", a.worker_id, window)


def halting(worker_id: int, index: int, value: float, step: int) -> NonFiniteGradient:
    """The error a step halts on, for the first non-finite element a worker
    sent (logged here, once, whichever engine found it)."""
    log.error("worker %d sent a non-finite gradient at step %d: halting", worker_id, step)
    return NonFiniteGradient(worker_id, index, value, worker_id=worker_id, step=step)


class Star:
    """The star's average over ``roster``'s workers, through a ring of
    ``ring_bytes`` per worker; ``socket_threads`` as the coordinator's."""

    def __init__(self, roster: Roster, ring_bytes: int, socket_threads: Optional[bool]):
        self.roster = roster
        self.ring_bytes = ring_bytes
        self.socket_threads = socket_threads

    def average(self, kind: Kind, step: Optional[int], key: Optional[int],
                out: Optional[np.ndarray], reply: bool) -> AnyResult:
        """One step's vector of ``kind``: averaged, and with ``reply`` the
        average streamed back while it is computed."""
        # a vector named by the caller keeps its length from step to step;
        # one the workers choose (step or key None) may change it
        pinned = step is not None and (kind.key is None or key is not None)
        with self.roster.talking(step):
            return self.stream(kind, step, key, out, reply, pinned=pinned)[0]

    def stream(self, kind: Kind, step: Optional[int], key: Optional[int],
               out: Optional[np.ndarray], reply: bool, *, pinned: bool, halt: bool = True,
               heads_into: Optional[list] = None,
               socket_threads: Optional[bool] = None) -> Tuple[AnyResult, Optional[list]]:
        """The streaming average. With ``halt`` a non-finite element raises
        (the replies cut short); without, the reply is finished all the same
        and the result comes with ``bad`` (each worker's first non-finite
        (index, value), or None when every element was finite). Without
        ``halt`` (a mesh step's part) a worker may send a CollectiveError in
        place of its payload: the WorkerLost it names. ``heads_into``
        receives the heads as they are read (see :meth:`collect_heads`);
        ``socket_threads`` overrides the choice of engine."""
        roster = self.roster
        t0 = time.perf_counter()
        heads, step, key = self.collect_heads(kind, step, key, pinned, failures=not halt,
                                              into=heads_into)
        t1 = time.perf_counter()
        out = result_buffer(out, heads[0].gradient_count)
        done: List[AnyResult] = []

        def finish(tails: List[bytes]) -> AnyResult:
            decoded = [_core.decode_tail(kind.payload.TAG, t) for t in tails]
            if kind is FLAT:
                self.check_totals(step, [t[2] for t in decoded])
            result = self.result(kind, step, key, heads, out, decoded, t1 - t0)
            done.append(result)
            return result

        conns = [chan.conn for chan in roster.channels]
        threads = self._use_socket_threads(heads) if socket_threads is None else socket_threads
        # the sample weights of the workers that do not apply their own
        scales = roster.shards.sums_scales() if roster.shards is not None and \
            roster.shards.step == step else None
        what = f"averaging {kind.payload.__name__}"
        if not reply:
            tails, bad = _core.reduce_stream(conns, out, heads[0].tail_len, roster.timeout,
                                             ring_bytes=self.ring_bytes, socket_threads=threads,
                                             step=step, what=what, scales=scales)
            self._raise_bad(bad, step)
            finish(tails)
        else:
            sizes = heads[0].component_sizes
            head = encode_frame_parts(self.reply(kind, step, key, out, 0.0, sizes),
                                      max_frame=roster.max_frame)[0]

            def make_tail(tails: List[bytes]) -> bytes:
                # every worker's tail is in: the result is complete, and for a
                # flat step its global_loss ends the reply
                result = finish(tails)
                loss = getattr(result, "global_loss", 0.0)
                return encode_frame_parts(self.reply(kind, step, key, out, loss, sizes),
                                          max_frame=roster.max_frame)[2]

            # Cut short by anything, it leaves some workers holding part of a
            # reply that will never be finished: the session is over, and
            # closing is the only way to tell them at once.
            with roster.sending_to_all(), roster.talking(step, any_error=True):
                _, bad = _core.allreduce_stream(
                    conns, out, heads[0].tail_len, head, make_tail, roster.timeout,
                    ring_bytes=self.ring_bytes, socket_threads=threads, step=step,
                    what=f"{what} into {kind.reply.__name__}", halt_on_nonfinite=halt,
                    scales=scales)
                if halt:
                    self._raise_bad(bad, step)
        if pinned:
            roster.lengths.setdefault((kind, key), len(out))
        result = done[0]
        result.reduce_time = time.perf_counter() - t1
        return result, bad

    def collect_heads(self, kind: Kind, step: Optional[int], key: Optional[int],
                      pinned: bool = True, failures: bool = False,
                      into: Optional[list] = None
                      ) -> Tuple[List["_core.FrameHead"], int, Optional[int]]:
        """Every worker's frame head, in worker order, checked; the elements
        stay in the sockets for the streaming reduce. The heads of one step
        are due within one timeout: a worker's heartbeats do not extend it.
        A step or key of None is worker 0's. Returns (heads, step, key);
        the heads go into ``into`` as they are read, when given (so a caller
        sees which were read when one fails)."""
        roster = self.roster
        deadline = time.monotonic() + roster.timeout
        if roster.shards is not None and roster.shards.step == step and \
                (roster.shards.balance or roster.shards.untimed()):
            self._time_arrivals(step, deadline)  # type: ignore[arg-type]
        heads = [] if into is None else into
        for chan in roster.channels:
            wid = chan.peer_id
            head = chan.read_head([kind.payload, CollectiveError] if failures else [kind.payload],
                                  step=step, deadline=deadline,
                                  what=f"waiting for {kind.payload.__name__}")
            if isinstance(head, CollectiveError):
                # a mesh worker that could not start its part of the step
                raise WorkerLost(f"worker {wid} could not start its part of the mesh step: "
                                 f"{head.detail}",
                                 worker_id=wid if head.worker_id == NO_WORKER else head.worker_id,
                                 step=step)
            if not isinstance(head, _core.FrameHead):
                raise UnexpectedMessage(kind.payload.__name__, message_name(head),
                                        worker_id=wid, step=step)
            if not heads:
                step = head.step if step is None else step
                if kind.key is not None and key is None:
                    key = getattr(head, kind.key)
            if head.step != step:
                raise GradientMismatch("step", step, head.step, worker_id=wid, step=step)
            if head.worker_id != wid:
                raise GradientMismatch("worker_id", wid, head.worker_id, worker_id=wid, step=step)
            if kind.key is not None and getattr(head, kind.key) != key:
                raise GradientMismatch(kind.key, key, getattr(head, kind.key), worker_id=wid,
                                       step=step)
            if kind is BLOCK:
                total = int(head.component_sizes.sum(dtype=np.uint64))
                if total != head.gradient_count:
                    raise GradientMismatch("sum of component_sizes", head.gradient_count, total,
                                           worker_id=wid, step=step)
                if heads and not np.array_equal(head.component_sizes, heads[0].component_sizes):
                    raise GradientMismatch("component_sizes", list(heads[0].component_sizes),
                                           list(head.component_sizes), worker_id=wid, step=step)
            heads.append(head)
        what = "gradients length" if kind.key is None else \
            f"{kind.key.replace('_idx', '')} {key} gradients length"
        want = roster.lengths.get((kind, key), heads[0].gradient_count) if pinned \
            else heads[0].gradient_count
        for chan, head in zip(roster.channels, heads):
            if head.gradient_count != want:
                raise GradientMismatch(what, want, head.gradient_count, worker_id=chan.peer_id,
                                       step=step)
        return heads, step, key  # type: ignore[return-value]

    def _time_arrivals(self, step: int, deadline: float) -> None:
        """When each worker's part of the step starts to come in, watched
        for all of them at once (the reads after take them in worker
        order). A worker that reports no compute time (a reference worker)
        sends nothing between its ShardAssignment and its gradient, so that
        moment also ends its compute; a timed worker's StepTiming comes
        first. One that is late, or closed, is left to the reads after."""
        shards = self.roster.shards
        assert shards is not None
        untimed = set(shards.untimed())
        poller = select.poll()
        waiting = {}

        def arrived(w: int) -> None:
            if w in untimed:
                shards.observe(w, step, None, time.perf_counter())
            else:
                shards.arrived(w, time.perf_counter())

        for w in shards.active:
            chan = self.roster.channel(w)
            if chan.conn.held():  # its part is in, opened from a sealed record
                arrived(w)
                continue
            waiting[chan.conn.fileno()] = w
            poller.register(chan.conn.fileno(), select.POLLIN)
            if chan.heartbeat_timeout is not None:
                # with heartbeats, a silent worker is the reads' to name
                # after heartbeat_timeout: this watch must not outwait them
                deadline = min(deadline, time.monotonic() + chan.heartbeat_timeout)
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            for fd, _ in poller.poll(max(1, int(left * 1000))):
                poller.unregister(fd)
                arrived(waiting.pop(fd))

    def check_totals(self, step: int, totals: List[int]) -> None:
        """Unequal shards: every count must match its worker's shard."""
        shards = self.roster.shards
        assert shards is not None
        wrong = shards.check_totals(totals)
        if wrong is not None:
            w, want, got = wrong
            raise GradientMismatch(f"total (for a shard of {shards.split[w]} samples)",
                                   want, got, worker_id=w, step=step)

    def _raise_bad(self, bad: Optional[list], step: int) -> None:
        if bad is None:
            return
        for chan, (index, value) in zip(self.roster.channels, bad):
            wid = chan.peer_id
            if index >= 0:
                raise halting(wid, index, value, step)

    def _use_socket_threads(self, heads: list) -> bool:
        """Whether the vectors these heads announce stream on threads."""
        return _socket_threads.for_coordinator(self.socket_threads, len(self.roster.channels),
                                               4 * heads[0].gradient_count)

    @staticmethod
    def reply(kind: Kind, step: int, key: Optional[int], out: np.ndarray, global_loss: float,
              component_sizes: Optional[Sequence[int]]) -> object:
        """The averaged message for ``out`` (only the flat one has a tail;
        a block's carries worker 0's ``component_sizes``)."""
        if kind is FLAT:
            return AveragedGradient(step=step, gradients=out, global_loss=global_loss)
        if kind is BLOCK:
            return AveragedBlockGradient(step=step, block_idx=key,
                                         component_sizes=component_sizes, gradients=out)
        return AveragedNonBlockGradient(step=step, component=key, gradients=out)

    def broadcast(self, kind: Kind, step: int, result: AnyResult) -> None:
        """Send every worker the same reply to the ``result`` a collect
        without reply kept (the reference's broadcast after collect_and_reduce)."""
        key = None if kind.key is None else getattr(result, kind.key)
        msg = self.reply(kind, step, key, result.avg_gradients,
                         getattr(result, "global_loss", 0.0),
                         getattr(result, "component_sizes", None))
        with self.roster.talking(step):
            self.roster.broadcast(msg, step)

    @staticmethod
    def result(kind: Kind, step: int, key: Optional[int], heads: list, avg: np.ndarray,
               tails: list, wait_time: float) -> AnyResult:
        """The step's result from its heads and decoded tails."""
        if kind is BLOCK:
            return BlockReduceResult(step=step, block_idx=key, avg_gradients=avg,
                                     component_sizes=heads[0].component_sizes, reduce_time=0.0,
                                     wait_time=wait_time)
        if kind is NON_BLOCK:
            return NonBlockReduceResult(step=step, component=key, avg_gradients=avg,
                                        reduce_time=0.0, wait_time=wait_time)
        losses = np.array([t[0] for t in tails], dtype=np.float32)
        totals = [t[2] for t in tails]
        total_samples = sum(totals)
        # float32 in worker order, as the reference computes it
        weighted = np.float32(0.0)
        for loss, total in zip(losses, totals):
            weighted = np.float32(weighted + loss * np.float32(total))
        global_loss = float(weighted / np.float32(total_samples)) if total_samples else 0.0
        return ReduceResult(step=step, avg_gradients=avg, global_loss=global_loss,
                            total_correct=sum(t[1] for t in tails), total_samples=total_samples,
                            reduce_time=0.0, wait_time=wait_time,
                            worker_losses=[float(x) for x in losses])
