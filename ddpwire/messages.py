"""The eleven messages of the DDP wire protocol, as plain Python objects.

Field names and order follow the wire layout (see docs/protocol-notes.md).
Each class carries its wire ``TAG``. The byte layout itself lives in the
compiled codec (:mod:`ddpwire._core`); these classes only hold values.

Value types:

* integers are Python ints (``u8``/``u32``/``u64`` on the wire; the encoder
  checks the range);
* strings are ``str`` (UTF-8 on the wire);
* ``loss`` and ``global_loss`` are Python floats holding a float32 value: the
  decoder widens the wire value bit-exactly (NaN payloads included) and the
  encoder rounds to float32;
* ``gradients`` is a float32 buffer. Decoded messages hold a read-only or
  writable numpy ``float32`` view *into the decoded buffer* (no copy); for
  encoding, any C-contiguous float32 buffer works (numpy array, a CPU
  tensor's ``.numpy()``, ``array.array('f')``, a ``memoryview`` of format
  ``'f'``);
* ``component_sizes`` is decoded as a numpy ``uint32`` view into the buffer;
  for encoding any sequence of ints that fit in u32 works.

Equality is bit-exact: gradients compare by their float32 bit patterns (so a
NaN equals a NaN with the same bits, and -0.0 differs from 0.0), and the
float fields by their bits as well. Messages are mutable and unhashable.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

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
    "MESSAGE_TYPES",
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


_COMPARE = {
    "gradients": _same_gradients,
    "component_sizes": _same_sizes,
    "loss": _same_float,
    "global_loss": _same_float,
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


@dataclass(eq=False)
class JoinRequest(Message):
    """Worker to coordinator: ask to join (tag 0x01)."""

    __slots__ = ("node_id", "gpu_count", "backend")
    TAG: ClassVar[int] = 0x01
    node_id: str
    gpu_count: int
    backend: str


@dataclass(eq=False)
class JoinAccepted(Message):
    """Coordinator to worker: the worker's id and the number of workers (0x02)."""

    __slots__ = ("worker_id", "total_workers")
    TAG: ClassVar[int] = 0x02
    worker_id: int
    total_workers: int


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


@dataclass(eq=False)
class NonBlockGradientPayload(Message):
    """Worker to coordinator: a non-block component's gradient (0x0A).

    ``component``: 0 = lm_head, 1 = final_norm, 2 = embedding (any u8 is carried).
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


#: tag -> message class, for every tag the protocol defines
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
    )
}
