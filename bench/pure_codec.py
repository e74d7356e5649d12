"""A plain pure-Python codec (struct + numpy), the baseline for the benchmarks.

It does what the compiled codec does, in the straightforward Python way: the
same frames, the same bounds checks with named fields, strict UTF-8, the
trailing-bytes check, and zero-copy gradient views (np.frombuffer). It exists
only so that bench/ can put a number beside the compiled codec's.
"""
from __future__ import annotations

import struct

import numpy as np

from ddpwire.wire.errors import FrameTooLarge, ProtocolError
from ddpwire.wire.messages import (
    AveragedBlockGradient,
    AveragedGradient,
    AveragedNonBlockGradient,
    BlockGradientPayload,
    GradientPayload,
    Heartbeat,
    JoinAccepted,
    JoinRequest,
    NonBlockGradientPayload,
    ShardAssignment,
    Shutdown,
)

MAX_FRAME = 100_000_000

_PREFIX = struct.Struct(">I")
_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_F32 = struct.Struct("<f")


class _Reader:
    """Cursor over a payload; each read checks the bytes left first."""

    __slots__ = ("buf", "pos", "end", "type")

    def __init__(self, buf: memoryview, type_name: str) -> None:
        self.buf = buf
        self.pos = 1
        self.end = len(buf)
        self.type = type_name

    def _need(self, n: int, field: str) -> None:
        left = self.end - self.pos
        if n > left:
            raise ProtocolError(f"truncated {self.type}.{field}: {left} of {n} bytes")

    def u8(self, field: str) -> int:
        self._need(1, field)
        (v,) = _U8.unpack_from(self.buf, self.pos)
        self.pos += 1
        return v

    def u32(self, field: str) -> int:
        self._need(4, field)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, field: str) -> int:
        self._need(8, field)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def f32(self, field: str) -> float:
        self._need(4, field)
        (v,) = _F32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def string(self, field: str) -> str:
        n = self.u32(field + " length")
        self._need(n, field)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError(f"invalid UTF-8 in {self.type}.{field}: {exc}") from None

    def u32list(self, field: str) -> np.ndarray:
        n = self.u32(field + " count")
        self._need(4 * n, field)
        arr = np.frombuffer(self.buf, dtype="<u4", count=n, offset=self.pos)
        self.pos += 4 * n
        return arr

    def f32vec(self, field: str) -> np.ndarray:
        n = self.u64(field + " count")
        if n > (2**64 - 1) // 4:
            raise ProtocolError(f"count overflow in {self.type}.{field}: {n} elements")
        self._need(4 * n, field)
        arr = np.frombuffer(self.buf, dtype="<f4", count=n, offset=self.pos)
        self.pos += 4 * n
        return arr

    def finish(self, allow_trailing: bool) -> None:
        extra = self.end - self.pos
        if extra and not allow_trailing:
            raise ProtocolError(f"{extra} bytes after the last field of {self.type}")


def _join_request(r: _Reader) -> JoinRequest:
    return JoinRequest(r.string("node_id"), r.u32("gpu_count"), r.string("backend"))


def _join_accepted(r: _Reader) -> JoinAccepted:
    return JoinAccepted(r.u32("worker_id"), r.u32("total_workers"))


def _shard_assignment(r: _Reader) -> ShardAssignment:
    return ShardAssignment(r.u64("step"), r.u64("shard_start"), r.u64("shard_end"))


def _gradient_payload(r: _Reader) -> GradientPayload:
    return GradientPayload(
        r.u64("step"), r.u32("worker_id"), r.f32vec("gradients"),
        r.f32("loss"), r.u64("correct"), r.u64("total"),
    )


def _averaged_gradient(r: _Reader) -> AveragedGradient:
    return AveragedGradient(r.u64("step"), r.f32vec("gradients"), r.f32("global_loss"))


def _heartbeat(r: _Reader) -> Heartbeat:
    return Heartbeat(r.string("node_id"), r.u64("timestamp_ms"))


def _shutdown(r: _Reader) -> Shutdown:
    return Shutdown()


def _block_gradient_payload(r: _Reader) -> BlockGradientPayload:
    return BlockGradientPayload(
        r.u64("step"), r.u32("worker_id"), r.u32("block_idx"), r.u32("num_blocks"),
        r.u32list("component_sizes"), r.f32vec("gradients"),
    )


def _averaged_block_gradient(r: _Reader) -> AveragedBlockGradient:
    return AveragedBlockGradient(
        r.u64("step"), r.u32("block_idx"), r.u32list("component_sizes"), r.f32vec("gradients")
    )


def _non_block_gradient_payload(r: _Reader) -> NonBlockGradientPayload:
    return NonBlockGradientPayload(
        r.u64("step"), r.u32("worker_id"), r.u8("component"), r.f32vec("gradients")
    )


