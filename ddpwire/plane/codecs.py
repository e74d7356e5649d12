"""The wire codecs of a flat allreduce, described once.

A codec is how a vector's float32 elements travel: float32 itself; rounded
to 16 bits (bfloat16 or IEEE binary16: half the bytes, and the kernels
widen them back to float32 before anything is summed); or int8, a byte an
element and a float32 scale per block of :data:`INT8_BLOCK` elements
(csrc/int8.h: about a quarter of the bytes). Every codec keeps one rule:
each member's vector is rounded once, the members' values are summed in
float32 in member order and divided, and the average is rounded once more,
so every member ends with the same bits.

Each entry names the codec as a user does (``compression=``,
``--compression``), the code MeshPeers carries to every member
(:class:`~ddpwire.Codec`), the element type its slices travel as in a
CollectiveRequest (:class:`~ddpwire.DType`), the bytes ``n`` elements take
(:meth:`WireCodec.size`), the elements that share a scale (``block``; a
slice of a blocked codec starts on a block) with that codec's kernels
(:class:`BlockKernels`, which the runner calls), and the name the compiled
16-bit kernels take (``codec=`` of :mod:`ddpwire.plane.reduce`). Every
layer that picks, checks or sends a codec reads it here: the mesh and its
plan, the coordinator's options, the command, the torch rank links, the
collectives service and DiLoCo.

A new codec is an entry here and its kernels: a C file in csrc/ (as
csrc/int8.c) with its glue (ddpwire/_int8.pxi, included by _core.pyx, its
source named in setup.py), and its code, one line of csrc/codes.def (and a
row of docs/extensions.md's MeshPeers table). A codec with blocks runs on the mesh
runner's blocked branch through its :class:`BlockKernels`; one encoded as
its bytes move would need its kernels in csrc/net.c's exchange, as the
16-bit ones have.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import numpy as np

from .._core import INT8_BLOCK, int8_decode, int8_encode, int8_mean, int8_size
from ..wire.errors import NonFiniteGradient
from ..wire.extensions import Codec, DType

__all__ = ["BlockKernels", "CODECS", "FLOAT32", "INT8", "INT8_BLOCK", "WireCodec", "by_code",
           "by_dtype", "codec_of", "names"]


@dataclass(frozen=True)
class BlockKernels:
    """A codec with a scale per block: its compiled kernels, in csrc/int8.h's
    shape (the runner calls them here, not by name)."""

    #: bytes n elements take
    size: Callable[[int], int]
    #: float32 into the codec's bytes: encode(src, out=None)
    encode: Callable[..., np.ndarray]
    #: the codec's bytes into float32: decode(src, out=None)
    decode: Callable[..., np.ndarray]
    #: encodings decoded, summed in input order, divided when ``divide``:
    #: mean(inputs, out=None, *, divide=True); NonFiniteGradient names the
    #: first non-finite element, the result written in full even then
    mean: Callable[..., np.ndarray]


@dataclass(frozen=True)
class WireCodec:
    """One codec: see the module docstring."""

    #: as a user names it (None: float32, the default)
    name: Optional[str]
    #: MeshPeers's codec field
    code: Codec
    #: the element type of a CollectiveRequest carrying its slices
    dtype: DType
    #: bytes an element takes on the wire (0: see :meth:`size`)
    width: int
    #: the 16-bit kernels' ``codec=`` name (None: not a 16-bit codec)
    half: Optional[str]
    #: elements that share one scale (0: none, every element stands alone)
    block: int = 0
    #: the kernels of a codec with blocks (None: none)
    kernels: Optional[BlockKernels] = None

    def size(self, n: int) -> int:
        """Bytes ``n`` elements take on the wire."""
        return n * self.width if self.kernels is None else self.kernels.size(n)

    def average(self, encodings: Sequence[Any]) -> np.ndarray:
        """What a flat allreduce of this blocked codec gives every member,
        from every member's encoding (in member order, equal lengths):
        decoded, summed in float32 in order, divided by their number, and
        that encoded once more and decoded. A NaN or infinity is passed on,
        not raised. For a group whose members' bytes were gathered (the
        collective service, a foreign process group)."""
        k = self.kernels
        assert k is not None, f"{self.name} has no blocks"
        parts = [np.ascontiguousarray(e).view(np.uint8).reshape(-1) for e in encodings]
        count = k.decode(parts[0]).size  # a length no encoding has is a ValueError
        average = np.empty(count, dtype=np.float32)
        try:
            k.mean(parts, average)
        except NonFiniteGradient:
            pass  # the average is written in full, NaN and inf in place
        return k.decode(k.encode(average))


FLOAT32 = WireCodec(None, Codec.FLOAT32, DType.FLOAT32, 4, None)
#: every codec, float32 first
CODECS: Tuple[WireCodec, ...] = (
    FLOAT32,
    WireCodec("bf16", Codec.BF16, DType.BFLOAT16, 2, "bf16"),
    WireCodec("fp16", Codec.FP16, DType.FLOAT16, 2, "fp16"),
    # its slices are raw bytes: scales and codes (csrc/int8.h)
    WireCodec("int8", Codec.INT8, DType.UINT8, 0, None, INT8_BLOCK,
              BlockKernels(int8_size, int8_encode, int8_decode, int8_mean)),
)
INT8 = CODECS[-1]
_BY_NAME: Dict[Optional[str], WireCodec] = {c.name: c for c in CODECS}
_BY_CODE: Dict[Codec, WireCodec] = {c.code: c for c in CODECS}
# a collective of bfloat16 or float16 carries a 16-bit codec's words; one of
# uint8 carries bytes, int8's or anyone's
_BY_DTYPE: Dict[DType, WireCodec] = {c.dtype: c for c in CODECS if not c.block}


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
