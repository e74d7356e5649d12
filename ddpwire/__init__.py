"""ddpwire: data-parallel training over plain TCP.

A compiled core (C and Cython) frames, encodes and decodes the wire protocol
and averages float32 gradients in place; thin Python classes on top run a
coordinator and its workers.
"""
from .errors import (
    CoordinatorLost,
    DdpwireError,
    DeviceUnavailable,
    FrameTooLarge,
    GradientMismatch,
    JoinTimeout,
    NonFiniteGradient,
    PeerLost,
    ProtocolError,
    UnexpectedMessage,
    WorkerLost,
)
from . import reduce

__version__ = "0.1.0"
