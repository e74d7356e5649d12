"""A worker's flat steps on the mesh, between its coordinator's messages.

The coordinator's side is :mod:`ddpwire.session.mesh_control`, the links and their
reduce-scatter/allgather :mod:`ddpwire.plane.mesh`. Here: the peer table the
coordinator sends once every worker has joined, the links opened at the
first flat step, and each step's two halves, the reduce-scatter with its
StepReport and, after the coordinator's StepCommit, the allgather. The
worker's state and failure path wrap these calls; none of them changes it.
"""
from __future__ import annotations

import contextlib
import socket
import time
from typing import Any, Callable, Optional, Tuple

import numpy as np

from . import mesh as _mesh
from ..wire.channel import Channel
from ..wire.errors import (DdpwireError, GradientMismatch, NonFiniteGradient, ShutdownDuringReduce,
                     WorkerLost)
from ..wire.messages import (
    NO_WORKER, AveragedGradient, MeshPeers, Shutdown, StepCommit, StepReport,
)

__all__ = ["MeshStep"]


class MeshStep:
    """One worker's part of the mesh over ``chan`` (its coordinator link):
    ``listener`` is its mesh port when the coordinator granted the mesh
    (None: it never takes part), ``congestion`` its links' TCP congestion
    control."""

    def __init__(self, chan: Channel, worker_id: int, listener: Optional[socket.socket],
                 congestion: Optional[str]):
        self.chan = chan
        self.worker_id = worker_id
        self.listener = listener
        self.congestion = congestion
        self.table: Optional[MeshPeers] = None
        #: the links, open from the first flat step on
        self.mesh: Optional[_mesh.Mesh] = None
        #: (step, length) reduced and reported, not yet gathered
        self.sent: Optional[Tuple[int, int]] = None

    @property
    def on(self) -> bool:
        """Whether flat steps run on the mesh (known once :meth:`read_table` ran)."""
        return self.table is not None and bool(self.table.peers)

    @property
    def frame_open(self) -> bool:
        """Whether a GradientPayload of the coordinator's share is cut short."""
        return self.mesh is not None and self.mesh.coordinator_frame_open

    # Misuse, checked outside the failure path: it ends nothing.

    def check_send(self, step: int) -> None:
        """A step's gradients go out only once the last step's average is in."""
        if self.sent is not None:
            raise DdpwireError(f"step {self.sent[0]}'s average not yet received",
                               worker_id=self.worker_id, step=step)

    def check_receive(self) -> Tuple[int, int]:
        """An average is received only for the step :attr:`sent`, returned."""
        if self.sent is None:
            raise DdpwireError("receive_averaged before send_gradients", worker_id=self.worker_id)
        return self.sent

    def read_table(self) -> None:
        """The MeshPeers a coordinator that granted the mesh sends before
        anything else; an empty one keeps the star."""
        if self.listener is None:
            return
        table = self.chan.expect([MeshPeers])
        if not table.peers:
            self.listener.close()
            self.listener = None
        self.table = table

    def close(self) -> None:
        if self.mesh is not None:
            self.mesh.close()
        listener, self.listener = self.listener, None
        if listener is not None:
            listener.close()

    def send(self, step: int, gradients: Any, loss: float, correct: int, total: int,
             total_workers: int, upload: Callable[[int, Any], np.ndarray]) -> None:
        """The step's reduce-scatter (``upload`` makes what goes out, after
        the links are up) and its StepReport to the coordinator. The step
        is then :attr:`sent`, until :meth:`receive`."""
        deadline = self._deadline(step)
        links = self._links(step, total_workers, deadline)
        gradients = upload(step, gradients)
        # with a coordinator share a GradientPayload to the coordinator
        # goes out with the slices: no heartbeat may land inside it
        with self.chan.send_lock if links.coordinator_share else contextlib.nullcontext():
            outcome = links.reduce_scatter(step, gradients, deadline, (loss, correct, total))
        self.chan.send(StepReport(step=step, worker_id=self.worker_id, count=len(gradients),
                                  loss=loss, correct=correct, total=total,
                                  bad_worker=outcome.bad_worker, bad_index=outcome.bad_index,
                                  bad_value=outcome.bad_value), step=step)
        self.sent = (step, len(gradients))

    def receive(self, out: np.ndarray) -> AveragedGradient:
        """The coordinator's go-ahead for the step :attr:`sent`, then the
        allgather into ``out`` (its length); a halt (NonFiniteGradient)
        writes nothing."""
        assert self.sent is not None
        step = self.sent[0]
        ctx = dict(worker_id=self.worker_id, step=step)
        try:
            commit = self.chan.expect([StepCommit, Shutdown], step=step)
            if isinstance(commit, Shutdown):
                raise ShutdownDuringReduce("coordinator shut down during AllReduce", **ctx)
            if commit.step != step:
                raise GradientMismatch("step", step, commit.step, **ctx)
            if commit.bad_worker != NO_WORKER:
                raise NonFiniteGradient(commit.bad_worker, commit.bad_index, commit.bad_value,
                                        worker_id=commit.bad_worker, step=step)
            assert self.mesh is not None
            self.mesh.allgather(step, out, time.monotonic() + self.chan.timeout)
        finally:
            self.sent = None
        return AveragedGradient(step=step, gradients=out, global_loss=commit.global_loss)

    def _links(self, step: int, total_workers: int, deadline: float) -> _mesh.Mesh:
        """The links, opened at the first flat step within that step's
        ``deadline`` (:meth:`_deadline`): waiting for a peer to open its
        link is waiting for the peer's part of the step, so it ends when
        the wait for its slices would, not ``timeout`` after this worker
        came to its step (however long it computed first), which the
        coordinator, listening for this worker's report, may not wait for."""
        if self.mesh is None:
            assert self.table is not None and self.listener is not None
            timeout = self.chan.timeout
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._late(step, time.monotonic())
            listener, self.listener = self.listener, None
            try:
                mesh = _mesh.Mesh.connect(listener, self.table, self.worker_id, total_workers,
                                          timeout=left, max_frame=self.chan.max_frame,
                                          congestion=self.congestion, coordinator=self.chan)
            except WorkerLost as exc:
                peer = exc.worker_id
                if peer is None or peer == self.worker_id or time.monotonic() < deadline:
                    raise
                # the step's deadline passed: say so in the step's terms
                raise WorkerLost(f"worker {peer} did not open its mesh link within "
                                 f"{timeout:g} s of the coordinator's last message",
                                 worker_id=peer, step=step) from exc
            # only the opening was bounded by the step: every later wait on
            # the links has the session's timeout as its silence limit
            mesh.timeout = timeout
            for link in mesh.links:
                if link is not None:
                    link.timeout = timeout
            self.mesh = mesh
        return self.mesh

    def _deadline(self, step: int) -> float:
        """When this worker's part of a mesh step (its links, its
        reduce-scatter) must be done: ``timeout`` after the coordinator's
        last message, the step's ShardAssignment or the previous step's
        go-ahead, as read here. The coordinator's wait for the step's
        reports starts when it sent that message, and it listens for a
        silent worker's report for as long again
        (:func:`ddpwire.plane.deadlines.accusation_wait`), so a worker left
        waiting on a stalled peer gives up, and names that peer, while the
        coordinator still listens, however long it computed, or took to
        read the message within the timeout (not ``timeout`` after its own
        computing ended, which could be too late to be heard). A worker
        that only comes to its step after that is itself the late one:
        WorkerLost naming it."""
        now = time.monotonic()
        since = self.chan.last_message_at
        if since is None:
            return now + self.chan.timeout
        deadline = since + self.chan.timeout
        if deadline <= now:
            raise self._late(step, now)
        return deadline

    def _late(self, step: int, now: float) -> WorkerLost:
        """This worker came to its part of ``step`` past the step's deadline:
        it is the late one."""
        since = self.chan.last_message_at
        late = "" if since is None else f"{now - since:.3g} s "
        return WorkerLost(f"worker {self.worker_id} came to its part of mesh step {step} "
                          f"{late}after the coordinator's last message, past "
                          f"the step's {self.chan.timeout:g} s timeout",
                          worker_id=self.worker_id, step=step)
