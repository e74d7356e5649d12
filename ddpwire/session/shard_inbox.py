"""What a worker hears from its coordinator between steps, and what it adds
to each step's gradients because of it.

Between two steps the coordinator sends the next ShardAssignment (with its
ShardScale when the shards follow measured speed), or Shutdown; in an
elastic session also a StateRequest (this worker hands its model's state
to a late joiner) or a StepAborted for a step already called off. A worker
that joined an elastic session late first receives the model's state. The
compute on each shard is timed (StepTiming) and its gradients scaled
(:class:`ddpwire.session.balance.ShardClock`). The Worker runs this under its
failure path; nothing here closes anything.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping, Optional, Tuple

import numpy as np

from . import model_state as _model_state
from .balance import ShardClock
from ..wire.channel import Channel
from ..wire.errors import DdpwireError, GradientMismatch, ProtocolError
from ..wire.extensions import Extension, decode_u64
from ..wire.messages import (
    ShardAssignment, ShardScale, Shutdown, StateRequest, StepAborted, StepTiming,
)
from ..plane.star_step import check_aborted

__all__ = ["ShardInbox"]

log = logging.getLogger("ddpwire.worker")

#: what a worker hands a late joiner: called with the step the joiner
#: enters at, it returns the state (bytes-like) to start from
StateSource = Callable[[int], Any]


class ShardInbox:
    """Worker ``worker_id``'s messages between steps on ``chan``, as the
    extensions it was ``granted`` shape them."""

    def __init__(self, chan: Channel, worker_id: int, granted: Mapping[int, bytes]) -> None:
        self._chan = chan
        self._worker_id = worker_id
        self.elastic = Extension.ELASTIC in granted
        self._timed = Extension.BALANCE in granted
        self._clock = ShardClock()
        late = granted.get(Extension.ELASTIC) or b""
        #: the step a worker that joined an elastic session late enters at
        #: (None for the first join)
        self.joins_at: Optional[int] = decode_u64(late) if late else None
        self._state_received = False

    def check_order(self, receiving_state: bool) -> None:
        """Before a call, outside the failure path (a misuse ends nothing):
        a late joiner receives the model's state before its first shard,
        and only a late joiner receives one."""
        if receiving_state and self.joins_at is None:
            raise DdpwireError("receive_state() is for a worker that joined an elastic session "
                               "late (this one joined at the start)", worker_id=self._worker_id)
        if not receiving_state and self.joins_at is not None and not self._state_received:
            raise DdpwireError("this worker joined the session late: call receive_state() for "
                               "the model's state before its first shard",
                               worker_id=self._worker_id, step=self.joins_at)

    def next_shard(self, state_source: Optional[StateSource]) -> Optional[ShardAssignment]:
        """The next ShardAssignment, or None at a Shutdown; a StateRequest
        on the way is answered from ``state_source`` (None: an empty state)."""
        me = self._worker_id
        while True:
            msg = self._chan.expect([ShardAssignment, Shutdown, StepAborted, StateRequest]
                                    if self.elastic else [ShardAssignment, Shutdown])
            if isinstance(msg, StateRequest):
                state = b"" if state_source is None else state_source(msg.step)
                _model_state.send_state(self._chan, msg.step, state)
            elif isinstance(msg, StepAborted):
                # another worker lost while the step was being called off
                # (its MembershipChanged was raised already), or this one dropped
                check_aborted(msg, me)
            else:
                break
        if isinstance(msg, Shutdown):
            log.info("worker %d: shutdown from the coordinator", me)
            return None
        if msg.shard_start > msg.shard_end:
            raise ProtocolError(f"ShardAssignment.shard_start {msg.shard_start} is past "
                                f"shard_end {msg.shard_end}", worker_id=me, step=msg.step)
        if self._timed:
            # a coordinator stopped between the two frames shuts down here
            scale = self._chan.expect([ShardScale, Shutdown], step=msg.step)
            if isinstance(scale, Shutdown):
                log.info("worker %d: shutdown from the coordinator", me)
                return None
            if scale.step != msg.step:
                raise GradientMismatch("ShardScale step", msg.step, scale.step,
                                       worker_id=me, step=msg.step)
            self._clock.assigned(msg.step, scale.scale, time.perf_counter())
        return msg

    def receive_state(self) -> Tuple[int, bytes]:
        """A late joiner's model state (Worker.receive_state)."""
        step = self.joins_at
        assert step is not None  # check_order(True) came first
        total, state = _model_state.receive_state(self._chan, step, self._worker_id)
        self._state_received = True
        log.info("worker %d: took the model's state (%d bytes) before step %d",
                 self._worker_id, total, step)
        return step, state

    def upload(self, step: int, gradients: np.ndarray) -> np.ndarray:
        """What goes out for ``step``: with shards by speed, first the
        step's StepTiming (the time since its shard arrived: the compute),
        then the gradients times its ShardScale, which makes the plain
        mean every path computes the sample-weighted one (ddpwire.session.balance)."""
        compute_us = self._clock.compute_us(step, time.perf_counter())
        if compute_us is not None:
            self._chan.send(StepTiming(step=step, compute_us=compute_us), step=step)
        return self._clock.scaled(step, gradients)
