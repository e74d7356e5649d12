"""The model's state handed to a worker that joins an elastic session late.

Between two steps the coordinator asks a worker in the session for its state
(StateRequest) and relays it, piece by piece, to the joiner (ModelState,
docs/extensions.md): each piece carries the whole state's length and SHA-256,
which the joiner checks before it trains from the next step.
"""
from __future__ import annotations

import hashlib
from typing import Any, Tuple

from .channel import Channel
from .errors import ProtocolError
from .messages import ModelState

__all__ = ["STATE_PIECE", "send_state", "receive_state"]

#: the most bytes of the model's state one ModelState carries
STATE_PIECE = 16 << 20


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
    before."""
    got = bytearray()
    total, digest = 0, b""
    for piece in chan.state_pieces(step):
        if got and bytes(piece.digest) != digest:
            raise ProtocolError(f"ModelState pieces for step {step} with two digests",
                                worker_id=worker_id, step=step)
        total, digest = piece.total, bytes(piece.digest)
        got += memoryview(piece.data)
    if hashlib.sha256(got).digest() != digest:
        raise ProtocolError(f"the model's state for step {step} does not match its "
                            f"digest ({total} bytes)", worker_id=worker_id, step=step)
    return total, bytes(got)
