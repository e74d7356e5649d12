"""The codes of ddpwire's protocol extensions (docs/extensions.md) as IntEnums.

Every value, name and dtype size is read from the compiled codec, made
from csrc/codes.def, where each is written once; nothing here restates a
number.
"""
from __future__ import annotations

from enum import IntEnum
from typing import Dict, Mapping, Optional, Sequence

import numpy as np

from .._core import _codes

__all__ = ["Extension", "RefusalReason", "CollectiveKind", "ReduceOp", "DType", "Codec",
           "decode_flag", "decode_u16", "decode_u64", "encode_flag", "encode_u16", "encode_u64",
           "samples_mismatch", "steps_mismatch"]

_FAMILIES, _DTYPE_SIZES = _codes()


def _enum(name: str, doc: str) -> type:
    members = [(label.upper(), value) for label, value in _FAMILIES[name]]
    cls = IntEnum(name, members, module=__name__)  # type: ignore[misc]
    cls.__doc__ = doc
    return cls


Extension = _enum("Extension", "Entry types of the extension block (AUTH, SAMPLES, COLLECTIVES, "
                               "MESH, PER_BLOCK, GRADIENT_LENGTH, STEPS, BALANCE, ELASTIC, "
                               "SEAL).")
RefusalReason = _enum("RefusalReason", "JoinRefused.reason codes.")
CollectiveKind = _enum("CollectiveKind", "CollectiveRequest/CollectiveResult.kind codes.")
ReduceOp = _enum("ReduceOp", "CollectiveRequest.op codes.")
Codec = _enum("Codec", "MeshPeers.codec: how gradient slices travel between mesh workers "
                       "(FLOAT32, BF16, FP16, INT8).")

# numpy has no bfloat16: its elements are handled as raw 16-bit words
_NUMPY: Dict[str, str] = {
    "FLOAT32": "<f4", "FLOAT64": "<f8", "FLOAT16": "<f2", "BFLOAT16": "<u2",
    "INT32": "<i4", "INT64": "<i8", "UINT8": "u1", "BOOL": "?", "INT8": "i1",
}


class _DTypeCodes(IntEnum):
    """Element types of collective data; ``itemsize`` is the wire size of one
    element, ``numpy`` a numpy dtype with that layout (``<u2`` for bfloat16)."""

    @property
    def itemsize(self) -> int:
        """Bytes of one element on the wire."""
        return _DTYPE_SIZES[int(self)]

    @property
    def numpy(self) -> np.dtype:
        """A numpy dtype with the wire layout (``<u2`` for bfloat16)."""
        return np.dtype(_NUMPY[self.name])


# A member-less enum may be extended: the members come from the codec, the
# properties from the class above.
DType = _DTypeCodes(  # type: ignore[call-overload]
    "DType", [(label.upper(), value) for label, value in _FAMILIES["DType"]], module=__name__)
DType.__doc__ = _DTypeCodes.__doc__


# Entry values that are one integer (the samples entry's u64, the
# collectives entry's u16 version, the per-block entry's u8 flag),
# little-endian like every field after the frame's length prefix.

def encode_flag(value: bool) -> bytes:
    """The value of an entry holding one u8 that is 0 or 1."""
    return b"\x01" if value else b"\x00"


def decode_flag(value: bytes) -> bool:
    """The u8 flag in an entry value; another size, or a byte other than 0
    or 1, is a ProtocolError."""
    flag = _decode_uint(value, 1)
    if flag > 1:
        from .errors import ProtocolError
        raise ProtocolError(f"extension entry: a flag is 0 or 1, got {flag}")
    return bool(flag)


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


def steps_mismatch(per_block: Optional[bool], gradient_length: Optional[int],
                   offer: Mapping[int, bytes],
                   joined: Sequence[Mapping[int, bytes]]) -> Optional[str]:
    """Why a worker's offer (``offer``, its JoinRequest entries) would send
    other steps than the session's, or None: per-block against flat steps,
    or a gradient of another length. Each is held to the coordinator's own
    value (``per_block``, ``gradient_length``; None: not configured), else
    to the first worker in ``joined`` (the offers of those admitted, in
    worker order) that offered one. An entry not offered, or a length of 0,
    agrees with anything: a reference worker offers none. The words say what
    to change on the command line."""
    mode = offer.get(Extension.PER_BLOCK)
    if mode is not None:
        theirs = decode_flag(mode)
        if per_block is not None:
            if theirs != per_block:
                return ("this coordinator runs per-block steps (--per-block); start the worker "
                        "with --per-block" if per_block else
                        "this coordinator runs flat steps; start the worker without --per-block")
        else:
            first = next((decode_flag(e[Extension.PER_BLOCK]) for e in joined
                          if Extension.PER_BLOCK in e), None)
            if first is not None and theirs != first:
                return ("the workers that joined run per-block steps (--per-block); start this "
                        "worker with --per-block too" if first else
                        "the workers that joined run flat steps; start this worker without "
                        "--per-block")
    value = offer.get(Extension.GRADIENT_LENGTH)
    length = decode_u64(value) if value is not None else 0
    if length:
        if gradient_length:
            if length != gradient_length:
                return (f"this worker's model has {length} gradient elements, this "
                        f"coordinator's gradient_length is {gradient_length}: every worker must "
                        f"train the model it was set up for")
        else:
            first_length = next((n for n in (decode_u64(e[Extension.GRADIENT_LENGTH])
                                             for e in joined if Extension.GRADIENT_LENGTH in e)
                                 if n), None)
            if first_length is not None and length != first_length:
                return (f"this worker's model has {length} gradient elements, the others' "
                        f"{first_length}: every worker must train the same model")
    return None
