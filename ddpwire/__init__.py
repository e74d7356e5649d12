"""ddpwire: data-parallel training over plain TCP.

A compiled core (C and Cython) frames, encodes and decodes the wire protocol
and averages float32 gradients in place; thin Python classes on top run a
coordinator and its workers.
"""
from .errors import (
    AuthenticationFailed,
    CoordinatorLost,
    DdpwireError,
    DeviceUnavailable,
    FrameTooLarge,
    GradientMismatch,
    JoinRefusedError,
    JoinTimeout,
    NonFiniteGradient,
    PeerLost,
    ProtocolError,
    ShutdownDuringReduce,
    UnexpectedMessage,
    WorkerLost,
)
from .messages import (
    AuthChallenge,
    AuthProof,
    CollectiveError,
    CollectiveRequest,
    CollectiveResult,
    JoinRefused,
    AveragedBlockGradient,
    AveragedGradient,
    AveragedNonBlockGradient,
    BlockGradientPayload,
    GradientPayload,
    Heartbeat,
    JoinAccepted,
    JoinRequest,
    Message,
    NonBlockGradientPayload,
    ShardAssignment,
    Shutdown,
)
from ._core import (
    DEFAULT_MAX_FRAME,
    FrameReader,
    decode_frame,
    decode_payload,
    encode_frame,
    encode_frame_parts,
    tag_max_payload,
)
from .extensions import CollectiveKind, DType, Extension, RefusalReason, ReduceOp
from . import reduce
from .coordinator import Coordinator
from .worker import Worker
from .results import BlockReduceResult, NonBlockReduceResult, ReduceResult
from .sessioninfo import WorkerInfo
from ._version import __version__

__all__ = [
    "AuthenticationFailed",
    "JoinRefusedError",
    "AuthChallenge",
    "AuthProof",
    "CollectiveError",
    "CollectiveKind",
    "CollectiveRequest",
    "CollectiveResult",
    "DType",
    "Extension",
    "JoinRefused",
    "RefusalReason",
    "ReduceOp",
    "tag_max_payload",
    "AveragedBlockGradient",
    "AveragedGradient",
    "AveragedNonBlockGradient",
    "BlockGradientPayload",
    "BlockReduceResult",
    "Coordinator",
    "CoordinatorLost",
    "DEFAULT_MAX_FRAME",
    "DdpwireError",
    "DeviceUnavailable",
    "FrameReader",
    "FrameTooLarge",
    "GradientMismatch",
    "GradientPayload",
    "Heartbeat",
    "JoinAccepted",
    "JoinRequest",
    "JoinTimeout",
    "Message",
    "NonBlockGradientPayload",
    "NonBlockReduceResult",
    "NonFiniteGradient",
    "PeerLost",
    "ProtocolError",
    "ReduceResult",
    "ShardAssignment",
    "Shutdown",
    "ShutdownDuringReduce",
    "UnexpectedMessage",
    "Worker",
    "WorkerInfo",
    "WorkerLost",
    "decode_frame",
    "decode_payload",
    "encode_frame",
    "encode_frame_parts",
    "reduce",
]
