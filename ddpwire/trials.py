"""Shard splits compared by their measured step times: the guard's evidence.

Arithmetic only (no I/O). A model of each worker's step predicts well
where the time a worker costs a step falls where it is measured; a CPU
quota that stalls a worker inside the exchange, after its part came in,
is charged to the last one in, and the model then points the wrong way.
So :class:`ddpwire.balance.Balancer` (``--balance auto``) tries splits
now and then and keeps what the clock says is faster: a :class:`Trial`
runs each of its *arms* (a split) for :data:`ARM_STEPS` steps in turn,
the current split first, and names the arm whose steps beat the current
one's past their noise.

Step times are not independent draws: under a CPU quota a short step
(a burst) is followed by a long one (the stall), and the sum over a few
quota periods is steady where any one step is not. So an arm's time and
its noise are taken over :data:`CHUNKS` runs of consecutive steps (batch
means): the mean of the chunks' means without the longest chunk (one
outlier, a collection, is dropped with its chunk, while a stall that comes
back in every chunk counts as much as it costs), and the standard error of
what is left.

A step whose split changed carries the change's cost (a worker's first
pass at a new size) and is not timed; a caller whose step times come some
steps late gets up to :data:`ARM_MOST` steps for an arm's times to come in.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

__all__ = ["ARM_MOST", "ARM_STEPS", "CHUNKS", "Trial", "beats", "chunked", "spread",
           "step_time"]

#: consecutive runs of steps an arm's times are cut into
CHUNKS = 4
#: steps each arm runs (its first, a change of split, is not timed)
ARM_STEPS = 5 * CHUNKS + 1
#: the most steps an arm runs waiting for its times to come in
ARM_MOST = 2 * ARM_STEPS


def spread(values: Sequence[float]) -> float:
    """The standard deviation of a few step times (0 for one)."""
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def chunked(values: Sequence[float]) -> List[float]:
    """The means of :data:`CHUNKS` runs of consecutive ``values`` (fewer
    for fewer values), without the longest (of three or more)."""
    n = min(CHUNKS, len(values))
    means = [sum(values[k * len(values) // n:(k + 1) * len(values) // n]) /
             len(values[k * len(values) // n:(k + 1) * len(values) // n]) for k in range(n)]
    if len(means) >= 3:
        means.remove(max(means))
    return means


def step_time(values: Sequence[float]) -> float:
    """An arm's step time: the mean of its chunks' means, the longest left out."""
    means = chunked(values)
    return sum(means) / len(means)


def beats(base: Sequence[float], other: Sequence[float], margin: float) -> bool:
    """Whether steps taking ``other`` seconds are shorter than steps taking
    ``base`` by more than ``margin`` of base's and by more than two standard
    errors of the difference (over chunks of consecutive steps: module
    docstring)."""
    if not base or not other:
        return False
    a, b = chunked(base), chunked(other)
    noise = 2.0 * math.sqrt(spread(a) ** 2 / len(a) + spread(b) ** 2 / len(b))
    mean_a = sum(a) / len(a)
    return mean_a - sum(b) / len(b) > max(margin * mean_a, noise)


class Trial:
    """One comparison: ``arms`` (kind, split) run in turn, the first the
    base the others are compared with. ``confirming``: a second trial of a
    winner against the base, on fresh steps (a win must show twice: one
    lucky run of a few steps must not move the split)."""

    def __init__(self, ident: int, arms: Sequence[Tuple[str, List[int]]], *,
                 confirming: bool = False) -> None:
        if len(arms) < 2:
            raise ValueError(f"a trial compares at least two splits, got {len(arms)}")
        self.ident = ident
        self.arms: List[Tuple[str, List[int]]] = [(k, list(s)) for k, s in arms]
        self.confirming = confirming
        self.times: List[List[float]] = [[] for _ in self.arms]
        self.at = 0        # the arm running
        self._steps = 0    # steps planned on it

    def next_arm(self) -> Optional[int]:
        """The arm the next step runs, or None when the trial is over (or
        the base got no time at all: a caller that times no step)."""
        if self.at < len(self.arms):
            done = len(self.times[self.at]) >= ARM_STEPS - 1 or self._steps >= ARM_MOST
            if done:
                if self.at == 0 and not self.times[0]:
                    self.at = len(self.arms)  # nothing to compare with: no arm is run
                    return None
                self.at, self._steps = self.at + 1, 0
        if self.at >= len(self.arms):
            return None
        self._steps += 1
        return self.at

    def on_base_for(self, steps: int) -> bool:
        """Whether the last ``steps`` steps all ran the base, in this trial."""
        return self.at == 0 and self._steps >= steps

    def record(self, arm: int, seconds: float) -> None:
        """Arm ``arm``'s step took ``seconds`` end to end."""
        self.times[arm].append(seconds)

    def winner(self, margin: float) -> Optional[int]:
        """The arm whose steps beat the base's by the most, past ``margin``
        and the noise; None when none does."""
        base = self.times[0]
        won = [i for i in range(1, len(self.arms)) if beats(base, self.times[i], margin)]
        return min(won, key=lambda i: step_time(self.times[i])) if won else None

    def mean(self, arm: int) -> float:
        """Arm ``arm``'s step time (:func:`step_time`)."""
        return step_time(self.times[arm])
