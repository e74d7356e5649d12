"""The ``"ddpwire"`` torch.distributed backend.

It is registered for cpu, cuda and mps by ``import torch`` (torch >= 2.5
loads the ``torch.backends`` entry point, _ddpwire_autoload) or by
``import ddpwire.torch``. After that, ``dist.init_process_group("ddpwire")``
works wherever ``"gloo"`` would (torchrun's environment,
``init_method="tcp://…"``, ``rank=``, ``world_size=``, ``timeout=``).
Collectives travel as the collectives extension to a coordinator hosted by
rank 0; each returns a Work at once and completes from the transport's
thread, so DDP overlaps its buckets with backward.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook

import _ddpwire_autoload as _autoload

from ..plane import codecs as _codecs
from ..plane import p2p as _p2p
from ..plane import shm as _shm
from ..plane.collectives import CollectiveAborted, DType, Kind, Op, check_op
from .composed import (
    addressed_to, check_count, check_nonempty, check_root, check_sizes, copy_into, flatten,
    rank_major, rank_major_pieces, rooted_list, split_counts, split_mismatch, unflatten_into,
)
from ..plane.rank_links import RankLinks, form_links, ports_from_env
from .rendezvous import Rendezvous, join_group, timings
from .sparse import sparse_sum
from .staging import Staging

__all__ = ["BACKEND", "DdpwireProcessGroup", "DdpwireWork", "PeerWork", "register"]

BACKEND = _autoload.BACKEND

#: largest piece of an allreduce or broadcast in one CollectiveRequest
PIECE_BYTES = 8 << 20

#: smallest float32 SUM/AVG allreduce that goes through shared memory when
#: the group has it: any with an element (even a scalar's two barriers
#: answer in about half the service's round trip, bench/results/notebook.md
#: "Small allreduces on one host"); everything else goes through the service
SHM_MIN_BYTES = int(os.environ.get("DDPWIRE_SHM_MIN_BYTES") or 4)
#: smallest float32 SUM/AVG allreduce that goes on the rank links when the
#: group has them (DDP's buckets): below it the service answers as fast
LINKS_MIN_BYTES = int(os.environ.get("DDPWIRE_LINKS_MIN_BYTES") or 64 << 10)

_DTYPES = {
    torch.float32: DType.FLOAT32,
    torch.float64: DType.FLOAT64,
    torch.float16: DType.FLOAT16,
    torch.bfloat16: DType.BFLOAT16,
    torch.int32: DType.INT32,
    torch.int64: DType.INT64,
    torch.uint8: DType.UINT8,
    torch.int8: DType.INT8,
    torch.bool: DType.BOOL,
}

_OPS = {
    dist.ReduceOp.SUM: Op.SUM,
    dist.ReduceOp.AVG: Op.AVG,
    dist.ReduceOp.MIN: Op.MIN,
    dist.ReduceOp.MAX: Op.MAX,
    dist.ReduceOp.PRODUCT: Op.PRODUCT,
}


def _dtype_of(tensors: Sequence[torch.Tensor], what: str) -> DType:
    sparse = next((t.layout for t in tensors if t.layout != torch.strided), None)
    if sparse is not None:
        # gloo's only sparse op is the sum of COO tensors (allreduce, as here)
        raise NotImplementedError(f"ddpwire {what}: {sparse} tensors are not supported (dense, "
                                  f"and sparse COO in allreduce SUM): pass t.to_dense()")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise TypeError(f"ddpwire {what}: tensors of several dtypes {sorted(map(str, dtypes))}")
    dtype = dtypes.pop()
    if dtype not in _DTYPES:
        raise NotImplementedError(f"ddpwire {what}: dtype {dtype} is not supported "
                                  f"(supported: {', '.join(str(d) for d in _DTYPES)})")
    return _DTYPES[dtype]


def _op_of(reduce_op: Any, what: str) -> Op:
    for known, op in _OPS.items():
        if reduce_op == known:
            return op
    raise NotImplementedError(f"ddpwire {what}: reduce op {reduce_op} is not supported "
                              "(SUM, AVG, MIN, MAX, PRODUCT)")


def _reduce_op(opts: Any, dtype: DType, what: str) -> Op:
    """The reduce op of ``opts`` (default SUM), refused by name where it
    cannot apply to ``dtype``."""
    op = _op_of(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, what)
    check_op(op, dtype)
    return op


def _root(opts: Any) -> int:
    return opts.rootRank if opts is not None else 0


def _one(tensors: Sequence[Any], what: str) -> Any:
    if len(tensors) != 1:
        raise NotImplementedError(f"ddpwire {what}: one tensor per call, got {len(tensors)}")
    return tensors[0]


class DdpwireWork(dist._Work):
    """A collective in flight; ``wait`` raises the typed error that ended the
    group (CollectiveAborted naming the rank) if it failed.

    Its future is never failed: torch 2.13's DDP crashes the process
    (SIGSEGV) when a bucket's future completes with an exception during
    backward. A failed collective whose future was taken (DDP takes them)
    completes it with the tensors unchanged, whatever else fails, and the
    main thread gets the error at its next optimizer step or forward
    (:class:`_Pending`), before any weights change.
    """

    def __init__(self, future: torch.futures.Future, limit: float, seq: int, what: str,
                 on_error: Callable[[BaseException], None],
                 deliver: Optional[Callable[[], None]] = None) -> None:
        super().__init__()
        # writes a composed op's result into the caller's tensors, on success
        # only and before the work completes (its future hands them on)
        self._deliver = deliver
        self._future = future
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._limit = limit
        self._future_taken = False
        self._on_error = on_error
        self.seq = seq
        self.what = what

    def _finish(self, value: Any, error: Optional[BaseException]) -> None:
        if error is None and self._deliver is not None:
            try:
                self._deliver()
            except BaseException as exc:  # noqa: BLE001 - the caller sees it from wait()
                error = exc
        self._error = error
        try:
            if error is not None and self._future_taken:
                self._on_error(error)
        finally:
            self._complete(value)

    def _complete(self, value: Any) -> None:
        # The future's callbacks run inside set_result, in torch's C++, on a
        # daemon thread of ours. wait() returns only once they have: a
        # program that waits and exits must not leave that thread in C++
        # while the interpreter finalises (the thread is then ended by
        # pthread_exit, whose unwinding through C++ aborts the process:
        # "terminate called without an active exception").
        try:
            self._future.set_result(value)
        finally:
            self._done.set()

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        """Block until done (at most ``timeout``, default the group's):
        True, or the collective's error raised; CollectiveAborted when no
        answer came in time."""
        limit = self._limit
        if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
            limit = timeout.total_seconds()
        if not self._done.wait(limit):
            raise CollectiveAborted(f"timed out: {self.what} got no answer within the "
                                    f"{limit:g} s timeout of its wait",
                                    rank=None, seq=self.seq)
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """Whether the collective ended (either way)."""
        return self._done.is_set()

    def is_success(self) -> bool:
        """Whether it ended without an error."""
        return self._done.is_set() and self._error is None

    def exception(self) -> Optional[BaseException]:
        """Its error (None while running or after a success)."""
        return self._error

    def get_future(self) -> torch.futures.Future:
        """A future holding the outputs once done (DDP's comm hooks chain on it)."""
        self._future_taken = True
        return self._future


class PeerWork(DdpwireWork):
    """A send or receive in flight (:mod:`ddpwire.plane.p2p`). ``wait`` raises
    :class:`ddpwire.plane.p2p.PointToPointTimeout` ("timed out") past the group's
    timeout, or the error that ended it: CollectiveAborted naming a rank
    that left, PointToPointMismatch for a message of another size. Its
    future (gloo's send/recv works have none) holds the tensors, or fails
    with that error: no DDP bucket waits on it, unlike a collective's.
    ``_source_rank()`` is the rank a receive's message came from."""

    def __init__(self, limit: float, what: str, *, src: Optional[int], dst: int,
                 tag: int) -> None:
        super().__init__(torch.futures.Future(), limit, -1, what, _ignore)
        self._source: int = -1 if src is None else src
        self._peers = (src, dst, tag)

    def _complete(self, value: Any) -> None:
        try:
            if self._error is not None:
                self._future.set_exception(self._error)
            else:
                self._future.set_result(value)
        finally:
            self._done.set()

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        """Block until done (at most ``timeout``, default the group's):
        True, or the error raised; PointToPointTimeout when it is not done
        in time (a receive stays posted)."""
        limit = self._limit
        if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
            limit = timeout.total_seconds()
        if not self._done.wait(limit):
            src, dst, tag = self._peers
            raise _p2p.PointToPointTimeout(f"timed out: {self.what} not done within the "
                                           f"{limit:g} s timeout of its wait", src=src, dst=dst,
                                           tag=tag)
        if self._error is not None:
            raise self._error
        return True

    def _source_rank(self) -> int:
        """The rank the received message came from (-1 before it came)."""
        return self._source

    def source_rank(self) -> int:
        """:meth:`_source_rank`."""
        return self._source


def _ignore(_error: BaseException) -> None:
    return None


class _Pending:
    """A failure the main thread has yet to see, raised where Python is in
    charge and before any weights change: at the next optimizer step
    (torch.optim's global step pre-hook) or the next module forward,
    whichever the script reaches first; a collective called meanwhile
    raises it itself.

    Never inside backward: an exception raised there (DDP's reducer runs
    the buckets' Python from torch's C++) comes out of ``backward()`` as a
    RuntimeError ("Cannot extract tensors from value: ..."), and
    ``except CollectiveAborted`` would not match it. The hooks are
    registered only once a group has failed, so a run that does not fail
    pays nothing."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._error: Optional[BaseException] = None
        self._owner: Optional[object] = None  # the group that failed
        self._handles: List[Any] = []

    def arm(self, error: BaseException, owner: object) -> None:
        """Raise ``error`` (``owner``'s failure) at the main thread's next
        optimizer step or forward."""
        with self._lock:
            if self._error is not None:
                return  # the first failure is the cause
            self._error, self._owner = error, owner
            self._handles = [register_optimizer_step_pre_hook(self._fire),
                             register_module_forward_pre_hook(self._fire)]

    def disarm(self, owner: object) -> None:
        """Forget ``owner``'s failure not yet raised: a group closed (or
        destroyed) does not fail the work that comes after it."""
        self._take(owner)

    def _fire(self, *_args: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # another thread's model: the main thread is told
        error = self._take(None)
        if error is not None:
            raise error.again() if isinstance(error, CollectiveAborted) else error

    def _take(self, owner: Optional[object]) -> Optional[BaseException]:
        """The failure armed (``owner``'s only, where one is named), with
        its hooks removed; None when there is none to take."""
        with self._lock:
            if owner is not None and self._owner is not owner:
                return None
            error, self._error, self._owner = self._error, None, None
            handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        return error


_pending = _Pending()

_log = logging.getLogger(__name__)
_carrier_missing = False  # said once per process where torch lacks what a carrier needs


def _carrier(rank: int, world_size: int) -> Optional[Any]:
    """A c10d backend that only carries a group's name: torch 2.13 builds
    no ProcessGroup around a creator that returns one itself, and names a
    group (``group_name``, ``_register_process_group``, what
    ``destroy_process_group`` unregisters) through the backends registered
    beneath it, of which ours would have none. The carrier is torch's
    FakeProcessGroup made to raise on every collective: our collectives
    are the Python methods of :class:`DdpwireProcessGroup`, and one that
    somehow reached the carrier fails rather than silently succeeds. None
    (said once) where this torch has no such backend."""
    global _carrier_missing
    try:
        fake = torch._C._distributed_c10d.FakeProcessGroup
        opts = fake.Options()
        opts.error_on_collective = True  # no carrier that would return untouched tensors
        return fake._create_internal(rank, world_size, opts)
    except (AttributeError, TypeError, RuntimeError) as exc:
        if not _carrier_missing:
            _carrier_missing = True
            _log.warning("ddpwire: this torch has no FakeProcessGroup(error_on_collective) to "
                         "carry a group's name (%s): group_name, destroy_process_group(group) "
                         "and the lookups by name fail on ddpwire groups", exc)
        return None


def _carry(pg: dist.ProcessGroup, rank: int, world_size: int) -> None:
    """Register a :func:`_carrier` beneath ``pg`` for every device the
    backend takes, as torch registers a backend beneath the ProcessGroup it
    builds for gloo or nccl; torch's ``_set_group_name`` then has a backend
    to name."""
    global _carrier_missing
    carrier = _carrier(rank, world_size)
    if carrier is None:
        return
    try:
        custom = dist.ProcessGroup.BackendType.CUSTOM
        for device in _autoload.DEVICES:
            pg._register_backend(torch.device(device), custom, carrier)
        pg._set_default_backend(custom)
    except (AttributeError, TypeError, RuntimeError) as exc:
        if not _carrier_missing:
            _carrier_missing = True
            _log.warning("ddpwire: could not register a name carrier beneath the group (%s): "
                         "group_name and destroy_process_group(group) fail on ddpwire groups",
                         exc)


class DdpwireProcessGroup(dist.ProcessGroup):
    """A process group whose collectives go through a ddpwire coordinator.

    Built by ``init_process_group("ddpwire")`` (or directly, given a store
    every rank shares). Supports allreduce (SUM, AVG, MIN, MAX, PRODUCT),
    broadcast, allgather (also into one tensor), reduce_scatter and barrier,
    and composed from them with gloo's semantics reduce, gather, scatter,
    all_to_all (also single, with split sizes) and the coalesced allreduce,
    allgather and reduce-scatter, on float32, float64, float16, bfloat16,
    int32, int64, uint8, int8 and bool tensors on cpu, cuda and mps.

    Point to point as gloo has it: send, recv, isend, irecv, recv from any
    source (``src=None``), batch_isend_irecv, with tags (:mod:`ddpwire.plane.p2p`).
    Where the group has rank links the messages go on direct links between
    the two ranks (:attr:`p2p_direct`); otherwise the service on rank 0
    relays them (a request of kind SEND). Anything else
    (monitored_barrier) raises NotImplementedError naming it.
    """

    def __init__(self, store: Any, rank: int, world_size: int,
                 timeout: timedelta = timedelta(minutes=30)) -> None:
        super().__init__(rank, world_size)
        _carry(self, rank, world_size)  # torch names the group through it
        self._rank = rank
        self._world = world_size
        seconds, heartbeat, silence = timings(timeout)
        # a Work waits past the group timeout only by the time the service
        # needs to notice a silent rank and say so
        self._limit = seconds + silence + 5.0
        self._staging = Staging()
        self._reported = False
        self._group: Rendezvous = join_group(store, rank, world_size, timeout)
        self._close_timeout = min(seconds, 10.0)
        self._seconds = seconds
        self._shm: Optional[_shm.SharedPlane] = None
        try:
            self._shm = _shm.negotiate(self._group.client, rank, world_size, seconds)
        except BaseException:
            self._group.close(self._close_timeout)
            raise
        self._links: Optional[RankLinks] = None
        if self._shm is not None:
            self._hook_shm(self._shm)
        else:
            try:
                self._links = form_links(self._group.client, rank, world_size,
                                         listen_host=self._group.listen_host,
                                         advertise=self._group.advertise, timeout=seconds,
                                         ports=ports_from_env(), heartbeat=heartbeat,
                                         silence=silence, sealed=self._group.sealed)
            except BaseException:
                self._group.close(self._close_timeout)
                raise
        self._p2p = self._open_p2p(heartbeat, silence)
        atexit.register(_close_at_exit, weakref.ref(self))

    def _hook_shm(self, seg: "_shm.SharedPlane") -> None:
        # A barrier in shared memory watches no socket: whatever ends the
        # group (the service's error, the coordinator gone, on rank 0 a rank's
        # connection closing) calls the barriers off, naming the rank.
        seg_ref = weakref.ref(seg)

        def on_failure(error: BaseException) -> None:
            s = seg_ref()
            if s is not None:
                s.abort(getattr(error, "rank", None))

        def on_lost(rank: int, error: BaseException) -> None:
            s = seg_ref()
            if s is not None:
                s.abort(rank)

        self._group.client.on_failure = on_failure
        if self._group.service is not None:
            self._group.service.on_lost = on_lost

    @property
    def shared_memory(self) -> bool:
        """True when this group's large float32 allreduces go through shared memory."""
        return self._shm is not None

    @property
    def rank_links(self) -> bool:
        """True when this group's large float32 allreduces, reduce-scatters
        and all-gathers run on direct links between the ranks (a ring's
        traffic), not through rank 0."""
        return self._links is not None

    @property
    def links_collectives(self) -> int:
        """How many collectives have run on the rank links so far (0 without them)."""
        return 0 if self._links is None else self._links.collectives

    @property
    def links_sealed(self) -> bool:
        """True when those links are sealed (a token, encryption on: ddpwire.wire.seal)."""
        return self._links is not None and self._links.sealed

    def _open_p2p(self, heartbeat: float, silence: float) -> Any:
        """Point to point's route: direct links where the rank links
        opened, else the service (ddpwire.plane.p2p)."""
        mailbox = _p2p.Mailbox(self._rank, self._world)
        if self._links is not None:
            try:
                links = _p2p.form_peer_links(self._group.client, self._rank, self._world, mailbox,
                                             listen_host=self._group.listen_host,
                                             advertise=self._group.advertise,
                                             timeout=self._seconds, ports=ports_from_env(),
                                             heartbeat=heartbeat, silence=silence,
                                             sealed=self._group.sealed)
            except BaseException:
                self._links.close()
                self._group.close(self._close_timeout)
                raise
            if links is not None:
                return links
        return _p2p.ServiceRoute(self._group.client, mailbox)

    @property
    def p2p_direct(self) -> bool:
        """True when send/recv travel on direct links between the two ranks,
        False when the service on rank 0 relays them."""
        return bool(getattr(self._p2p, "direct", False))

    # ---- identity ----

    def getBackendName(self) -> str:
        """ "ddpwire" """
        return BACKEND

    @property
    def closed(self) -> bool:
        """True once the group is closed (``destroy_process_group`` closes it)."""
        return self._group is None

    def _label(self) -> Optional[str]:
        """The name torch gave the group (None before it did, or where no
        carrier could be registered)."""
        try:
            return self.group_name or None
        except RuntimeError:
            return None

    def _closed(self, what: str) -> RuntimeError:
        """The error of a call on a closed group, naming the group."""
        name = self._label()
        which = f"process group {name!r}" if name is not None else "process group"
        return RuntimeError(f"ddpwire {what}: the {which} (rank {self._rank} of "
                            f"{self._world}) is closed (destroyed)")

    def __repr__(self) -> str:
        return (f"DdpwireProcessGroup(rank={self._rank}, world_size={self._world}, "
                f"group_name={self._label()!r}, closed={self._group is None})")

    def close(self) -> None:
        """Leave the group (rank 0 first waits for the others to leave)."""
        group, self._group = self._group, None
        seg, self._shm = self._shm, None
        links, self._links = self._links, None
        p2p, self._p2p = getattr(self, "_p2p", None), None
        _pending.disarm(self)
        try:
            if p2p is not None:
                p2p.close()  # what is queued goes out; the receives waiting fail
            if group is not None:
                group.close(self._close_timeout)
        finally:
            if seg is not None:
                seg.close()
            if links is not None:
                links.close()

    def shutdown(self) -> None:
        """:meth:`close` (torch's name on destroy_process_group)."""
        self.close()

    def abort(self) -> None:
        """:meth:`close`: nothing here outlives the links it closes."""
        self.close()

    def _report(self, error: BaseException) -> None:
        # once per group: the main thread learns of the failure a single time
        if not self._reported:
            self._reported = True
            _pending.arm(error, self)

    # ---- the one path every collective takes ----

    def _issue(self, what: str, kind: Kind, op: Op, dtype: DType, root: int,
               inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], value: Any,
               deliver: Optional[Callable[[], None]] = None) -> DdpwireWork:
        if self._group is None:
            raise self._closed(what)
        data, ready, release = self._staging.outgoing(inputs) if inputs else (
            np.empty(0, dtype=np.uint8), None, _nothing)
        # ``deliver`` is set before anything is submitted: an answer may come
        # before this returns
        work = DdpwireWork(torch.futures.Future(), self._limit, -1, f"{what} (rank {self._rank})",
                           self._report, deliver)
        seg, links = self._shm, self._links
        if (kind is Kind.ALLREDUCE and dtype is DType.FLOAT32 and op in (Op.SUM, Op.AVG)
                and seg is not None and data.nbytes >= SHM_MIN_BYTES):
            timeout = self._seconds
            return self._issue_local(work, lambda d: seg.allreduce(d, op, timeout), data,
                                     ready, release, inputs, outputs, value)
        # the collective's whole vector: an all-gather's is every rank's input
        size = data.nbytes * (self._world if kind is Kind.ALLGATHER else 1)
        run = None if links is None or size < LINKS_MIN_BYTES else \
            _links_route(links, kind, op, dtype, data.nbytes, root)
        if run is not None:
            return self._issue_local(work, run, data, ready, release, inputs, outputs, value)
        # element-wise collectives travel in pieces: the service reduces one
        # while the next arrives, and no frame nears the size limit
        pieces = [(0, data.nbytes)]
        if (kind in (Kind.ALLREDUCE, Kind.BROADCAST) and len(outputs) == 1
                and outputs[0].is_contiguous() and data.nbytes > PIECE_BYTES):
            pieces = [(a, min(a + PIECE_BYTES, data.nbytes)) for a in range(0, data.nbytes, PIECE_BYTES)]
        # results land in the output tensor itself where it is one contiguous CPU tensor
        out_bytes = sum(t.numel() * t.element_size() for t in outputs)
        state = {"left": len(pieces), "error": None}
        lock = threading.Lock()
        staging = self._staging

        def piece_done(offset: int, result: Optional[np.ndarray], error: Optional[BaseException]) -> None:
            try:
                if error is None:
                    if len(pieces) == 1:
                        staging.incoming(outputs, result)
                    else:
                        staging.incoming_at(outputs[0], offset, result)
            except BaseException as exc:  # noqa: BLE001 - the caller sees it from wait()
                error = exc
            with lock:
                if error is not None and state["error"] is None:
                    state["error"] = error
                state["left"] -= 1
                last = state["left"] == 0
            if last:
                release()
                work._finish(value, state["error"])

        submitted = 0
        try:
            for a, b in pieces:
                seq = self._group.client.submit(
                    kind, op, dtype, root, data[a:b],
                    lambda result, error, a=a: piece_done(a, result, error),
                    before_send=ready if a == 0 else None,
                    into=(staging.landing(outputs, a, b - a) if len(pieces) > 1
                          else staging.landing(outputs, 0, out_bytes)))
                if work.seq < 0:
                    work.seq = seq
                submitted += 1
        except BaseException as exc:
            if submitted == 0:
                release()
                raise
            # the pieces already queued fail with the group; count the rest as failed
            for a, _ in pieces[submitted:]:
                piece_done(a, None, exc)
        # ``inputs`` must outlive the send: the pieces hold views of the host
        # bytes, and this holds the tensors themselves.
        work._keep = (inputs, outputs)
        return work

    def _issue_local(self, work: DdpwireWork,
                     reduce: Callable[[np.ndarray], Optional[np.ndarray]],
                     data: np.ndarray, ready: Optional[Callable[[], None]],
                     release: Callable[[], None], inputs: Sequence[torch.Tensor],
                     outputs: Sequence[torch.Tensor], value: Any) -> DdpwireWork:
        """A collective this rank takes part in itself (shared memory, or the
        rank links): ``reduce(data)`` in place, or returning the result (a
        reduce-scatter's chunk, an all-gather's whole), queued in issue
        order with the service's collectives, run (GIL-free) on the sending
        thread."""
        staging = self._staging
        if not data.flags.writeable:
            data = data.copy()  # the result lands in the host bytes, then in the outputs
        result: List[Optional[np.ndarray]] = [None]

        def run() -> None:
            if ready is not None:
                ready()
            result[0] = reduce(data)

        def done(_: Optional[np.ndarray], error: Optional[BaseException]) -> None:
            try:
                if error is None:
                    staging.incoming(outputs, data if result[0] is None else result[0])
            except BaseException as exc:  # noqa: BLE001 - the caller sees it from wait()
                error = exc
            release()
            work._finish(value, error)

        try:
            group = self._group
            if group is None:
                raise self._closed(work.what.split(" (rank")[0])
            group.client.submit_local(run, done)
        except BaseException:
            release()
            raise
        work._keep = (inputs, outputs)
        return work

    # ---- collectives ----

    def allreduce(self, tensors: List[torch.Tensor], opts: Any = None) -> DdpwireWork:
        """``all_reduce`` of one tensor in place (float32 SUM and AVG of a
        large one on the rank links or shared memory, bfloat16 and float16
        on the rank links; the rest on the service)."""
        t = _one(tensors, "allreduce")
        if t.layout == torch.sparse_coo:
            return self._sparse_allreduce(t, opts, tensors)
        dtype = _dtype_of([t], "allreduce")
        op = _reduce_op(opts, dtype, "allreduce")
        return self._issue("allreduce", Kind.ALLREDUCE, op, dtype, 0, [t], [t], tensors)

    def _sparse_allreduce(self, t: torch.Tensor, opts: Any,
                          tensors: List[torch.Tensor]) -> DdpwireWork:
        """A sparse COO tensor's SUM, as gloo's (ddpwire/torch/sparse.py):
        done before this returns, its Work complete."""
        dtype = _dtype_of([t._values()], "allreduce")
        if _reduce_op(opts, dtype, "allreduce") is not Op.SUM:
            raise NotImplementedError("ddpwire allreduce: a sparse tensor is summed only "
                                      "(ReduceOp.SUM), as on gloo")

        def gather(output: torch.Tensor, input: torch.Tensor) -> None:
            self._allgather_base(output, input).wait()

        sparse_sum(t, int(dtype), self._rank, self._world, gather)
        work = DdpwireWork(torch.futures.Future(), self._limit, -1,
                           f"allreduce (rank {self._rank})", self._report)
        work._finish(tensors, None)
        return work

    def broadcast(self, tensors: List[torch.Tensor], opts: Any = None) -> DdpwireWork:
        """``broadcast`` of one tensor from ``opts.rootRank`` (default 0)."""
        t = _one(tensors, "broadcast")
        root = check_root(_root(opts), self._world, "broadcast")
        return self._issue("broadcast", Kind.BROADCAST, Op.SUM, _dtype_of([t], "broadcast"), root,
                           [t], [t], tensors)

    def allgather(self, output_tensors: List[List[torch.Tensor]], input_tensors: List[torch.Tensor],
                  opts: Any = None) -> DdpwireWork:
        """``all_gather``: one input, one list of world-size outputs of its size."""
        t = _one(input_tensors, "allgather")
        outs = _one(output_tensors, "allgather")
        if len(outs) != self._world or any(o.numel() != t.numel() for o in outs):
            raise ValueError(f"ddpwire allgather: {self._world} outputs of {t.numel()} elements "
                             f"needed, got {[o.numel() for o in outs]}")
        return self._issue("allgather", Kind.ALLGATHER, Op.SUM, _dtype_of([t, *outs], "allgather"),
                           0, [t], outs, output_tensors)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> DdpwireWork:
        if output.numel() != input.numel() * self._world:
            raise ValueError(f"ddpwire all_gather_into_tensor: output has {output.numel()} elements, "
                             f"{self._world} x {input.numel()} needed")
        return self._issue("all_gather_into_tensor", Kind.ALLGATHER, Op.SUM,
                           _dtype_of([input, output], "all_gather_into_tensor"), 0, [input], [output],
                           [output])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> DdpwireWork:
        """``all_gather_into_tensor`` (torch 2.13 calls it by this name)."""
        return self._allgather_base(output, input, opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> DdpwireWork:
        """``reduce_scatter_tensor`` (torch 2.13 calls it by this name)."""
        return self._reduce_scatter_base(output, input, opts)

    def reduce_scatter(self, output_tensors: List[torch.Tensor], input_tensors: List[List[torch.Tensor]],
                       opts: Any = None) -> DdpwireWork:
        """``reduce_scatter``: one output, world-size inputs of its size."""
        out = _one(output_tensors, "reduce_scatter")
        ins = _one(input_tensors, "reduce_scatter")
        if len(ins) != self._world or any(i.numel() != out.numel() for i in ins):
            raise ValueError(f"ddpwire reduce_scatter: {self._world} inputs of {out.numel()} elements "
                             f"needed, got {[i.numel() for i in ins]}")
        dtype = _dtype_of([out, *ins], "reduce_scatter")
        op = _reduce_op(opts, dtype, "reduce_scatter")
        return self._issue("reduce_scatter", Kind.REDUCE_SCATTER, op, dtype, 0, ins, [out],
                           output_tensors)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor,
                             opts: Any = None) -> DdpwireWork:
        if input.numel() != output.numel() * self._world:
            raise ValueError(f"ddpwire reduce_scatter_tensor: input has {input.numel()} elements, "
                             f"{self._world} x {output.numel()} needed")
        dtype = _dtype_of([output, input], "reduce_scatter_tensor")
        op = _reduce_op(opts, dtype, "reduce_scatter_tensor")
        return self._issue("reduce_scatter_tensor", Kind.REDUCE_SCATTER, op, dtype, 0, [input],
                           [output], [output])

    def barrier(self, opts: Any = None) -> DdpwireWork:
        """Done once every rank has called it."""
        return self._issue("barrier", Kind.BARRIER, Op.SUM, DType.UINT8, 0, [], [], None)

    def allreduce_compressed(self, tensor: torch.Tensor, compression: str = "bf16") -> DdpwireWork:
        """Average a float32 tensor in place with ``compression`` on the
        wire (a codec of :mod:`ddpwire.plane.codecs`: "bf16", "fp16" or
        "int8", a byte an element and a scale per 256): each rank's values
        rounded once, summed in float32 in rank order, divided by the world
        size, the average rounded once more, and every rank decodes the same
        average. For DDP buckets (:mod:`ddpwire.torch.hooks`) and DiLoCo's
        pseudo-gradients. On the rank links the tensor is encoded as it is
        sent; otherwise 16 bits travel as a bfloat16/float16 AVG through the
        service, and int8 as every rank's bytes gathered through it, each
        rank averaging them in rank order: the same bits either way."""
        wire = _codecs.codec_of(compression)
        if wire.name is None:
            raise ValueError("ddpwire allreduce_compressed: compression names a codec "
                             f"({', '.join(_codecs.names())}); use all_reduce for float32")
        if tensor.dtype != torch.float32:
            raise TypeError(f"ddpwire allreduce_compressed: a float32 tensor is encoded on the "
                            f"wire, got {tensor.dtype}")
        what = f"allreduce_compressed {wire.name}"
        links = self._links
        if links is not None and tensor.numel() * 4 >= LINKS_MIN_BYTES:
            data, ready, release = self._staging.outgoing([tensor])
            work = DdpwireWork(torch.futures.Future(), self._limit, -1,
                               f"{what} (rank {self._rank})", self._report)
            return self._issue_local(work, lambda d: links.allreduce(d.view(np.float32), Op.AVG,
                                                                     compression=wire.name),
                                     data, ready, release, [tensor], [tensor], [tensor])
        if wire.block:
            kernels = wire.kernels
            assert kernels is not None
            coded = torch.from_numpy(kernels.encode(
                tensor.detach().to("cpu").contiguous().view(-1).numpy()))
            gathered = torch.empty(self._world * coded.numel(), dtype=torch.uint8)
            return self._issue(what, Kind.ALLGATHER, Op.SUM, DType.UINT8, 0, [coded], [gathered],
                               [tensor], deliver=lambda: copy_into(tensor, torch.from_numpy(
                                   wire.average(gathered.numpy().reshape(self._world, -1)))))
        half = tensor.to(torch.bfloat16 if wire.half == "bf16" else torch.float16)
        # widened into the caller's tensor before the work completes: its
        # future hands DDP the float32 bucket
        return self._issue(what, Kind.ALLREDUCE, Op.AVG, _dtype_of([half], "allreduce"),
                           0, [half], [half], [tensor], deliver=lambda: copy_into(tensor, half))

    def allreduce_16bit(self, tensor: torch.Tensor, codec: str = "bf16") -> DdpwireWork:
        """:meth:`allreduce_compressed` with a 16-bit ``codec`` ("bf16" or
        "fp16"), the name it had first."""
        if codec not in ("bf16", "fp16"):
            raise ValueError(f"ddpwire allreduce_16bit: codec must be 'bf16' or 'fp16', "
                             f"got {codec!r}")
        return self.allreduce_compressed(tensor, codec)

    # ---- composed from the collectives above, with gloo's semantics ----

    def reduce(self, tensors: List[torch.Tensor], opts: Any = None) -> DdpwireWork:
        """``reduce`` of one tensor to ``opts.rootRank``: an allreduce of a
        copy, written into the root's tensor once it succeeds. The other
        ranks' tensors stay as they were (gloo leaves partial results in
        them)."""
        t = _one(tensors, "reduce")
        root = check_root(_root(opts), self._world, "reduce")
        dtype = _dtype_of([t], "reduce")
        op = _reduce_op(opts, dtype, "reduce")
        # a copy even on the root: the shared-memory and links paths reduce
        # their input in place, and the root's tensor changes only on success
        staged = t.detach().clone(memory_format=torch.contiguous_format)
        deliver = (lambda: copy_into(t, staged)) if root == self._rank else None
        return self._issue("reduce", Kind.ALLREDUCE, op, dtype, 0, [staged], [staged], tensors,
                           deliver=deliver)

    def gather(self, output_tensors: List[List[torch.Tensor]], input_tensors: List[torch.Tensor],
               opts: Any = None) -> DdpwireWork:
        """``gather`` to ``opts.rootRank``: an allgather, which the root
        alone copies into its world-size outputs (the others pass none)."""
        t = _one(input_tensors, "gather")
        root = check_root(_root(opts), self._world, "gather")
        outs = rooted_list(output_tensors, root == self._rank, self._world, t.numel(), "gather",
                           "output")
        dtype = _dtype_of([t, *outs], "gather")
        gathered = _host_scratch(self._world * t.numel(), t)
        return self._issue("gather", Kind.ALLGATHER, Op.SUM, dtype, 0, [t], [gathered], outs,
                           deliver=(lambda: unflatten_into(outs, gathered)) if outs else None)

    def scatter(self, output_tensors: List[torch.Tensor], input_tensors: List[List[torch.Tensor]],
                opts: Any = None) -> DdpwireWork:
        """``scatter`` from ``opts.rootRank``: a broadcast of the root's
        world-size inputs end to end (the others pass none), of which each
        rank keeps its own part."""
        out = _one(output_tensors, "scatter")
        root = check_root(_root(opts), self._world, "scatter")
        ins = rooted_list(input_tensors, root == self._rank, self._world, out.numel(), "scatter",
                          "input")
        dtype = _dtype_of([out, *ins], "scatter")
        n = out.numel()
        # the other ranks send as many bytes as the root (the service checks
        # that every rank's request agrees) and the service drops them
        flat = flatten(ins) if ins else _host_scratch(self._world * n, out, zeroed=True)
        mine = flat[self._rank * n:(self._rank + 1) * n]
        return self._issue("scatter", Kind.BROADCAST, Op.SUM, dtype, root, [flat], [flat],
                           output_tensors, deliver=lambda: copy_into(out, mine))

    def alltoall(self, output_tensors: List[torch.Tensor], input_tensors: List[torch.Tensor],
                 opts: Any = None) -> DdpwireWork:
        """``all_to_all``: input j goes to rank j, output i comes from rank
        i. Every tensor has the same number of elements (gloo's rule; other
        sizes go through ``all_to_all_single`` with split sizes). One
        allgather of the inputs end to end."""
        what = "alltoall"
        check_count(input_tensors, self._world, what, "input")
        n = input_tensors[0].numel()
        check_sizes(input_tensors, [n] * self._world, what, "input")
        check_sizes(output_tensors, [n] * self._world, what, "output")
        dtype = _dtype_of([*output_tensors, *input_tensors], what)
        outs = list(output_tensors)
        return self._exchange(what, dtype, list(input_tensors), [[n] * self._world] * self._world,
                              lambda pieces: [copy_into(o, p) for o, p in zip(outs, pieces)],
                              output_tensors)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: Sequence[int], input_split_sizes: Sequence[int],
                          opts: Any = None) -> DdpwireWork:
        """``all_to_all_single``: the input's rows split over the ranks (by
        ``input_split_sizes``, or evenly when empty), the output's rows taken
        from them in rank order (``output_split_sizes``, or evenly).

        Without split sizes every rank's input has the same size: one
        allgather. With them (on every rank, one list or both), every rank's
        element counts travel first in an allgather waited for here, so that
        each rank issues the exchange itself in its own program order, and a
        count some rank does not expect is a ValueError on every rank.
        """
        return self._all_to_all_single("all_to_all_single", output, input, output_split_sizes,
                                       input_split_sizes)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: Sequence[int], input_split_sizes: Sequence[int],
                      opts: Any = None) -> DdpwireWork:
        """:meth:`all_to_all_single` (its older name in torch)."""
        return self._all_to_all_single("alltoall_base", output, input, output_split_sizes,
                                       input_split_sizes)

    def _all_to_all_single(self, what: str, output: torch.Tensor, input: torch.Tensor,
                           output_split_sizes: Sequence[int],
                           input_split_sizes: Sequence[int]) -> DdpwireWork:
        dtype = _dtype_of([output, input], what)
        sends = split_counts(input_split_sizes, input, self._world, what, "input")
        receives = split_counts(output_split_sizes, output, self._world, what, "output")
        if output_split_sizes or input_split_sizes:
            table = self._counts_of_every_rank(what, sends, receives)
        else:
            if sum(sends) != sum(receives):
                raise ValueError(f"ddpwire {what}: the output holds {sum(receives)} elements, "
                                 f"the input {sum(sends)}")
            # every rank's input has this size, or the allgather's counts
            # disagree and the service says which rank's
            table = [sends] * self._world
        return self._exchange(what, dtype, [input], table,
                              lambda pieces: copy_into(output, torch.cat(pieces)), [output])

    def _counts_of_every_rank(self, what: str, sends: List[int], receives: List[int]
                              ) -> List[List[int]]:
        """Every rank's element counts to each rank (rank order), checked
        against what each receiver expects; waited for on this thread."""
        mine = torch.tensor(sends + receives, dtype=torch.int64)
        table = torch.empty(self._world * len(mine), dtype=torch.int64)
        self._issue(f"{what} (split sizes)", Kind.ALLGATHER, Op.SUM, DType.INT64, 0, [mine], [table],
                    None).wait()
        rows = table.view(self._world, -1).tolist()
        problem = split_mismatch(rows)
        if problem is not None:
            raise ValueError(f"ddpwire {what}: {problem}")
        return [row[:self._world] for row in rows]

    def _exchange(self, what: str, dtype: DType, inputs: List[torch.Tensor],
                  sends: List[List[int]], deliver: Callable[[List[torch.Tensor]], Any],
                  value: Any) -> DdpwireWork:
        """An all-to-all as one allgather: each rank's ``inputs`` end to end
        (``sends[i][j]`` elements from rank i for rank j, in rank order),
        padded to the longest rank's; ``deliver`` gets the pieces addressed
        to this rank, once all have come."""
        stride = max(sum(row) for row in sends)
        short = stride - sum(sends[self._rank])
        if short:
            inputs = inputs + [inputs[0].new_zeros(short)]
        gathered = _host_scratch(self._world * stride, inputs[0])
        pieces = addressed_to(self._rank, gathered, stride, sends)
        return self._issue(what, Kind.ALLGATHER, Op.SUM, dtype, 0, inputs, [gathered], value,
                           deliver=lambda: deliver(pieces))

    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: Any = None) -> DdpwireWork:
        """``all_reduce_coalesced``: one allreduce of the tensors end to end
        (float32 SUM and AVG on shared memory or the rank links as
        :meth:`allreduce`), written back into them once it succeeds."""
        what = "allreduce_coalesced"
        check_nonempty(tensors, what, "tensor")
        dtype = _dtype_of(tensors, what)
        op = _reduce_op(opts, dtype, what)
        flat = flatten(tensors)
        return self._issue(what, Kind.ALLREDUCE, op, dtype, 0, [flat], [flat], tensors,
                           deliver=lambda: unflatten_into(tensors, flat))

    def allgather_coalesced(self, output_lists: List[List[torch.Tensor]],
                            input_list: List[torch.Tensor], opts: Any = None) -> DdpwireWork:
        """``all_gather_coalesced``: ``output_lists[r][k]`` is rank r's
        ``input_list[k]``; one allgather of the inputs end to end."""
        what = "allgather_coalesced"
        check_nonempty(input_list, what, "input")
        check_count(output_lists, self._world, what, "output list")
        numels = [t.numel() for t in input_list]
        for outs in output_lists:
            check_sizes(outs, numels, what, "output")
        dtype = _dtype_of([*input_list, *(o for outs in output_lists for o in outs)], what)

        def deliver(pieces: List[List[torch.Tensor]]) -> None:
            for outs, mine in zip(output_lists, pieces):
                for o, p in zip(outs, mine):
                    copy_into(o, p)

        return self._gather_rank_major(what, dtype, input_list, deliver, output_lists)

    def all_gather_single_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                    opts: Any = None) -> DdpwireWork:
        """``all_gather_into_tensor`` of several pairs (torch's coalescing
        manager): one allgather of the inputs end to end."""
        return self._allgather_into_tensors("all_gather_single_coalesced", outputs, inputs)

    def allgather_into_tensor_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                        opts: Any = None) -> DdpwireWork:
        """:meth:`all_gather_single_coalesced` (the functional collectives' name)."""
        return self._allgather_into_tensors("allgather_into_tensor_coalesced", outputs, inputs)

    def _allgather_into_tensors(self, what: str, outputs: List[torch.Tensor],
                                inputs: List[torch.Tensor]) -> DdpwireWork:
        check_nonempty(inputs, what, "input")
        check_sizes(outputs, [self._world * t.numel() for t in inputs], what, "output")
        dtype = _dtype_of([*inputs, *outputs], what)

        def deliver(pieces: List[List[torch.Tensor]]) -> None:
            for k, out in enumerate(outputs):
                copy_into(out, torch.cat([mine[k] for mine in pieces]))

        return self._gather_rank_major(what, dtype, inputs, deliver, outputs)

    def _gather_rank_major(self, what: str, dtype: DType, inputs: List[torch.Tensor],
                           deliver: Callable[[List[List[torch.Tensor]]], None],
                           value: Any) -> DdpwireWork:
        """One allgather of ``inputs`` end to end; ``deliver`` gets
        ``[rank][k]``, rank's input k, once all have come."""
        gathered = _host_scratch(self._world * sum(t.numel() for t in inputs), inputs[0])
        pieces = rank_major_pieces(gathered, self._world, [t.numel() for t in inputs])
        return self._issue(what, Kind.ALLGATHER, Op.SUM, dtype, 0, inputs, [gathered], value,
                           deliver=lambda: deliver(pieces))

    def reduce_scatter_single_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                        opts: Any = None) -> DdpwireWork:
        """``reduce_scatter_tensor`` of several pairs (torch's coalescing
        manager): one reduce-scatter of the inputs with each rank's parts
        put together."""
        return self._reduce_scatter_tensors("reduce_scatter_single_coalesced", outputs, inputs, opts)

    def reduce_scatter_tensor_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                        opts: Any = None) -> DdpwireWork:
        """:meth:`reduce_scatter_single_coalesced` (the functional collectives' name)."""
        return self._reduce_scatter_tensors("reduce_scatter_tensor_coalesced", outputs, inputs, opts)

    def _reduce_scatter_tensors(self, what: str, outputs: List[torch.Tensor],
                                inputs: List[torch.Tensor], opts: Any) -> DdpwireWork:
        check_nonempty(outputs, what, "output")
        check_sizes(inputs, [self._world * t.numel() for t in outputs], what, "input")
        dtype = _dtype_of([*inputs, *outputs], what)
        op = _reduce_op(opts, dtype, what)
        mine = _host_scratch(sum(t.numel() for t in outputs), outputs[0])
        return self._issue(what, Kind.REDUCE_SCATTER, op, dtype, 0, rank_major(inputs, self._world),
                           [mine], outputs, deliver=lambda: unflatten_into(outputs, mine))

    # ---- point to point (ddpwire.plane.p2p) ----

    def send(self, tensors: List[torch.Tensor], dstRank: int, tag: int) -> "PeerWork":
        """``send``/``isend`` of one tensor to ``dstRank`` with ``tag``: done
        once its bytes are written out (on the direct link to the rank, or
        to the service on rank 0, which relays them)."""
        t = _one(tensors, "send")
        dst = self._peer(dstRank, "send", "destination")
        tag = _p2p.check_tag(tag, "send")
        dtype = _dtype_of([t], "send")
        _p2p.check_size(t.numel() * t.element_size(), "send")
        if self._group is None:
            raise self._closed("send")
        data, ready, release = self._staging.outgoing([t])
        work = PeerWork(self._limit, f"send to rank {dst} with tag {tag} (rank {self._rank})",
                        src=self._rank, dst=dst, tag=tag)
        work._keep = (t, data)

        def sent(error: Optional[BaseException]) -> None:
            release()
            work._finish(tensors, error)

        try:
            self._p2p.send(dst, tag, dtype, data, sent, before_send=ready)
        except BaseException:
            release()
            raise
        return work

    def recv(self, tensors: List[torch.Tensor], srcRank: int, tag: int) -> "PeerWork":
        """``recv``/``irecv`` of one tensor from ``srcRank`` with ``tag``:
        done once the message is in the tensor; a message of another dtype
        or size fails it (:class:`ddpwire.plane.p2p.PointToPointMismatch`)."""
        src = self._peer(srcRank, "recv", "source")
        return self._receive(tensors, src, _p2p.check_tag(tag, "recv"), "recv")

    def recv_anysource(self, tensors: List[torch.Tensor], tag: int) -> "PeerWork":
        """``recv``/``irecv`` with ``src=None``: the first message with
        ``tag`` from any rank; the Work's ``_source_rank()`` is its sender."""
        return self._receive(tensors, None, _p2p.check_tag(tag, "recv"), "recv_anysource")

    def _peer(self, rank: int, what: str, role: str) -> int:
        rank = int(rank)
        if not 0 <= rank < self._world:
            raise ValueError(f"ddpwire {what}: {role} rank {rank} is not a rank of {self._world}")
        if rank == self._rank:
            raise ValueError(f"Invalid {role} rank: {role} rank should not be the same as the "
                             f"rank of the current process ({rank})")
        return rank

    def _receive(self, tensors: List[torch.Tensor], src: Optional[int], tag: int,
                 what: str) -> "PeerWork":
        t = _one(tensors, what)
        dtype = _dtype_of([t], what)
        if self._group is None:
            raise self._closed(what)
        nbytes = t.numel() * t.element_size()
        whence = "any rank" if src is None else f"rank {src}"
        work = PeerWork(self._limit, f"recv from {whence} with tag {tag} (rank {self._rank})",
                        src=src, dst=self._rank, tag=tag)
        staging, rank = self._staging, self._rank

        def deliver(message: Optional[_p2p.Message], error: Optional[BaseException]) -> None:
            if message is not None:
                try:
                    if message.dtype != int(dtype) or message.nbytes != nbytes:
                        raise _p2p.PointToPointMismatch(
                            f"ddpwire recv: rank {message.src} sent rank {rank} (tag {tag}) "
                            f"{message.count} elements of {DType(message.dtype).name.lower()} "
                            f"({message.nbytes} bytes) where the receiving tensor holds "
                            f"{t.numel()} of {DType(dtype).name.lower()} ({nbytes} bytes)",
                            src=message.src, dst=rank, tag=tag)
                    staging.incoming([t], message.data)
                    work._source = message.src
                except BaseException as exc:  # noqa: BLE001 - the caller sees it from wait()
                    error = exc
            work._finish(tensors, error)

        self._p2p.mailbox.post(src, tag, deliver)
        return work

    # ---- everything else: named, not silently wrong ----

    def _unsupported(name: str) -> Callable[..., Any]:  # type: ignore[misc]
        def method(self: "DdpwireProcessGroup", *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(f"the ddpwire backend does not implement {name}")
        method.__name__ = name
        method.__doc__ = f"Not implemented: raises NotImplementedError ({name})."
        return method

    for _name in ("monitored_barrier",):
        locals()[_name] = _unsupported(_name)
    del _name, _unsupported


_Route = Callable[[np.ndarray], Optional[np.ndarray]]


def _links_route(links: RankLinks, kind: Kind, op: Op, dtype: DType, nbytes: int,
                 root: int) -> Optional[_Route]:
    """How the rank links' runner takes a collective of ``nbytes`` (its
    data's raw bytes in, the result in place or returned), or None for the
    service; either way the bits are the service's, and rank 0's link is no
    busier than any other's. float32 SUM/AVG allreduces and reduce-scatters;
    bfloat16 and float16 ones in their own 16-bit codec (their words sent as
    they are, summed in float32 in rank order, rounded once); all-gathers
    and broadcasts (from ``root``) of any dtype, as bytes (float32 words:
    their length a multiple of 4)."""
    if kind in (Kind.ALLGATHER, Kind.BROADCAST) and nbytes % 4:
        return None
    if kind is Kind.ALLGATHER:
        return lambda d: links.allgather(d.view(np.float32))
    if kind is Kind.BROADCAST:
        return lambda d: links.broadcast(d.view(np.float32), root)
    if kind not in (Kind.ALLREDUCE, Kind.REDUCE_SCATTER) or op not in (Op.SUM, Op.AVG):
        return None
    if dtype is DType.FLOAT32:
        if kind is Kind.ALLREDUCE:
            return lambda d: links.allreduce(d.view(np.float32), op)
        return lambda d: links.reduce_scatter(d.view(np.float32), op)
    wire = _codecs.by_dtype(dtype)
    if wire is None or wire.half is None:
        return None

    def half(d: np.ndarray) -> Optional[np.ndarray]:
        # the tensor's words travel as they are
        if kind is Kind.REDUCE_SCATTER:
            return links.reduce_scatter(d.view(np.uint16), op, compression=wire.name)
        links.allreduce(d.view(np.uint16), op, compression=wire.name)
        return None
    return half


def _nothing() -> None:
    return None


def _host_scratch(numel: int, like: torch.Tensor, zeroed: bool = False) -> torch.Tensor:
    """A flat CPU tensor of ``like``'s dtype for a composed op's whole
    result: the wire's bytes land on the host whatever the device."""
    return (torch.zeros if zeroed else torch.empty)(numel, dtype=like.dtype)


def _close_at_exit(ref: "weakref.ReferenceType[DdpwireProcessGroup]") -> None:
    pg = ref()
    if pg is not None:
        try:
            pg.close()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass


def _create(store: Any, rank: int, world_size: int, timeout: timedelta) -> DdpwireProcessGroup:
    return DdpwireProcessGroup(store, rank, world_size, timeout)


def register() -> None:
    """Register the backend ``"ddpwire"`` for cpu, cuda and mps. Calling it
    again does nothing, and so does calling it after torch's autoload has
    registered the backend. ``import ddpwire.torch`` calls it; the
    registration itself lives in _ddpwire_autoload."""
    _autoload.register(_create)
