"""Argument checks and tensor layouts for the collectives the "ddpwire"
backend composes from the four the service answers (allreduce, broadcast,
allgather, reduce-scatter): reduce, gather, scatter, all-to-all and the
coalesced forms.

Nothing here talks to a process group. The checks run before anything is
sent, so a call refused on every rank leaves the group as it was; the
layouts say where each rank's piece lies in the flat result of the one
collective an op becomes.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch

__all__ = [
    "addressed_to",
    "check_count",
    "check_nonempty",
    "check_root",
    "check_sizes",
    "copy_into",
    "flatten",
    "rank_major",
    "rank_major_pieces",
    "rooted_list",
    "split_counts",
    "split_mismatch",
    "unflatten_into",
]


# ---- checks: a ValueError naming the op, raised before anything is sent ----

def check_root(root: int, world: int, what: str) -> int:
    """``root`` when it is a rank of a group of ``world``."""
    if not 0 <= root < world:
        raise ValueError(f"ddpwire {what}: root {root} is not a rank of {world}")
    return root


def check_count(items: Sequence[object], count: int, what: str, role: str) -> None:
    """Exactly ``count`` ``role``s (one per rank, or one per input)."""
    if len(items) != count:
        raise ValueError(f"ddpwire {what}: {count} {role}s needed, got {len(items)}")


def check_sizes(tensors: Sequence[torch.Tensor], numels: Sequence[int], what: str, role: str) -> None:
    """One tensor per entry of ``numels``, each of that many elements
    (element counts, not shapes: every op here copies elements in order)."""
    check_count(tensors, len(numels), what, role)
    got = [t.numel() for t in tensors]
    if got != list(numels):
        raise ValueError(f"ddpwire {what}: {role}s of {list(numels)} elements needed, got {got}")


def check_nonempty(tensors: Sequence[torch.Tensor], what: str, role: str) -> None:
    """At least one ``role`` (a coalesced op of nothing has no dtype to check)."""
    if not tensors:
        raise ValueError(f"ddpwire {what}: at least one {role} needed, got none")


def rooted_list(lists: Sequence[Sequence[torch.Tensor]], at_root: bool, world: int, numel: int,
                what: str, role: str) -> List[torch.Tensor]:
    """The root's list of ``world`` tensors of ``numel`` elements (gather's
    outputs, scatter's inputs); [] on the other ranks, which pass none
    (torch passes ``[]``, or ``[[]]`` through torchcomms)."""
    if not at_root:
        if any(len(tensors) for tensors in lists):
            raise ValueError(f"ddpwire {what}: only the root passes {role}s, this rank is not it")
        return []
    if len(lists) != 1:
        raise ValueError(f"ddpwire {what}: the root passes one list of {role}s, got {len(lists)}")
    check_sizes(lists[0], [numel] * world, what, role)
    return list(lists[0])


def split_counts(splits: Sequence[int], t: torch.Tensor, world: int, what: str, role: str) -> List[int]:
    """The elements of ``t`` for each rank, from its split sizes along dim
    0 (empty: equal parts, as torch's all_to_all_single)."""
    if t.dim() == 0:
        raise ValueError(f"ddpwire {what}: the {role} needs a dim 0 to split, got a scalar")
    rows, per_row = t.shape[0], math.prod(t.shape[1:])
    if not splits:
        if rows % world:
            raise ValueError(f"ddpwire {what}: the {role}'s {rows} rows do not split evenly over "
                             f"{world} ranks (pass {role}_split_sizes)")
        return [rows // world * per_row] * world
    splits = [int(s) for s in splits]
    if len(splits) != world or min(splits) < 0:
        raise ValueError(f"ddpwire {what}: {role}_split_sizes needs {world} sizes of 0 or more, "
                         f"got {splits}")
    if sum(splits) != rows:
        raise ValueError(f"ddpwire {what}: {role}_split_sizes {splits} add up to {sum(splits)}, "
                         f"the {role} has {rows} rows")
    return [s * per_row for s in splits]


def split_mismatch(table: Sequence[Sequence[int]]) -> Optional[str]:
    """What is wrong with every rank's (sends, receives) element counts, a
    row of 2 x world per rank; None when each send is what its receiver
    expects. Every rank holds the same table, so every rank finds the same."""
    world = len(table)
    for src, row in enumerate(table):
        for dst in range(world):
            expected = table[dst][world + src]
            if row[dst] != expected:
                return (f"rank {src} sends {row[dst]} elements to rank {dst}, which expects "
                        f"{expected} from it")
    return None


# ---- layouts ----

def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The elements of ``tensors`` end to end, in a new tensor."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Write ``src``'s elements into ``dst`` in place, as the backend's own
    byte copies do: outside autograd, so a leaf that requires grad takes
    a result as it does from allreduce."""
    with torch.no_grad():
        dst.copy_(src.reshape(dst.shape))


def unflatten_into(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Write the elements of ``flat`` into ``tensors`` in order."""
    offset = 0
    for t in tensors:
        copy_into(t, flat[offset:offset + t.numel()])
        offset += t.numel()


def rank_major(inputs: Sequence[torch.Tensor], world: int) -> List[torch.Tensor]:
    """Views of ``inputs`` (each ``world`` equal parts) reordered so that
    each rank's parts lie together: the input of one reduce-scatter for
    several pairs."""
    parts = [t.detach().reshape(world, -1) for t in inputs]
    return [p[r] for r in range(world) for p in parts]


def rank_major_pieces(gathered: torch.Tensor, world: int, numels: Sequence[int]
                      ) -> List[List[torch.Tensor]]:
    """Views of an allgather of several tensors (each rank's ``numels``
    end to end): ``[rank][k]`` is rank's tensor k."""
    stride = sum(numels)
    starts = [sum(numels[:k]) for k in range(len(numels))]
    return [[gathered[r * stride + s:r * stride + s + n] for s, n in zip(starts, numels)]
            for r in range(world)]


def addressed_to(rank: int, gathered: torch.Tensor, stride: int,
                 sends: Sequence[Sequence[int]]) -> List[torch.Tensor]:
    """Views of an all-to-all's allgather (each rank's input padded to
    ``stride`` elements, its part for rank j ``sends[i][j]`` elements after
    its parts for the ranks before j): what each rank sent ``rank``."""
    pieces = []
    for i, row in enumerate(sends):
        start = i * stride + sum(row[:rank])
        pieces.append(gathered[start:start + row[rank]])
    return pieces
