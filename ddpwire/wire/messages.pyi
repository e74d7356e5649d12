# Made from csrc/messages.def by ddpwire.wire.messages.stub(): do not edit.
from typing import Any, ClassVar, Dict, Optional, Sequence, Tuple, Type

Float32Buffer = Any
Extensions = Optional[Dict[int, bytes]]
NO_WORKER: int
NON_BLOCK_COMPONENTS: Dict[str, int]

class Message:
    TAG: ClassVar[int]
    def __eq__(self, other: object) -> bool: ...

class Layout:
    tag: int
    name: str
    direction: str
    fields: Tuple[Tuple[str, str], ...]
    extensible: bool
    rules: Tuple[Tuple[str, str], ...]
    doc: str
    @property
    def python_order(self) -> Tuple[str, ...]: ...

LAYOUTS: Tuple[Layout, ...]
MESSAGE_TYPES: Dict[int, Type[Message]]

class JoinRequest(Message):
    """Worker to coordinator: ask to join (tag 0x01), optionally offering
    extensions."""

    node_id: str
    gpu_count: int
    backend: str
    extensions: Extensions
    def __init__(self, node_id: str, gpu_count: int, backend: str, extensions: Extensions = ...) -> None: ...

class JoinAccepted(Message):
    """Coordinator to worker: the worker's id and the number of workers (0x02),
    optionally granting extensions."""

    worker_id: int
    total_workers: int
    extensions: Extensions
    def __init__(self, worker_id: int, total_workers: int, extensions: Extensions = ...) -> None: ...

class ShardAssignment(Message):
    """Coordinator to worker: train samples [shard_start, shard_end) at ``step`` (0x03)."""

    step: int
    shard_start: int
    shard_end: int
    def __init__(self, step: int, shard_start: int, shard_end: int) -> None: ...

class GradientPayload(Message):
    """Worker to coordinator: a flat gradient and the shard's loss and accuracy (0x04)."""

    step: int
    worker_id: int
    gradients: Float32Buffer
    loss: float
    correct: int
    total: int
    def __init__(self, step: int, worker_id: int, gradients: Float32Buffer, loss: float, correct: int, total: int) -> None: ...

class AveragedGradient(Message):
    """Coordinator to worker: the averaged flat gradient and global loss (0x05)."""

    step: int
    gradients: Float32Buffer
    global_loss: float
    def __init__(self, step: int, gradients: Float32Buffer, global_loss: float) -> None: ...

class Heartbeat(Message):
    """Either direction: the sender is alive (0x06)."""

    node_id: str
    timestamp_ms: int
    def __init__(self, node_id: str, timestamp_ms: int) -> None: ...

class Shutdown(Message):
    """Coordinator to worker: training is over (0x07)."""

    def __init__(self) -> None: ...

class BlockGradientPayload(Message):
    """Worker to coordinator: one transformer block's gradient (0x08).

    ``gradients`` is the concatenation of the block's components;
    ``component_sizes`` gives each one's element count."""

    step: int
    worker_id: int
    block_idx: int
    num_blocks: int
    component_sizes: Sequence[int]
    gradients: Float32Buffer
    def __init__(self, step: int, worker_id: int, block_idx: int, num_blocks: int, component_sizes: Sequence[int], gradients: Float32Buffer) -> None: ...

class AveragedBlockGradient(Message):
    """Coordinator to worker: one block's averaged gradient (0x09)."""

    step: int
    block_idx: int
    component_sizes: Sequence[int]
    gradients: Float32Buffer
    def __init__(self, step: int, block_idx: int, component_sizes: Sequence[int], gradients: Float32Buffer) -> None: ...

class NonBlockGradientPayload(Message):
    """Worker to coordinator: a non-block component's gradient (0x0A).

    ``component``: 0 = lm_head, 1 = final_norm, 2 = embedding
    (:data:`NON_BLOCK_COMPONENTS`; any u8 is carried)."""

    step: int
    worker_id: int
    component: int
    gradients: Float32Buffer
    def __init__(self, step: int, worker_id: int, component: int, gradients: Float32Buffer) -> None: ...

class AveragedNonBlockGradient(Message):
    """Coordinator to worker: a non-block component's averaged gradient (0x0B)."""

    step: int
    component: int
    gradients: Float32Buffer
    def __init__(self, step: int, component: int, gradients: Float32Buffer) -> None: ...

class AuthChallenge(Message):
    """Coordinator to worker: the coordinator's nonce and its proof of the
    token (0x40). Both are 32 bytes."""

    nonce: bytes
    proof: bytes
    def __init__(self, nonce: bytes, proof: bytes) -> None: ...

class AuthProof(Message):
    """Worker to coordinator: the worker's proof of the token (0x41), 32 bytes."""

    proof: bytes
    def __init__(self, proof: bytes) -> None: ...

class JoinRefused(Message):
    """Coordinator to worker: why the join was refused (0x42); ``reason`` is a
    :class:`ddpwire.wire.extensions.RefusalReason` code (any u8 is carried)."""

    reason: int
    detail: str
    def __init__(self, reason: int, detail: str) -> None: ...