def _averaged_non_block_gradient(r: _Reader) -> AveragedNonBlockGradient:
    return AveragedNonBlockGradient(r.u64("step"), r.u8("component"), r.f32vec("gradients"))


_DECODERS = {
    cls.TAG: (cls.__name__, fn)
    for cls, fn in (
        (JoinRequest, _join_request),
        (JoinAccepted, _join_accepted),
        (ShardAssignment, _shard_assignment),
        (GradientPayload, _gradient_payload),
        (AveragedGradient, _averaged_gradient),
        (Heartbeat, _heartbeat),
        (Shutdown, _shutdown),
        (BlockGradientPayload, _block_gradient_payload),
        (AveragedBlockGradient, _averaged_block_gradient),
        (NonBlockGradientPayload, _non_block_gradient_payload),
        (AveragedNonBlockGradient, _averaged_non_block_gradient),
    )
}


def decode_payload(buffer, *, allow_trailing: bool = False):
    buf = memoryview(buffer).cast("B")
    if len(buf) == 0:
        raise ProtocolError("empty payload")
    entry = _DECODERS.get(buf[0])
    if entry is None:
        raise ProtocolError(f"unknown message tag: 0x{buf[0]:02x}")
    reader = _Reader(buf, entry[0])
    msg = entry[1](reader)
    reader.finish(allow_trailing)
    return msg


def decode_frame(buffer, *, allow_trailing: bool = False, max_frame: int = MAX_FRAME):
    buf = memoryview(buffer).cast("B")
    if len(buf) < 4:
        raise ProtocolError(f"truncated frame: length prefix {len(buf)} of 4 bytes")
    (length,) = _PREFIX.unpack_from(buf)
    if length == 0:
        raise ProtocolError("empty payload")
    if length > max_frame:
        raise FrameTooLarge(length, max_frame)
    if len(buf) - 4 != length:
        raise ProtocolError(f"frame of {length} bytes in a buffer of {len(buf) - 4}")
    return decode_payload(buf[4:], allow_trailing=allow_trailing)


# -- encoding ---------------------------------------------------------------


def _string(value: str) -> bytes:
    raw = value.encode("utf-8")
    return _U32.pack(len(raw)) + raw


def _f32vec(values) -> tuple:
    arr = np.ascontiguousarray(values, dtype="<f4")
    return _U64.pack(arr.size), arr


def _u32list(values) -> bytes:
    arr = np.asarray(values, dtype="<u4")
    return _U32.pack(arr.size) + arr.tobytes()


def _parts(msg) -> list:
    tag = bytes((msg.TAG,))
    if isinstance(msg, JoinRequest):
        return [tag, _string(msg.node_id), _U32.pack(msg.gpu_count), _string(msg.backend)]
    if isinstance(msg, JoinAccepted):
        return [tag, struct.pack("<II", msg.worker_id, msg.total_workers)]
    if isinstance(msg, ShardAssignment):
        return [tag, struct.pack("<QQQ", msg.step, msg.shard_start, msg.shard_end)]
    if isinstance(msg, GradientPayload):
        count, arr = _f32vec(msg.gradients)
        return [tag, struct.pack("<QI", msg.step, msg.worker_id), count, arr,
                struct.pack("<fQQ", msg.loss, msg.correct, msg.total)]
    if isinstance(msg, AveragedGradient):
        count, arr = _f32vec(msg.gradients)
        return [tag, _U64.pack(msg.step), count, arr, _F32.pack(msg.global_loss)]
    if isinstance(msg, Heartbeat):
        return [tag, _string(msg.node_id), _U64.pack(msg.timestamp_ms)]
    if isinstance(msg, Shutdown):
        return [tag]
    if isinstance(msg, BlockGradientPayload):
        count, arr = _f32vec(msg.gradients)
        return [tag, struct.pack("<QIII", msg.step, msg.worker_id, msg.block_idx, msg.num_blocks),
                _u32list(msg.component_sizes), count, arr]
    if isinstance(msg, AveragedBlockGradient):
        count, arr = _f32vec(msg.gradients)
        return [tag, struct.pack("<QI", msg.step, msg.block_idx),
                _u32list(msg.component_sizes), count, arr]
    if isinstance(msg, NonBlockGradientPayload):
        count, arr = _f32vec(msg.gradients)
        return [tag, struct.pack("<QIB", msg.step, msg.worker_id, msg.component), count, arr]
    if isinstance(msg, AveragedNonBlockGradient):
        count, arr = _f32vec(msg.gradients)
        return [tag, struct.pack("<QB", msg.step, msg.component), count, arr]
    raise TypeError(f"expected a ddpwire message, got {type(msg).__name__}")


def encode_frame(msg, *, max_frame: int = MAX_FRAME) -> bytes:
    parts = _parts(msg)
    size = sum(memoryview(p).nbytes for p in parts)
    if size > max_frame:
        raise FrameTooLarge(size, max_frame)
    return b"".join([_PREFIX.pack(size), *parts])
