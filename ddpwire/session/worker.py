"""The worker's side of the session: join, take shards, send gradients,
receive their average.

Method names follow the reference worker client, so code written against one
reads like the other. Its parts each have a module: the join
:mod:`ddpwire.session.join`, the state and the one failure path
:mod:`ddpwire.session.uplink`, what comes between steps :mod:`ddpwire.session.shard_inbox`,
the steps through the coordinator :mod:`ddpwire.plane.star_step` and on the mesh
:mod:`ddpwire.plane.mesh_step`. This module is the session's face: the calls a
training loop makes. One thread may send while another receives (the
per-block mode overlaps them); two threads must not both send or both receive.
"""
from __future__ import annotations

import logging
import socket
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from .. import _core
from ..plane import mesh as _mesh
from .._text import counted
from ..wire.channel import Channel, result_buffer
from ..wire.errors import DdpwireError
from .join import join
from .lifecycle import LifecycleOwner
from ..wire.messages import (AveragedBlockGradient, AveragedGradient, AveragedNonBlockGradient,
                       BlockGradientPayload, GradientPayload, NonBlockGradientPayload,
                       ShardAssignment, StepAborted)
from .options import UNSET, SessionOptions, options_from
from .shard_inbox import ShardInbox
from ..plane.star_step import Owed
from .uplink import Uplink, WorkerState

__all__ = ["Worker", "WorkerState"]

log = logging.getLogger("ddpwire.worker")


