"""One plan per vector: which elements each mesh member averages, and which
the coordinator does.

Every member of a mesh computes the same :class:`Plan` from the same inputs
(the vector's length, the members' fractions, the codec and
MeshPeers.coordinator_share) and nothing else, so no cut ever has to travel:
the slices a member sends are the ones their owners expect. This module is
arithmetic only (no I/O, nothing from :mod:`ddpwire.plane.mesh`, which builds on
it).

The vector of ``count`` elements is laid out as

    [ member 0 | member 1 | ... | member N-1 | the coordinator's part ]

The coordinator's part is the last :func:`coordinator_part` elements (none
without a share). The members' slices tile the rest, ``ours`` elements,
in member order, by their fractions.

The rounding rule: the fractions are taken exactly as the binary doubles
they are, turned into integer weights w_0 … w_{N-1} over one common
power-of-two denominator, and member k's slice starts at element

    floor(ours · (w_0 + … + w_{k-1}) / (w_0 + … + w_{N-1}))

(integer arithmetic, so no float rounding can differ between machines) and
ends where member k+1's starts, the last at ``ours``. A codec with blocks
(int8: a scale per 256 elements, :mod:`ddpwire.plane.codecs`) cuts the same
way in whole blocks, ``ours`` rounded up to B blocks, block
floor(B · (w_0 + … + w_{k-1}) / (w_0 + … + w_{N-1})) starting slice k
(no later than ``ours``), so every slice starts on a block. So the slices tile
[0, ours) exactly, in order, each within one element of its exact share; a
member whose fraction is 0 owns no element (it still sends every other
member its slice of its own vector and receives every slice of the
average); and equal fractions give exactly :func:`slice_bounds`, the cut
every mesh session has always used. Fractions are relative weights:
scaling them all by a power of two never changes a cut, another factor
(0.1 and 0.3 against 1 and 3) may move one by an element, so every member
must be handed the same numbers.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from ..wire.extensions import Codec
from .codecs import by_code

__all__ = ["MAX_SHARE", "Plan", "check_fractions", "coordinator_part", "share_value",
           "slice_bounds"]

#: the largest MeshPeers.coordinator_share (65536ths of the vector)
MAX_SHARE = 0xFFFF

Bounds = Tuple[int, int]


def slice_bounds(count: int, world: int) -> List[Bounds]:
    """Member w's slice of a ``count``-element vector under equal fractions:
    [w·count//N, (w+1)·count//N)."""
    return [(w * count // world, (w + 1) * count // world) for w in range(world)]


def coordinator_part(count: int, share: int) -> int:
    """How many elements at the end of a ``count``-element vector the
    coordinator averages itself, for MeshPeers.coordinator_share ``share``
    (65536ths of the vector, rounded down)."""
    return (count * share) >> 16


def share_value(fraction: float) -> int:
    """MeshPeers.coordinator_share for a fraction of the vector in [0, 1)."""
    if not isinstance(fraction, (int, float)) or not 0.0 <= fraction < 1.0:
        raise ValueError(f"coordinator_share must be a fraction in [0, 1), got {fraction!r}")
    return min(MAX_SHARE, round(fraction * 65536))


def check_fractions(fractions: Optional[Sequence[float]],
                    members: int) -> Optional[Tuple[float, ...]]:
    """``fractions`` as a tuple of floats, one per member (None stays None:
    equal slices); ValueError naming what is wrong: another count than
    ``members``, an entry that is not a real number, NaN or infinite,
    negative, or no entry above 0."""
    if fractions is None:
        return None
    if isinstance(fractions, (str, bytes)):
        raise ValueError(f"fractions must be a sequence of numbers, got {fractions!r}")
    try:
        values = list(fractions)
    except TypeError:
        raise ValueError(f"fractions must be a sequence of numbers, got {fractions!r}") from None
    if len(values) != members:
        raise ValueError(f"fractions name {len(values)} members, the mesh has {members}")
    out = []
    for i, f in enumerate(values):
        if isinstance(f, bool) or not isinstance(f, numbers.Real):
            raise ValueError(f"fractions[{i}] must be a real number, got {f!r}")
        x = float(f)
        if not math.isfinite(x):
            raise ValueError(f"fractions[{i}] must be finite, got {x!r}")
        if x < 0:
            raise ValueError(f"fractions[{i}] must not be negative, got {x!r}")
        out.append(x + 0.0)  # -0.0 is 0: no sign left to compare
    if not any(x > 0 for x in out):
        raise ValueError(f"fractions must sum to a positive number, got {tuple(out)!r}")
    return tuple(out)


def _weights(fractions: Sequence[float]) -> List[int]:
    """Integers in the fractions' exact proportions: every double is n/2^k,
    so scaled to the largest denominator each numerator is whole."""
    ratios = [f.as_integer_ratio() for f in fractions]
    denominator = max(d for _, d in ratios)
    return [n * (denominator // d) for n, d in ratios]


def _check_int(name: str, value: object, low: int, high: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    v = int(value)
    if v < low or (high is not None and v > high):
        span = f"at least {low}" if high is None else f"from {low} to {high}"
        raise ValueError(f"{name} must be {span}, got {v}")
    return v


@dataclass(frozen=True)
class Plan:
    """Who averages which elements of one ``count``-element vector.

    ``members`` share the vector's first :attr:`ours` elements by
    ``fractions`` (any sequence, kept as a tuple of floats; None: equally;
    see the module's rounding rule); the
    coordinator averages the last :attr:`part` ones, for MeshPeers
    ``coordinator_share`` (65536ths). ``codec`` is how slices travel. Raises
    ValueError naming a bad argument.
    """

    count: int
    members: int
    fractions: Optional[Tuple[float, ...]] = None
    codec: Codec = Codec.FLOAT32
    coordinator_share: int = 0
    #: elements at the end of the vector that the coordinator averages
    part: int = field(init=False, repr=False, compare=False)
    #: [start, end) of each member's slice, in member order
    bounds: Tuple[Bounds, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        count = _check_int("count", self.count, 0)
        members = _check_int("members", self.members, 1)
        share = _check_int("coordinator_share", self.coordinator_share, 0, MAX_SHARE)
        fractions = check_fractions(self.fractions, members)
        try:
            codec = Codec(self.codec)
        except ValueError:
            raise ValueError(f"codec must be one of {[c.name for c in Codec]}, "
                             f"got {self.codec!r}") from None
        part = coordinator_part(count, share)
        ours = count - part
        # one rule for every plan: with equal weights w it is
        # floor(ours·k·w / (N·w)) = floor(ours·k / N), slice_bounds exactly
        weights = [1] * members if fractions is None else _weights(fractions)
        total = sum(weights)
        unit = by_code(codec).block or 1
        units = -(-ours // unit)
        starts, prefix = [], 0
        for w in weights:
            starts.append(min(ours, units * prefix // total * unit))
            prefix += w
        bounds = list(zip(starts, starts[1:] + [ours]))
        for name, value in (("count", count), ("members", members), ("fractions", fractions),
                            ("codec", codec), ("coordinator_share", share), ("part", part),
                            ("bounds", tuple(bounds))):
            object.__setattr__(self, name, value)

    @property
    def equal(self) -> bool:
        """Whether every member has the same fraction: the slices are
        :func:`slice_bounds`, what the shared segment (csrc/shm.c) cuts."""
        return self.fractions is None or len(set(self.fractions)) == 1

    @property
    def ours(self) -> int:
        """The elements the members average among themselves: [0, ours)."""
        return self.count - self.part

    def slice(self, member: int) -> Bounds:
        """[start, end) of ``member``'s slice (empty for a fraction of 0)."""
        if not 0 <= member < self.members:
            raise ValueError(f"member must be from 0 to {self.members - 1}, got {member}")
        return self.bounds[member]
