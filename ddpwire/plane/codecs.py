"""The wire codecs of a flat allreduce, described once.

A codec is how a vector's float32 elements travel: float32 itself, or
rounded to 16 bits (bfloat16 or IEEE binary16: half the bytes, and the
kernels widen them back to float32 before anything is summed). Each entry
names the codec as a user does (``compression=``, ``--compression``), the
code MeshPeers carries to every member (:class:`~ddpwire.Codec`), the
element type a collective names it by (:class:`~ddpwire.DType`), its
width, and the name the compiled 16-bit kernels take (``codec=`` of
:mod:`ddpwire.reduce`). Every layer that picks, checks or sends a codec
reads it here: the mesh, the coordinator's options, the command, the torch
rank links and the collectives service.

A new codec is an entry here, its kernels in csrc/reduce.c registered in
ddpwire/_reduce.pxi, and its code in docs/extensions.md's MeshPeers table.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from ..wire.extensions import Codec, DType

__all__ = ["CODECS", "FLOAT32", "WireCodec", "by_code", "by_dtype", "codec_of", "names"]


@dataclass(frozen=True)
class WireCodec:
    """One codec: see the module docstring."""

    #: as a user names it (None: float32, the default)
    name: Optional[str]
    #: MeshPeers's codec field
    code: Codec
    #: the element type of a collective carrying it
    dtype: DType
    #: bytes an element takes on the wire
    width: int
    #: the 16-bit kernels' ``codec=`` name (None: float32 needs none)
    half: Optional[str]


FLOAT32 = WireCodec(None, Codec.FLOAT32, DType.FLOAT32, 4, None)
#: every codec, float32 first
CODECS: Tuple[WireCodec, ...] = (
    FLOAT32,
    WireCodec("bf16", Codec.BF16, DType.BFLOAT16, 2, "bf16"),
    WireCodec("fp16", Codec.FP16, DType.FLOAT16, 2, "fp16"),
)
_BY_NAME: Dict[Optional[str], WireCodec] = {c.name: c for c in CODECS}
_BY_CODE: Dict[Codec, WireCodec] = {c.code: c for c in CODECS}
_BY_DTYPE: Dict[DType, WireCodec] = {c.dtype: c for c in CODECS}


def names() -> Tuple[str, ...]:
    """The names a user may give ``compression`` (float32's None aside)."""
    return tuple(c.name for c in CODECS if c.name is not None)


def codec_of(name: Optional[str]) -> WireCodec:
    """The codec a ``compression`` argument names; ValueError naming the choices."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        choices = ", ".join(repr(n) for n in names())
        raise ValueError(f"compression must be None or one of {choices}, got {name!r}") \
            from None


def by_code(code: Codec) -> WireCodec:
    """The codec of a MeshPeers codec code (KeyError for one not described here)."""
    return _BY_CODE[Codec(code)]


def by_dtype(dtype: DType) -> Optional[WireCodec]:
    """The codec whose elements a collective of ``dtype`` carries, if any."""
    return _BY_DTYPE.get(dtype)
