"""The eleven messages of the DDP wire protocol and ddpwire's extension
messages (docs/extensions.md), as plain Python objects.

Field names and order follow the wire layout (see docs/protocol-notes.md),
except MeshPeers.coordinator_share, which comes last so that it may be left out.
Each class carries its wire ``TAG``. :data:`LAYOUTS` is the one description
of every message's bytes (tag, fields in wire order, wire types); the
compiled codec (:mod:`ddpwire._core`) implements it, and these classes only
hold values; tests/test_message_table.py checks the codec, the classes and
the docs against the table.

Value types:

* integers are Python ints (``u8``/``u16``/``u32``/``u64`` on the wire; the
  encoder checks the range);
* strings are ``str`` (UTF-8 on the wire);
* ``loss``, ``global_loss`` and the other ``f32`` fields are Python floats
  holding a float32 value: the decoder widens the wire value bit-exactly (NaN
  payloads included) and the encoder rounds to float32;
* ``gradients`` is a float32 buffer. Decoded messages hold a read-only or
  writable numpy ``float32`` view *into the decoded buffer* (no copy); for
  encoding, any C-contiguous float32 buffer works (numpy array, a CPU
  tensor's ``.numpy()``, ``array.array('f')``, a ``memoryview`` of format
  ``'f'``);
* ``component_sizes`` is decoded as a numpy ``uint32`` view into the buffer;
  for encoding any sequence of ints that fit in u32 works.
* ``extensions`` (JoinRequest, JoinAccepted) is ``None`` (no extension block:
  the reference bytes) or a dict ``{entry type: value bytes}``; decoded
  values are ``bytes``, in wire order. It is not among ``__slots__`` of the
  class (those are the reference fields) but compares like one.
* ``nonce`` and ``proof`` are 32 ``bytes``; ``data`` of the collective
  messages is decoded as a numpy ``uint8`` view into the buffer (no copy;
  ``.view(DType.X.numpy)`` reinterprets it) and for encoding is any
  C-contiguous buffer of ``count`` elements of ``dtype``.

Equality is bit-exact: gradients compare by their float32 bit patterns (so a
NaN equals a NaN with the same bits, and -0.0 differs from 0.0), and the
float fields by their bits as well. Messages are mutable and unhashable.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Optional, Sequence, Tuple

import numpy as np

__all__ = [
    "Message",
    "JoinRequest",
    "JoinAccepted",
    "ShardAssignment",
    "GradientPayload",
    "AveragedGradient",
    "Heartbeat",
    "Shutdown",
    "BlockGradientPayload",
    "AveragedBlockGradient",
    "NonBlockGradientPayload",
    "AveragedNonBlockGradient",
    "AuthChallenge",
    "AuthProof",
    "JoinRefused",
    "CollectiveRequest",
    "CollectiveResult",
    "CollectiveError",
    "MeshPeers",
    "PeerHello",
    "StepReport",
    "StepCommit",
    "StepTiming",
    "ShardScale",
    "StepAborted",
    "StateRequest",
    "ModelState",
    "NO_WORKER",
    "NON_BLOCK_COMPONENTS",
    "MESSAGE_TYPES",
    "Layout",
    "LAYOUTS",
]

# A float32 buffer: what a gradients field holds or accepts.
Float32Buffer = Any


def _float32_bits(value: Any) -> np.ndarray:
    return np.asarray(value, dtype=np.float32).reshape(-1).view(np.uint32)


def _same_gradients(a: Any, b: Any) -> bool:
    bits_a = _float32_bits(a)
    bits_b = _float32_bits(b)
    return bits_a.shape == bits_b.shape and bool(np.array_equal(bits_a, bits_b))


def _same_sizes(a: Any, b: Any) -> bool:
    return bool(np.array_equal(np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)))


_double = struct.Struct("d")  # host order: a bit comparison, not a wire format


def _same_float(a: Any, b: Any) -> bool:
    return _double.pack(a) == _double.pack(b)


def _same_bytes(a: Any, b: Any) -> bool:
    # any C-contiguous buffers, compared as their raw bytes
    return memoryview(a).cast("B") == memoryview(b).cast("B")


_COMPARE = {
    "data": _same_bytes,
    "gradients": _same_gradients,
    "component_sizes": _same_sizes,
    "loss": _same_float,
    "global_loss": _same_float,
    "bad_value": _same_float,
    "scale": _same_float,
}


class Message:
    """Base of every wire message. ``TAG`` is the message's tag byte."""

    __slots__ = ()
    TAG: ClassVar[int]

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        for name in self.__slots__:
            a = getattr(self, name)
            b = getattr(other, name)
            same = _COMPARE.get(name)
            if same is None:
                if a != b:
                    return False
            elif not same(a, b):
                return False
        return True

    __hash__ = None  # type: ignore[assignment]  # mutable, and arrays are unhashable


