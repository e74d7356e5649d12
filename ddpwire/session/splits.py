"""Whole-sample splits of a step's batch among its workers: arithmetic only.

One home for what the shard rules (ddpwire.session.balance) and the guard's trials
(ddpwire.session.guard) both do to a split: the reference's equal split, the
smallest shard a worker keeps, rounding a split of real numbers to whole
samples, and a nudge (samples moved from one worker to the others).
"""
from __future__ import annotations

import math
from typing import List, Sequence

__all__ = ["FLOOR", "at_floor", "equal_shards", "floor_shard", "largest_remainder", "nudged",
           "shard_starts"]

#: the smallest shard, a fraction of an equal share (at least one sample)
FLOOR = 0.1


def equal_shards(total: int, workers: int) -> List[int]:
    """The reference's split: ``total // workers`` each, the rest to the last."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    each = total // workers
    return [each] * (workers - 1) + [total - each * (workers - 1)]


def shard_starts(shards: Sequence[int]) -> List[int]:
    """Each shard's first sample: shards are laid out in worker order."""
    starts, at = [], 0
    for count in shards:
        starts.append(at)
        at += count
    return starts


def floor_shard(total: int, workers: int) -> int:
    """The smallest shard: :data:`FLOOR` of an equal share, at least one
    sample, at most an equal share."""
    return min(max(1, math.ceil(FLOOR * total / workers)), total // workers)


def largest_remainder(ideal: Sequence[float], total: int) -> List[int]:
    """Whole counts adding up to ``total`` nearest ``ideal`` (which adds up
    to it); ties go to the lower index, so every run splits alike."""
    split = [int(math.floor(x)) for x in ideal]
    order = sorted(range(len(ideal)), key=lambda i: (split[i] - ideal[i], i))
    for i in order[:total - sum(split)]:
        split[i] += 1
    return split


def nudged(current: Sequence[int], giver: int, fraction: float) -> List[int]:
    """``current`` with samples taken from worker ``giver`` and shared by
    the others: ``fraction`` of the giver's shard or of the smallest
    receiver's, whichever is less (a worker far slower a sample than the
    others gets few of them, and a nudge sized by the others' would cost
    more than it could tell), at least one, never below the floor;
    ``current`` itself when nothing can move."""
    n, total = len(current), sum(current)
    if n < 2:
        return list(current)
    least = min(c for k, c in enumerate(current) if k != giver)
    moved = min(max(1.0, fraction * min(current[giver], (n - 1) * least)),
                current[giver] - floor_shard(total, n))
    if moved < 1:
        return list(current)
    ideal = [c - moved if k == giver else c + moved / (n - 1) for k, c in enumerate(current)]
    return largest_remainder(ideal, total)


def at_floor(current: Sequence[int], worker: int) -> List[int]:
    """``current`` with ``worker`` at the floor and what it gives up shared
    by the others in proportion to their shards; ``current`` itself when
    it is there already."""
    n, total = len(current), sum(current)
    if n < 2:
        return list(current)
    floor = floor_shard(total, n)
    if current[worker] <= floor:
        return list(current)
    others = total - current[worker]
    moved = current[worker] - floor
    ideal = [float(floor) if k == worker else
             c + moved * (c / others if others else 1.0 / (n - 1)) for k, c in enumerate(current)]
    return largest_remainder(ideal, total)
