"""Stubs for ddpwire._core, the compiled core: the wire codec (_wire.pxi),
the float32 kernels (_reduce.pxi), the int8 wire codec (_int8.pxi), the
socket layer (_net.pxi) and the shared-memory allreduce (_shm.pxi)."""
import socket
from typing import Any, Callable, Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple, Type, TypeVar, Union, overload

import numpy
import numpy.typing

from .wire.errors import PeerLost
from .wire.messages import Message

# ---- the wire codec ----

DEFAULT_MAX_FRAME: int

def encode_frame(msg: Message, *, max_frame: int = ...) -> bytes:
    """Encode a message into one frame: big-endian length prefix and payload.
    A payload over ``max_frame`` bytes raises FrameTooLarge."""

def encode_frame_parts(
    msg: Message, *, max_frame: int = ...
) -> Tuple[bytes, Optional[memoryview], bytes]:
    """(head, bulk, tail) whose concatenation is ``encode_frame(msg)``; bulk is
    a byte memoryview on the caller's buffer (gradients, or collective data),
    None for a message without a bulk field."""

def float32_gradients(obj: Any, field: str = ...) -> numpy.ndarray:
    """``obj`` (any C-contiguous float32 buffer) as a 1-D float32 array over
    the same memory; TypeError naming ``field`` and what ``obj`` is, the
    encoder's own check, for anything it could not send."""

def tag_max_payload(tag: int, max_frame: int) -> int:
    """Most payload bytes a frame with ``tag`` may carry: exact for fixed-size
    messages, 65,536 for small variable ones, ``max_frame`` for bulk ones, 0
    for an unknown tag."""

def message_layouts() -> Tuple[
    Tuple[int, str, str, bool, str, Tuple[Tuple[str, str, str], ...]], ...
]:
    """Every message of csrc/messages.def in tag order: (tag, name,
    direction, extensible, doc, fields), each field (name, wire type, rule)."""

def register_message_class(cls: type) -> None:
    """Make ``cls`` what decoding gives for ``cls.TAG`` and what encoding
    accepts (with its subclasses)."""

def _codes() -> Tuple[Dict[str, List[Tuple[str, int]]], Dict[int, int]]:
    """The codes of csrc/wire.h by family, and the dtype sizes."""

def decode_payload(buffer: Any, *, allow_trailing: bool = False) -> Message:
    """Decode one payload (tag + body). Arrays are views into ``buffer``."""

def decode_frame(buffer: Any, *, allow_trailing: bool = False, max_frame: int = ...) -> Message:
    """Decode exactly one frame (length prefix + payload)."""

class FrameReader:
    """Cut a byte stream into frames and decode each into a message."""

    max_frame: int
    allow_trailing: bool
    allowed_tags: Optional[FrozenSet[int]]
    def __init__(self, max_frame: int = ..., *, allow_trailing: bool = False,
                 allowed_tags: Optional[Iterable[int]] = None) -> None:
        """``allowed_tags``: refuse, before allocating its payload, a frame whose
        tag is not in the set or whose length exceeds ``tag_max_payload``."""
    @property
    def pending(self) -> int:
        """Bytes received of a frame not yet complete (0 between frames)."""
    def feed(self, data: Any) -> List[Message]:
        """Take the next chunk of the stream; return the messages it completed."""
    def close(self) -> None:
        """Raise ProtocolError if the stream ended inside a frame."""


# ---- the float32 kernels ----

# Any C-contiguous object exporting native float32 through the buffer protocol
# (numpy arrays, memoryviews, array.array('f'), torch CPU tensors' .numpy()).
_Buffer = Any
_B = TypeVar("_B")

@overload
def mean(inputs: Sequence[_Buffer], out: None = None) -> numpy.typing.NDArray[numpy.float32]: ...
@overload
def mean(inputs: Sequence[_Buffer], out: _B) -> _B: ...
@overload
def total(inputs: Sequence[_Buffer], out: None = None) -> numpy.typing.NDArray[numpy.float32]: ...
@overload
def total(inputs: Sequence[_Buffer], out: _B) -> _B: ...
def accumulate(acc: _B, src: _Buffer) -> _B: ...
def scale(buf: _B, divisor: float) -> _B: ...
def first_non_finite(buf: _Buffer) -> Optional[int]: ...
@overload
def to_half(src: _Buffer, out: None = None, *, codec: str) -> numpy.typing.NDArray[numpy.uint16]:
    """Narrow float32 ``src`` to the 16-bit ``codec`` ("bf16" or "fp16"),
    round to nearest even, into a new uint16 array; non-finite values are
    converted, not reported."""