Extensions = Optional[Dict[int, bytes]]


class _Extensible(Message):
    """A reference message that may carry the extension block after its last
    field. ``extensions`` lives in this base's slot so that the subclass's
    ``__slots__`` stay exactly the reference fields."""

    __slots__ = ("extensions",)
    extensions: Extensions

    def __eq__(self, other: object) -> bool:
        same = super().__eq__(other)
        if same is not True:
            return same
        return self.extensions == other.extensions  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"{type(self).__name__}({fields}, extensions={self.extensions!r})"


@dataclass(eq=False, init=False, repr=False)
class JoinRequest(_Extensible):
    """Worker to coordinator: ask to join (tag 0x01), optionally offering
    extensions."""

    __slots__ = ("node_id", "gpu_count", "backend")
    TAG: ClassVar[int] = 0x01
    node_id: str
    gpu_count: int
    backend: str

    def __init__(self, node_id: str, gpu_count: int, backend: str,
                 extensions: Extensions = None) -> None:
        self.node_id = node_id
        self.gpu_count = gpu_count
        self.backend = backend
        self.extensions = extensions


@dataclass(eq=False, init=False, repr=False)
class JoinAccepted(_Extensible):
    """Coordinator to worker: the worker's id and the number of workers (0x02),
    optionally granting extensions."""

    __slots__ = ("worker_id", "total_workers")
    TAG: ClassVar[int] = 0x02
    worker_id: int
    total_workers: int

    def __init__(self, worker_id: int, total_workers: int,
                 extensions: Extensions = None) -> None:
        self.worker_id = worker_id
        self.total_workers = total_workers
        self.extensions = extensions


@dataclass(eq=False)
class ShardAssignment(Message):
    """Coordinator to worker: train samples [shard_start, shard_end) at ``step`` (0x03)."""

    __slots__ = ("step", "shard_start", "shard_end")
    TAG: ClassVar[int] = 0x03
    step: int
    shard_start: int
    shard_end: int


@dataclass(eq=False)
class GradientPayload(Message):
    """Worker to coordinator: a flat gradient and the shard's loss and accuracy (0x04)."""

    __slots__ = ("step", "worker_id", "gradients", "loss", "correct", "total")
    TAG: ClassVar[int] = 0x04
    step: int
    worker_id: int
    gradients: Float32Buffer
    loss: float
    correct: int
    total: int


@dataclass(eq=False)
class AveragedGradient(Message):
    """Coordinator to worker: the averaged flat gradient and global loss (0x05)."""

    __slots__ = ("step", "gradients", "global_loss")
    TAG: ClassVar[int] = 0x05
    step: int
    gradients: Float32Buffer
    global_loss: float


@dataclass(eq=False)
class Heartbeat(Message):
    """Either direction: the sender is alive (0x06)."""

    __slots__ = ("node_id", "timestamp_ms")
    TAG: ClassVar[int] = 0x06
    node_id: str
    timestamp_ms: int


@dataclass(eq=False)
class Shutdown(Message):
    """Coordinator to worker: training is over (0x07)."""

    __slots__ = ()
    TAG: ClassVar[int] = 0x07


