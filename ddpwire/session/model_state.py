"""The model's state handed to a worker that joins an elastic session late.

Between two steps the coordinator asks a worker in the session for its state
(StateRequest) and relays it, piece by piece, to the joiner (ModelState,
docs/extensions.md): each piece carries the whole state's length and SHA-256,
which the joiner checks before it trains from the next step. A source lost
mid-state is followed by a StepAborted naming it: the pieces so far are void
and the state starts again, from another worker (ddpwire.session.handover).
"""
from __future__ import annotations

import hashlib
import logging
from typing import Any, Optional, Tuple

from ..wire.channel import Channel
from ..wire.errors import ProtocolError
from ..wire.messages import ModelState, StepAborted
from ..plane.star_step import check_aborted

__all__ = ["STATE_PIECE", "PieceCheck", "send_state", "receive_state"]

log = logging.getLogger("ddpwire.worker")

#: the most bytes of the model's state one ModelState carries
STATE_PIECE = 16 << 20


class PieceCheck:
    """The pieces of one state from one source, checked as they come (on the
    coordinator that relays them and on the joiner alike): the step asked
    for, one total and one digest, never past the total. A failed check is
    a ProtocolError naming ``peer_id``, the peer that sent the piece."""

    def __init__(self, step: int, peer_id: Optional[int]) -> None:
        self.step = step
        self.peer_id = peer_id
        self.got = 0
        self.total: Optional[int] = None
        self.digest = b""

    def take(self, piece: ModelState) -> bool:
        """Check ``piece`` against the ones before it; True once the whole
        state is in."""
        step = self.step
        if piece.step != step or (self.total is not None and piece.total != self.total):
            raise ProtocolError(f"ModelState for step {piece.step} of {piece.total} bytes, "
                                f"asked for step {step}"
                                f"{'' if self.total is None else f' ({self.total} bytes)'}",
                                worker_id=self.peer_id, step=step)
        if self.total is not None and bytes(piece.digest) != self.digest:
            raise ProtocolError(f"ModelState pieces for step {step} with two digests",
                                worker_id=self.peer_id, step=step)
        self.total, self.digest = piece.total, bytes(piece.digest)
        self.got += len(piece.data)
        if self.got > self.total:
            raise ProtocolError(f"ModelState pieces past its {self.total} bytes",
                                worker_id=self.peer_id, step=step)
        return self.got >= self.total


def send_state(chan: Channel, step: int, state: Any) -> None:
    """``state`` (bytes-like) as the state before ``step``, in ModelState
    pieces that each fit the channel's frame limit."""
    data = memoryview(state).cast("B")
    digest = hashlib.sha256(data).digest()
    piece = max(1, min(STATE_PIECE, chan.max_frame - 4096))
    at = 0
    while True:
        chunk = data[at:at + piece]
        chan.send(ModelState(step=step, total=len(data), digest=digest, data=chunk), step=step)
        at += len(chunk)
        if at >= len(data):
            return


def receive_state(chan: Channel, step: int, worker_id: int) -> Tuple[int, bytes]:
    """The state before ``step``, its pieces put together and its digest
    checked (ProtocolError naming ``worker_id`` otherwise). Returns (its
    length, its bytes); each piece is due within the timeout of the one
    before. A StepAborted between pieces voids them (their source was lost:
    the state comes again from the first piece); one naming this worker
    says the coordinator dropped it (WorkerDropped)."""
    check = PieceCheck(step, worker_id)
    got = bytearray()
    while True:
        msg = chan.expect([ModelState, StepAborted], step=step)
        if isinstance(msg, StepAborted):
            check_aborted(msg, worker_id, step)
            log.info("worker %d: the model's state from worker %d was cut short; it comes "
                     "again from another", worker_id, msg.worker_id)
            check, got = PieceCheck(step, worker_id), bytearray()
            continue
        done = check.take(msg)
        got += memoryview(msg.data)
        if done:
            break
    if hashlib.sha256(got).digest() != check.digest:
        raise ProtocolError(f"the model's state for step {step} does not match its "
                            f"digest ({check.total} bytes)", worker_id=worker_id, step=step)
    return check.got, bytes(got)
