"""The codes of ddpwire's protocol extensions (docs/extensions.md) as IntEnums.

Every value, name and dtype size is read from the compiled codec, where
csrc/wire.h defines them once; nothing here restates a number.
"""
from __future__ import annotations

from enum import IntEnum
from typing import Dict, Mapping, Optional

import numpy as np

from ._core import _codes

__all__ = ["Extension", "RefusalReason", "CollectiveKind", "ReduceOp", "DType", "Codec",
           "decode_u16",
           "decode_u64", "encode_u16", "encode_u64", "samples_mismatch"]

_FAMILIES, _DTYPE_SIZES = _codes()


def _enum(name: str, doc: str) -> type:
    members = [(label.upper(), value) for label, value in _FAMILIES[name]]
    cls = IntEnum(name, members, module=__name__)  # type: ignore[misc]
    cls.__doc__ = doc
    return cls


Extension = _enum("Extension", "Entry types of the extension block (AUTH, SAMPLES, COLLECTIVES, "
                                "MESH, STEPS).")
RefusalReason = _enum("RefusalReason", "JoinRefused.reason codes.")
CollectiveKind = _enum("CollectiveKind", "CollectiveRequest/CollectiveResult.kind codes.")
ReduceOp = _enum("ReduceOp", "CollectiveRequest.op codes.")
Codec = _enum("Codec", "MeshPeers.codec: how gradient slices travel between mesh workers "
                       "(FLOAT32, BF16, FP16).")

# numpy has no bfloat16: its elements are handled as raw 16-bit words
_NUMPY: Dict[str, str] = {
    "FLOAT32": "<f4", "FLOAT64": "<f8", "FLOAT16": "<f2", "BFLOAT16": "<u2",
    "INT32": "<i4", "INT64": "<i8", "UINT8": "u1", "BOOL": "?",
}


class _DTypeCodes(IntEnum):
    """Element types of collective data; ``itemsize`` is the wire size of one
    element, ``numpy`` a numpy dtype with that layout (``<u2`` for bfloat16)."""

    @property
    def itemsize(self) -> int:
        return _DTYPE_SIZES[int(self)]

    @property
    def numpy(self) -> np.dtype:
        return np.dtype(_NUMPY[self.name])


# A member-less enum may be extended: the members come from the codec, the
# properties from the class above.
DType = _DTypeCodes(  # type: ignore[call-overload]
    "DType", [(label.upper(), value) for label, value in _FAMILIES["DType"]], module=__name__)


# Entry values that are one integer (the samples entry's u64, the
# collectives entry's u16 version), little-endian like every field after the
# frame's length prefix.

def encode_u64(value: int) -> bytes:
    """The value of an entry holding one u64."""
    return int(value).to_bytes(8, "little")


def encode_u16(value: int) -> bytes:
    """The value of an entry holding one u16."""
    return int(value).to_bytes(2, "little")


def decode_u64(value: bytes) -> int:
    """The u64 in an entry value; a value of another size is a ProtocolError."""
    return _decode_uint(value, 8)


def decode_u16(value: bytes) -> int:
    """The u16 in an entry value; a value of another size is a ProtocolError."""
    return _decode_uint(value, 2)


def _decode_uint(value: bytes, size: int) -> int:
    from .errors import ProtocolError
    if len(value) != size:
        raise ProtocolError(f"extension entry: a u{8 * size} value has {size} bytes, "
                            f"got {len(value)}")
    return int.from_bytes(value, "little")


def samples_mismatch(coordinator: Optional[int], entries: Mapping[int, bytes],
                     worker: Optional[int] = None) -> Optional[str]:
    """Why the samples per step of the two sides disagree, or None. One side's
    value is known locally; the other's is the samples entry in ``entries``
    (the offer, on the coordinator; the grant, on a worker). Zero or absent
    means "not given" and agrees with anything."""
    value = entries.get(Extension.SAMPLES)
    if value is None:
        return None
    theirs = decode_u64(value)
    if coordinator is None:
        coordinator = theirs
    else:
        worker = theirs
    if coordinator and worker and coordinator != worker:
        return f"samples per step differ: coordinator {coordinator}, worker {worker}"
    return None