@dataclass(eq=False)
class BlockGradientPayload(Message):
    """Worker to coordinator: one transformer block's gradient (0x08).

    ``gradients`` is the concatenation of the block's components;
    ``component_sizes`` gives each one's element count.
    """

    __slots__ = ("step", "worker_id", "block_idx", "num_blocks", "component_sizes", "gradients")
    TAG: ClassVar[int] = 0x08
    step: int
    worker_id: int
    block_idx: int
    num_blocks: int
    component_sizes: Sequence[int]
    gradients: Float32Buffer


@dataclass(eq=False)
class AveragedBlockGradient(Message):
    """Coordinator to worker: one block's averaged gradient (0x09)."""

    __slots__ = ("step", "block_idx", "component_sizes", "gradients")
    TAG: ClassVar[int] = 0x09
    step: int
    block_idx: int
    component_sizes: Sequence[int]
    gradients: Float32Buffer


#: NonBlockGradientPayload.component: the protocol's code for each non-block
#: part of the model, by name (in code order)
NON_BLOCK_COMPONENTS: Dict[str, int] = {"lm_head": 0, "final_norm": 1, "embedding": 2}


@dataclass(eq=False)
class NonBlockGradientPayload(Message):
    """Worker to coordinator: a non-block component's gradient (0x0A).

    ``component``: 0 = lm_head, 1 = final_norm, 2 = embedding
    (:data:`NON_BLOCK_COMPONENTS`; any u8 is carried).
    """

    __slots__ = ("step", "worker_id", "component", "gradients")
    TAG: ClassVar[int] = 0x0A
    step: int
    worker_id: int
    component: int
    gradients: Float32Buffer


@dataclass(eq=False)
class AveragedNonBlockGradient(Message):
    """Coordinator to worker: a non-block component's averaged gradient (0x0B)."""

    __slots__ = ("step", "component", "gradients")
    TAG: ClassVar[int] = 0x0B
    step: int
    component: int
    gradients: Float32Buffer


@dataclass(eq=False)
class AuthChallenge(Message):
    """Coordinator to worker: the coordinator's nonce and its proof of the
    token (0x40). Both are 32 bytes."""

    __slots__ = ("nonce", "proof")
    TAG: ClassVar[int] = 0x40
    nonce: bytes
    proof: bytes


@dataclass(eq=False)
class AuthProof(Message):
    """Worker to coordinator: the worker's proof of the token (0x41), 32 bytes."""

    __slots__ = ("proof",)
    TAG: ClassVar[int] = 0x41
    proof: bytes


@dataclass(eq=False)
class JoinRefused(Message):
    """Coordinator to worker: why the join was refused (0x42); ``reason`` is a
    :class:`ddpwire.wire.extensions.RefusalReason` code (any u8 is carried)."""

    __slots__ = ("reason", "detail")
    TAG: ClassVar[int] = 0x42
    reason: int
    detail: str


@dataclass(eq=False)
class CollectiveRequest(Message):
    """One collective operation (0x43): worker to coordinator on the
    collective service, and worker to worker on a mesh or rank link.

    ``kind``, ``op`` and ``dtype`` are codes of
    :mod:`ddpwire.wire.extensions`; ``data`` holds ``count`` elements of ``dtype``.
    """

    __slots__ = ("seq", "kind", "op", "dtype", "root", "count", "data")
    TAG: ClassVar[int] = 0x43
    seq: int
    kind: int
    op: int
    dtype: int
    root: int
    count: int
    data: Any


@dataclass(eq=False)
class CollectiveResult(Message):
    """Coordinator to worker: the result of collective ``seq`` (0x44)."""

    __slots__ = ("seq", "kind", "dtype", "count", "data")
    TAG: ClassVar[int] = 0x44
    seq: int
    kind: int
    dtype: int
    count: int
    data: Any