@overload
def to_half(src: _Buffer, out: _B, *, codec: str) -> _B:
    """Narrow float32 ``src`` into ``out`` (uint16 or float16 elements)."""
@overload
def from_half(src: _Buffer, out: None = None, *, codec: str) -> numpy.typing.NDArray[numpy.float32]:
    """Widen 16-bit ``src`` (uint16 or float16 elements) exactly to float32,
    into a new array; non-finite values are converted, not reported."""
@overload
def from_half(src: _Buffer, out: _B, *, codec: str) -> _B:
    """Widen 16-bit ``src`` exactly into float32 ``out``."""
@overload
def mean_half(inputs: Sequence[_Buffer], out: None = None, *, codec: str
              ) -> numpy.typing.NDArray[numpy.uint16]:
    """The float32 mean of 16-bit buffers in input order, rounded once to
    ``codec``: ``to_half(mean([from_half(x) for x in inputs]))`` bit for bit.
    Raises NonFiniteGradient for the first NaN or inf (lowest input, then
    index), out complete even then."""
@overload
def mean_half(inputs: Sequence[_Buffer], out: _B, *, codec: str) -> _B:
    """As above, into ``out`` (uint16 or float16 elements, no overlap)."""
@overload
def total_half(inputs: Sequence[_Buffer], out: None = None, *, codec: str
               ) -> numpy.typing.NDArray[numpy.uint16]:
    """The float32 sum of 16-bit buffers in input order, rounded once to
    ``codec``: ``to_half(total([from_half(x) for x in inputs]))`` bit for
    bit; errors as :func:`mean_half`."""
@overload
def total_half(inputs: Sequence[_Buffer], out: _B, *, codec: str) -> _B:
    """As above, into ``out`` (uint16 or float16 elements, no overlap)."""

# ---- the int8 wire codec (csrc/int8.h) ----

#: elements that share one float32 scale
INT8_BLOCK: int

def int8_size(n: int) -> int:
    """Bytes ``n`` elements take: ``n`` codes and 4 bytes of scale per
    :data:`INT8_BLOCK` elements (a trailing partial block too)."""
@overload
def int8_encode(src: _Buffer, out: None = None) -> numpy.typing.NDArray[numpy.uint8]:
    """Encode float32 ``src`` into a new uint8 array: per block, its scale
    (max |x| / 127; NaN for a block holding a NaN or inf) and a code per
    element rounded to nearest even. Non-finite values are not reported."""
@overload
def int8_encode(src: _Buffer, out: _B) -> _B:
    """As above, into ``out`` (uint8 or int8 elements, no overlap)."""
@overload
def int8_decode(src: _Buffer, out: None = None) -> numpy.typing.NDArray[numpy.float32]:
    """Decode an encoding (code times scale) into a new float32 array; its
    count is the one ``src``'s length names (ValueError for a length no
    encoding has)."""
@overload
def int8_decode(src: _Buffer, out: _B) -> _B:
    """As above, into float32 ``out`` (no overlap)."""
@overload
def int8_mean(inputs: Sequence[_Buffer], out: None = None, *, divide: bool = ...
              ) -> numpy.typing.NDArray[numpy.float32]:
    """Each encoding decoded, summed in float32 in input order and (with
    ``divide``) divided by their number: ``mean([int8_decode(x) for x in
    inputs])`` bit for bit. Raises NonFiniteGradient for the first
    non-finite decoded element (lowest input, then index), out complete
    even then."""
@overload
def int8_mean(inputs: Sequence[_Buffer], out: _B, *, divide: bool = ...) -> _B:
    """As above, into float32 ``out`` (no overlap)."""
def available_paths() -> List[str]: ...
def current_path() -> str: ...
def current_threads() -> int: ...
def _set_path(name: str) -> None: ...
def _set_threads(threads: int) -> None: ...


# ---- the socket layer ----


