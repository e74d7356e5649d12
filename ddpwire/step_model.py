"""One worker's compute time for a shard: a fixed part plus a part per sample.

Arithmetic only (no I/O). A step's compute has a part that does not shrink
with the shard (Python, kernel launches, the optimizer, the copy out) and a
part that does. Taking a worker's speed as samples over seconds folds the
first into the second: a worker given one sample then looks a thousand
times slower per sample than it is, and never gets work back. So
:class:`StepModel` fits ``seconds = fixed + per_sample * samples`` to the
worker's recent steps, robustly:

- each shard size keeps the median of its last :data:`PER_SIZE` times, and
  the :data:`SIZES` most recent sizes are kept: one noisy step moves no
  median;
- the slope is the median of the slopes between those sizes' medians
  (Theil-Sen), over pairs :data:`SPREAD` apart at least (two sizes a
  sample apart say nothing of the slope but their noise); the fixed part
  the median of what each size leaves over;
- until two sizes that far apart are known the model is *provisional*:
  fixed 0, all of the time per sample (the old rule), and whoever acts on
  it moves only part of the way;
- :data:`JUMP_STEPS` times in a row more than :data:`JUMP` off the model,
  the same way and alike, are a machine that changed speed (throttled,
  another job): both parts are scaled by their median ratio and the older
  times are dropped, so a real change is followed in that many steps while
  noise, however large, moves only medians. Whether the fixed or the
  per-sample part changed one shard size cannot tell: the caller measures
  the worker at another size after a jump (:attr:`StepModel.jumps`).
"""
from __future__ import annotations

import statistics
from collections import deque
from typing import Deque, Dict, List, Optional, Tuple

__all__ = ["JUMP", "JUMP_STEPS", "PER_SIZE", "SIZES", "SPREAD", "StepModel"]

#: times kept per shard size (their median is the size's time)
PER_SIZE = 5
#: shard sizes kept, the most recent ones
SIZES = 4
#: two sizes give a slope when they differ by this fraction of the larger
SPREAD = 0.1
#: how far (a fraction of the prediction) a time must fall from the model,
#: JUMP_STEPS times in a row, alike, for the model to move there at once
JUMP = 0.2
JUMP_STEPS = 3
#: the robust scale of a normal's median absolute deviation
_MAD = 1.4826


class StepModel:
    """A worker's compute seconds for ``samples`` samples: :meth:`add`
    what was measured, :meth:`predict` what a shard would take."""

    def __init__(self) -> None:
        self._times: Dict[int, Deque[float]] = {}
        self._sizes: Deque[int] = deque()          # most recent last
        self._recent: Deque[Tuple[int, float]] = deque(maxlen=JUMP_STEPS)
        #: seconds per step whatever its shard (None: nothing measured yet)
        self.fixed: Optional[float] = None
        #: seconds per sample (None: nothing measured yet)
        self.per_sample: Optional[float] = None
        #: True while the two parts are not told apart (one size measured)
        self.provisional = True
        #: robust scale of one step's time around the model (seconds)
        self.error = 0.0
        self._prior: Optional[Tuple[float, float]] = None  # a fit scaled by a jump
        #: how many times the model jumped (a caller re-measures after one)
        self.jumps = 0

    @property
    def measured(self) -> bool:
        """Whether any step was measured."""
        return self.per_sample is not None

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
        self._recent.append((samples, seconds))
        if self.measured and self._jumped():
            ratio = statistics.median(t / self.predict(s) for s, t in self._recent)
            assert self.fixed is not None and self.per_sample is not None
            self.jumps += 1
            self._prior = (self.fixed * ratio, self.per_sample * ratio)
            self._times.clear()
            self._sizes.clear()
            for s, t in self._recent:
                self._keep(s, t)
        else:
            self._keep(samples, seconds)
        self._fit()

    def _jumped(self) -> bool:
        if len(self._recent) < JUMP_STEPS:
            return False
        ratios = [t / max(self.predict(s), 1e-12) for s, t in self._recent]
        up = all(r > 1.0 + JUMP for r in ratios)
        down = all(r < 1.0 - JUMP for r in ratios)
        return (up or down) and max(ratios) <= (1.0 + JUMP) * min(ratios)

    def _keep(self, samples: int, seconds: float) -> None:
        if samples in self._times:
            self._sizes.remove(samples)
        else:
            self._times[samples] = deque(maxlen=PER_SIZE)
            if len(self._sizes) == SIZES:
                del self._times[self._sizes.popleft()]
        self._sizes.append(samples)
        self._times[samples].append(seconds)

    def _points(self) -> List[Tuple[int, float]]:
        return [(s, statistics.median(self._times[s])) for s in self._sizes]

    def _fit(self) -> None:
        points = self._points()
        slopes = [(t2 - t1) / (s2 - s1) for i, (s1, t1) in enumerate(points)
                  for s2, t2 in points[i + 1:] if abs(s2 - s1) >= SPREAD * max(s1, s2)]
        if slopes:
            per_sample = max(statistics.median(slopes), 0.0)
            fixed = statistics.median(t - per_sample * s for s, t in points)
            if fixed < 0.0:
                # a negative fixed part is noise around none: all per sample
                fixed = 0.0
                per_sample = statistics.median(t / s for s, t in points)
            self.fixed, self.per_sample, self.provisional = fixed, per_sample, False
        elif self._prior is not None:
            # one size since a jump: the fit before it, scaled by the jump
            self.fixed, self.per_sample = self._prior
            self.provisional = False
        else:
            s, t = points[-1]
            self.fixed, self.per_sample, self.provisional = 0.0, t / s, True
        residuals = [abs(t - self.predict(s)) for s in self._sizes for t in self._times[s]]
        self.error = _MAD * statistics.median(residuals)