@dataclass(eq=False)
class CollectiveError(Message):
    """Collective ``seq`` failed (0x45): coordinator to worker, and, in a
    mesh step, worker to coordinator; ``worker_id`` is the worker at fault,
    0xFFFFFFFF for none."""

    __slots__ = ("seq", "worker_id", "detail")
    TAG: ClassVar[int] = 0x45
    seq: int
    worker_id: int
    detail: str


#: StepReport.bad_worker / StepCommit.bad_worker when every value was finite
NO_WORKER = 0xFFFFFFFF


@dataclass(eq=False, init=False)
class MeshPeers(Message):
    """Coordinator to worker, once after the join: where the other workers
    of a mesh session listen (0x46). ``peers`` is ``host:port`` per worker in
    worker order, comma-separated (an IPv6 host in brackets); empty means the
    session keeps the star. ``key`` (32 bytes) authenticates the links
    between workers; ``codec`` is a :class:`ddpwire.wire.extensions.Codec` code;
    ``shared_memory`` (0 or 1) says every worker offered the same host and
    steps move through a shared segment rather than the links
    (:mod:`ddpwire.plane.mesh`).

    ``coordinator_share`` (u16) is the part of each linked step (shared_memory
    0) the coordinator averages itself, as the star would: the last
    ``count * coordinator_share >> 16`` elements of the ``count``-element
    vector travel to it in a GradientPayload and come back in an
    AveragedGradient; 0 leaves the whole vector to the workers. It is last
    here so that older constructions keep working, but sits between
    ``shared_memory`` and ``peers`` on the wire."""

    __slots__ = ("key", "codec", "shared_memory", "peers", "coordinator_share")
    TAG: ClassVar[int] = 0x46
    key: bytes
    codec: int
    shared_memory: int
    peers: str
    coordinator_share: int

    # A dataclass default would be a class attribute, which __slots__ forbids.
    def __init__(self, key: bytes, codec: int, shared_memory: int, peers: str,
                 coordinator_share: int = 0) -> None:
        self.key = key
        self.codec = codec
        self.shared_memory = shared_memory
        self.peers = peers
        self.coordinator_share = coordinator_share


@dataclass(eq=False)
class PeerHello(Message):
    """Worker to worker, first on a mesh link, both ways (0x47): the
    sender's worker_id and its proof of the session's mesh key."""

    __slots__ = ("worker_id", "proof")
    TAG: ClassVar[int] = 0x47
    worker_id: int
    proof: bytes


@dataclass(eq=False)
class StepReport(Message):
    """Worker to coordinator in a mesh step (0x48): the worker has averaged
    its slice. ``count`` is its gradient length; loss, correct and total are
    GradientPayload's; ``bad_worker`` (NO_WORKER when none) names the first
    worker whose elements in this slice were NaN or +/-inf, ``bad_index``
    the element in the whole vector, ``bad_value`` its value."""

    __slots__ = ("step", "worker_id", "count", "loss", "correct", "total", "bad_worker",
                 "bad_index", "bad_value")
    TAG: ClassVar[int] = 0x48
    step: int
    worker_id: int
    count: int
    loss: float
    correct: int
    total: int
    bad_worker: int
    bad_index: int
    bad_value: float


@dataclass(eq=False)
class StepCommit(Message):
    """Coordinator to worker, ending a mesh step (0x49). With ``bad_worker``
    NO_WORKER every slice was finite: exchange the averaged slices and apply
    them. Otherwise the session halts: no worker applies any of it."""

    __slots__ = ("step", "global_loss", "bad_worker", "bad_index", "bad_value")
    TAG: ClassVar[int] = 0x49
    step: int
    global_loss: float
    bad_worker: int
    bad_index: int
    bad_value: float


@dataclass(eq=False)
class StepTiming(Message):
    """Worker to coordinator, with the balance extension (0x4A): how long
    the worker computed step ``step``, in microseconds from receiving the
    step's ShardAssignment to starting to send its gradients. Sent right
    before the step's first gradient frame."""

    __slots__ = ("step", "compute_us")
    TAG: ClassVar[int] = 0x4A
    step: int
    compute_us: int


