"""Collectives beyond the averaged gradient: the service on the coordinator's
machine and the client every rank talks through.

This is the "collectives" extension of docs/extensions.md. A rank sends one
CollectiveRequest per collective, numbered from 0 in the order it issues
them; the service reads request ``seq`` from every rank, checks that they
agree, computes the answer and sends each rank its CollectiveResult. Any
failure (a rank lost, silent past the timeout, or disagreeing) ends the group:
every rank gets a CollectiveError naming the rank at fault and the
connections close, so nobody waits for an answer that cannot come.

Nothing here imports torch: a machine that only coordinates needs numpy alone.
"""
from __future__ import annotations

import collections
import logging
import re
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import _core
from . import codecs as _codecs
from . import reduce as _reduce
# CollectiveAborted lives with the other errors; it stays importable from here
from ..wire.errors import (
    CollectiveAborted, DdpwireError, NonFiniteGradient, PeerLost, ProtocolError,
    without_frame_progress,
)
from ..wire.extensions import CollectiveKind, DType, ReduceOp
from ..wire.messages import (
    NO_WORKER, CollectiveError, CollectiveRequest, CollectiveResult, Heartbeat,
)

__all__ = [
    "Kind",
    "Op",
    "DType",
    "DEPARTED_TAG",
    "NO_RANK",
    "NUMPY_DTYPES",
    "CollectiveAborted",
    "CollectiveService",
    "CollectiveClient",
    "combine",
    "local_link",
    "relayed_seq",
    "split_relayed_seq",
]

log = logging.getLogger("ddpwire.collectives")

#: CollectiveError.worker_id when no rank is at fault (a rank is a worker id here)
NO_RANK = NO_WORKER

# A rank may compute for as long as it likes between collectives: waits for
# the next message rest on the service's own deadline (first rank + timeout)
# and on heartbeat silence, not on a per-read limit.
_IDLE = 10.0 * 365 * 24 * 3600


def _idle_deadline() -> float:
    return time.monotonic() + _IDLE


# The codes live in the codec (ddpwire.wire.extensions); these are their short names here.
Kind = CollectiveKind
Op = ReduceOp

#: the numpy layout of each wire dtype (bfloat16 as its uint16 bits)
NUMPY_DTYPES: Dict[Any, np.dtype] = {d: d.numpy for d in DType}

_FLOATS = {DType.FLOAT32, DType.FLOAT64, DType.FLOAT16, DType.BFLOAT16}


# ---- arithmetic ----

def _half_mean(inputs: Sequence[np.ndarray], codec: str) -> np.ndarray:
    out = np.empty(len(inputs[0]), dtype=np.uint16)
    try:
        _reduce.mean_half([np.ascontiguousarray(x) for x in inputs], out, codec=codec)
    except NonFiniteGradient:
        pass  # as _float32_mean: the NaN or inf is the caller's answer
    return out


def _float32_sum(inputs: Sequence[np.ndarray]) -> np.ndarray:
    out = np.empty(len(inputs[0]), dtype=np.float32)
    try:
        _reduce.total(inputs, out)
    except NonFiniteGradient:
        pass  # a NaN or inf is the caller's answer, as with gloo; out is complete
    return out


def _float32_mean(inputs: Sequence[np.ndarray]) -> np.ndarray:
    out = np.empty(len(inputs[0]), dtype=np.float32)
    try:
        _reduce.mean(inputs, out)
    except NonFiniteGradient:
        pass
    return out


def _fold(ufunc: Any, inputs: Sequence[np.ndarray]) -> np.ndarray:
    out = np.array(inputs[0], copy=True)
    for src in inputs[1:]:
        ufunc(out, src, out=out)
    return out


_BOOL_UFUNCS = {Op.SUM: np.logical_or, Op.MAX: np.logical_or,
                Op.PRODUCT: np.logical_and, Op.MIN: np.logical_and}
_UFUNCS = {Op.SUM: np.add, Op.PRODUCT: np.multiply, Op.MIN: np.minimum, Op.MAX: np.maximum}


def check_op(op: Op, dtype: DType) -> None:
    """Raise NotImplementedError for a combination no rank can compute."""
    if op is Op.AVG and dtype not in _FLOATS:
        raise NotImplementedError(f"ReduceOp.AVG on {dtype.name.lower()}: only float types average")


