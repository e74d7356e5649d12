"""A worker's steps through the coordinator (the star), between its messages.

The coordinator's side is :mod:`ddpwire.session.star`; the mesh's worker side is
:mod:`ddpwire.plane.mesh_step`. Here: the replies the coordinator owes (so that a
reply for something else is caught instead of applied), the flat step's
duplex exchange (the GradientPayload goes out while its average streams
in), and the checks on every reply's head before a byte of it lands. The
worker's state and failure path wrap these calls; none of them changes it.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Deque, Optional, Tuple, Union

import numpy as np

from .. import _core
from . import socket_threads as _socket_threads
from .._core import encode_frame_parts
from .._text import counted
from ..wire.channel import Channel, message_name
from .deadlines import answer_wait
from ..wire.errors import (DdpwireError, GradientMismatch, NonFiniteGradient, ShutdownDuringReduce,
                     UnexpectedMessage, WorkerDropped)
from ..wire.messages import (AveragedBlockGradient, AveragedGradient, AveragedNonBlockGradient,
                       GradientPayload, Heartbeat, Shutdown, StepAborted)

__all__ = ["Owed", "StarStep", "check_aborted", "refuse_non_finite"]

#: a reply the coordinator owes: its type, the step, and the block index or
#: component (None for a flat step)
Owed = Tuple[type, int, Optional[int]]

Averaged = Union[AveragedGradient, AveragedBlockGradient, AveragedNonBlockGradient]


def check_aborted(msg: StepAborted, worker_id: int, step: Optional[int] = None) -> None:
    """A StepAborted for another step than ``step`` (when given) is a
    GradientMismatch; one naming this worker says it was dropped
    (WorkerDropped, which ends its session)."""
    if step is not None and msg.step != step:
        raise GradientMismatch("StepAborted step", step, msg.step, worker_id=worker_id, step=step)
    if msg.worker_id == worker_id:
        raise WorkerDropped(
            f"the coordinator dropped this worker during step {msg.step} (it was silent or "
            f"stalled past the coordinator's timeout) and goes on with "
            f"{counted(msg.workers, 'worker')}", worker_id=worker_id, step=msg.step)


def refuse_non_finite(worker_id: int, average: np.ndarray, bad: Optional[int],
                      step: Optional[int]) -> None:
    """A coordinator must never send a non-finite average (the receive
    checked each element as it landed); applying one would ruin the
    model, so it is an error here too."""
    if bad is not None:
        raise NonFiniteGradient(worker_id, bad, float(average[bad]), worker_id=worker_id,
                                step=step, source="average")


class StarStep:
    """One worker's replies from the coordinator over ``chan``. ``lock``
    (the worker's lifecycle lock) guards :attr:`owed`, which the per-block
    sender appends to while the receiver takes from it; ``elastic``: a
    flat step's average may come as a StepAborted instead."""

    def __init__(self, chan: Channel, worker_id: int, lock: threading.RLock, *, elastic: bool,
                 socket_threads: Optional[bool]) -> None:
        self.chan = chan
        self.worker_id = worker_id
        self.lock = lock
        self.elastic = elastic
        self.socket_threads = socket_threads
        #: each reply still owed, oldest first
        self.owed: Deque[Owed] = collections.deque()

    def owed_step(self) -> Optional[int]:
        """The step of the oldest reply owed (to name in errors), if any."""
        return self.owed[0][1] if self.owed else None

    def exchange(self, msg: GradientPayload, out: np.ndarray) -> Union[float, StepAborted]:
        """Send ``msg`` while its AveragedGradient comes in, straight into
        ``out``, in one GIL-free loop or from a sending thread of its own
        (:mod:`ddpwire.plane.socket_threads`). Returns global_loss, or in an
        elastic session the StepAborted that came in its place. Any
        exception leaves a frame cut short one way or the other."""
        chan = self.chan
        step = msg.step
        send_thread = _socket_threads.for_worker(self.socket_threads, 4 * len(out))
        parts = encode_frame_parts(msg, max_frame=chan.max_frame)
        with chan.send_lock:
            # without heartbeats, the coordinator is silent for as long as it
            # waits for another worker: no less than the answer's deadline
            silence = (answer_wait(chan.timeout) if self.elastic and chan.heartbeat_timeout is None
                       else chan.read_timeout)
            exchange = _core.Exchange(chan.conn, parts, silence, step=step,
                                     what="sending GradientPayload", send_thread=send_thread)
            try:
                global_loss = self._receive_exchanged(exchange, step, out)
                # called off or not, the coordinator reads the rest of the gradients
                exchange.finish()
            except BaseException:
                exchange.abandon()  # its thread must be off the socket before it closes
                raise
        return global_loss

    def _receive_exchanged(self, exchange: "_core.Exchange", step: int,
                           out: np.ndarray) -> Union[float, StepAborted]:
        chan = self.chan
        ctx = dict(worker_id=self.worker_id, step=step)
        # an elastic coordinator may end its wait for another worker with a call-off
        deadline = time.monotonic() + (answer_wait(chan.timeout) if self.elastic
                                       else chan.timeout)
        expect = (AveragedGradient, Shutdown, Heartbeat) + ((StepAborted,) if self.elastic else ())
        while True:
            head = _core.exchange_frame_head(exchange, chan.max_frame, deadline=deadline,
                                             expect=expect, peer_id=self.worker_id, step=step,
                                             what="receiving AveragedGradient")
            if isinstance(head, StepAborted):
                check_aborted(head, self.worker_id, step)
                return head
            if not isinstance(head, Heartbeat):
                break
        self._check_head(head, AveragedGradient, step, None)
        if head.gradient_count != len(out):
            raise GradientMismatch("gradients length", len(out), head.gradient_count, **ctx)
        if head.step != step:
            raise GradientMismatch("step", step, head.step, **ctx)
        tail = bytearray(head.tail_len)
        bad = exchange.recv_into(out, tail, what="receiving AveragedGradient.gradients",
                                 check_finite=True)
        refuse_non_finite(self.worker_id, out, bad, step)
        return _core.decode_tail(head.tag, bytes(tail))[3]

    def receive(self, expected: type,
                out: Optional[np.ndarray]) -> Union[Averaged, StepAborted]:
        """The next reply, of type ``expected``, into ``out`` when given;
        in an elastic session a flat step's StepAborted (the owed reply is
        settled then too)."""
        # The per-block receiver starts waiting before the first send, so the
        # queue may still be empty here: peek only to name the step in errors,
        # and take the owed entry once the head is in (a send queues its entry
        # before its bytes go out, so any reply finds it).
        step = self.owed_step()
        called_off = [StepAborted] if self.elastic and expected is AveragedGradient else []
        deadline = (time.monotonic() + answer_wait(self.chan.timeout)) if called_off else None
        try:
            head = self.chan.read_head([expected, Shutdown] + called_off, step=step,
                                       what=f"waiting for {expected.__name__}", deadline=deadline)
        except DdpwireError as exc:
            if self.owed:
                exc.add_context(step=self.owed_step())
            raise
        with self.lock:
            owed = self.owed.popleft() if self.owed else None
        if owed is not None:
            step = owed[1]
        if isinstance(head, StepAborted):
            check_aborted(head, self.worker_id, step)
            return head
        self._check_head(head, expected, step, owed)
        gradients, tail, bad = self.chan.recv_gradients(head, out, step=head.step)
        refuse_non_finite(self.worker_id, gradients, bad, head.step)
        if expected is AveragedGradient:
            return AveragedGradient(step=head.step, gradients=gradients, global_loss=tail[3])
        if expected is AveragedBlockGradient:
            return AveragedBlockGradient(step=head.step, block_idx=head.block_idx,
                                         component_sizes=head.component_sizes, gradients=gradients)
        return AveragedNonBlockGradient(step=head.step, component=head.component,
                                        gradients=gradients)

    def _check_head(self, head: object, expected: type, step: Optional[int],
                    owed: Optional[Owed]) -> None:
        """``head`` is a reply of type ``expected`` and, when ``owed`` (the
        entry queued for it), the one owed for ``step``; or the error says
        what it is instead."""
        ctx = dict(worker_id=self.worker_id, step=step)
        if isinstance(head, Shutdown):
            raise ShutdownDuringReduce(f"coordinator shut down during {_DURING[expected]}", **ctx)
        if not isinstance(head, _core.FrameHead) or head.tag != expected.TAG:
            raise UnexpectedMessage(expected.__name__, message_name(head), **ctx)
        if owed is not None and owed[0] is not expected:
            raise UnexpectedMessage(owed[0].__name__, expected.__name__, **ctx)
        if owed is None:
            return
        key = owed[2]
        if head.step != step:
            raise GradientMismatch("step", step, head.step, **ctx)
        if expected is AveragedBlockGradient and head.block_idx != key:
            raise GradientMismatch("block_idx", key, head.block_idx, **ctx)
        if expected is AveragedNonBlockGradient and head.component != key:
            raise GradientMismatch("component", key, head.component, **ctx)


#: what a Shutdown in place of each reply cut short
_DURING = {AveragedGradient: "AllReduce", AveragedBlockGradient: "block AllReduce",
           AveragedNonBlockGradient: "non-block AllReduce"}