@dataclass(eq=False)
class ShardScale(Message):
    """Coordinator to worker, with the balance extension (0x4B), right after
    the step's ShardAssignment: the worker multiplies every gradient it
    sends for ``step`` by ``scale`` (float32) before it leaves. ``scale`` is
    finite and >= 0 (0.0 for an empty shard; 1.0 when shards are equal);
    the codec refuses anything else both ways."""

    __slots__ = ("step", "scale")
    TAG: ClassVar[int] = 0x4B
    step: int
    scale: float


@dataclass(eq=False)
class StepAborted(Message):
    """Coordinator to worker, with the elastic extension (0x4C), in place
    of the step's average: worker ``worker_id`` was lost during ``step``,
    nobody applies any of the step, and the ``workers`` left compute it
    again on the shards that follow (a new ShardAssignment for the same
    step). A ``worker_id`` that is the receiver's own says it was dropped
    from the session (it stalled past its timeout): its connection closes
    next."""

    __slots__ = ("step", "worker_id", "workers")
    TAG: ClassVar[int] = 0x4C
    step: int
    worker_id: int
    workers: int


@dataclass(eq=False)
class StateRequest(Message):
    """Coordinator to worker, with the elastic extension (0x4D), between two
    steps (where a ShardAssignment could come): send the model's state as it
    is before step ``step`` (a ModelState), for a worker joining there."""

    __slots__ = ("step",)
    TAG: ClassVar[int] = 0x4D
    step: int


@dataclass(eq=False)
class ModelState(Message):
    """Worker to coordinator in answer to a StateRequest, and coordinator to
    a worker joining an elastic session before its first step (0x4E): a
    piece of whatever the training code keeps of its state before step
    ``step`` (weights, optimizer, anything else; opaque here). The state
    is ``total`` bytes, sent as consecutive pieces in order (each frame
    within the peer's frame limit); ``digest`` is the SHA-256 of the whole
    state, the same in every piece, which the joiner checks before using
    it."""

    __slots__ = ("step", "total", "digest", "data")
    TAG: ClassVar[int] = 0x4E
    step: int
    total: int
    digest: bytes
    data: Any


#: tag -> message class, for every tag the protocol and its extensions define
MESSAGE_TYPES = {
    cls.TAG: cls
    for cls in (
        JoinRequest,
        JoinAccepted,
        ShardAssignment,
        GradientPayload,
        AveragedGradient,
        Heartbeat,
        Shutdown,
        BlockGradientPayload,
        AveragedBlockGradient,
        NonBlockGradientPayload,
        AveragedNonBlockGradient,
        AuthChallenge,
        AuthProof,
        JoinRefused,
        CollectiveRequest,
        CollectiveResult,
        CollectiveError,
        MeshPeers,
        PeerHello,
        StepReport,
        StepCommit,
        StepTiming,
        ShardScale,
        StepAborted,
        StateRequest,
        ModelState,
    )
}


@dataclass(frozen=True)
class Layout:
    """One message's place on the wire: its tag, who sends it, and its
    fields in wire order with their wire types (``u8`` ``u16`` ``u32``
    ``u64`` ``f32``; ``string``: u32 byte count and UTF-8; ``f32vec``: u64
    count and float32 elements; ``u32list``: u32 count and u32 elements;
    ``bytes32``: 32 raw bytes; ``bytes``: u64 byte count and the bytes).
    ``extensible``: an extension block may follow the last field."""

    tag: int
    name: str
    direction: str
    fields: Tuple[Tuple[str, str], ...]
    extensible: bool = False


def _layout(tag: int, name: str, direction: str, body: str, extensible: bool = False) -> Layout:
    fields = tuple(tuple(f.split(": ")) for f in body.split(", ")) if body else ()
    return Layout(tag, name, direction, fields, extensible)  # type: ignore[arg-type]