class Worker(LifecycleOwner[WorkerState]):
    """A connected, joined worker. Create it with :meth:`connect`."""

    def __init__(self, channel: Channel, worker_id: int, total_workers: int, node_id: str,
                 heartbeat: Optional[float], socket_threads: Optional[bool] = None,
                 extensions: Optional[Mapping[int, bytes]] = None,
                 mesh_listener: Optional[socket.socket] = None,
                 tcp_congestion: Optional[str] = _mesh.DEFAULT_CONGESTION) -> None:
        self._chan = channel
        self.extensions: Dict[int, bytes] = dict(extensions or {})
        self._worker_id = worker_id
        self.node_id = node_id
        # Between steps (ddpwire.session.shard_inbox): shards, timed and scaled when
        # they follow measured speed; in an elastic session (docs/extensions.md)
        # a step may be called off (StepAborted) and computed again.
        self._inbox = ShardInbox(channel, worker_id, self.extensions)
        self._up = Uplink(channel, worker_id, total_workers, heartbeat=heartbeat,
                          node_id=node_id, listener=mesh_listener, congestion=tcp_congestion,
                          elastic=self._inbox.elastic, socket_threads=socket_threads)
        self._life = self._up.life
        self._mesh_step, self._star = self._up.mesh, self._up.star
        #: the step a worker that joined an elastic session late enters at
        #: (its state comes first: :meth:`receive_state`); None for the first join
        self.joins_at: Optional[int] = self._inbox.joins_at
        #: what this worker hands a worker joining an elastic session late:
        #: called with the step the joiner enters at, between two steps of
        #: this one, it returns the state (bytes-like) the joiner starts from
        #: (DataParallelTrainer sets it); None hands an empty state
        self.state_source: Optional[Callable[[int], Any]] = None

    @classmethod
    def connect(
        cls,
        addr: Tuple[str, int],
        gpu_count: int = 0,
        backend: str = "cpu",
        node_id: Optional[str] = None,
        timeout: float = UNSET,
        *,
        options: Optional[SessionOptions] = None,
        connect_timeout: Optional[float] = None,
        heartbeat: Optional[float] = UNSET,
        heartbeat_timeout: Optional[float] = UNSET,
        max_frame: int = UNSET,
        socket_threads: Optional[bool] = UNSET,
        token: Union[str, bytes, None] = UNSET,
        encrypt: bool = UNSET,
        extensions: Optional[Mapping[int, bytes]] = None,
        samples_per_step: Optional[int] = UNSET,
        mesh: bool = True,
        tcp_congestion: Optional[str] = _mesh.DEFAULT_CONGESTION,
        per_block: Optional[bool] = UNSET,
        gradient_length: Optional[int] = UNSET,
        resume_step: Optional[int] = None,
    ) -> "Worker":
        """Connect to the coordinator at ``addr`` and join (:mod:`ddpwire.session.join`).

        ``options`` (:class:`~ddpwire.session.options.SessionOptions`, the object a
        Coordinator takes too) holds what both sides agree on; or pass its
        fields as keywords (not both). Connecting is retried until
        ``connect_timeout`` (default ``timeout``), so workers may start before
        the coordinator. ``timeout`` then bounds every wait on the
        coordinator (:class:`~ddpwire.CoordinatorLost`) and, in a mesh
        session, each flat step's part on this worker, counted from the
        coordinator's last message before it, as the coordinator counts its
        wait: give workers the coordinator's timeout, so that one left
        waiting on a stalled peer names it in time. ``heartbeat`` needs a
        ddpwire coordinator. A worker whose ``samples_per_step``,
        ``per_block`` or ``gradient_length`` differs from the session's is
        refused at the join, not at step 0.

        ``extensions`` (type -> value) are offered in the JoinRequest's
        extension block, which the reference coordinator ignores; what was
        granted is :attr:`extensions` afterwards. ``mesh`` offers to average
        flat steps with the other workers directly (:mod:`ddpwire.plane.mesh`; the
        coordinator decides), on a port of its own on the address it reaches
        the coordinator from; its links send under ``tcp_congestion`` where
        the kernel lets a socket choose (:data:`ddpwire.plane.mesh.DEFAULT_CONGESTION`;
        None keeps the system's). ``resume_step``: this worker was in an
        elastic session whose coordinator was lost, kept its state, and joins
        the restarted one (``Coordinator(resume=True)``) to go on from that
        step. A refusal raises :class:`~ddpwire.JoinRefusedError` saying why.
        """
        opts = options_from(options, dict(
            timeout=timeout, max_frame=max_frame, heartbeat=heartbeat,
            heartbeat_timeout=heartbeat_timeout, socket_threads=socket_threads, token=token, encrypt=encrypt,
            samples_per_step=samples_per_step, per_block=per_block,
            gradient_length=gradient_length))
        tcp_congestion = _mesh.check_congestion(tcp_congestion)
        j = join(addr, opts, gpu_count=gpu_count, backend=backend, node_id=node_id,
                 connect_timeout=connect_timeout, extensions=extensions, mesh=mesh,
                 resume_step=resume_step)
        return cls(j.chan, j.accepted.worker_id, j.accepted.total_workers, j.node_id,
                   opts.heartbeat, opts.socket_threads, j.granted, j.listener, tcp_congestion)

    @property
    def channel(self) -> Channel:
        """The connection to the coordinator, for extensions that exchange
        their own messages over it (docs/extensions.md)."""
        return self._chan

    @property
    def worker_id(self) -> int:
        """This worker's id: its order of joining, from 0."""
        return self._worker_id

    @property
    def elastic(self) -> bool:
        """Whether the coordinator may call a step off (an elastic session:
        :class:`~ddpwire.MembershipChanged`) instead of ending the session
        when it loses a worker."""
        return self._inbox.elastic

    @property
    def total_workers(self) -> int:
        """The number of workers in the session."""
        return self._up.total_workers

    # ---- flat steps ----

    def receive_shard(self) -> Optional[ShardAssignment]:
        """The next ShardAssignment, or None when the coordinator shuts training down."""
        self._up.enter()
        self._inbox.check_order(receiving_state=False)
        with self._up.talking(None):
            return self._inbox.next_shard(self.state_source)

    def send_gradients(self, step: int, gradients: Any, loss: float, correct: int, total: int) -> None:
        """Send this step's gradients (any C-contiguous float32 buffer, sent
        from where it lies) with the shard's mean loss and counts. In a mesh
        session this is the reduce-scatter and the StepReport."""
        gradients = _core.float32_gradients(gradients)
        self._up.enter()
        if self.uses_mesh:
            self._mesh_send(step, gradients, loss, correct, total)
            return
        self._send(step, (AveragedGradient, step, None), gradients, lambda up: GradientPayload(
            step=step, worker_id=self._worker_id, gradients=up, loss=loss, correct=correct,
            total=total))

    def receive_averaged(self, out: Optional[np.ndarray] = None) -> AveragedGradient:
        """The averaged gradients; with ``out`` (float32, the gradient length)
        the elements are received straight into it, allocating nothing."""
        result_buffer(out, None)
        self._up.enter()
        if self.uses_mesh:
            return self._mesh_receive(out)
        return self._receive(AveragedGradient, out)

    def allreduce(self, step: int, gradients: Any, loss: float, correct: int, total: int,
                  out: Optional[np.ndarray] = None) -> AveragedGradient:
        """:meth:`send_gradients` and :meth:`receive_averaged` at once.

        The GradientPayload goes out while the AveragedGradient comes in, in
        one GIL-free loop or, with socket threads, from a sending thread
        while this one receives: against a coordinator that streams its average
        (:meth:`Coordinator.allreduce`) the reply starts before this worker
        has finished sending. The average lands straight in ``out`` (float32,
        the gradient length; allocated when None), which may be the
        ``gradients`` buffer itself: an averaged element can only arrive after
        this worker's element at the same index has left the buffer (the
        coordinator needs it to compute the average). Any coordinator works,
        including one that replies only after it has read everything.

        Errors are those of receive_averaged: ShutdownDuringReduce,
        UnexpectedMessage, GradientMismatch (step or length), ProtocolError,
        CoordinatorLost. Any of them ends the session (docs/sessions.md,
        "When a session fails"): the connection closes, since it leaves a
        frame cut short in one direction or the other, and every later call
        raises the same error. Calling it again while an earlier average is
        still owed is a DdpwireError; in an elastic session a step the
        coordinator called off raises MembershipChanged (not a failure: the
        session goes on).

        In a mesh session (:mod:`ddpwire.plane.mesh`) the same call averages with
        the other workers directly, with the same result bits and errors,
        plus WorkerLost naming a worker whose link failed, and
        NonFiniteGradient when the coordinator halts the step (no element of
        ``out`` is written then).
        """
        # both checked before anything goes on the wire, on every path
        gradients = _core.float32_gradients(gradients)
        result_buffer(out, len(gradients))
        self._up.enter()
        if self.uses_mesh:
            self._mesh_send(step, gradients, loss, correct, total)
            return self._mesh_receive(out)
        if self._life.state is WorkerState.IN_STEP:
            raise DdpwireError(f"allreduce: {counted(len(self._star.owed), 'earlier average')} "
                               f"not yet received",
                               worker_id=self._worker_id, step=step)
        out = result_buffer(out, len(gradients))
        with self._up.talking(step):
            gradients = self._inbox.upload(step, gradients)
        msg = GradientPayload(step=step, worker_id=self._worker_id, gradients=gradients,
                              loss=loss, correct=correct, total=total)
        with self._up.talking(step, any_error=True):
            self._up.owe()
            global_loss = self._star.exchange(msg, out)
        self._up.settled()
        if isinstance(global_loss, StepAborted):
            raise self._up.membership_changed(global_loss)
        return AveragedGradient(step=step, gradients=out, global_loss=global_loss)

    # ---- joining an elastic session late ----

    def receive_state(self) -> Tuple[int, bytes]:
        """For a worker that joined an elastic session late (:attr:`joins_at`
        is not None), before its first shard: the model's state as a worker
        in the session had it before step :attr:`joins_at`, its SHA-256
        checked. Returns (step, the state's bytes); load it, then train from
        :meth:`receive_shard` on. A digest that does not match is a
        ProtocolError."""
        self._life.check()
        self._inbox.check_order(receiving_state=True)
        with self._up.talking(self.joins_at):
            return self._inbox.receive_state()

    # ---- the mesh ----

    @property
    def uses_mesh(self) -> bool:
        """Whether flat steps run on the mesh (known once the first call
        after the join has read the coordinator's peer table)."""
        return self._mesh_step.on

    def _mesh_send(self, step: int, gradients: Any, loss: float, correct: int,
                   total: int) -> None:
        self._mesh_step.check_send(step)
        # a mesh step that fails leaves frames cut short on some link
        with self._up.talking(step, any_error=True, tell=True):
            self._mesh_step.send(step, gradients, loss, correct, total,
                                 self._up.total_workers, self._inbox.upload)
            self._up.owe()

    def _mesh_receive(self, out: Optional[np.ndarray]) -> AveragedGradient:
        sent = self._mesh_step.check_receive()
        out = result_buffer(out, sent[1])
        with self._up.talking(sent[0], any_error=True, tell=True):
            result = self._mesh_step.receive(out)
        self._up.settled()
        return result

    # ---- per-block steps (v2) ----

    def send_block_gradient(self, step: int, block_idx: int, num_blocks: int, gradients: Any,
                            component_sizes: Sequence[int]) -> None:
        """Send one block's gradient: its components concatenated, with their sizes."""
        self._up.enter()
        self._send(step, (AveragedBlockGradient, step, block_idx), gradients,
                   lambda up: BlockGradientPayload(
                       step=step, worker_id=self._worker_id, block_idx=block_idx,
                       num_blocks=num_blocks, component_sizes=component_sizes, gradients=up))

    def receive_averaged_block(self, out: Optional[np.ndarray] = None) -> AveragedBlockGradient:
        """The next averaged block gradient (into ``out`` when given)."""
        self._up.enter()
        return self._receive(AveragedBlockGradient, out)

    def send_non_block_gradient(self, step: int, component: int, gradients: Any) -> None:
        """Send a non-block component's gradient (0 lm_head, 1 final_norm, 2 embedding)."""
        self._up.enter()
        self._send(step, (AveragedNonBlockGradient, step, component), gradients,
                   lambda up: NonBlockGradientPayload(step=step, worker_id=self._worker_id,
                                                      component=component, gradients=up))

    def receive_averaged_non_block(self, out: Optional[np.ndarray] = None) -> AveragedNonBlockGradient:
        """The next averaged non-block gradient (into ``out`` when given)."""
        self._up.enter()
        return self._receive(AveragedNonBlockGradient, out)

    def _send(self, step: int, owed: Owed, gradients: Any,
              message: Callable[[np.ndarray], object]) -> None:
        """A star message carrying this step's gradients (``message`` made
        from what the shard's timing and scale leave of them); its reply is
        owed from here on."""
        with self._up.talking(step):
            msg = message(self._inbox.upload(step, gradients))
            self._up.owe(owed)
            self._chan.send(msg, step=step)

    def _receive(self, expected: type, out: Optional[np.ndarray]) -> Any:
        with self._up.talking(self._star.owed_step()):
            reply = self._star.receive(expected, out)
        self._up.settled()
        if isinstance(reply, StepAborted):
            raise self._up.membership_changed(reply)
        return reply

    # ---- lifecycle ----

    def close(self) -> None:
        """Close the connection (the coordinator sees the worker leave).
        After a failure everything is closed already; the failure stays
        what every call raises."""
        self._up.close()