class Connection:
    sock: socket.socket
    fd: int
    peer_id: Optional[int]
    lost: Type[PeerLost]
    peer_name: str
    def __init__(self, sock: socket.socket, *, peer_id: Optional[int] = ...,
                 lost: Type[PeerLost] = ..., peer_name: str = ...) -> None: ...
    def fileno(self) -> int: ...
    def close(self) -> None: ...
    def seal(self, send_key: bytes, recv_key: bytes) -> None:
        """From here on every byte either way goes in AES-256-GCM records
        under these 32-byte keys (the peer seals at the same byte, keys
        swapped); a record that fails to open raises IntegrityError."""
    @property
    def sealed(self) -> bool: ...
    def held(self) -> int:
        """Bytes received and opened but not yet taken (a poll on the socket
        does not see them)."""
    def recv_into(self, buf: _Buffer, timeout: float, *, deadline: Optional[float] = ...,
                  check_finite: bool = ..., step: Optional[int] = ...,
                  what: str = ...) -> Optional[int]:
        """Fill ``buf``; ``timeout`` bounds silence, ``deadline`` (time.monotonic())
        the whole receive. With ``check_finite``: the first non-finite element's
        index, checked as the bytes land, or None."""
    def recv_exact(self, n: int, timeout: float, *, step: Optional[int] = ...,
                   what: str = ...) -> bytes: ...
    def send_parts(self, parts: Iterable[Optional[_Buffer]], timeout: float, *,
                   deadline: Optional[float] = ..., step: Optional[int] = ...,
                   what: str = ...) -> None: ...

SEALED_RECORD: int

def load_libcrypto(path: str) -> None:
    """Load libcrypto's AES-256-GCM for sealed links; OSError saying what is missing."""
def libcrypto_loaded() -> bool: ...

class FrameHead:
    tag: int
    message_type: str
    step: int
    worker_id: int
    block_idx: int
    num_blocks: int
    component: int
    component_sizes: numpy.typing.NDArray[numpy.uint32]
    gradient_count: int
    tail_len: int
    bulk_len: int
    seq: int
    kind: int
    op: int
    dtype: int
    root: int
    count: int

def send_many(conns: List[Connection], parts: Iterable[Optional[_Buffer]], timeout: float, *,
              step: Optional[int] = ..., what: str = ...) -> None: ...
def exchange_many(conns: List[Optional[Connection]],
                  sends: Sequence[Optional[Sequence[Optional[_Buffer]]]],
                  recvs: Sequence[Optional[Sequence[_Buffer]]], timeout: float, *,
                  deadline: Optional[float] = ..., step: Optional[int] = ...,
                  what: str = ..., codec: Optional[str] = ...,
                  narrow_from: Optional[Sequence[Optional[_Buffer]]] = ...,
                  widen_into: Optional[Sequence[Optional[_Buffer]]] = ...,
                  reduce: Optional[Tuple[Sequence[_Buffer], Sequence[Optional[int]], _Buffer,
                                         bool, Optional[_Buffer]]] = ...
                  ) -> Optional[Tuple[int, int]]:
    """Send ``sends[i]`` to ``conns[i]`` while filling ``recvs[i]`` from it, for
    every i at once in one GIL-free poll loop (the data plane of a mesh
    reduce); receiving never waits for sending, so peers that all send before
    they read cannot deadlock. A None connection is an empty slot. Each
    ``sends[i]`` / ``recvs[i]`` is at most 8 buffers (recvs writable), taken as
    one concatenation. ``timeout`` bounds silence on all sockets together,
    ``deadline`` (time.monotonic()) the whole call; a failure raises the
    failing connection's ``lost`` error, naming that peer and the bytes moved.

    Kernels run on the elements as they move: with ``codec`` ("bf16",
    "fp16"), ``narrow_from[i]`` (float32) is narrowed into ``sends[i]``'s one
    part just ahead of its bytes and ``recvs[i]``'s one buffer widened into
    ``widen_into[i]`` as it arrives; ``reduce`` = (inputs, sources, out,
    divide, own_from) makes ``out`` the mean or sum of ``inputs`` in order,
    input j arriving as ``recvs[sources[j]]`` (None: this member's own,
    narrowed from ``own_from`` in 16 bits). Returns the reduce's first
    non-finite input element as (input, index), or None."""
def set_kernel_chunk(elements: int) -> None:
    """How many elements exchange_many's kernels narrow ahead and reduce or
    widen per call at least (0: the defaults); a few, for tests."""
def reduce_stream(conns: List[Connection], out: _Buffer, tail_len: int, timeout: float, *,
                  ring_bytes: int = ..., socket_threads: bool = ..., step: Optional[int] = ...,
                  what: str = ..., scales: Optional[Sequence[float]] = ...
                  ) -> Tuple[List[bytes], Optional[List[Tuple[int, float]]]]: ...