#: The one description of every message's layout, in tag order. The C codec
#: (csrc/wire.h, wire.c), the classes above and the tables of
#: docs/extensions.md are checked against it, byte by byte where it counts,
#: by tests/test_message_table.py: a message changed in one place and not
#: another fails there.
LAYOUTS: Tuple[Layout, ...] = (
    _layout(0x01, "JoinRequest", "worker → coordinator",
            "node_id: string, gpu_count: u32, backend: string", extensible=True),
    _layout(0x02, "JoinAccepted", "coordinator → worker",
            "worker_id: u32, total_workers: u32", extensible=True),
    _layout(0x03, "ShardAssignment", "coordinator → worker",
            "step: u64, shard_start: u64, shard_end: u64"),
    _layout(0x04, "GradientPayload", "worker → coordinator",
            "step: u64, worker_id: u32, gradients: f32vec, loss: f32, correct: u64, total: u64"),
    _layout(0x05, "AveragedGradient", "coordinator → worker",
            "step: u64, gradients: f32vec, global_loss: f32"),
    _layout(0x06, "Heartbeat", "both", "node_id: string, timestamp_ms: u64"),
    _layout(0x07, "Shutdown", "coordinator → worker", ""),
    _layout(0x08, "BlockGradientPayload", "worker → coordinator",
            "step: u64, worker_id: u32, block_idx: u32, num_blocks: u32, "
            "component_sizes: u32list, gradients: f32vec"),
    _layout(0x09, "AveragedBlockGradient", "coordinator → worker",
            "step: u64, block_idx: u32, component_sizes: u32list, gradients: f32vec"),
    _layout(0x0A, "NonBlockGradientPayload", "worker → coordinator",
            "step: u64, worker_id: u32, component: u8, gradients: f32vec"),
    _layout(0x0B, "AveragedNonBlockGradient", "coordinator → worker",
            "step: u64, component: u8, gradients: f32vec"),
    _layout(0x40, "AuthChallenge", "coordinator → worker", "nonce: bytes32, proof: bytes32"),
    _layout(0x41, "AuthProof", "worker → coordinator", "proof: bytes32"),
    _layout(0x42, "JoinRefused", "coordinator → worker", "reason: u8, detail: string"),
    _layout(0x43, "CollectiveRequest", "worker → coordinator; worker → worker (mesh link)",
            "seq: u64, kind: u8, op: u8, dtype: u8, root: u32, count: u64, data: bytes"),
    _layout(0x44, "CollectiveResult", "coordinator → worker",
            "seq: u64, kind: u8, dtype: u8, count: u64, data: bytes"),
    _layout(0x45, "CollectiveError", "coordinator → worker; worker → coordinator in a mesh step",
            "seq: u64, worker_id: u32, detail: string"),
    _layout(0x46, "MeshPeers", "coordinator → worker",
            "key: bytes32, codec: u8, shared_memory: u8, coordinator_share: u16, peers: string"),
    _layout(0x47, "PeerHello", "worker → worker (mesh link)", "worker_id: u32, proof: bytes32"),
    _layout(0x48, "StepReport", "worker → coordinator",
            "step: u64, worker_id: u32, count: u64, loss: f32, correct: u64, total: u64, "
            "bad_worker: u32, bad_index: u64, bad_value: f32"),
    _layout(0x49, "StepCommit", "coordinator → worker",
            "step: u64, global_loss: f32, bad_worker: u32, bad_index: u64, bad_value: f32"),
    _layout(0x4A, "StepTiming", "worker → coordinator", "step: u64, compute_us: u64"),
    _layout(0x4B, "ShardScale", "coordinator → worker", "step: u64, scale: f32"),
    _layout(0x4C, "StepAborted", "coordinator → worker", "step: u64, worker_id: u32, workers: u32"),
    _layout(0x4D, "StateRequest", "coordinator → worker", "step: u64"),
    _layout(0x4E, "ModelState", "worker → coordinator; coordinator → worker",
            "step: u64, total: u64, digest: bytes32, data: bytes"),
)
