"""The coordinator: admits workers, assigns shards, averages their gradients.

It mirrors the reference coordinator's session (protocol.md, "Session
semantics") with what the reference leaves undefined made into typed errors.
Its parts each have a module: the listening socket :mod:`ddpwire.session.intake`,
the join on it (concurrent handshakes, tokens, refusals)
:mod:`ddpwire.session.admission`, the workers' connections and the one
failure path :mod:`ddpwire.session.roster`, the star's streaming average
:mod:`ddpwire.session.star`, the mesh's control :mod:`ddpwire.session.mesh_control`, an
elastic session's losses and joins :mod:`ddpwire.session.elastic`, the shards
:mod:`ddpwire.session.balance`. This module is the session's face: its state and
the calls a training loop makes, in order.
"""
from __future__ import annotations

import enum
import logging
from typing import Dict, FrozenSet, List, Mapping, Optional, Tuple, Union

import numpy as np

from . import balance as _balance
from .._text import counted
from .admission import Admitted
from ..wire.channel import Channel, check_timeout, result_buffer
from .elastic import Membership
from ..wire.errors import DdpwireError
from .intake import Intake
from .lifecycle import Lifecycle, LifecycleOwner
from .mesh_control import MeshControl
from .options import UNSET, CoordinatorOptions, SessionOptions
from .results import BlockReduceResult, MembershipEvent, NonBlockReduceResult, ReduceResult
from .roster import Roster
from .sessioninfo import WorkerInfo
from .star import BLOCK, FLAT, NON_BLOCK, AnyResult, Kind, Star, limit_receive

__all__ = ["Coordinator", "CoordinatorState"]

