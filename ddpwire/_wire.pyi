"""Type stubs for the compiled wire codec (ddpwire/_wire.pyx)."""
from typing import Any, List, Optional, Tuple

from .messages import Message

DEFAULT_MAX_FRAME: int

def encode_frame(msg: Message, *, max_frame: int = ...) -> bytes:
    """Encode a message into one frame: big-endian length prefix and payload.
    A payload over ``max_frame`` bytes raises FrameTooLarge."""

def encode_frame_parts(
    msg: Message, *, max_frame: int = ...
) -> Tuple[bytes, Optional[memoryview], bytes]:
    """(head, gradients, tail) whose concatenation is ``encode_frame(msg)``;
    gradients is a byte memoryview on the caller's buffer, None for a message
    without gradients."""

def decode_payload(buffer: Any, *, allow_trailing: bool = False) -> Message:
    """Decode one payload (tag + body). Arrays are views into ``buffer``."""

def decode_frame(buffer: Any, *, allow_trailing: bool = False, max_frame: int = ...) -> Message:
    """Decode exactly one frame (length prefix + payload)."""

class FrameReader:
    """Cut a byte stream into frames and decode each into a message."""

    max_frame: int
    allow_trailing: bool
    def __init__(self, max_frame: int = ..., *, allow_trailing: bool = False) -> None: ...
    @property
    def pending(self) -> int:
        """Bytes received of a frame not yet complete (0 between frames)."""
    def feed(self, data: Any) -> List[Message]:
        """Take the next chunk of the stream; return the messages it completed."""
    def close(self) -> None:
        """Raise ProtocolError if the stream ended inside a frame."""
