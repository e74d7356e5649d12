"""One worker's time for a shard: a fixed part plus a part per sample.

Arithmetic only (no I/O). A step has a part that does not shrink with the
shard (Python, kernel launches, the optimizer, the copy out) and a part
that does. Taking a worker's speed as samples over seconds folds the first
into the second: a worker given one sample then looks a thousand times
slower per sample than it is, and never gets work back. So
:class:`StepModel` fits ``seconds = fixed + per_sample * samples`` to the
worker's recent steps, robustly:

- each shard size keeps its last :data:`PER_SIZE` times, and its time is
  their mean without the longest (:func:`trimmed_mean`): one outlier (a
  collection, a page fault) is dropped whole, while stalls that come back
  (a CPU quota whose period is longer than a step) count as much as they
  cost, which a median would hide;
- the :data:`SIZES` most recent sizes are kept; the slope is the median of
  the slopes between them (Theil-Sen), over sizes measured
  :data:`MIN_POINT` times at least and pairs :data:`SPREAD` apart at least
  (two sizes a sample apart say nothing of the slope but their noise); the
  fixed part the median of what each size leaves over;
- until two such sizes are known the model is *provisional*: fixed 0, all
  of the time per sample (the old rule), and whoever acts on it moves only
  part of the way;
- :data:`JUMP_STEPS` times in a row more than :data:`JUMP` off the model,
  the same way, alike, and each outside every time its size had shown (a
  worker whose steps swing between two speeds has shown both), are a
  machine that changed speed (throttled, another job): both parts are
  scaled by their median ratio and the older times are dropped, so a real
  change is followed in that many steps. Whether the fixed or the
  per-sample part changed one shard size cannot tell: the caller measures
  the worker at another size after a jump (:attr:`StepModel.jumps`).
"""
from __future__ import annotations

import math
from collections import deque
from typing import Deque, Dict, Iterable, Optional, Sequence, Tuple

__all__ = ["JUMP", "JUMP_STEPS", "MIN_POINT", "PER_SIZE", "SIZES",
           "SPREAD", "StepModel", "median", "spread", "trimmed_mean"]

#: times kept per shard size
PER_SIZE = 9
#: shard sizes kept, the most recent ones
SIZES = 4
#: two sizes give a slope when they differ by this fraction of the larger
SPREAD = 0.1
#: times a size needs before it takes part in a slope, or the model moves
#: a split (one or two steps at a size a split passed through are noise,
#: not a point)
MIN_POINT = 3
#: how far (a fraction of the prediction) a time must fall from the model,
#: JUMP_STEPS times in a row, alike, for the model to move there at once
JUMP = 0.2
JUMP_STEPS = 3


def median(values: Iterable[float]) -> float:
    """The median of a few values (statistics.median's answer, without its
    type checks: the coordinator plans each step on this)."""
    v = sorted(values)
    n = len(v)
    if n == 0:
        raise ValueError("median of no values")
    half = n // 2
    return v[half] if n % 2 else (v[half - 1] + v[half]) / 2


def spread(values: Sequence[float]) -> float:
    """The standard deviation of a few values (0 for one)."""
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def trimmed_mean(values: Iterable[float]) -> float:
    """The mean without the largest value (of three or more): a step time's
    expectation, robust to one outlier, where a median would ignore stalls
    that come back every few steps."""
    v = list(values)
    if not v:
        raise ValueError("mean of no values")
    if len(v) >= 3:
        v.remove(max(v))
    return sum(v) / len(v)


