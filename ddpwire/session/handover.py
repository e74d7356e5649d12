"""One relay of the model's state from a worker in an elastic session (the
source) to a worker that joins it late, and who failed when it fails.

The relay is bounded as a whole, not by silence alone: a joiner that reads
a byte now and then, or a source that streams a state without end, is cut
off at the relay's deadline. Each side's failure is kept apart, so the
coordinator drops only the one that failed (ddpwire.session.elastic): a joiner lost
mid-state leaves the source's remaining pieces to be read out (by a later
deadline) before the source can take its next shard; a source lost
mid-state leaves the joiner with pieces that a StepAborted naming the
source voids (docs/extensions.md).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from ..wire.channel import Channel
from ..wire.errors import DdpwireError, WorkerLost
from ..wire.messages import ModelState, StateRequest
from .model_state import PieceCheck

__all__ = ["Relayed", "relay"]


@dataclass
class Relayed:
    """What one relay came to: each side's failure (None: it did its part)
    and how many pieces reached the joiner."""

    source_failed: Optional[DdpwireError] = None
    joiner_failed: Optional[DdpwireError] = None
    pieces_sent: int = 0

    @property
    def complete(self) -> bool:
        return self.source_failed is None and self.joiner_failed is None


def relay(source: Channel, joiner: Channel, step: int, *, first_by: float, deadline: float,
          read_out_by: float) -> Relayed:
    """Ask ``source`` for the state before ``step`` and pass each piece on to
    ``joiner`` as it comes (time.monotonic() deadlines: the first piece
    due by ``first_by``, the whole relay by ``deadline``). A joiner that
    fails is sent nothing more, and the source's remaining pieces are read
    out by ``read_out_by`` so that its connection is between two frames
    again. Never raises a peer's failure: it is in the result."""
    out = Relayed()
    check = PieceCheck(step, source.peer_id)
    due = first_by
    try:
        source.send(StateRequest(step=step), step=step, deadline=deadline)
        while True:
            piece = source.expect([ModelState], step=step, deadline=due)
            due = deadline if out.joiner_failed is None else read_out_by
            done = check.take(piece)
            if out.joiner_failed is None:
                try:
                    joiner.send(piece, step=step, deadline=deadline)
                    out.pieces_sent += 1
                except DdpwireError as exc:
                    out.joiner_failed = exc
                    due = read_out_by
            if done:
                return out
    except DdpwireError as exc:  # everything above but the joiner's send is the source's
        if check.got and time.monotonic() >= due:
            # streaming, not silent: it was cut off, and says so
            exc = WorkerLost(f"worker {source.peer_id} did not hand over its state of "
                             f"{check.total} bytes by the relay's deadline ({check.got} in)",
                             worker_id=source.peer_id, step=step)
        out.source_failed = exc
        return out
