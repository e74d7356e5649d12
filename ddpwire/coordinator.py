"""The coordinator: admits workers, assigns shards, averages their gradients.

It mirrors the reference coordinator's session (protocol.md, "Session
semantics") with what the reference leaves undefined made into typed errors,
and it receives from every worker at once, averaging the bytes as they
arrive, so memory stays at about one gradient vector whatever the number of
workers. The join itself (concurrent handshakes, tokens, refusals) is
:mod:`ddpwire.admission`.
"""
from __future__ import annotations

import contextlib
import enum
import errno
import logging
import select
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from typing import (AbstractSet, Callable, ContextManager, Dict, FrozenSet, Iterator, List, Mapping,
                    Optional, Set, Tuple, Union)

import numpy as np

from . import _core
from . import balance as _balance
from . import incast as _incast
from . import mesh as _mesh
from . import plan as _plan
from . import shm as _shm
from . import socket_threads as _socket_threads
from ._core import encode_frame_parts
from ._text import counted
from .admission import Admission, Admitted, Refuser
from .auth import TOKEN_ENV
from .channel import SIDE_MESSAGES, Channel, check_timeout, message_name, result_buffer
from .errors import (
    DdpwireError,
    GradientMismatch,
    JoinTimeout,
    MembershipChanged,
    NonFiniteGradient,
    ProtocolError,
    UnexpectedMessage,
    WorkerLost,
)
from .extensions import Extension, encode_u64
from .launch import is_loopback
from .lifecycle import Lifecycle, LifecycleOwner
from .options import UNSET, SessionOptions, options_from
from .messages import (
    AveragedBlockGradient,
    AveragedGradient,
    AveragedNonBlockGradient,
    BlockGradientPayload,
    CollectiveError,
    GradientPayload,
    MeshPeers,
    NO_WORKER,
    NonBlockGradientPayload,
    ShardAssignment,
    ShardScale,
    Shutdown,
    StateRequest,
    StepAborted,
    StepCommit,
    StepReport,
    StepTiming,
)
from .results import BlockReduceResult, MembershipEvent, NonBlockReduceResult, ReduceResult
from .sessioninfo import WorkerInfo

__all__ = ["Coordinator", "CoordinatorState"]

log = logging.getLogger(__name__)

#: How long past its deadline a mesh step's collect keeps listening when
#: more than one worker is silent and nothing says which stalled: a worker
#: waiting on a peer gives up when the step's deadline passes (it counts it
#: from the coordinator's last message, as the coordinator does) and sends
#: a CollectiveError naming that peer, which arrives a moment after the
#: coordinator's own deadline. Capped at the timeout.
MESH_BLAME_GRACE = 1.0


def _bind(bind: Tuple[str, int], backlog: int) -> socket.socket:
    host, port = bind
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host, port), family=family, backlog=backlog)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise OSError(exc.errno, f"cannot listen on {host}:{port}: address already in use") from None
        if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
            raise OSError(exc.errno, f"cannot listen on {host}:{port}: no such local address") from None
        raise


@dataclass(frozen=True)
class _Kind:
    """One kind of gradient message the coordinator averages: what it
    receives, what identifies one vector of it within a step (None, the
    block index or the component) and what it answers."""

    payload: type
    key: Optional[str]
    reply: type


_FLAT = _Kind(GradientPayload, None, AveragedGradient)
_BLOCK = _Kind(BlockGradientPayload, "block_idx", AveragedBlockGradient)
_NON_BLOCK = _Kind(NonBlockGradientPayload, "component", AveragedNonBlockGradient)

AnyResult = Union[ReduceResult, BlockReduceResult, NonBlockReduceResult]


class CoordinatorState(enum.Enum):
    """Where a :class:`Coordinator`'s session stands (:attr:`Coordinator.state`).

    JOINING: admitting workers. READY: every worker joined and was told the
    topology; steps run. FAILED: an error ended the session
    (:attr:`Coordinator.failure`); the connections it left inside a frame
    are closed (after a mesh step, every one), and every later step's call raises
    that error again. CLOSED: :meth:`Coordinator.close`
    ran. Forward only: nothing leaves FAILED but CLOSED, or CLOSED at all.
    The coordinator needs no state within a step: each of its calls runs
    its part of a step from start to end, and a failure anywhere in it
    ends the session.
    """

    JOINING = "joining"
    READY = "ready"
    FAILED = "failed"
    CLOSED = "closed"


_COORDINATOR_MOVES: Dict[CoordinatorState, FrozenSet[CoordinatorState]] = {
    CoordinatorState.JOINING: frozenset({CoordinatorState.READY, CoordinatorState.FAILED,
                                         CoordinatorState.CLOSED}),
    CoordinatorState.READY: frozenset({CoordinatorState.FAILED, CoordinatorState.CLOSED}),
    CoordinatorState.FAILED: frozenset({CoordinatorState.CLOSED}),
    CoordinatorState.CLOSED: frozenset(),
}