class StepModel:
    """A worker's compute seconds for ``samples`` samples: :meth:`add`
    what was measured, :meth:`predict` what a shard would take."""

    def __init__(self) -> None:
        self._times: Dict[int, Deque[float]] = {}
        self._means: Dict[int, float] = {}       # each size's time (trimmed mean)
        self._sizes: Deque[int] = deque()          # most recent last
        self._recent: Deque[Tuple[int, float, bool]] = deque(maxlen=JUMP_STEPS)  # novel?
        #: seconds per step whatever its shard (None: nothing measured yet)
        self.fixed: Optional[float] = None
        #: seconds per sample (None: nothing measured yet)
        self.per_sample: Optional[float] = None
        #: True while the two parts are not told apart (one size measured)
        self.provisional = True
        self._prior: Optional[Tuple[float, float]] = None  # a fit scaled by a jump
        #: how many times the model jumped (a caller re-measures after one)
        self.jumps = 0

    @property
    def ready(self) -> bool:
        """Whether the newest shard size was measured often enough to act
        on the model (its error known)."""
        return bool(self._sizes) and len(self._times[self._sizes[-1]]) >= MIN_POINT

    @property
    def error(self) -> float:
        """The standard error of the newest size's time (seconds): the
        spread of its steps over the root of their number."""
        if not self._sizes:
            return 0.0
        times = self._times[self._sizes[-1]]
        return spread(times) / math.sqrt(len(times)) if len(times) >= 2 else 0.0

    @property
    def measured(self) -> bool:
        """Whether any step was measured."""
        return bool(self._sizes)

    def predict(self, samples: int) -> float:
        """Seconds of compute for a shard of ``samples`` (0 before any
        measurement)."""
        if self.fixed is None or self.per_sample is None:
            return 0.0
        return self.fixed + self.per_sample * samples

    def add(self, samples: int, seconds: float) -> None:
        """A shard of ``samples`` took ``seconds`` of compute."""
        if samples <= 0 or not seconds > 0.0:
            return
        # what the size showed before the streak a jump would be made of
        times = self._times.get(samples)
        if times is None or len(times) < MIN_POINT + JUMP_STEPS - 1:
            novel = True
        else:
            seen = list(times)[:len(times) - (JUMP_STEPS - 1)]
            novel = not min(seen) <= seconds <= max(seen)
        self._recent.append((samples, seconds, novel))
        if novel and self._sizes and self._jumped():
            ratio = median(t / self.predict(s) for s, t, _ in self._recent)
            assert self.fixed is not None and self.per_sample is not None
            self.jumps += 1
            self._prior = (self.fixed * ratio, self.per_sample * ratio)
            self._times.clear()
            self._means.clear()
            self._sizes.clear()
            for s, t, _ in self._recent:
                self._keep(s, t)
        else:
            self._keep(samples, seconds)
        # the fit is made here, when a worker's StepTiming comes in, while
        # the others still compute: the step's report reads it at its end,
        # when every worker waits for the next shards (issue 38)
        self._fit()

    def _jumped(self) -> bool:
        if len(self._recent) < JUMP_STEPS or not all(n for _, _, n in self._recent):
            return False
        ratios = [t / max(self.predict(s), 1e-12) for s, t, _ in self._recent]
        up = all(r > 1.0 + JUMP for r in ratios)
        down = all(r < 1.0 - JUMP for r in ratios)
        return (up or down) and max(ratios) <= (1.0 + JUMP) * min(ratios)

    def _keep(self, samples: int, seconds: float) -> None:
        if samples in self._times:
            self._sizes.remove(samples)
        else:
            self._times[samples] = deque(maxlen=PER_SIZE)
            if len(self._sizes) == SIZES:
                gone = self._sizes.popleft()
                del self._times[gone], self._means[gone]
        self._sizes.append(samples)
        self._times[samples].append(seconds)
        self._means[samples] = trimmed_mean(self._times[samples])

    def _fit(self) -> None:
        times, means = self._times, self._means
        sizes = [s for s in self._sizes if len(times[s]) >= MIN_POINT]
        slopes = []
        for i, s1 in enumerate(sizes):
            t1 = means[s1]
            for s2 in sizes[i + 1:]:
                if abs(s2 - s1) >= SPREAD * (s1 if s1 > s2 else s2):
                    slopes.append((means[s2] - t1) / (s2 - s1))
        if slopes:
            per_sample = max(median(slopes), 0.0)
            fixed = median([means[s] - per_sample * s for s in sizes])
            if fixed < 0.0:
                # a negative fixed part is noise around none: all per sample
                fixed = 0.0
                per_sample = median([means[s] / s for s in sizes])
            self.fixed, self.per_sample, self.provisional = fixed, per_sample, False
        elif self._prior is not None:
            # one size since a jump: the fit before it, scaled by the jump
            self.fixed, self.per_sample = self._prior
            self.provisional = False
        else:
            s = self._sizes[-1]
            self.fixed, self.per_sample, self.provisional = 0.0, means[s] / s, True