def combine(op: Op, dtype: DType, inputs: Sequence[np.ndarray]) -> np.ndarray:
    """Combine equal-length arrays (of ``NUMPY_DTYPES[dtype]``) element-wise,
    in input order, the same bits on every call.

    float32 SUM and AVG run on the compiled kernels (((x0 + x1) + x2) ...,
    AVG a true division by k); float16 and bfloat16 are widened to float32,
    combined as float32 and rounded back once (nearest even); integers wrap.
    bool SUM and MAX are a logical or, PRODUCT and MIN a logical and.
    """
    op, dtype = Op(op), DType(dtype)
    check_op(op, dtype)
    if dtype in (DType.FLOAT16, DType.BFLOAT16):
        codec = _codecs.by_dtype(dtype).half  # type: ignore[union-attr]
        if op is Op.AVG:
            return _half_mean(inputs, codec).view(NUMPY_DTYPES[dtype])
        wide = [_reduce.from_half(np.ascontiguousarray(x), codec=codec) for x in inputs]
        out = combine(op, DType.FLOAT32, wide)
        return _reduce.to_half(out, codec=codec).view(NUMPY_DTYPES[dtype])
    if dtype is DType.FLOAT32 and op is Op.SUM:
        return _float32_sum(inputs)
    if dtype is DType.FLOAT32 and op is Op.AVG:
        return _float32_mean(inputs)
    if op is Op.AVG:
        out = _fold(np.add, inputs)
        out /= len(inputs)
        return out
    if dtype is DType.BOOL:
        return _fold(_BOOL_UFUNCS[op], inputs)
    with np.errstate(over="ignore"):
        return _fold(_UFUNCS[op], inputs)


def _as_array(data: Any, dtype: DType) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8).view(NUMPY_DTYPES[dtype])


def answer(requests: Sequence[Any]) -> List[np.ndarray]:
    """Each rank's result data for one collective, from every rank's request
    (in rank order, already checked to agree)."""
    first = requests[0]
    kind, dtype = Kind(first.kind), DType(first.dtype)
    world = len(requests)
    if kind is Kind.BARRIER:
        return [np.empty(0, dtype=np.uint8)] * world
    if kind is Kind.BROADCAST:
        return [_as_array(requests[first.root].data, dtype)] * world
    if kind is Kind.ALLGATHER:
        gathered = np.concatenate([_as_array(r.data, dtype) for r in requests])
        return [gathered] * world
    inputs = [_as_array(r.data, dtype) for r in requests]
    out = combine(Op(first.op), dtype, inputs)
    if kind is Kind.ALLREDUCE:
        return [out] * world
    chunk = len(out) // world
    return [out[r * chunk:(r + 1) * chunk] for r in range(world)]


def disagreement(requests: Sequence[Any]) -> Optional[Tuple[int, str]]:
    """(rank, what differs) for the first request that does not match rank
    0's, or that no collective could answer; None when all agree."""
    first = requests[0]
    world = len(requests)
    for rank, req in enumerate(requests):
        for field in ("kind", "op", "dtype", "root", "count"):
            mine, theirs = getattr(req, field), getattr(first, field)
            if mine != theirs:
                return rank, f"{field} {mine} where rank 0 has {theirs}"
        try:
            kind, dtype = Kind(req.kind), DType(req.dtype)
            Op(req.op)
        except ValueError:
            return rank, f"unknown kind {req.kind}, op {req.op} or dtype {req.dtype}"
        if kind in (Kind.BROADCAST,) and req.root >= world:
            return rank, f"root {req.root} is not a rank of {world}"
        if kind is Kind.REDUCE_SCATTER and req.count % world:
            return rank, f"count {req.count} does not split over {world} ranks"
        if kind in (Kind.ALLREDUCE, Kind.REDUCE_SCATTER):
            try:
                check_op(Op(req.op), dtype)
            except NotImplementedError as exc:
                return rank, str(exc)
        if len(memoryview(req.data).cast("B")) != req.count * NUMPY_DTYPES[dtype].itemsize:
            return rank, f"{len(memoryview(req.data).cast('B'))} data bytes for count {req.count}"
    return None


# ---- the service (on the coordinator's machine) ----


#: a lost connection's text as the coordinator words it ("worker 0 (node@host)
#: disconnected while ..."): the service speaks of ranks, worker r-1 being rank r
_WORKER_PREFIX = re.compile(r"worker \d+ (?:\((?P<name>[^)]*)\) )?")