class CollectiveRequest(Message):
    """One collective operation (0x43): worker to coordinator on the
    collective service, and worker to worker on a mesh or rank link.

    ``kind``, ``op`` and ``dtype`` are codes of
    :mod:`ddpwire.wire.extensions`; ``data`` holds ``count`` elements of ``dtype``."""

    seq: int
    kind: int
    op: int
    dtype: int
    root: int
    count: int
    data: Any
    def __init__(self, seq: int, kind: int, op: int, dtype: int, root: int, count: int, data: Any) -> None: ...

class CollectiveResult(Message):
    """Coordinator to worker: the result of collective ``seq`` (0x44)."""

    seq: int
    kind: int
    dtype: int
    count: int
    data: Any
    def __init__(self, seq: int, kind: int, dtype: int, count: int, data: Any) -> None: ...

class CollectiveError(Message):
    """Collective ``seq`` failed (0x45): coordinator to worker, and, in a
    mesh step, worker to coordinator; ``worker_id`` is the worker at fault,
    0xFFFFFFFF for none."""

    seq: int
    worker_id: int
    detail: str
    def __init__(self, seq: int, worker_id: int, detail: str) -> None: ...

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
    AveragedGradient; 0 leaves the whole vector to the workers. The class
    takes it last, with a default of 0, so that it may be left out; on the
    wire it sits between ``shared_memory`` and ``peers``."""

    key: bytes
    codec: int
    shared_memory: int
    peers: str
    coordinator_share: int
    def __init__(self, key: bytes, codec: int, shared_memory: int, peers: str, coordinator_share: int = ...) -> None: ...

class PeerHello(Message):
    """Worker to worker, first on a mesh link, both ways (0x47): the
    sender's worker_id and its proof of the session's mesh key."""

    worker_id: int
    proof: bytes
    def __init__(self, worker_id: int, proof: bytes) -> None: ...

class StepReport(Message):
    """Worker to coordinator in a mesh step (0x48): the worker has averaged
    its slice. ``count`` is its gradient length; loss, correct and total are
    GradientPayload's; ``bad_worker`` (NO_WORKER when none) names the first
    worker whose elements in this slice were NaN or +/-inf, ``bad_index``
    the element in the whole vector, ``bad_value`` its value."""

    step: int
    worker_id: int
    count: int
    loss: float
    correct: int
    total: int
    bad_worker: int
    bad_index: int
    bad_value: float
    def __init__(self, step: int, worker_id: int, count: int, loss: float, correct: int, total: int, bad_worker: int, bad_index: int, bad_value: float) -> None: ...

class StepCommit(Message):
    """Coordinator to worker, ending a mesh step (0x49). With ``bad_worker``
    NO_WORKER every slice was finite: exchange the averaged slices and apply
    them. Otherwise the session halts: no worker applies any of it."""

    step: int
    global_loss: float
    bad_worker: int
    bad_index: int
    bad_value: float
    def __init__(self, step: int, global_loss: float, bad_worker: int, bad_index: int, bad_value: float) -> None: ...

class StepTiming(Message):
    """Worker to coordinator, with the balance extension (0x4A): how long
    the worker computed step ``step``, in microseconds from receiving the
    step's ShardAssignment to starting to send its gradients. Sent right
    before the step's first gradient frame."""

    step: int
    compute_us: int
    def __init__(self, step: int, compute_us: int) -> None: ...

class ShardScale(Message):
    """Coordinator to worker, with the balance extension (0x4B), right after
    the step's ShardAssignment: the worker multiplies every gradient it
    sends for ``step`` by ``scale`` (float32) before it leaves. ``scale`` is
    finite and >= 0 (0.0 for an empty shard; 1.0 when shards are equal);
    the codec refuses anything else both ways."""

    step: int
    scale: float
    def __init__(self, step: int, scale: float) -> None: ...

class StepAborted(Message):
    """Coordinator to worker, with the elastic extension (0x4C), in place
    of the step's average: worker ``worker_id`` was lost during ``step``,
    nobody applies any of the step, and the ``workers`` left compute it
    again on the shards that follow (a new ShardAssignment for the same
    step). A ``worker_id`` that is the receiver's own says it was dropped
    from the session (it stalled past its timeout): its connection closes
    next."""

    step: int
    worker_id: int
    workers: int
    def __init__(self, step: int, worker_id: int, workers: int) -> None: ...

class StateRequest(Message):
    """Coordinator to worker, with the elastic extension (0x4D), between two
    steps (where a ShardAssignment could come): send the model's state as it
    is before step ``step`` (a ModelState), for a worker joining there."""

    step: int
    def __init__(self, step: int) -> None: ...

class ModelState(Message):
    """Worker to coordinator in answer to a StateRequest, and coordinator to
    a worker joining an elastic session before its first step (0x4E): a
    piece of whatever the training code keeps of its state before step
    ``step`` (weights, optimizer, anything else; opaque here). The state
    is ``total`` bytes, sent as consecutive pieces in order (each frame
    within the peer's frame limit); ``digest`` is the SHA-256 of the whole
    state, the same in every piece, which the joiner checks before using
    it."""

    step: int
    total: int
    digest: bytes
    data: Any
    def __init__(self, step: int, total: int, digest: bytes, data: Any) -> None: ...
