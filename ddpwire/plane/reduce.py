"""Averaging float32 gradients: in place, deterministic, near memory bandwidth.

The mean of k buffers is the float32 sum in input order, ((x0 + x1) + x2) + ...,
divided by k: exactly the reference coordinator's arithmetic, whatever the
instruction-set path or thread count the compiled kernels pick; :func:`total`
is the same sum without the division (the SUM collective). Every kernel
runs without the GIL; the sums (:func:`mean`, :func:`total`,
:func:`accumulate`, :func:`mean_half`) check their inputs for NaN and +/-inf
in the same pass,
raising :class:`ddpwire.NonFiniteGradient` with the input number and element
index of the first one (lowest input, then lowest index).

Buffers are any C-contiguous native float32 exporters of the buffer protocol:
numpy arrays, memoryviews, ``array.array('f')``, ``tensor.numpy()``.

Gradients may also travel as 16 bits (:data:`CODECS`: ``"bf16"``, ``"fp16"``):
:func:`to_half` narrows float32 with round-to-nearest-even (torch's bits),
:func:`from_half` widens exactly, and :func:`mean_half` averages 16-bit
buffers in float32 and rounds once, the same bits as widening, :func:`mean`
and narrowing, so every worker expands the same average (:func:`total_half`:
the same sum without the division). 16-bit buffers hold
the bits as uint16 (or, for fp16, numpy.float16) elements.

Or as int8 (csrc/int8.h: a byte an element and a float32 scale per
:data:`INT8_BLOCK` elements): :func:`int8_encode` and :func:`int8_decode`,
and :func:`int8_mean`, which decodes, sums in float32 in input order and
divides, the same bits as decoding each input and calling :func:`mean`.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

from .._core import (
    accumulate,
    available_paths,
    current_path,
    current_threads,
    first_non_finite,
    from_half,
    INT8_BLOCK,
    int8_decode,
    int8_encode,
    int8_mean,
    int8_size,
    mean,
    mean_half,
    scale,
    total_half,
    to_half,
    total,
)
from .._core import _set_path, _set_threads
from . import codecs as _codecs

__all__ = [
    "mean",
    "total",
    "accumulate",
    "scale",
    "first_non_finite",
    "CODECS",
    "to_half",
    "from_half",
    "mean_half",
    "total_half",
    "INT8_BLOCK",
    "int8_size",
    "int8_encode",
    "int8_decode",
    "int8_mean",
    "available_paths",
    "current_path",
    "use_path",
    "current_threads",
    "use_threads",
]


#: the 16-bit wire codecs the kernels take as ``codec=``: bfloat16 and IEEE binary16
#: (ddpwire.plane.codecs describes them)
CODECS: Tuple[str, ...] = tuple(c.half for c in _codecs.CODECS if c.half is not None)


class _Restore:
    """Undoes a setting on leaving a ``with`` block; a plain call keeps it."""

    def __init__(self, setter: Callable[[Any], None], previous: Any) -> None:
        self._setter = setter
        self._previous = previous

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: object) -> None:
        self._setter(self._previous)


def use_path(name: str) -> _Restore:
    """Run the kernels on one instruction-set path (a name from
    :func:`available_paths`, or ``"auto"`` for the fastest), from now on.

    Used as a context manager it restores the previous path on exit::

        with ddpwire.plane.reduce.use_path("portable"):
            ...

    Raises ValueError for an unknown path or one this CPU cannot run.
    The setting is process-wide.
    """
    previous = current_path()
    _set_path(name)
    return _Restore(_set_path, previous)


def use_threads(threads: Optional[int]) -> _Restore:
    """Let one kernel call split a large buffer over at most ``threads``
    threads (``None`` or 0: the default, one per online CPU up to 8), from
    now on; as a context manager, restore the previous count on exit. The
    bits of every result are the same whatever the count."""
    previous = current_threads()
    _set_threads(0 if threads is None else threads)
    return _Restore(_set_threads, previous)