def allreduce_stream(conns: List[Connection], out: _Buffer, tail_len: int, head: _Buffer,
                     make_tail: Callable[[List[bytes]], _Buffer], timeout: float, *,
                     ring_bytes: int = ..., socket_threads: bool = ..., step: Optional[int] = ...,
                     what: str = ..., halt_on_nonfinite: bool = ...,
                     scales: Optional[Sequence[float]] = ...
                     ) -> Tuple[List[bytes], Optional[List[Tuple[int, float]]]]: ...

class Exchange:
    sent: int
    done: bool
    def __init__(self, conn: Connection, parts: Iterable[Optional[_Buffer]], timeout: float, *,
                 step: Optional[int] = ..., what: str = ..., send_thread: bool = ...) -> None: ...
    def recv_into(self, *bufs: _Buffer, what: str = ..., deadline: Optional[float] = ...,
                  check_finite: bool = ...) -> Optional[int]: ...
    def finish(self) -> None: ...
    def abandon(self) -> None: ...

def read_frame_head(conn: Connection, timeout: float, max_frame: int, *,
                    deadline: Optional[float] = ..., expect: Optional[Sequence[type]] = ...,
                    step: Optional[int] = ..., what: str = ...,
                    collective_heads: bool = ...) -> Any:
    """One frame up to its bulk field: a FrameHead, or a whole message.
    A tag outside ``expect`` or over its own limit is refused before its
    body is allocated; ``deadline`` bounds the whole head."""
def exchange_frame_head(exchange: "Exchange", max_frame: int, *,
                        deadline: Optional[float] = ..., expect: Optional[Sequence[type]] = ...,
                        peer_id: Optional[int] = ..., step: Optional[int] = ..., what: str = ...,
                        collective_heads: bool = ...) -> Any: ...
def decode_tail(tag: int, tail: bytes) -> Tuple[float, int, int, float]: ...
def read_tail(conn: Connection, head: FrameHead, timeout: float, *,
              step: Optional[int] = ...) -> Tuple[float, int, int, float]: ...

# ---- the shared-memory allreduce (csrc/shm.h; public face ddpwire.plane.shm) ----

SHM_OK: int
SHM_TIMEOUT: int
SHM_ABORTED: int

SHM_OFFER_LEN: int

def shm_offer_encode(host_id: bytes, nonce: bytes, region_bytes: int, name: str) -> bytes:
    """The 81 bytes of a shared-memory offer (csrc/shm.h); an empty name is
    the offer of no segment."""
    ...

def shm_offer_decode(data: bytes) -> Optional[Tuple[bytes, bytes, int, str]]:
    """(host_id, nonce, region_bytes, name), or None for the offer of no
    segment; ValueError for bytes that are not an offer."""
    ...

def shm_size(world: int, region_bytes: int) -> int:
    """Bytes of a mapping for ``world`` ranks and regions of ``region_bytes`` (0 when impossible)."""

class ShmArena:
    """Rank ``rank`` of ``world`` on a shared mapping of ``shm_size(world, region_bytes)`` bytes."""
    rank: int
    world: int
    region_bytes: int
    def __init__(self, mapping: Any, world: int, rank: int, region_bytes: int) -> None: ...
    def close(self) -> bool:
        """Let go of the mapping (when the running allreduce returns, if one runs); True when now."""
    def init(self, nonce: bytes) -> None: ...
    def check(self, nonce: bytes) -> bool: ...
    def barrier(self, generation: int, timeout: float) -> Tuple[int, int]:
        """(SHM_OK, -1), (SHM_TIMEOUT, first missing rank) or (SHM_ABORTED, rank blamed)."""
    def abort(self, rank: int) -> None: ...
    def aborted(self) -> int: ...
    def stage(self, buf: _Buffer, op: int, start: int, count: int) -> None:
        """Copy float32 bytes, all but this rank's own slice (elements
        [start, start + count): ddpwire.plane.plan's cut, alike on every rank),
        into its input region and post their count and ``op`` (SUM 0, AVG
        1); ``buf`` must not change until :meth:`reduce`."""
    def agree(self) -> int: ...
    def reduce(self, buf: _Buffer, into_own: bool = ...) -> Tuple[int, int, int, int, float]:
        """This rank's slice (the staged one) reduced with the staged op into
        the output (and, with ``into_own``, into ``buf``), its own input read from ``buf``
        (the buffer :meth:`stage` was given): (start, count, bad rank or -1,
        bad element, its value)."""
    def gather(self, buf: _Buffer, skip_own: bool = ...) -> None:
        """The output into ``buf`` (with ``skip_own``, all but this rank's staged slice)."""