#: the tag of the service's notice that a rank has left (no real tag has it)
DEPARTED_TAG = 0xFFFFFFFF


def relayed_seq(src: int, tag: int) -> int:
    """The ``seq`` of a relayed SEND (point to point, ddpwire/plane/p2p.py): the
    source rank in the high 32 bits, the tag in the low 32."""
    return (src << 32) | (tag & 0xFFFFFFFF)


def split_relayed_seq(seq: int) -> Tuple[int, int]:
    """(source rank, tag) of a relayed SEND's ``seq``."""
    return seq >> 32, seq & 0xFFFFFFFF


def rank_gone(rank: int, exc: BaseException) -> str:
    """Why ``rank`` failed the group, in ranks alone: the rank, its node
    where the error names it, and how it was lost (without how far into a
    frame, and without the worker numbering of the session beneath)."""
    text = without_frame_progress(getattr(exc, "message", None) or str(exc))
    found = _WORKER_PREFIX.match(text)
    if found is None:
        return f"rank {rank} is gone: {text}"
    name = found.group("name")
    return f"rank {rank} is gone{f' ({name})' if name else ''}: {text[found.end():]}"

class CollectiveService:
    """Answers collectives for ranks 0..n-1, one Channel each (rank = index).

    One reading thread per rank keeps each socket drained, so a rank that
    sends collective ``k + 1`` while ``k`` is being computed is never blocked,
    and one thread matches, computes and answers. ``timeout`` bounds how long
    a collective waits for its last rank once the first has sent it.
    """

    def __init__(self, channels: Sequence[Any], *, timeout: float) -> None:
        if not channels:
            raise ValueError("a collective service needs at least one rank")
        self._channels = list(channels)
        self.timeout = timeout
        self._cond = threading.Condition()
        self._inbox: List[Deque[Tuple[float, Any]]] = [collections.deque() for _ in channels]
        self._lost: List[Optional[BaseException]] = [None] * len(channels)
        self._stopping = False
        self.failure: Optional[CollectiveAborted] = None
        self.answered = 0
        self._threads: List[threading.Thread] = []
        self._done = threading.Event()
        #: called with (rank, error) from the reading thread when a rank's
        #: connection ends (the shared-memory path's waits watch no socket)
        self.on_lost: Optional[Callable[[int, BaseException], None]] = None

    @property
    def world(self) -> int:
        return len(self._channels)

    def start(self) -> "CollectiveService":
        """Start the reading threads and the answering thread (all daemons)."""
        for rank, chan in enumerate(self._channels):
            t = threading.Thread(target=self._read, args=(rank, chan),
                                 name=f"ddpwire-collectives-read-{rank}", daemon=True)
            t.start()
            self._threads.append(t)
        t = threading.Thread(target=self._serve, name="ddpwire-collectives", daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def _read(self, rank: int, chan: Any) -> None:
        while True:
            try:
                msg = chan.expect([CollectiveRequest], deadline=_idle_deadline())
            except BaseException as exc:  # noqa: BLE001 - any end of the stream is this rank's end
                with self._cond:
                    self._lost[rank] = exc
                    self._cond.notify_all()
                hook = self.on_lost
                if hook is not None:
                    try:
                        hook(rank, exc)
                    except Exception:  # noqa: BLE001 - the service goes on whatever the hook does
                        log.exception("rank %d lost: the hook failed", rank)
                self._departed(rank)
                return
            if msg.kind == int(Kind.SEND):
                # point to point is not a collective: relayed at once, in
                # the order this rank sent, outside the collectives' seq
                if not self._relay(rank, msg):
                    return
                continue
            with self._cond:
                self._inbox[rank].append((time.monotonic(), msg))
                self._cond.notify_all()

    def _relay(self, src: int, req: Any) -> bool:
        """Pass rank ``src``'s SEND on to its destination (``root``) as a
        CollectiveResult whose ``seq`` is :func:`relayed_seq`. A
        destination that is not another rank of the group, or a tag past
        31 bits, fails the group naming ``src``; False then."""
        dst, tag = req.root, req.seq
        bad = None
        if dst >= self.world or dst == src:
            bad = (f"rank {src} sent a point-to-point message to rank {dst}: not another "
                   f"rank of {self.world}")
        elif tag > 0x7FFFFFFF:
            bad = f"rank {src} sent a point-to-point message with tag {tag}: over 31 bits"
        elif req.dtype not in {int(d) for d in DType}:
            bad = f"rank {src} sent a point-to-point message of unknown dtype {req.dtype}"
        elif DType(req.dtype).numpy.itemsize * req.count != len(memoryview(req.data).cast("B")):
            bad = f"rank {src} sent a point-to-point message whose count disagrees with its data"
        if bad is not None:
            with self._cond:
                self._fail(self.answered, src, bad)
            return False
        with self._cond:
            if self._lost[dst] is not None or self._stopping or self.failure is not None:
                return True  # nobody to hand it to: its receives fail when it leaves
        try:
            self._channels[dst].send(CollectiveResult(seq=relayed_seq(src, tag), kind=int(Kind.SEND),
                                                      dtype=req.dtype, count=req.count,
                                                      data=req.data))
        except (DdpwireError, OSError) as exc:
            log.debug("point to point: rank %d's message for rank %d is lost with it: %s",
                      src, dst, exc)
        return True

    def _departed(self, rank: int) -> None:
        """Tell every other rank still here that ``rank`` has left, after its
        last message: its point-to-point receives cannot complete (a relayed
        SEND of no bytes with tag :data:`DEPARTED_TAG`)."""
        with self._cond:
            if self._stopping or self.failure is not None:
                return
            # rank 0 last, as with answers: it shares a process with the service
            others = [r for r in list(range(1, self.world)) + [0]
                      if r != rank and self._lost[r] is None]
        notice = CollectiveResult(seq=relayed_seq(rank, DEPARTED_TAG), kind=int(Kind.SEND),
                                  dtype=int(DType.UINT8), count=0, data=np.empty(0, dtype=np.uint8))
        for r in others:
            try:
                self._channels[r].send(notice)
            except (DdpwireError, OSError):
                pass

    def _next(self, seq: int) -> Optional[List[Any]]:
        """Every rank's request ``seq``, or None once the service fails or stops."""
        with self._cond:
            while True:
                if self._stopping:
                    return None
                missing = [r for r in range(self.world) if not self._inbox[r]]
                if not missing:
                    return [self._inbox[r].popleft()[1] for r in range(self.world)]
                arrived = [self._inbox[r][0][0] for r in range(self.world) if self._inbox[r]]
                gone = [r for r in missing if self._lost[r] is not None]
                if gone and len(gone) == self.world:
                    return None  # everyone left between collectives: the group is over
                if gone and arrived:
                    # a rank that left between collectives fails the group only
                    # once another rank needs it, so leaving at the end is clean
                    r = gone[0]
                    self._fail(seq, r, rank_gone(r, self._lost[r]))
                    return None
                if arrived:
                    left = min(arrived) + self.timeout - time.monotonic()
                    if left <= 0:
                        # "timed out" and " timeout ": the words torch's backends
                        # use, its tests match and users search for
                        self._fail(seq, missing[0], f"timed out: rank {missing[0]} did not send "
                                   f"collective {seq} within the {self.timeout:g} s timeout "
                                   f"(counted from the first rank's)")
                        return None
                    self._cond.wait(min(left, 1.0))
                else:
                    self._cond.wait(1.0)

    def _serve(self) -> None:
        seq = 0
        try:
            while True:
                requests = self._next(seq)
                if requests is None:
                    return
                bad = disagreement(requests)
                if bad is None:
                    for rank, req in enumerate(requests):
                        if req.seq != seq:
                            bad = rank, f"sequence number {req.seq} where {seq} was due"
                            break
                if bad is not None:
                    with self._cond:
                        self._fail(seq, bad[0], f"rank {bad[0]} disagrees: {bad[1]}")
                    return
                try:
                    results = answer(requests)
                except Exception as exc:  # noqa: BLE001 - a bug here must not hang the ranks
                    with self._cond:
                        self._fail(seq, None, f"the service could not compute it: {exc!r}")
                    return
                first = requests[0]
                # Rank 0 last: it shares a process with the service, and must
                # not exit while the others' answers are still unsent.
                for rank in list(range(1, self.world)) + [0]:
                    data = results[rank]
                    try:
                        self._channels[rank].send(CollectiveResult(
                            seq=seq, kind=first.kind, dtype=first.dtype,
                            count=data.size, data=data), step=seq)
                    except (DdpwireError, OSError) as exc:
                        with self._cond:
                            self._fail(seq, rank, rank_gone(rank, exc))
                        return
                self.answered = seq = seq + 1
        finally:
            self._done.set()

    def _fail(self, seq: int, rank: Optional[int], detail: str) -> None:
        """Tell every rank still reachable why the group ends, then close (holds _cond)."""
        if self.failure is not None or self._stopping:
            return
        self.failure = CollectiveAborted(detail, rank=rank, seq=seq)
        log.error("collective %d failed: %s", seq, detail)
        wid = NO_RANK if rank is None else rank
        for r, chan in enumerate(self._channels):
            if r == rank and self._lost[r] is not None:
                continue
            try:
                chan.send(CollectiveError(seq=seq, worker_id=wid, detail=detail), step=seq)
            except (DdpwireError, OSError):
                pass
        for chan in self._channels:
            chan.close()
        self._cond.notify_all()

    def wait_for_ranks_to_leave(self, timeout: float) -> bool:
        """Wait until every rank has closed its connection (so closing ours
        cannot cut an answer short); True when they all did in time."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not all(x is not None for x in self._lost):
                left = deadline - time.monotonic()
                if left <= 0 or self.failure is not None:
                    return False
                self._cond.wait(min(left, 0.5))
        return True

    def stop(self) -> None:
        """Stop answering and close every connection."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for chan in self._channels:
            chan.close()


# ---- the client (every rank) ----

Done = Callable[[Optional[np.ndarray], Optional[BaseException]], None]


class _Local:
    """A collective this rank computes itself (the shared-memory path),
    queued between the service's in issue order."""

    __slots__ = ("run", "done", "finished", "running")

    def __init__(self, run: Callable[[], None], done: Done) -> None:
        self.run = run
        self.done = done
        self.finished = False
        # while it runs, a failure of the group leaves completing it to the
        # sending thread: its buffers are in use until run returns
        self.running = False


class _Send:
    """A point-to-point SEND request queued among the collectives."""

    __slots__ = ("request", "sent", "called")

    def __init__(self, request: Any, sent: Callable[[Optional[BaseException]], None]) -> None:
        self.request = request
        self.sent = sent
        self.called = False


def _sent(entry: _Send, error: Optional[BaseException]) -> None:
    if entry.called:
        return
    entry.called = True
    try:
        entry.sent(error)
    except BaseException:  # noqa: BLE001 - a failing callback must not stop the others
        log.exception("point to point: completing a send failed")


class CollectiveClient:
    """Issues collectives in order over one connection and completes each
    from a receiving thread.

    ``submit`` returns at once: a sending thread writes the requests in
    order while the caller goes on (DDP issues its next bucket), and the
    receiving thread calls each ``done`` with the result data, or with the
    error that ended the group. After an error every later ``submit`` fails
    at once with the same error.

    ``submit_local`` queues a collective computed outside the service (the
    shared-memory allreduce): the sending thread runs it when every earlier
    request is sent, and it completes after every earlier collective, so
    completions keep the issue order whichever path each took.
    """

    def __init__(self, channel: Any, rank: int, world: int) -> None:
        self._chan = channel
        self.rank = rank
        self.world = world
        self._seq = 0
        self._lock = threading.Lock()
        self._pending: Deque[Any] = collections.deque()
        self._outbox: Deque[Any] = collections.deque()
        self._wake = threading.Condition(self._lock)
        # held while completing: the receiving and the sending thread both
        # complete collectives, one after the other, in issue order
        self._completing = threading.RLock()
        self.failure: Optional[BaseException] = None
        #: called once with the error that ends the group (not on close)
        self.on_failure: Optional[Callable[[BaseException], None]] = None
        # takes each point-to-point message the service relays (set_on_message);
        # those that come before it is set wait in _early
        self._on_message: Optional[Callable[[int, int, np.ndarray], None]] = None
        self._early: List[Tuple[int, int, np.ndarray]] = []
        self._closing = False
        self._sender = threading.Thread(target=self._send_loop, daemon=True,
                                        name=f"ddpwire-collectives-send-{rank}")
        self._receiver = threading.Thread(target=self._receive_loop, daemon=True,
                                          name=f"ddpwire-collectives-recv-{rank}")
        self._sender.start()
        self._receiver.start()

    def submit(self, kind: Kind, op: Op, dtype: DType, root: int, data: Any, done: Done,
               *, before_send: Optional[Callable[[], None]] = None,
               into: Optional[np.ndarray] = None) -> int:
        """Queue one collective; returns its sequence number. ``data`` (a
        buffer of ``dtype`` elements) must stay unchanged until ``done``
        runs; ``before_send`` runs on the sending thread first (a device
        copy to wait for). A result of exactly ``into``'s size (writable
        uint8) is received straight into it, and ``done`` gets a view of it;
        ``into`` may be ``data`` itself, since no answer can come before the
        service has every byte of the request."""
        view = memoryview(data).cast("B")
        itemsize = NUMPY_DTYPES[DType(dtype)].itemsize
        if view.nbytes % itemsize:
            raise ValueError(f"{view.nbytes} bytes is not a whole number of {DType(dtype).name}")
        with self._lock:
            if self.failure is not None:
                raise self.failure
            if self._closing:
                raise DdpwireError("the collective client is closed", worker_id=self.rank)
            seq = self._seq
            self._seq += 1
            req = CollectiveRequest(seq=seq, kind=int(kind), op=int(op), dtype=int(dtype),
                                    root=root, count=view.nbytes // itemsize, data=data)
            self._pending.append((seq, int(kind), int(dtype), done, into))
            self._outbox.append((req, before_send))
            self._wake.notify_all()
        return seq

    def set_on_message(self, hook: Callable[[int, int, np.ndarray], None]) -> None:
        """Hand each point-to-point message the service relays to
        ``hook(seq, dtype, data)`` (seq: :func:`relayed_seq`;
        :mod:`ddpwire.plane.p2p`), first those that came before this call, on
        this thread, then the rest from the receiving thread, in order."""
        while True:
            with self._lock:
                early, self._early = self._early, []
                if not early:
                    self._on_message = hook
                    return
            for seq, dtype, data in early:
                hook(seq, dtype, data)

    def submit_send(self, request: Any, sent: Callable[[Optional[BaseException]], None], *,
                    before_send: Optional[Callable[[], None]] = None) -> None:
        """Queue a point-to-point SEND request (kind SEND, ``root`` the
        destination, ``seq`` the tag) in order with the collectives; it
        takes no collective sequence number and gets no answer. ``sent``
        runs once it is written out, or with the error that ended the group."""
        if not hasattr(self._chan, "conn"):
            # in process, the service reads the request after ``sent`` has
            # run: it gets a copy of the bytes, which the caller may reuse
            inner = before_send

            def before_send() -> None:
                if inner is not None:
                    inner()
                request.data = np.array(request.data, copy=True)
        with self._lock:
            if self.failure is not None:
                raise self.failure
            if self._closing:
                raise DdpwireError("the collective client is closed", worker_id=self.rank)
            self._outbox.append((_Send(request, sent), before_send))
            self._wake.notify_all()

    def call(self, kind: Kind, dtype: DType, root: int, data: Any,
             timeout: float) -> np.ndarray:
        """One collective through the service, waited for at most ``timeout``
        seconds: the result's bytes (a copy). For a group's set-up (shared
        memory, the rank links), which every rank runs in the same order."""
        box: dict = {}
        done = threading.Event()

        def finish(result: Optional[np.ndarray], error: Optional[BaseException]) -> None:
            box["result"], box["error"] = result, error
            done.set()

        self.submit(kind, Op.SUM, dtype, root, data, finish)
        if not done.wait(timeout):
            raise CollectiveAborted(f"timed out: the group's set-up got no answer within "
                                    f"{timeout:g} s", rank=None, seq=None)
        if box["error"] is not None:
            raise box["error"]
        return np.array(box["result"], dtype=np.uint8, copy=True)

    def submit_local(self, run: Callable[[], None], done: Done) -> None:
        """Queue a collective this rank computes itself: ``run`` on the
        sending thread once every earlier request is sent (an exception
        from it ends the group), then ``done(None, None)`` once every
        earlier collective has completed."""
        with self._lock:
            if self.failure is not None:
                raise self.failure
            if self._closing:
                raise DdpwireError("the collective client is closed", worker_id=self.rank)
            entry = _Local(run, done)
            self._pending.append(entry)
            self._outbox.append((entry, None))
            self._wake.notify_all()

    def _send_loop(self) -> None:
        while True:
            with self._lock:
                while not self._outbox and not self._closing and self.failure is None:
                    self._wake.wait()
                if self.failure is not None or not self._outbox:
                    return
                req, before_send = self._outbox.popleft()
            try:
                if isinstance(req, _Local):
                    if self._run_local(req):
                        continue
                    return
                if before_send is not None:
                    before_send()
                if isinstance(req, _Send):
                    self._chan.send(req.request)
                    _sent(req, None)
                    continue
                self._chan.send(req, step=req.seq)
            except BaseException as exc:  # noqa: BLE001 - ends the group, reported to every caller
                if isinstance(req, _Send):
                    _sent(req, exc)
                self._end(exc)
                return

    def _run_local(self, entry: _Local) -> bool:
        """Run a local collective on the sending thread; False when the group has ended."""
        with self._lock:
            if self.failure is not None:
                return False
            entry.running = True
        error: Optional[BaseException] = None
        try:
            entry.run()
        except BaseException as exc:  # noqa: BLE001 - ends the group, reported to every caller
            error = exc
        with self._lock:
            entry.running = False
            # _end ran meanwhile and left this one to us
            orphaned = self.failure is not None and entry not in self._pending
            if error is None and not orphaned:
                entry.finished = True
        if error is not None:
            self._end(error)
        if orphaned:
            try:
                entry.done(None, self.failure)
            except BaseException:  # noqa: BLE001
                log.exception("local collective: failing it raised")
        if error is not None or orphaned:
            return False
        self._complete_locals()
        return True

    def _complete_locals(self) -> None:
        """Complete the finished local collectives at the head of the queue."""
        with self._completing:
            while True:
                with self._lock:
                    head = self._pending[0] if self._pending else None
                    if not isinstance(head, _Local) or not head.finished:
                        return
                    self._pending.popleft()
                try:
                    head.done(None, None)
                except BaseException:  # noqa: BLE001 - a failing callback must not stop the others
                    log.exception("local collective: completion failed")

    def _receive_loop(self) -> None:
        streaming = hasattr(self._chan, "conn")  # a socket Channel, not the in-process link
        while True:
            try:
                if streaming:
                    msg = self._read_streaming()
                else:
                    msg = self._chan.expect([CollectiveResult, CollectiveError], deadline=_idle_deadline())
                    if isinstance(msg, CollectiveResult):
                        msg = (msg.seq, msg.kind, msg.dtype,
                               np.frombuffer(msg.data, dtype=np.uint8) if msg.kind == int(Kind.SEND)
                               else msg.data)
            except BaseException as exc:  # noqa: BLE001
                self._end(exc)
                return
            if isinstance(msg, CollectiveError):
                rank = None if msg.worker_id == NO_RANK else msg.worker_id
                self._end(CollectiveAborted(msg.detail, rank=rank, seq=msg.seq))
                return
            seq, kind, dtype, data = msg
            if kind == int(Kind.SEND):
                with self._lock:
                    hook = self._on_message
                    if hook is None:
                        self._early.append((seq, dtype, data))
                        continue
                try:
                    hook(seq, dtype, data)
                except BaseException:  # noqa: BLE001 - a failing callback must not stop the others
                    log.exception("point to point: filing a message failed")
                continue
            with self._completing:
                with self._lock:
                    # A local collective ahead of this one has finished and
                    # been completed before this one's request was sent.
                    entry = self._pending[0] if self._pending else None
                    if isinstance(entry, _Local):
                        entry = None
                    elif entry is not None:
                        self._pending.popleft()
                if entry is None or (entry[0], entry[1], entry[2]) != (seq, kind, dtype):
                    want = "nothing" if entry is None else f"collective {entry[0]}"
                    self._end(ProtocolError(f"result for collective {seq} while {want} was due",
                                            worker_id=self.rank, step=seq))
                    return
                try:
                    entry[3](_as_array(data, DType(dtype)), None)
                except BaseException:  # noqa: BLE001 - a failing callback must not stop the others
                    log.exception("collective %d: completion failed", seq)
            self._complete_locals()

    def _read_streaming(self) -> Any:
        """The next result as (seq, kind, dtype, data), its data received
        straight into the waiting collective's ``into`` when it fits, or a
        CollectiveError."""
        chan = self._chan
        allowed = (CollectiveResult, CollectiveError, Heartbeat)
        deadline = _idle_deadline()
        while True:
            head = _core.read_frame_head(chan.conn, chan.read_timeout, chan.max_frame,
                                        deadline=deadline, expect=allowed, collective_heads=True,
                                        what="waiting for CollectiveResult")
            if not isinstance(head, Heartbeat):
                break
        if isinstance(head, CollectiveError):
            return head
        with self._lock:
            first = self._pending[0] if self._pending else None
            into = first[4] if first is not None and not isinstance(first, _Local) else None
        if head.kind == int(Kind.SEND):
            into = None  # a relayed message: its own buffer, handed to the mailbox
        if into is None or into.nbytes != head.bulk_len:
            into = np.empty(head.bulk_len, dtype=np.uint8)
        if head.bulk_len:
            chan.conn.recv_into(into, chan.read_timeout, step=head.seq,
                                what="receiving CollectiveResult.data")
        return head.seq, head.kind, head.dtype, into

    def _end(self, exc: BaseException) -> None:
        with self._lock:
            if self._closing and self.failure is None and not self._pending:
                return  # our own close
            first = self.failure is None
            if first:
                if isinstance(exc, PeerLost) and not isinstance(exc, CollectiveAborted):
                    head = self._pending[0] if self._pending else None
                    exc = CollectiveAborted(f"the coordinator (rank 0) is gone: {exc}", rank=0,
                                            seq=head[0] if isinstance(head, tuple) else None)
                self.failure = exc
            failure = self.failure
            pending = [e for e in self._pending if not (isinstance(e, _Local) and e.running)]
            self._pending.clear()
            sends = [e for e, _ in self._outbox if isinstance(e, _Send)]
            self._wake.notify_all()
        for entry in sends:
            _sent(entry, failure)
        hook = self.on_failure
        if first and hook is not None:
            try:
                hook(failure)
            except Exception:  # noqa: BLE001 - failing the collectives matters more
                log.exception("the failure hook failed")
        self._chan.close()
        for entry in pending:
            done, what = (entry.done, "local") if isinstance(entry, _Local) else (entry[3], entry[0])
            try:
                done(None, failure)
            except BaseException:  # noqa: BLE001
                log.exception("collective %s: failing it raised", what)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then close the connection, and wait (at most
        ``timeout`` each) for both threads to end: none may still be
        completing a collective when the program exits."""
        with self._lock:
            self._closing = True
            self._wake.notify_all()
        self._sender.join(timeout)
        self._chan.close()
        if threading.current_thread() is not self._receiver:
            self._receiver.join(timeout)


# ---- the rank that shares a process with the service ----

class _LocalEnd:
    """One end of an in-process link: the Channel calls the service and the
    client make, on message objects, with no bytes and no copies."""

    def __init__(self, inbox: "collections.deque", peer: Optional["_LocalEnd"], lost: type,
                 cond: threading.Condition, name: str) -> None:
        self._inbox = inbox
        self.peer = peer
        self._lost = lost
        self._cond = cond
        self.closed = False
        self.name = name

    def send(self, msg: Any, *, step: Optional[int] = None) -> None:
        with self._cond:
            if self.closed or self.peer is None or self.peer.closed:
                raise self._lost(f"{self.name}: the in-process peer has left", worker_id=0, step=step)
            self.peer._inbox.append(msg)
            self._cond.notify_all()

    def expect(self, expected: Sequence[type], *, step: Optional[int] = None,
               deadline: Optional[float] = None) -> Any:
        with self._cond:
            while not self._inbox:
                if self.closed or (self.peer is not None and self.peer.closed):
                    raise self._lost(f"{self.name}: the in-process peer has left", worker_id=0, step=step)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise self._lost(f"{self.name}: nothing within the deadline", worker_id=0, step=step)
                self._cond.wait(None if left is None else min(left, 3600.0))
            msg = self._inbox.popleft()
        if not isinstance(msg, tuple(expected)):
            raise ProtocolError(f"{self.name}: {type(msg).__name__} where "
                                f"{' or '.join(t.__name__ for t in expected)} was due", step=step)
        return msg

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


def local_link() -> Tuple[Any, Any]:
    """(service end, client end) of an in-process link for rank 0, so the
    rank hosting the service hands it its data without a socket: on
    loopback that halves the bytes the hosting process moves."""
    from ..wire.errors import CoordinatorLost, WorkerLost

    cond = threading.Condition()
    service_end = _LocalEnd(collections.deque(), None, WorkerLost, cond, "rank 0 (in process)")
    client_end = _LocalEnd(collections.deque(), service_end, CoordinatorLost, cond, "the service (in process)")
    service_end.peer = client_end
    return service_end, client_end