class Coordinator(LifecycleOwner[CoordinatorState]):
    """Admits ``expect_workers`` workers and runs the averaging side of training.

    ``timeout`` bounds every wait on a worker: a worker that has not sent the
    message waited for within that time (Heartbeats do not count), or that
    goes silent that long while streaming it, raises
    :class:`~ddpwire.WorkerLost` naming it and the step (a mesh step with
    several workers silent at its deadline listens up to
    :data:`MESH_BLAME_GRACE` longer, for the one that stalled to be named
    by a live one waiting for it; docs/sessions.md). With ``heartbeat``
    (seconds) set, the coordinator sends Heartbeat frames to idle workers at
    that interval, and declares a worker lost after ``heartbeat_timeout`` of
    complete silence (the reference does not speak heartbeats: leave it off
    when reference workers join).

    The join (:meth:`wait_for_workers`) runs every handshake at once, each
    bounded by ``handshake_timeout``; ``token`` (str or bytes) makes it admit
    only workers that prove they know the token, and prove the coordinator
    does too (docs/security.md). ``extensions`` maps extension types
    (:class:`ddpwire.extensions.Extension`) to the value granted to a worker
    that offers them; ``samples_per_step``, when known at the join, is handed
    to ddpwire workers, and a worker that was given another value is
    refused. So is a ddpwire worker that says it sends per-block steps when
    ``per_block`` is False, or flat steps when it is True, or whose gradient
    has another number of elements than ``gradient_length``; where either is
    None, the first worker to offer one sets it for the others. A
    per-block coordinator keeps the star (per-block steps never take the
    mesh).

    Gradients are averaged as they stream in, through a ring of
    ``ring_bytes`` per worker. ``socket_threads`` gives each worker
    connection a receiving and a sending thread while a step streams, so the
    copies in and out of the kernel spread over the cores instead of all
    running on one; None (the default) chooses threads for vectors of a
    megabyte or more when the machine has a core for each worker plus one.
    The result is bit-identical either way.

    ``topology`` chooses how flat steps (:meth:`allreduce`) are averaged:
    "auto" (the default) lets the workers average among themselves, the
    mesh of :mod:`ddpwire.mesh`, when every worker is a ddpwire worker that
    offers it, and keeps the star through this coordinator whenever a
    reference worker takes part; "star" always keeps the star; "mesh"
    refuses a session where some worker cannot join the mesh. Either way
    the bits of the average are the reference's, and a NaN or +/-inf halts
    the step before any worker applies any of it. In a mesh session the
    average never passes through the coordinator (``avg_gradients`` is
    None). ``compression`` ("bf16" or "fp16", mesh only) sends gradients and
    averages as 16-bit words, summed in float32 in worker order (see
    docs/sessions.md for the error this adds). Block and non-block messages
    always take the star.

    ``shared_memory`` lets a mesh whose workers all offered the same host
    (:func:`ddpwire.shm.host_id`) move its steps through one shared segment
    instead of loopback links, with the same bits and checks; it needs
    float32 (no ``compression``) and is off when ``DDPWIRE_SHM=0`` here or on
    any worker.

    ``coordinator_share`` is the part of each mesh step's vector (a fraction
    in [0, 1), or "auto") that this coordinator averages itself over its own
    link, which a mesh otherwise leaves idle: the workers send it their last
    elements during the reduce-scatter and it streams the average back, as
    the star does, held by the workers until the step's go-ahead. "auto"
    (the default) takes three quarters of 1/(N+1) of the vector (where
    equal links would finish together; :func:`ddpwire.mesh.auto_share`)
    with 3 or more workers on the links, none of them on this host (whose
    link they would share), and float32; else none. A coordinator whose
    link is slower than the workers' should pass 0.

    ``receive_window`` bounds, in bytes, what each worker may have in
    flight towards this coordinator: under the star all of them stream into
    its link at once and, left to the kernel, overrun the buffer in front
    of it (:mod:`ddpwire.incast`). "auto" (the default) sizes a window for
    each worker of a star session from the round trip measured at the
    join, leaving alone a single worker, a loopback one, a long path and
    mesh sessions; an int sets that window on every worker connection;
    None leaves every connection to the kernel.

    ``options`` (:class:`~ddpwire.options.SessionOptions`, the object
    :meth:`Worker.connect` takes too) gives ``timeout``, ``heartbeat``,
    ``heartbeat_timeout``, ``max_frame``, ``socket_threads``, ``token``,
    ``samples_per_step``, ``per_block`` and ``gradient_length`` at once,
    checked once; or pass them as keywords (not both).

    ``balance`` sizes each step's shards in proportion to the workers'
    measured speeds (:mod:`ddpwire.balance`), so a machine four times
    faster computes four times the samples and nobody waits, and averages
    the sample-weighted mean ``sum(c_i * g_i) / sum(c_i)``. It needs every
    worker to report its compute time (a ddpwire worker does; the
    reference does not): True refuses a session where one cannot, "auto"
    keeps the reference's ``T // n`` for it; False (the default) always
    keeps ``T // n`` and the plain mean. Timed workers report either way,
    and :attr:`shards` shows each step's split and times.

    ``elastic`` keeps the session going when a worker is lost (it
    disconnects, or stays silent past ``timeout`` or ``heartbeat_timeout``):
    the step it was lost in is called off on every survivor before any of
    them applies any of it (StepAborted, docs/extensions.md), and
    :meth:`allreduce` raises :class:`~ddpwire.MembershipChanged`; the next
    :meth:`send_shard_assignments` for the same step splits all of its
    samples among the survivors, so no sample is dropped and no step
    applied twice (:attr:`shard_log`). The average is the sample-weighted
    one, so a step's result does not depend on how many workers computed
    it. Lost while the average goes out, a worker is dropped and the step
    stands. Below ``min_workers`` (default 1) the session ends with the
    WorkerLost as without ``elastic``. It needs flat steps on the star and
    every worker able to redo a step (a ddpwire worker: a reference worker
    is refused at the join); the mesh keeps its fail-fast behaviour. The
    join stays open between steps: a worker that connects later, into a
    free slot, is handed the model's state by a worker in the session and
    takes part from the next step (docs/sessions.md).

    ``resume`` (with ``elastic``) is a coordinator restarted after the last
    one was lost: its workers kept their state and join it again, each
    saying the step it goes on from (``Worker.connect(resume_step=)``); a
    worker that disagrees with the first one admitted is refused, and
    :attr:`first_step` is theirs.
    """

    def __init__(
        self,
        bind: Tuple[str, int] = ("127.0.0.1", 0),
        expect_workers: int = 1,
        *,
        options: Optional[SessionOptions] = None,
        timeout: float = UNSET,
        join_timeout: float = 300.0,
        handshake_timeout: float = 10.0,
        max_frame: int = UNSET,
        heartbeat: Optional[float] = UNSET,
        heartbeat_timeout: Optional[float] = UNSET,
        ring_bytes: int = 1 << 20,
        socket_threads: Optional[bool] = UNSET,
        node_id: str = "coordinator",
        token: Union[str, bytes, None] = UNSET,
        extensions: Optional[Mapping[int, bytes]] = None,
        samples_per_step: Optional[int] = UNSET,
        topology: str = "auto",
        compression: Optional[str] = None,
        shared_memory: bool = True,
        coordinator_share: Union[str, float] = "auto",
        receive_window: Union[str, int, None] = "auto",
        per_block: Optional[bool] = UNSET,
        gradient_length: Optional[int] = UNSET,
        balance: Union[bool, str] = False,
        elastic: bool = False,
        min_workers: Optional[int] = None,
        resume: bool = False,
    ) -> None:
        opts = options_from(options, dict(
            timeout=timeout, max_frame=max_frame, heartbeat=heartbeat,
            heartbeat_timeout=heartbeat_timeout, socket_threads=socket_threads, token=token,
            samples_per_step=samples_per_step, per_block=per_block,
            gradient_length=gradient_length))
        #: the session's options, as checked (:class:`ddpwire.options.SessionOptions`)
        self.options = opts
        per_block = opts.per_block
        if expect_workers < 1:
            raise ValueError(f"expect_workers must be at least 1, got {expect_workers}")
        if topology not in ("auto", "star", "mesh"):
            raise ValueError(f"topology must be 'auto', 'star' or 'mesh', got {topology!r}")
        if per_block and topology == "mesh":
            raise ValueError("per-block steps always take the star: topology 'mesh' needs "
                             "flat steps")
        if balance not in (True, False, "auto"):
            raise ValueError(f"balance must be True, False or 'auto', got {balance!r}")
        self.balance = balance
        if elastic:
            if per_block:
                raise ValueError("elastic sessions run flat steps: per_block must not be True")
            if topology == "mesh" or compression is not None:
                raise ValueError("elastic sessions average on the star: topology 'mesh' and "
                                 "compression are for sessions that end when a worker is lost")
            topology = "star"
        if min_workers is not None and (not elastic or isinstance(min_workers, bool) or
                                        not isinstance(min_workers, int) or
                                        not 1 <= min_workers <= expect_workers):
            raise ValueError(f"min_workers must be from 1 to expect_workers ({expect_workers}) "
                             f"in an elastic session, got {min_workers!r}"
                             f"{'' if elastic else ' without elastic=True'}")
        if resume and not elastic:
            raise ValueError("resume picks up an elastic session's run: it needs elastic=True")
        #: whether a lost worker is dropped and its step redone by the others
        self.elastic = bool(elastic)
        #: whether this coordinator picks a run up where its workers are
        #: (a restart): :attr:`first_step` is theirs once they have joined
        self.resume = bool(resume)
        self.min_workers = 1 if min_workers is None else min_workers
        #: each worker that left an elastic session (:class:`ddpwire.results.MembershipEvent`)
        self.membership: List[MembershipEvent] = []
        #: every averaged step's shards, ``(step, {worker_id: (start, end)})``,
        #: in an elastic session (None otherwise): each sample of a step once
        self.shard_log: Optional[List[Tuple[int, Dict[int, Tuple[int, int]]]]] = \
            [] if elastic else None
        self._dropped: List[Channel] = []  # told, half-closed, read until they hang up
        self._late: Optional[Admission] = None  # an elastic session's join, between steps
        self._next_step = 0  # the step after the last one averaged
        #: the steps this coordinator runs: True per-block, False flat, None not said
        self.per_block = per_block
        self.gradient_length = opts.gradient_length
        self.codec = _mesh.codec_of(compression)
        if compression is not None and topology == "star":
            raise ValueError("compression travels on the mesh: it needs topology 'auto' or 'mesh'")
        self.topology = topology
        self.compression = compression
        self.shared_memory = bool(shared_memory)
        if coordinator_share != "auto":
            _mesh.share_value(coordinator_share)  # type: ignore[arg-type]
        self.coordinator_share = coordinator_share
        # below a few dozen segments TCP stalls on its own delayed ACKs
        # (4 KiB took seconds per megabyte on loopback)
        if receive_window not in ("auto", None) and (
                not isinstance(receive_window, int) or isinstance(receive_window, bool)
                or not _incast.FLOOR <= receive_window <= 1 << 30):
            raise ValueError(f"receive_window must be 'auto', None or a number of bytes from "
                             f"{_incast.FLOOR} to 2**30, got {receive_window!r}")
        self.receive_window = receive_window
        #: whether flat steps run on the mesh (decided when the join completes)
        self.mesh = False
        #: MeshPeers.coordinator_share in effect: 65536ths of each mesh step's
        #: vector this coordinator averages (decided when the join completes)
        self.share = 0
        self.expect_workers = expect_workers
        self.timeout = opts.timeout
        self.join_timeout = check_timeout("join_timeout", join_timeout)
        self.handshake_timeout = check_timeout("handshake_timeout", handshake_timeout)
        self.max_frame = opts.max_frame
        self.ring_bytes = ring_bytes
        self.socket_threads = opts.socket_threads
        self.node_id = node_id
        self.heartbeat = opts.heartbeat
        self.heartbeat_timeout = opts.heartbeat_timeout
        self._token: Optional[bytes] = opts.token  # type: ignore[assignment]
        self._grants = dict(extensions or {})
        if topology != "star" and not per_block:
            self._grants[Extension.MESH] = b""
        # granted whether or not the shards follow it: the timings show where
        # each step's time went (Shards.timings, the progress table)
        self._grants[Extension.BALANCE] = b""
        if self.elastic:
            self._grants[Extension.ELASTIC] = b""
        #: the shards of every step (set when the join completes)
        self.shards: Optional[_balance.Shards] = None
        self._assigned_at = 0.0  # time.perf_counter() when the last step's shards went out
        # True while a step's ShardAssignments go out, one worker after another
        self._assigning = False
        self.total_samples = 0
        if opts.samples_per_step is not None:
            self.set_total_samples(opts.samples_per_step)
        self._listener = _bind(bind, backlog=max(16, expect_workers))
        if self._token is None and not is_loopback(bind[0]):
            log.warning("listening on %s:%d without a token: any host that reaches this port can "
                        "join as a worker and change the averages (pass token=, --token-file or "
                        "%s; see docs/security.md)", *self.local_addr, TOKEN_ENV)
        self._admission: Optional[Admission] = None
        self._refuser: Optional[Refuser] = None
        self._channels: List[Channel] = []
        self.workers: List[WorkerInfo] = []
        # Vector lengths are fixed by the first step that sees them: a worker
        # whose model differs is caught on its first gradient.
        self._lengths: Dict[Tuple[_Kind, Optional[int]], int] = {}
        self._life: Lifecycle[CoordinatorState] = Lifecycle(
            CoordinatorState.JOINING, _COORDINATOR_MOVES, failed=CoordinatorState.FAILED,
            closed=CoordinatorState.CLOSED, owner="the coordinator")
        self._stop = threading.Event()
        self._heartbeat_thread: Optional[threading.Thread] = None

    # ---- lifecycle ----

    @property
    def local_addr(self) -> Tuple[str, int]:
        """The (host, port) the coordinator listens on (the real port when bound to 0)."""
        host, port = self._listener.getsockname()[:2]
        return host, port

    @property
    def worker_count(self) -> int:
        """Workers joined so far."""
        if self._admission is not None:
            return sum(slot is not None for slot in self._admission.slots)
        return len(self._channels)

    @property
    def first_step(self) -> int:
        """The step this coordinator's run starts at: 0, or with ``resume``
        the one its workers go on from (known once they have joined)."""
        if not self.resume or self._late is None or self._late.resume_step is None:
            return 0
        return self._late.resume_step

    def channel(self, worker_id: int) -> Channel:
        """The connection to one joined worker, for extensions that exchange
        their own messages over it (docs/extensions.md)."""
        for chan in self._channels:
            if chan.peer_id == worker_id:
                return chan
        raise KeyError(f"worker {worker_id} is not in the session")

    # ---- the session's state and its one failure path ----

    def _talking(self, step: Optional[int], *, any_error: bool = False,
                 mesh: bool = False) -> ContextManager[None]:
        """Where a call talks to the workers about ``step``: an error there
        ends the session through :meth:`_fail`; with ``any_error`` any
        exception does, for a part that leaves the workers inside a frame
        from this coordinator when it is cut short. ``mesh``: a mesh step."""
        def fail(exc: BaseException) -> None:
            self._fail(exc, step, mesh=mesh)
        return self._life.failing(fail, any_error=any_error)

    def _fail(self, cause: BaseException, step: Optional[int] = None, *,
              mesh: bool = False) -> bool:
        """End the session on ``cause``, once: keep it (the first cause;
        :attr:`failure`) for every later call, and close the worker
        connections, which is how the workers hear of it: the star's
        protocol has no error message. Returns False when the session had
        ended already.

        Every connection a frame from here was cut short on closes (its
        worker holds part of a reply that will never end), and when a mesh
        step failed (``mesh``) every connection, so that the workers, who
        wait on each other, all stop at once. A star connection between two frames stays
        open until :meth:`close`, only for the Shutdown that
        :meth:`shutdown_workers` or :meth:`stop_workers` may still send
        there (the reference's way to stop a worker; after the two-call
        path's halt nothing else went out, docs/sessions.md). The listening
        socket stays until :meth:`close` too, refusing late workers."""
        with self._life.lock:
            if not self._life.record(cause, step=step, worker_id=None):
                return False
            for chan in self._channels:
                if mesh or chan.frame_open:
                    chan.close()
            if all(chan.conn.fileno() < 0 for chan in self._channels):
                self._release()  # nobody left to keep alive
        return True

    def _release(self) -> None:
        """Close every worker connection and stop the heartbeat thread
        (with the lock held; once more is harmless)."""
        # the heartbeat thread may be inside a send on a connection closed
        # below: Connection.close() then waits for it to leave the descriptor
        self._stop.set()
        for chan in self._channels:
            chan.close()
        beat = self._heartbeat_thread
        if beat is not None and beat is not threading.current_thread():
            beat.join(self.timeout)

    def _check_ready(self) -> None:
        """Before a step's call: the session's failure, or that it is
        closed, or that the join is not done."""
        self._life.check()
        if self._life.state is CoordinatorState.JOINING:
            raise DdpwireError(
                f"only {self.worker_count} of {counted(self.expect_workers, 'worker')} joined: "
                "call wait_for_workers() first")

    def wait_for_workers(self, timeout: Optional[float] = None, *,
                         count: Optional[int] = None) -> List[WorkerInfo]:
        """Admit workers until ``expect_workers`` have joined (or, with
        ``count``, return once that many have: call again for the rest).

        Every handshake runs at once, each within ``handshake_timeout``; the
        join as a whole ends at ``timeout`` (default: the constructor's
        ``join_timeout``) from this call, with :class:`~ddpwire.JoinTimeout`
        naming who is missing. worker_id is the order of admission; a worker
        that disconnects before the join completes frees its id for the next.
        Afterwards every new connection is refused at once (a ddpwire worker
        hears that training has started).
        """
        limit = self.join_timeout if timeout is None else check_timeout("timeout", timeout)
        self._life.check()
        if self._late is not None:
            return self._wait_late(limit, count)
        if self._refuser is not None:
            return list(self.workers)
        if self._admission is None:
            self._admission = Admission(
                self._listener, expect_workers=self.expect_workers, token=self._token,
                grants=self._grants, samples=self.total_samples or None,
                handshake_timeout=self.handshake_timeout, max_frame=self.max_frame,
                per_block=self.per_block, gradient_length=self.gradient_length,
                elastic=self.elastic, resume=self.resume)
        until = self.expect_workers if count is None else min(count, self.expect_workers)
        admitted = self._admission.run(time.monotonic() + limit, limit, until)
        if len(admitted) < self.expect_workers:
            return [a.info() for a in admitted]
        for a in admitted:
            self._channels.append(self._open_channel(a))
            self.workers.append(a.info())
        if self.elastic:
            # the join goes on between steps, for workers that come late or back
            self._late = self._admission
            if self.resume:
                self._next_step = self._late.resume_step or 0
                log.info("resuming the run at step %d, where its workers are", self._next_step)
            self._late.resume = False  # a later joiner is handed the state
        else:
            self._refuser = Refuser(self._admission.handshakes,
                                    detail=f"training has started with "
                                           f"{counted(self.expect_workers, 'worker')}")
        self._admission = None
        with self._talking(None):
            self._start_shards(admitted)
            self._announce_topology(admitted)
        self._set_state(CoordinatorState.READY)
        if self.heartbeat and self._heartbeat_thread is None:
            self._heartbeat_thread = threading.Thread(
                target=self._send_heartbeats, name="ddpwire-coordinator-heartbeat", daemon=True)
            self._heartbeat_thread.start()
        return list(self.workers)

    def _open_channel(self, a: "Admitted") -> Channel:
        return Channel(a.sock, timeout=self.timeout, lost=WorkerLost, peer_id=a.worker_id,
                       peer_name=f"worker {a.worker_id} ({a.join.node_id}@{a.address[0]})",
                       max_frame=self.max_frame, heartbeat_timeout=self.heartbeat_timeout)

    def _start_shards(self, admitted: list) -> None:
        """Shards by measured speed when ``balance`` asks and every worker
        reports its compute time; the reference's split otherwise."""
        timed = [Extension.BALANCE in a.granted for a in admitted]
        # "auto" stays off beside a reference worker: its speed is only seen
        # from when its gradient arrives, its weight applied here
        self.shards = _balance.Shards(timed, self.balance is True or
                                      (self.balance == "auto" and all(timed)),
                                      weighted=self.elastic)
        for chan, on in zip(self._channels, timed):
            if on:
                chan.on_timing = self._timing_from(chan.peer_id)
        if self.shards.balance:
            log.info("shards follow each worker's measured speed")

    def _timing_from(self, worker_id: int) -> Callable[[StepTiming], None]:
        def on_timing(msg: StepTiming) -> None:
            assert self.shards is not None
            why = self.shards.observe(worker_id, msg.step, msg.compute_us)
            if why is not None:
                raise ProtocolError(why, worker_id=worker_id, step=msg.step)
        return on_timing

    def _announce_topology(self, admitted: list) -> None:
        """Choose the star or the mesh for flat steps and tell every worker
        that was granted the mesh which (an empty MeshPeers keeps the star)."""
        if self.per_block:
            # no worker was granted the mesh: nothing to tell them
            log.info("per-block steps run on the star, through this coordinator")
            if self.compression:
                log.warning("compression=%r is off: it travels on the mesh only",
                            self.compression)
            self._limit_receive(admitted)
            return
        addresses: List[Optional[Tuple[str, int]]] = []
        hosts: List[Optional[bytes]] = []
        for a in admitted:
            value = a.granted.get(Extension.MESH) is not None and \
                (a.join.extensions or {}).get(Extension.MESH)
            try:
                addresses.append((a.address[0], _mesh.peer_port(value)) if value else None)
                hosts.append(_mesh.peer_host(value) if value else None)
            except ProtocolError as exc:
                log.warning("worker %d: %s; it takes the star", a.worker_id, exc)
                addresses.append(None)
                hosts.append(None)
        outsiders = [a.worker_id for a, addr in zip(admitted, addresses) if addr is None]
        if self.topology == "mesh" and outsiders:
            raise DdpwireError(f"topology 'mesh': worker {outsiders[0]} "
                               f"({admitted[outsiders[0]].join.node_id}) did not offer the mesh")
        self.mesh = not outsiders
        if self.mesh:
            # Shared memory carries float32 only: 16-bit words save wire
            # bytes, and with no wire they would only cost precision.
            shared = (self.shared_memory and len(admitted) > 1 and _shm.enabled()
                      and self.codec == _mesh.Codec.FLOAT32
                      and hosts[0] is not None and all(h == hosts[0] for h in hosts))
            self.share = 0 if shared or self.codec != _mesh.Codec.FLOAT32 else \
                self._choose_share(admitted, hosts)
            table = MeshPeers(key=_mesh.new_key(), codec=int(self.codec),
                              shared_memory=int(shared), coordinator_share=self.share,
                              peers=_mesh.format_peers(addresses))  # type: ignore[arg-type]
            log.info("flat steps run on the mesh %s (%s%s%s)",
                     f"between the {len(admitted)} workers" if len(admitted) > 1
                     else "of its 1 worker", self.compression or "float32",
                     ", in shared memory" if shared else "",
                     f", {self.share / 65536:.1%} through the coordinator" if self.share else "")
        else:
            table = MeshPeers(key=bytes(32), codec=0, shared_memory=0, peers="")
            log.info("flat steps run on the star: worker %d does not take part in a mesh",
                     outsiders[0])
            if self.compression:
                log.warning("compression=%r is off: it travels on the mesh only",
                            self.compression)
        for chan, addr, a in zip(self._channels, addresses, admitted):
            if Extension.MESH in a.granted:
                chan.send(table)
        self._limit_receive(admitted)

    def _limit_receive(self, admitted: list) -> None:
        """Each worker connection's receive window (``receive_window``)."""
        if self.receive_window is None:
            return
        for a in admitted:
            if self.receive_window != "auto":
                window: Optional[int] = self.receive_window  # type: ignore[assignment]
            elif self.mesh or is_loopback(a.address[0]):
                continue  # no N-to-1 stream here, or no link to share
            else:
                window = _incast.receive_window(_incast.round_trip(a.sock), len(admitted))
            if window is not None:
                _incast.limit_receive(a.sock, window)
                log.info("worker %d: receive window %d bytes", a.worker_id, window)

    def _choose_share(self, admitted: list, hosts: List[Optional[bytes]]) -> int:
        """MeshPeers.coordinator_share for a mesh over the links."""
        if self.coordinator_share != "auto":
            return _mesh.share_value(self.coordinator_share)  # type: ignore[arg-type]
        here = _shm.host_id()
        for a, host in zip(admitted, hosts):
            if host == here or is_loopback(a.address[0]) or \
                    a.address[0] == a.sock.getsockname()[0]:
                log.info("worker %d runs on this host: the mesh takes no coordinator share",
                         a.worker_id)
                return 0
        return _mesh.share_value(_mesh.auto_share(len(admitted)))

    def _send_heartbeats(self) -> None:
        assert self.heartbeat is not None
        while not self._stop.wait(self.heartbeat):
            for chan in list(self._channels):
                try:
                    chan.try_send_heartbeat(self.node_id)
                except (DdpwireError, OSError) as exc:
                    log.debug("heartbeat to worker %s failed: %s", chan.peer_id, exc)

    def close(self) -> None:
        """Close every connection and the listening socket. After a failure,
        the failure stays what every call raises."""
        for chan in self._dropped:
            chan.close()
        self._dropped = []
        with self._life.lock:
            state = self._life.state
            if state is CoordinatorState.CLOSED:
                return
            self._set_state(CoordinatorState.CLOSED)
            self._release()
        if self._refuser is not None:
            self._refuser.close()
        if self._late is not None:
            self._late.close_late()
        if self._admission is not None:
            self._admission.handshakes.close_all()
            for slot in self._admission.slots:
                if slot is not None:
                    slot.sock.close()
        self._listener.close()

    def __enter__(self) -> "Coordinator":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- shards ----

    def set_total_samples(self, total: int) -> None:
        """The number of samples split between the workers at every step."""
        if total < 0:
            raise ValueError(f"total samples must be >= 0, got {total}")
        self.total_samples = int(total)

    def shard_bounds(self, worker_id: int) -> Tuple[int, int]:
        """[start, end) of the worker's shard in the step last assigned:
        without balancing T // n each, the rest to the last."""
        self._check_ready()
        assert self.shards is not None
        if self.shards.step is None:
            self.shards.plan(0, self.total_samples)
        return self.shards.bounds(worker_id)

    def send_shard_assignments(self, step: int) -> None:
        """Send every worker its ShardAssignment for ``step`` (and a timed
        worker its ShardScale: docs/extensions.md, "Shards by measured speed")."""
        self._check_ready()
        assert self.shards is not None
        self._reap_dropped()
        if self._late is not None:
            with self._talking(step):
                self._admit_late(step, 0.0, self.expect_workers)
        self.shards.plan(step, self.total_samples)
        self._assigned_at = time.perf_counter()
        with self._talking(step):
            sent: List[Channel] = []
            lost: Dict[int, WorkerLost] = {}
            self._assigning = True
            try:
                self._assign(step, sent, lost)
            finally:
                self._assigning = False
            if lost:
                # those told already compute the step: it is called off for them
                self._call_off(step, lost, sent, [None] * len(sent), None)

    def _assign(self, step: int, sent: List[Channel], lost: Dict[int, WorkerLost]) -> None:
        """Every worker's ShardAssignment (and ShardScale) for ``step``: those
        sent to go into ``sent``; in an elastic session the workers lost on
        the way into ``lost``."""
        assert self.shards is not None
        for chan in list(self._channels):
            start, end = self.shards.bounds(chan.peer_id)
            try:
                chan.send(ShardAssignment(step=step, shard_start=start, shard_end=end),
                          step=step)
                if chan.on_timing is not None:
                    chan.send(ShardScale(step=step, scale=self.shards.scale(chan.peer_id)),
                              step=step)
            except WorkerLost as exc:
                if not self.elastic:
                    raise
                lost[chan.peer_id] = exc
                continue
            sent.append(chan)

    # ---- averaging: one entry per message kind ----

    def allreduce(self, step: int, out: Optional[np.ndarray] = None, *,
                  reply: bool = True) -> ReduceResult:
        """Average every worker's GradientPayload for ``step`` into ``out``
        (float32, the gradient length; allocated when None).

        With ``reply`` (the default) the AveragedGradient streams back while
        the gradients still arrive: each element range goes out as soon as
        every worker's elements for it are in and averaged, and global_loss
        last, once every loss and count is in. Without it nothing is sent:
        send the result with :meth:`broadcast_averaged` (that is the
        reference's collect_and_reduce).

        What a failure leaves (docs/sessions.md, "Halting" and "When a
        session fails"): any error ends the session and is raised again by
        every later call; the connections it leaves inside a frame close
        (after a mesh step, every connection). Errors found in
        the heads (GradientMismatch, UnexpectedMessage) come before any byte
        of the average. With ``reply``, a NaN or +/-inf found later stops
        every send at once, drains the incoming frames and raises
        NonFiniteGradient: a worker may hold the first part of the average,
        never a complete AveragedGradient (global_loss, its last field, is
        only sent once every gradient has been checked), so none can apply
        it; a lost worker (WorkerLost) ends it the same way.

        ``reduce_time`` covers the pass after the heads (transfer in,
        average, and with ``reply`` the transfer out); ``wait_time`` the
        wait for the heads.
        """
        if self.mesh:
            if out is not None:
                raise ValueError("out: in a mesh session the average stays on the workers "
                                 "(topology='star' keeps a copy here)")
            self._check_ready()
            part = self._mesh_part(step) if self.share else None
            result = self._mesh_collect(step, part)
            if reply:
                self._mesh_commit(step, result.global_loss)
            return result
        if self.elastic:
            return self._elastic_average(step, out, reply)
        return self._average(_FLAT, step, None, out, reply)

    def _mesh_part(self, step: int) -> Tuple[int, Optional[list]]:
        """This coordinator's part of a mesh step's reduce-scatter: every
        worker's GradientPayload of the vector's last elements, averaged as
        the star averages and streamed back while it arrives. A non-finite
        element does not cut the reply short (the workers hold it until the
        StepCommit, which halts the step). Returns the part's length and,
        when some element was not finite, each worker's first (index in the
        part, value), index -1 for none."""
        # the workers are inside their reduce-scatter: cut short, it is over
        with self._talking(step, any_error=True, mesh=True):
            result, bad = self._stream(_FLAT, step, None, None, True, pinned=False, halt=False)
        return len(result.avg_gradients), bad

    def _mesh_collect(self, step: int, part: Optional[Tuple[int, Optional[list]]] = None
                      ) -> ReduceResult:
        """Every worker's StepReport for a mesh step: their slices are
        averaged, none applied. A worker that fails the step is named as
        :meth:`_mesh_answers` and :meth:`_mesh_culprit` find it, and every
        connection closes. A non-finite element anywhere (``part``: the
        coordinator's own part, from :meth:`_mesh_part`) halts the step
        here: every worker hears which, the connections close."""
        with self._talking(step, mesh=True):
            return self._mesh_reports(step, part)

    def _mesh_reports(self, step: int, part: Optional[Tuple[int, Optional[list]]]
                      ) -> ReduceResult:
        t0 = time.perf_counter()
        reports: List[StepReport] = []
        answers, silent, alive = self._mesh_answers(step)
        if not all(isinstance(a, StepReport) for a in answers):
            culprit = self._mesh_culprit(answers, step, silent, alive)
            assert culprit is not None
            raise culprit
        for chan, msg in zip(self._channels, answers):
            wid = chan.peer_id
            if msg.step != step:
                raise GradientMismatch("step", step, msg.step, worker_id=wid, step=step)
            if msg.worker_id != wid:
                raise GradientMismatch("worker_id", wid, msg.worker_id, worker_id=wid, step=step)
            want = self._lengths.get((_FLAT, None), reports[0].count if reports else msg.count)
            if msg.count != want:
                raise GradientMismatch("gradients length", want, msg.count, worker_id=wid,
                                       step=step)
            if part is not None and _plan.coordinator_part(msg.count, self.share) != part[0]:
                raise GradientMismatch("coordinator's part length (for its gradients' length)",
                                       _plan.coordinator_part(msg.count, self.share), part[0],
                                       worker_id=wid, step=step)
            reports.append(msg)
        t1 = time.perf_counter()
        bad = [(r.bad_worker, r.bad_index, r.bad_value) for r in reports
               if r.bad_worker != NO_WORKER]
        if part is not None and part[1] is not None:
            start = reports[0].count - part[0]
            bad += [(w, start + index, value) for w, (index, value) in enumerate(part[1])
                    if index >= 0]
        if bad:
            bad_worker, bad_index, bad_value = min(bad, key=lambda b: (b[0], b[1]))
            log.error("worker %d sent a non-finite gradient at step %d: halting", bad_worker, step)
            # even an interrupted halt ends the session: its frames are cut short
            with self._talking(step, any_error=True, mesh=True):
                try:
                    self._broadcast(StepCommit(step=step, global_loss=0.0, bad_worker=bad_worker,
                                               bad_index=bad_index, bad_value=bad_value), step)
                except DdpwireError as exc:
                    # the halt is the cause; a worker not told hears the close
                    log.warning("step %d: the halt did not reach every worker: %s", step, exc)
                raise NonFiniteGradient(bad_worker, bad_index, bad_value, worker_id=bad_worker,
                                        step=step)
        self._lengths.setdefault((_FLAT, None), reports[0].count)
        self._check_totals(step, [r.total for r in reports])
        result = self._result(_FLAT, step, None, [], None,  # type: ignore[arg-type]
                              [(r.loss, r.correct, r.total) for r in reports], t1 - t0)
        result.reduce_time = time.perf_counter() - t1
        return result

    def _mesh_answers(self, step: int) -> Tuple[List[object], Set[int], Set[int]]:
        """Every worker's answer to a mesh step, all watched at once: a
        StepReport, a CollectiveError, or the WorkerLost of a worker that
        disconnected, went quiet for ``heartbeat_timeout`` (with heartbeats)
        or sent nothing by the deadline, ``timeout`` from now.

        Returns (answers, silent, alive): ``silent`` the workers that sent
        nothing but heartbeats by the deadline (and its grace), ``alive``
        those of them that were heard (a Heartbeat) within the last
        ``heartbeat_timeout`` (or grace) before the end. When at the deadline
        the answers do not yet single out a culprit (:meth:`_mesh_culprit`),
        the silent workers are listened to for up to :data:`MESH_BLAME_GRACE`
        longer: a live one waiting on a peer reports that peer then."""
        chans = self._channels
        what = "waiting for StepReport or CollectiveError"
        start = time.monotonic()
        deadline = start + self.timeout
        end = deadline
        grace = min(MESH_BLAME_GRACE, self.timeout)
        window = self.heartbeat_timeout if self.heartbeat_timeout is not None else grace
        answers: List[object] = [None] * len(chans)
        heard: List[Optional[float]] = [None] * len(chans)  # each one's last frame in this wait
        silent: Set[int] = set()

        def quiet_since(w: int) -> float:
            last = heard[w]
            return start if last is None else last

        def alive(now: float) -> Set[int]:
            return {w for w in silent if heard[w] is not None and now - quiet_since(w) < window}

        def settle(w: int, answer: object) -> None:
            answers[w] = answer
            silent.discard(w)
            sel.unregister(chans[w].conn.sock)

        def sure(now: float) -> bool:
            return self._mesh_culprit(answers, step, silent, alive(now), final=False) is not None

        sel = selectors.DefaultSelector()
        in_grace = False
        try:
            for w, chan in enumerate(chans):
                if chan.conn.fileno() < 0:
                    answers[w] = WorkerLost(f"{chan.conn.peer_name} connection is closed",
                                            worker_id=chan.peer_id, step=step)
                else:
                    sel.register(chan.conn.sock, selectors.EVENT_READ, w)
            while sel.get_map():
                now = time.monotonic()
                if now >= end:
                    if in_grace:
                        break
                    for key in sel.get_map().values():
                        w, chan = key.data, chans[key.data]
                        silent.add(w)
                        answers[w] = WorkerLost(
                            f"{chan.conn.peer_name} silent (heartbeats aside) past the deadline "
                            f"({self.timeout:g} s) while {what}", worker_id=chan.peer_id,
                            step=step)
                    if sure(now):
                        break
                    in_grace, end = True, deadline + grace
                    continue
                # wake at the end, or when a quiet worker reaches its heartbeat limit
                wake = end
                for key in sel.get_map().values():
                    limit = chans[key.data].heartbeat_timeout
                    if limit is not None:
                        wake = min(wake, quiet_since(key.data) + limit)
                for key, _ in sel.select(max(0.0, wake - now)):
                    w = key.data
                    try:
                        msg = chans[w].read_frame([StepReport, CollectiveError], step=step,
                                                  what=what, deadline=end)
                    except WorkerLost as exc:
                        settle(w, exc)
                        continue
                    heard[w] = time.monotonic()
                    if not isinstance(msg, SIDE_MESSAGES):
                        settle(w, msg)
                now = time.monotonic()
                for key in list(sel.get_map().values()):
                    w, chan = key.data, chans[key.data]
                    limit = chan.heartbeat_timeout
                    if limit is not None and now - quiet_since(w) >= limit:
                        settle(w, WorkerLost(f"{chan.conn.peer_name} silent for {limit:g} s while "
                                             f"{what}", worker_id=chan.peer_id, step=step))
                # in the grace, stop as soon as the answers single out the culprit
                if in_grace and sure(now):
                    break
        finally:
            sel.close()
        return answers, silent, alive(time.monotonic())

    @staticmethod
    def _mesh_culprit(answers: List[object], step: int, silent: AbstractSet[int] = frozenset(),
                      alive: AbstractSet[int] = frozenset(), *,
                      final: bool = True) -> Optional[WorkerLost]:
        """The error for a mesh step some worker could not finish, naming
        the worker to blame: the one place that chooses it.

        ``answers[w]`` is worker w's StepReport, its CollectiveError (it is
        alive, and blames the worker it names, or itself), or a WorkerLost:
        it vanished (disconnected, or its heartbeats stopped), or, for w in
        ``silent``, it sent nothing by the deadline; ``alive`` are the silent
        workers still heard from (heartbeats). When one worker fails, those
        linked to it fail too and close their links, so a worker may blame
        one that only gave up after it. The culprit is the first of:

        1. a worker that did not answer and that some CollectiveError blames;
        2. a worker that vanished;
        3. a silent worker not heard from;
        4. a silent worker still heard from;
        5. a blamed worker (every worker answered);

        the lowest-numbered within the first of these that has any. With
        ``final`` False the answers may not be all in: None when the choice
        is not sure yet, that is when it would be one of several silent
        workers (3 or 4), of which a live one may still name another."""
        unanswered = [w for w, a in enumerate(answers) if isinstance(a, WorkerLost)]
        blamed = {w: (w if a.worker_id == NO_WORKER else a.worker_id)
                  for w, a in enumerate(answers) if isinstance(a, CollectiveError)}
        named = sorted(set(blamed.values()))
        tiers = [[w for w in named if w in unanswered],
                 [w for w in unanswered if w not in silent],
                 [w for w in unanswered if w in silent and w not in alive],
                 [w for w in unanswered if w in silent and w in alive],
                 named]
        rank, tier = next((k, t) for k, t in enumerate(tiers) if t)
        if not final and rank in (2, 3) and len(tier) > 1:
            return None
        culprit = tier[0]
        reporter = next((w for w, b in sorted(blamed.items()) if b == culprit), None)
        if reporter is not None:
            detail = answers[reporter].detail  # type: ignore[union-attr]
            return WorkerLost(f"worker {reporter} could not finish its part of the mesh step: "
                              f"{detail}", worker_id=culprit, step=step)
        exc = answers[culprit]
        assert isinstance(exc, WorkerLost)
        return exc

    def _mesh_commit(self, step: int, global_loss: float) -> None:
        """The go-ahead: every worker exchanges its averaged slice and applies."""
        with self._talking(step, any_error=True, mesh=True):
            self._broadcast(StepCommit(step=step, global_loss=global_loss, bad_worker=NO_WORKER,
                                       bad_index=0, bad_value=0.0), step)

    def allreduce_block(self, step: Optional[int], block_idx: Optional[int],
                        out: Optional[np.ndarray] = None, *,
                        reply: bool = True) -> BlockReduceResult:
        """:meth:`allreduce` for one block's BlockGradientPayload (the
        reply carries worker 0's component sizes). With ``step`` or
        ``block_idx`` None, the block is whichever worker 0 sends next, and
        every other worker must send the same (the order is the workers'
        to choose, as with DDP's buckets, whose sizes may change from one
        step to the next: a followed block's length is not pinned)."""
        return self._average(_BLOCK, step, block_idx, out, reply)

    def allreduce_non_block(self, step: int, component: int, out: Optional[np.ndarray] = None, *,
                            reply: bool = True) -> NonBlockReduceResult:
        """:meth:`allreduce` for one non-block component's
        NonBlockGradientPayload (0 lm_head, 1 final_norm, 2 embedding)."""
        return self._average(_NON_BLOCK, step, component, out, reply)

    # The reference coordinator's names: collect, then broadcast separately.

    def collect_and_reduce(self, step: int, out: Optional[np.ndarray] = None) -> ReduceResult:
        """``allreduce(step, out, reply=False)``."""
        return self.allreduce(step, out, reply=False)

    def collect_and_reduce_block(self, step: int, block_idx: int,
                                 out: Optional[np.ndarray] = None) -> BlockReduceResult:
        """``allreduce_block(step, block_idx, out, reply=False)``."""
        return self.allreduce_block(step, block_idx, out, reply=False)

    def collect_and_reduce_non_block(self, step: int, component: int,
                                     out: Optional[np.ndarray] = None) -> NonBlockReduceResult:
        """``allreduce_non_block(step, component, out, reply=False)``."""
        return self.allreduce_non_block(step, component, out, reply=False)

    def _average(self, kind: _Kind, step: int, key: Optional[int], out: Optional[np.ndarray],
                 reply: bool) -> AnyResult:
        # a vector named by the caller keeps its length from step to step;
        # one the workers choose (step or key None) may change it
        pinned = step is not None and (kind.key is None or key is not None)
        result_buffer(out, None)  # a wrong out is refused before any head is read
        self._check_ready()
        with self._talking(step):
            return self._stream(kind, step, key, out, reply, pinned=pinned)[0]

    def _stream(self, kind: _Kind, step: int, key: Optional[int], out: Optional[np.ndarray],
                reply: bool, *, pinned: bool, halt: bool = True,
                heads_into: Optional[list] = None,
                socket_threads: Optional[bool] = None) -> Tuple[AnyResult, Optional[list]]:
        """The star's streaming average. With ``halt`` a non-finite element
        raises (the replies cut short); without, the reply is finished all
        the same and the result comes with ``bad`` (each worker's first
        non-finite (index, value), or None when every element was finite).
        Without ``halt`` (a mesh step's part) a worker may send a
        CollectiveError in place of its payload: the WorkerLost it names.
        ``heads_into`` receives the heads as they are read (see
        :meth:`_collect_heads`); ``socket_threads`` overrides the choice of
        engine."""
        t0 = time.perf_counter()
        heads, step, key = self._collect_heads(kind, step, key, pinned, failures=not halt,
                                               into=heads_into)
        t1 = time.perf_counter()
        out = result_buffer(out, heads[0].gradient_count)
        done: List[AnyResult] = []

        def finish(tails: List[bytes]) -> AnyResult:
            decoded = [_core.decode_tail(kind.payload.TAG, t) for t in tails]
            if kind is _FLAT:
                self._check_totals(step, [t[2] for t in decoded])
            result = self._result(kind, step, key, heads, out, decoded, t1 - t0)
            done.append(result)
            return result

        conns = [chan.conn for chan in self._channels]
        threads = self._use_socket_threads(heads) if socket_threads is None else socket_threads
        # the sample weights of the workers that do not apply their own
        scales = self.shards.sums_scales() if self.shards is not None and \
            self.shards.step == step else None
        what = f"averaging {kind.payload.__name__}"
        if not reply:
            tails, bad = _core.reduce_stream(conns, out, heads[0].tail_len, self.timeout,
                                             ring_bytes=self.ring_bytes, socket_threads=threads,
                                             step=step, what=what, scales=scales)
            self._raise_bad(bad, step)
            finish(tails)
        else:
            head = encode_frame_parts(self._reply(kind, step, key, heads, out, 0.0),
                                      max_frame=self.max_frame)[0]

            def make_tail(tails: List[bytes]) -> bytes:
                # every worker's tail is in: the result is complete, and for a
                # flat step its global_loss ends the reply
                result = finish(tails)
                loss = getattr(result, "global_loss", 0.0)
                return encode_frame_parts(self._reply(kind, step, key, heads, out, loss),
                                          max_frame=self.max_frame)[2]

            # Cut short by anything, it leaves some workers holding part of a
            # reply that will never be finished: the session is over, and
            # closing is the only way to tell them at once.
            with self._sending_to_all(), self._talking(step, any_error=True):
                _, bad = _core.allreduce_stream(
                    conns, out, heads[0].tail_len, head, make_tail, self.timeout,
                    ring_bytes=self.ring_bytes, socket_threads=threads, step=step,
                    what=f"{what} into {kind.reply.__name__}", halt_on_nonfinite=halt,
                    scales=scales)
                if halt:
                    self._raise_bad(bad, step)
        if pinned:
            self._lengths.setdefault((kind, key), len(out))
        result = done[0]
        result.reduce_time = time.perf_counter() - t1
        return result, bad

    # ---- elastic steps ----

    def _elastic_average(self, step: int, out: Optional[np.ndarray],
                         reply: bool) -> ReduceResult:
        """A flat step that a lost worker calls off instead of ending the
        session: the heads, then every element summed (no reply streams
        out meanwhile: a survivor holding part of an average could not be
        told to drop it), then the average to each worker in turn. A loss
        before the average is complete calls the step off
        (:meth:`_call_off`, MembershipChanged); one while it goes out only
        drops that worker, and the step stands."""
        result_buffer(out, None)
        self._check_ready()
        with self._talking(step):
            chans = list(self._channels)
            heads: list = []
            try:
                # the poll loop: its byte counts say where each frame stands
                result, _ = self._stream(_FLAT, step, None, out, False, pinned=True,
                                         heads_into=heads, socket_threads=False)
            except WorkerLost as exc:
                # lost during the heads (those not read yet are None) or the
                # sum (how far each frame was read rides on the error)
                self._call_off(step, {self._blamed(exc): exc}, chans,
                               heads + [None] * (len(chans) - len(heads)),
                               getattr(exc, "received", None))
            assert self.shard_log is not None and self.shards is not None
            self.shard_log.append((step, {c.peer_id: self.shards.bounds(c.peer_id)
                                          for c in chans}))
            self._next_step = step + 1
            sent_at = time.perf_counter()
            if reply:
                self._send_each(AveragedGradient(step=step, gradients=result.avg_gradients,
                                                 global_loss=result.global_loss), step)
        result.reduce_time += time.perf_counter() - sent_at
        return result  # type: ignore[return-value]

    @staticmethod
    def _blamed(exc: WorkerLost) -> int:
        assert exc.worker_id is not None, exc
        return int(exc.worker_id)

    def _call_off(self, step: int, lost: Dict[int, WorkerLost], chans: List[Channel],
                  heads: list, received: Optional[List[int]]) -> None:
        """Call ``step`` off after losing ``lost``: drop them, tell every
        survivor (StepAborted), read the rest of each survivor's gradient
        frame for the step (``chans`` were sent the step's shards; ``heads``
        and ``received``, where known, say how far each was read), so that
        every connection is between two frames and nothing of the step was
        applied. A survivor lost meanwhile is dropped too. Raises
        MembershipChanged; with fewer than ``min_workers`` left, once
        joiners have brought them back (waiting up to half the timeout, the
        survivors' wait for their next shard, or ``join_timeout`` when
        shorter), else the first WorkerLost."""
        gone: Dict[int, WorkerLost] = {}
        told: Set[int] = set()
        drained: Set[int] = set()
        fresh = dict(lost)
        while fresh:
            for w, exc in fresh.items():
                gone[w] = exc
                self._drop(w, step, exc, committed=False)
            fresh = {}
            for w in sorted(set(gone) - told):
                told.add(w)
                for chan in self._channels:
                    try:
                        chan.send(StepAborted(step=step, worker_id=w,
                                              workers=len(self._channels)), step=step)
                    except WorkerLost as exc:
                        fresh.setdefault(chan.peer_id, exc)
            deadline = time.monotonic() + self.timeout
            for chan, head, got in zip(chans, heads, received or [0] * len(chans)):
                if chan.peer_id in gone or chan.peer_id in fresh or chan.peer_id in drained:
                    continue
                try:
                    chan.discard_gradients(head, got, deadline=deadline, step=step)
                    drained.add(chan.peer_id)
                except WorkerLost as exc:
                    fresh[chan.peer_id] = exc
        if len(self._channels) < self.min_workers and self._late is not None:
            log.warning("step %d: %s left, fewer than min_workers (%d): waiting for workers to "
                        "join", step, counted(len(self._channels), "worker"), self.min_workers)
            self._admit_late(step, min(self.join_timeout, self.timeout / 2), self.min_workers)
        if len(self._channels) < self.min_workers:
            # nobody will send them anything more: closing tells them at once
            for chan in self._channels:
                chan.close()
            first = next(iter(lost.values()))
            raise first.__class__(
                f"{first.message}; {counted(len(self._channels), 'worker')} left, fewer "
                f"than min_workers ({self.min_workers})", worker_id=first.worker_id, step=step)
        raise MembershipChanged(sorted(gone), len(self._channels), step=step,
                                why="; ".join(e.message for e in gone.values()))

    def _drop(self, worker_id: int, step: int, exc: WorkerLost, *, committed: bool) -> None:
        """Take a lost worker out of the session: no more shards, no place
        in any later sum. One that may only be stalled (a stopped process)
        is told it was dropped, and its connection half-closed, so that
        resumed it reads StepAborted naming itself, not a reset."""
        chan = next((c for c in self._channels if c.peer_id == worker_id), None)
        if chan is None:
            return
        self._channels = [c for c in self._channels if c is not chan]
        self.workers = [i for i in self.workers if i.worker_id != worker_id]
        assert self.shards is not None
        self.shards.drop(worker_id)
        if self._late is not None:
            self._late.release(worker_id)
        event = MembershipEvent(step, worker_id, exc.message, len(self._channels),
                                         committed)
        self.membership.append(event)
        log.warning("worker %d lost during step %d (%s): %s with %s", worker_id, step,
                    exc.message, "the step stands, going on" if committed else "redoing it",
                    counted(len(self._channels), "worker"))
        # a heartbeat may be going out: it is short, and a frame of its own
        if not chan.send_lock.acquire(timeout=1.0):
            chan.close()
            return
        try:
            if chan.frame_open or chan.conn.fileno() < 0:
                chan.close()  # inside a frame from here: closing is all it can be told
                return
            chan.conn.send_parts(encode_frame_parts(StepAborted(
                step=step, worker_id=worker_id, workers=len(self._channels))), 1.0,
                what="telling a dropped worker")
            chan.conn.sock.shutdown(socket.SHUT_WR)
        except (DdpwireError, OSError):
            chan.close()
            return
        finally:
            chan.send_lock.release()
        self._dropped.append(chan)

    def _wait_late(self, limit: float, count: Optional[int]) -> List[WorkerInfo]:
        """wait_for_workers between two steps of an elastic session: admit
        late joiners (each handed the model's state, :meth:`_admit_late`)
        until ``count`` (default ``expect_workers``) take part; JoinTimeout
        after ``limit`` seconds."""
        want = self.expect_workers if count is None else min(count, self.expect_workers)
        deadline = time.monotonic() + limit
        step = self._next_step
        with self._talking(step):
            while len(self._channels) < want:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise JoinTimeout(f"{len(self._channels)} of {counted(want, 'worker')} "
                                      f"in the session within {limit:g} s")
                self._admit_late(step, left, want)
        return list(self.workers)

    def _admit_late(self, step: int, timeout: float, until: int) -> None:
        """Take in the workers that completed the join since the last step
        (waiting up to ``timeout`` for ``until`` to take part): each receives
        the model's state before ``step`` from a worker in the session
        (:meth:`_hand_state`) and takes part from ``step`` on."""
        assert self._late is not None and self.shards is not None
        self._late.grants[Extension.ELASTIC] = encode_u64(step)
        for a in self._late.admit_late(timeout, until):
            chan = self._open_channel(a)
            try:
                self._hand_state(step, chan)
            except WorkerLost as exc:
                if exc.worker_id != a.worker_id:
                    raise
                log.warning("worker %d joined before step %d but could not take the model's "
                            "state: %s", a.worker_id, step, exc.message)
                chan.close()
                self._late.release(a.worker_id)
                continue
            self._channels = sorted(self._channels + [chan], key=lambda c: c.peer_id)
            self.workers = sorted(self.workers + [a.info()], key=lambda i: i.worker_id)
            timed = Extension.BALANCE in a.granted
            self.shards.add(a.worker_id, timed)
            if timed:
                chan.on_timing = self._timing_from(a.worker_id)
            event = MembershipEvent(step, a.worker_id, f"joined from {a.join.node_id}@"
                                    f"{a.address[0]}", len(self._channels), False, joined=True)
            self.membership.append(event)
            log.warning("worker %d (%s@%s) joined before step %d: going on with %s",
                        a.worker_id, a.join.node_id, a.address[0], step,
                        counted(len(self._channels), "worker"))

    def _hand_state(self, step: int, joiner: Channel) -> None:
        """Relay the model's state before ``step`` from a worker in the
        session to ``joiner``, piece by piece (ModelState, docs/extensions.md):
        asked of each in turn until one answers; one lost meanwhile is
        dropped. The joiner checks the digest."""
        for source in list(self._channels):
            try:
                source.send(StateRequest(step=step), step=step)
                for piece in source.state_pieces(step, deadline=time.monotonic() + self.timeout):
                    joiner.send(piece, step=step)
                return
            except WorkerLost as exc:
                if exc.worker_id == joiner.peer_id:
                    raise
                self._drop(source.peer_id, step, exc, committed=True)
        raise WorkerLost(f"no worker in the session to take the model's state from for "
                         f"step {step}", worker_id=joiner.peer_id, step=step)

    def _reap_dropped(self) -> None:
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

    def _send_each(self, msg: object, step: int) -> None:
        """``msg`` to every worker, one connection after another: a worker
        lost meanwhile is dropped and the others still get all of it."""
        parts = encode_frame_parts(msg, max_frame=self.max_frame)
        lost: Dict[int, WorkerLost] = {}
        for chan in list(self._channels):
            with chan.send_lock:
                chan.frame_open = True
                try:
                    _core.send_many([chan.conn], parts, self.timeout, step=step,
                                    what=f"sending {type(msg).__name__}")
                except WorkerLost as exc:
                    lost[chan.peer_id] = exc  # its frame stays open: it is closed
                    continue
                chan.frame_open = False
        for w, exc in lost.items():
            self._drop(w, step, exc, committed=True)
        if len(self._channels) < self.min_workers:
            raise WorkerLost(f"{counted(len(self._channels), 'worker')} left after step "
                             f"{step}, fewer than min_workers ({self.min_workers})", step=step)

    def _check_totals(self, step: int, totals: List[int]) -> None:
        """Unequal shards: every count must match its worker's shard."""
        assert self.shards is not None
        wrong = self.shards.check_totals(totals)
        if wrong is not None:
            w, want, got = wrong
            raise GradientMismatch(f"total (for a shard of {self.shards.split[w]} samples)",
                                   want, got, worker_id=w, step=step)

    @staticmethod
    def _reply(kind: _Kind, step: int, key: Optional[int], heads: list, out: np.ndarray,
               global_loss: float) -> object:
        """The averaged message for ``out`` (only the flat one has a tail)."""
        if kind is _FLAT:
            return AveragedGradient(step=step, gradients=out, global_loss=global_loss)
        if kind is _BLOCK:
            return AveragedBlockGradient(step=step, block_idx=key,
                                         component_sizes=heads[0].component_sizes, gradients=out)
        return AveragedNonBlockGradient(step=step, component=key, gradients=out)

    @staticmethod
    def _result(kind: _Kind, step: int, key: Optional[int], heads: list, avg: np.ndarray,
                tails: list, wait_time: float) -> AnyResult:
        if kind is _BLOCK:
            return BlockReduceResult(step=step, block_idx=key, avg_gradients=avg,
                                     component_sizes=heads[0].component_sizes, reduce_time=0.0,
                                     wait_time=wait_time)
        if kind is _NON_BLOCK:
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

    def _collect_heads(self, kind: _Kind, step: Optional[int], key: Optional[int],
                       pinned: bool = True, failures: bool = False,
                       into: Optional[list] = None
                       ) -> Tuple[List["_core.FrameHead"], int, Optional[int]]:
        """Every worker's frame head, in worker order, checked; the elements
        stay in the sockets for the streaming reduce. The heads of one step
        are due within one timeout: a worker's heartbeats do not extend it.
        A step or key of None is worker 0's. Returns (heads, step, key);
        the heads go into ``into`` as they are read, when given (so a caller
        sees which were read when one fails)."""
        deadline = time.monotonic() + self.timeout
        if self.shards is not None and self.shards.step == step and self.shards.untimed():
            self._time_arrivals(step, deadline)
        heads = [] if into is None else into
        for chan in self._channels:
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
            if kind is _BLOCK:
                total = int(head.component_sizes.sum(dtype=np.uint64))
                if total != head.gradient_count:
                    raise GradientMismatch("sum of component_sizes", head.gradient_count, total,
                                           worker_id=wid, step=step)
                if heads and not np.array_equal(head.component_sizes, heads[0].component_sizes):
                    raise GradientMismatch("component_sizes", list(heads[0].component_sizes),
                                           list(head.component_sizes), worker_id=wid, step=step)
            heads.append(head)
        what = "gradients length" if kind.key is None else f"{kind.key.replace('_idx', '')} {key} gradients length"
        want = self._lengths.get((kind, key), heads[0].gradient_count) if pinned \
            else heads[0].gradient_count
        for chan, head in zip(self._channels, heads):
            if head.gradient_count != want:
                raise GradientMismatch(what, want, head.gradient_count, worker_id=chan.peer_id,
                                       step=step)
        return heads, step, key

    def _time_arrivals(self, step: int, deadline: float) -> None:
        """A worker that reports no compute time (a reference worker) sends
        nothing between its ShardAssignment and its gradient: the moment its
        socket turns readable, watched for all of them at once, ends its
        compute. One that is late, or closed, is left to the reads after."""
        assert self.shards is not None
        poller = select.poll()
        waiting = {}
        for w in self.shards.untimed():
            chan = self.channel(w)
            waiting[chan.conn.fileno()] = w
            poller.register(chan.conn.fileno(), select.POLLIN)
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            for fd, _ in poller.poll(max(1, int(left * 1000))):
                w = waiting.pop(fd)
                poller.unregister(fd)
                self.shards.observe(w, step, int((time.perf_counter() - self._assigned_at) * 1e6))

    def _raise_bad(self, bad: Optional[list], step: int) -> None:
        if bad is None:
            return
        for chan, (index, value) in zip(self._channels, bad):
            wid = chan.peer_id
            if index >= 0:
                log.error("worker %d sent a non-finite gradient at step %d: halting", wid, step)
                raise NonFiniteGradient(wid, index, value, worker_id=wid, step=step)

    def _use_socket_threads(self, heads: list) -> bool:
        """Whether the vectors these heads announce stream on threads."""
        return _socket_threads.for_coordinator(self.socket_threads, len(self._channels),
                                               4 * heads[0].gradient_count)

    # ---- broadcast ----

    def _broadcast(self, msg: object, step: int) -> None:
        parts = encode_frame_parts(msg, max_frame=self.max_frame)
        with self._sending_to_all():
            _core.send_many([c.conn for c in self._channels], parts, self.timeout, step=step,
                            what=f"sending {type(msg).__name__}")

    @contextlib.contextmanager
    def _sending_to_all(self) -> Iterator[None]:
        """Hold every worker's send lock: a heartbeat must not land inside a
        frame. Each connection's frame stays open (Channel.frame_open) when
        the block ends in an exception."""
        held: List[Channel] = []
        try:
            for chan in self._channels:
                chan.send_lock.acquire()
                held.append(chan)
                chan.frame_open = True
            yield
            for chan in held:
                chan.frame_open = False
        finally:
            for chan in held:
                chan.send_lock.release()

    def broadcast_averaged(self, step: int, result: ReduceResult) -> None:
        """Send every worker the same AveragedGradient (in a mesh session, the
        StepCommit that lets them exchange and apply their averaged slices)."""
        self._check_ready()
        if self.mesh:
            self._mesh_commit(step, result.global_loss)
            return
        with self._talking(step):
            self._broadcast(AveragedGradient(step=step, gradients=result.avg_gradients,
                                             global_loss=result.global_loss), step)

    def broadcast_averaged_block(self, step: int, result: BlockReduceResult) -> None:
        """Send every worker the same AveragedBlockGradient."""
        self._check_ready()
        with self._talking(step):
            self._broadcast(AveragedBlockGradient(step=step, block_idx=result.block_idx,
                                                  component_sizes=result.component_sizes,
                                                  gradients=result.avg_gradients), step)

    def broadcast_averaged_non_block(self, step: int, result: NonBlockReduceResult) -> None:
        """Send every worker the same AveragedNonBlockGradient."""
        self._check_ready()
        with self._talking(step):
            self._broadcast(AveragedNonBlockGradient(step=step, component=result.component,
                                                     gradients=result.avg_gradients), step)

    def shutdown_workers(self) -> None:
        """Send Shutdown to every worker still connected (a lost one is
        skipped): after a failure too, to the workers whose connection it
        left open between frames (:meth:`_fail`)."""
        for chan in self._channels:
            try:
                chan.send(Shutdown())
            except DdpwireError as exc:
                log.warning("could not send Shutdown to worker %s: %s", chan.peer_id, exc)

    @property
    def mid_frame(self) -> bool:
        """Whether some worker connection is inside a frame this coordinator
        sends (or one that an exception cut short): no other frame, a
        Shutdown included, may go there before it ends. So is a step whose
        ShardAssignments are going out: a Shutdown then would reach some
        workers after their shard and the others before theirs, and in a
        mesh the first would wait on the others inside the step."""
        return self._assigning or any(chan.frame_open for chan in self._channels)

    def stop_workers(self, grace: float = 10.0) -> int:
        """End the run before its last step (the caller was interrupted):
        send Shutdown to every worker whose connection is between two frames,
        then give each up to ``grace`` seconds to hang up. Returns how many
        were told.

        A worker waiting for a shard then ends its run as after the last
        step; one waiting for an average raises ShutdownDuringReduce. A
        connection left inside a frame (an exception cut the frame short) is
        skipped: a Shutdown there would be read as the rest of that frame.
        The wait for the hang-up matters: a worker may still be sending its
        gradients, and closing with them unread would reset the connection,
        failing that send before the worker reads the Shutdown."""
        grace = check_timeout("grace", grace)
        deadline = time.monotonic() + grace
        self._stop.set()  # no heartbeat after the Shutdown
        frame = encode_frame_parts(Shutdown())
        told: List[Channel] = []
        for chan in self._channels:
            if chan.conn.fileno() < 0:
                continue  # closed: a failed step abandoned it
            # the heartbeat thread may be inside a frame: it is short, wait
            if not chan.send_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                continue
            try:
                if chan.frame_open:
                    log.info("worker %s: its connection is inside a frame, no Shutdown",
                             chan.peer_id)
                    continue
                chan.conn.send_parts(frame, min(grace, self.timeout), what="sending Shutdown")
                told.append(chan)
            except DdpwireError as exc:
                log.debug("could not send Shutdown to worker %s: %s", chan.peer_id, exc)
            finally:
                chan.send_lock.release()
        self._await_hang_up(told, deadline)
        return len(told)

    @staticmethod
    def _await_hang_up(chans: List[Channel], deadline: float) -> None:
        """Read and drop what each connection still brings until its worker
        closes it, or the deadline passes."""
        sel = selectors.DefaultSelector()
        try:
            for chan in chans:
                try:
                    chan.conn.sock.shutdown(socket.SHUT_WR)  # nothing more from here
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
                        data = key.fileobj.recv(1 << 16, socket.MSG_DONTWAIT)
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        data = b""
                    if not data:
                        sel.unregister(key.fileobj)
        finally:
            sel.close()