log = logging.getLogger("ddpwire.coordinator")


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

    Takes a :class:`~ddpwire.session.options.SessionOptions` (``options``, the object
    :meth:`Worker.connect` takes too) or its fields as keywords, not both;
    the other keywords are :class:`~ddpwire.session.options.CoordinatorOptions`,
    documented there. ``timeout`` bounds every wait on a worker: one silent
    that long raises :class:`~ddpwire.WorkerLost` naming it and the step.
    What a failure leaves: docs/sessions.md ("When a session fails").
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
        encrypt: bool = UNSET,
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
        require_encryption: bool = False,
    ) -> None:
        opts, config = CoordinatorOptions.split(options, expect_workers, dict(locals()))
        #: the session's options and the coordinator's, as checked: the one
        #: home of every option (``coord.options.timeout``, ``coord.config.topology``)
        self.options, self.config = opts, config
        self.expect_workers = expect_workers
        self._life: Lifecycle[CoordinatorState] = Lifecycle(
            CoordinatorState.JOINING, _COORDINATOR_MOVES, failed=CoordinatorState.FAILED,
            closed=CoordinatorState.CLOSED, owner="the coordinator")
        self._roster = Roster(opts, self._life)
        self._star = Star(self._roster, config.ring_bytes, opts.socket_threads)
        self._mesh = MeshControl(self._roster, self._star, config)
        self._members = Membership(self._roster, self._star, config)
        self.total_samples = opts.samples_per_step or 0  # checked >= 0 by SessionOptions
        self._intake = Intake(bind, expect_workers, opts, config)

    # ---- what the session shows ----

    @property
    def local_addr(self) -> Tuple[str, int]:
        """The (host, port) listened on (the real port when bound to 0)."""
        return self._intake.local_addr

    @property
    def workers(self) -> List[WorkerInfo]:
        """The workers in the session, in worker order."""
        return list(self._roster.workers)

    @property
    def shards(self) -> Optional[_balance.Shards]:
        """Every step's shards and the workers' timings (set by the join)."""
        return self._roster.shards

    @property
    def mesh(self) -> bool:
        """Whether flat steps run on the mesh (decided when the join completes)."""
        return self._mesh.on

    @property
    def share(self) -> int:
        """MeshPeers.coordinator_share in effect: 65536ths of each mesh step's
        vector this coordinator averages (decided when the join completes)."""
        return self._mesh.share

    @property
    def membership(self) -> List[MembershipEvent]:
        """Each worker that left or joined an elastic session."""
        return self._members.events

    @property
    def shard_log(self) -> Optional[List[Tuple[int, Dict[int, Tuple[int, int]]]]]:
        """Every averaged step's shards in an elastic session (None
        otherwise), ``(step, {worker_id: (start, end)})``: each sample once."""
        return self._members.shard_log

    @property
    def worker_count(self) -> int:
        """Workers joined so far."""
        return self._intake.joined or len(self._roster.channels)

    @property
    def first_step(self) -> int:
        """The step this coordinator's run starts at: 0, or with ``resume``
        the one its workers go on from (known once they have joined)."""
        return self._members.first_step if self.config.resume else 0

    def channel(self, worker_id: int) -> Channel:
        """The connection to one joined worker, for extensions that exchange
        their own messages over it (docs/extensions.md)."""
        return self._roster.channel(worker_id)

    # ---- the session's state ----

    def _check_ready(self) -> None:
        """Before a step's call: the session's failure, its close, an unfinished join."""
        self._life.check()
        if self._life.state is CoordinatorState.JOINING:
            raise DdpwireError(
                f"only {self.worker_count} of {counted(self.expect_workers, 'worker')} joined: "
                "call wait_for_workers() first")

    def wait_for_workers(self, timeout: Optional[float] = None, *,
                         count: Optional[int] = None) -> List[WorkerInfo]:
        """Admit workers until ``expect_workers`` have joined (with ``count``,
        return once that many have; call again for the rest): every
        handshake at once, each within ``handshake_timeout``, the whole by
        ``timeout`` (default ``join_timeout``), else :class:`~ddpwire.JoinTimeout`
        naming who is missing. Later connections are refused but in an
        elastic session, where a late worker takes a free slot between steps
        (docs/sessions.md, "The join").
        """
        limit = self.config.join_timeout if timeout is None else check_timeout("timeout", timeout)
        want = self.expect_workers if count is None else min(count, self.expect_workers)
        self._life.check()
        if self._members.late is not None:
            self._members.wait(limit, want)
        elif self._life.state is CoordinatorState.JOINING:
            admitted = self._intake.admit(limit, want, self.total_samples or None)
            if len(admitted) < self.expect_workers:
                return [a.info() for a in admitted]
            self._seat(admitted)
        return self.workers

    def _seat(self, admitted: List[Admitted]) -> None:
        """The join is complete: connections, shards, the topology told; steps may run."""
        self._roster.seat(admitted)
        late = self._intake.complete()
        if late is not None:
            self._members.open(late)
        with self._roster.talking(None):
            self._roster.start_shards(admitted, self.config.balance, weighted=self.config.elastic,
                                      planned=self.config.planned_steps())
            self._mesh.announce(admitted, per_block=bool(self.options.per_block))
            limit_receive(admitted, self.config.receive_window, self._mesh.on)
        self._set_state(CoordinatorState.READY)
        self._roster.start_heartbeats(self.config.node_id)

    def close(self) -> None:
        """Close every connection and the listener (a failure stays what every call raises)."""
        self._members.close_dropped()
        with self._life.lock:
            if self._life.state is CoordinatorState.CLOSED:
                return
            self._set_state(CoordinatorState.CLOSED)
            self._roster.release()
        self._members.close_late()
        self._intake.close()

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
        shards = self._roster.shards
        assert shards is not None
        if shards.step is None:
            shards.plan(0, self.total_samples)
        return shards.bounds(worker_id)

    def send_shard_assignments(self, step: int) -> None:
        """Send every worker its ShardAssignment for ``step`` (a timed worker its
        ShardScale too); in an elastic session, first take in the workers that
        joined since the last step, calling the step off for one lost here."""
        self._check_ready()
        self._members.assign(step, self.total_samples, self.expect_workers)

    # ---- averaging: one entry per message kind ----

    def allreduce(self, step: int, out: Optional[np.ndarray] = None, *,
                  reply: bool = True) -> ReduceResult:
        """Average every worker's GradientPayload for ``step`` into ``out``
        (float32, the gradient length; allocated when None; None in a mesh
        session, where the average stays on the workers).

        With ``reply`` (the default) the AveragedGradient streams back as
        the gradients arrive, global_loss last; without it nothing is sent
        before :meth:`broadcast_averaged` (the reference's collect_and_reduce).
        Any error ends the session (docs/sessions.md, "Halting"): one in the
        heads comes before any byte of the average, and a NaN or +/-inf
        raises NonFiniteGradient before any worker can apply it.
        """
        if self._mesh.on:
            if out is not None:
                raise ValueError("out: in a mesh session the average stays on the workers "
                                 "(topology='star' keeps a copy here)")
            self._check_ready()
            return self._mesh.step(step, reply)
        if self.config.elastic:
            result_buffer(out, None)
            self._check_ready()
            return self._members.average(step, out, reply)
        return self._average(FLAT, step, None, out, reply)  # type: ignore[return-value]

    def allreduce_block(self, step: Optional[int], block_idx: Optional[int],
                        out: Optional[np.ndarray] = None, *,
                        reply: bool = True) -> BlockReduceResult:
        """:meth:`allreduce` for one block's BlockGradientPayload (the
        reply carries worker 0's component sizes). With ``step`` or
        ``block_idx`` None, the block is whichever worker 0 sends next, and
        every other worker must send the same (the workers' order, as with
        DDP's buckets, whose lengths may change between steps)."""
        return self._average(BLOCK, step, block_idx, out, reply)  # type: ignore[return-value]

    def allreduce_non_block(self, step: int, component: int, out: Optional[np.ndarray] = None, *,
                            reply: bool = True) -> NonBlockReduceResult:
        """:meth:`allreduce` for one non-block component's
        NonBlockGradientPayload (0 lm_head, 1 final_norm, 2 embedding)."""
        return self._average(NON_BLOCK, step, component, out, reply)  # type: ignore[return-value]

    def _average(self, kind: Kind, step: Optional[int], key: Optional[int],
                 out: Optional[np.ndarray], reply: bool) -> AnyResult:
        result_buffer(out, None)  # a wrong out is refused before any head is read
        self._check_ready()
        return self._star.average(kind, step, key, out, reply)

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

    def broadcast_averaged(self, step: int, result: ReduceResult) -> None:
        """Send every worker the same AveragedGradient (in a mesh session, the
        StepCommit that lets them exchange and apply their averaged slices)."""
        self._check_ready()
        if self._mesh.on:
            self._mesh.commit(step, result.global_loss)
            return
        self._star.broadcast(FLAT, step, result)

    def broadcast_averaged_block(self, step: int, result: BlockReduceResult) -> None:
        """Send every worker the same AveragedBlockGradient."""
        self._check_ready()
        self._star.broadcast(BLOCK, step, result)

    def broadcast_averaged_non_block(self, step: int, result: NonBlockReduceResult) -> None:
        """Send every worker the same AveragedNonBlockGradient."""
        self._check_ready()
        self._star.broadcast(NON_BLOCK, step, result)

    # ---- the end ----

    def shutdown_workers(self) -> None:
        """Send Shutdown to every worker still connected (a lost one is
        skipped): after a failure too, to the workers whose connection it
        left open between frames."""
        self._roster.shutdown()

    @property
    def mid_frame(self) -> bool:
        """Whether a Shutdown must wait: some worker connection is inside a
        frame this coordinator sends (or one an exception cut short), or a
        step's ShardAssignments are going out (a Shutdown among them would
        leave a mesh's workers waiting on each other inside the step)."""
        return self._roster.assigning or any(c.frame_open for c in self._roster.channels)

    def stop_workers(self, grace: float = 10.0) -> int:
        """End the run before its last step (the caller was interrupted): a
        Shutdown to every worker between two frames, then up to ``grace``
        seconds each to hang up. Returns how many were told."""
        return self._roster.stop(check_timeout("grace", grace))
