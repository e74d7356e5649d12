"""Each step's shards sized by the workers' measured speeds.

Arithmetic only (no I/O): the coordinator feeds :class:`Balancer` each
worker's compute time for its shard, as the worker reported it
(StepTiming, docs/extensions.md "Shards by measured speed"), and asks it
for the next step's shard sizes.

The rules, and why:

- A worker's speed is samples per second of compute, smoothed over the
  steps (an exponential average, weight :data:`SMOOTHING` on the newest):
  one step's time is noisy (a page fault, a collection, another process),
  and a shard sized from it alone would swing from step to step.
- The shards are in proportion to the smoothed speeds, in whole samples,
  by largest remainder, so they add up to the step's total exactly; every
  worker keeps at least one sample (when there are enough), or its speed
  could never be measured again.
- Two measurements in a row more than :data:`JUMP` away from the smoothed
  speed, on the same side and within :data:`JUMP` of each other, replace
  it: a machine that really slowed down (throttled, another job) is
  followed in two steps, while noise, however large, is only smoothed.
- A step ends when the last worker's part is in, not when its compute
  ends: each worker has a lag outside its compute that a shard's size does
  not change (its optimizer step before the shard came, a stop before its
  upload, and, when it is the last one in, the rest of its part of the
  exchange, which a slow machine or a slow link pays at its own speed).
  The shards are sized so that compute plus lag ends alike for every
  worker: ``c_i = r_i * (t - lag_i)``, ``t`` set by ``sum(c_i) = T``.
  Each lag is smoothed like the speeds; one never measured counts as 0.
- The shards change only when the new split is predicted to shorten the
  step by more than :data:`TOLERANCE`: a difference of a sample or two is
  noise, and shards that flap cost more than they save. Nor do they change
  while the last step's predicted ends are within :data:`SETTLED` of each
  other: where a step is mostly a fixed cost, the speeds per sample
  mislead. A step whose slowest compute is under :data:`MIN_COMPUTE` is
  left alone.
- A worker's first measurement (its warm-up) is left out.
- Until every worker has been timed once, the split is the reference's
  (``T // n``, the rest to the last), which is also the split of a
  coordinator that does not balance.

The average over unequal shards is the sample-weighted mean
``sum(c_i * g_i) / sum(c_i)``: each worker multiplies its mean gradient by
:func:`sample_scale` (``n * c_i / T`` in float32) before it leaves, and
every averaging path divides the sum by ``n`` as it always has. With equal
shards the scale is exactly 1 and the bits are the reference's.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["CHOICES", "JUMP", "MIN_COMPUTE", "SETTLED", "SMOOTHING", "TOLERANCE", "Balancer",
           "ShardClock", "Shards", "WorkerTiming", "equal_shards", "sample_scale", "shard_starts"]

#: ``--balance`` on the command line to ``Coordinator(balance=)``
CHOICES = {"auto": "auto", "on": True, "off": False}
#: weight of the newest measurement in a worker's smoothed speed (a real
#: change of speed is followed sooner, by the JUMP rule)
SMOOTHING = 0.3
#: how far (a fraction of the smoothed speed) a measurement must fall from
#: it, twice in a row, alike, for the speed to jump there
JUMP = 0.2
#: the smallest predicted saving (a fraction of the step's compute time)
#: worth changing the shards for
TOLERANCE = 0.03
#: a step whose workers' predicted ends (compute plus lag) are within this
#: fraction of each other is balanced already
SETTLED = 0.05
#: seconds of compute below which a step is left as it is (the shards the
#: reference splits stay, and with them its bits)
MIN_COMPUTE = 0.005


def _far(rate: float, reference: float) -> bool:
    return abs(rate - reference) > JUMP * reference


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


def sample_scale(count: int, total: int, workers: int) -> float:
    """The factor a worker with ``count`` of the step's ``total`` samples
    multiplies its mean gradient by, so that the plain mean over the
    ``workers`` (a sum divided by ``workers``) is the sample-weighted one:
    ``workers * count / total`` rounded once to float32; 1.0 when ``total``
    is 0 (nothing to weight)."""
    if total <= 0:
        return 1.0
    return float(np.float32(workers * count / total))


@dataclass
class WorkerTiming:
    """One worker's part of a finished step, as the coordinator saw it."""

    worker_id: int
    samples: int
    #: seconds of compute the worker reported (None: it reports none)
    compute: Optional[float]
    #: smoothed samples per second of compute (None until measured)
    rate: Optional[float]
    #: seconds from the step's shards going out to its part coming in (None: not measured)
    arrival: Optional[float] = None


class Balancer:
    """Shard sizes for ``workers`` workers, in proportion to their speeds
    and net of their lags.

    :meth:`observe` feeds one worker's compute time for a shard (and the
    lag before its part came in), :meth:`ended` the rest of a step after
    its last worker's part came in; :meth:`shards` returns the next step's
    sizes. ``smoothing`` and ``tolerance`` are :data:`SMOOTHING` and
    :data:`TOLERANCE` by default.
    """

    def __init__(self, workers: int, *, smoothing: float = SMOOTHING,
                 tolerance: float = TOLERANCE) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing!r}")
        if not 0.0 <= tolerance < 1.0:
            raise ValueError(f"tolerance must be in [0, 1), got {tolerance!r}")
        self.workers = workers
        self.smoothing = smoothing
        self.tolerance = tolerance
        #: smoothed samples per second of compute, per worker (None: not yet timed)
        self.rates: List[Optional[float]] = [None] * workers
        #: smoothed seconds from a shard going out to the worker's part coming
        #: in, outside its compute (None: not yet measured)
        self.before: List[Optional[float]] = [None] * workers
        #: smoothed seconds a step went on after its part came in, when it
        #: was the last one in (None: not yet measured)
        self.after: List[Optional[float]] = [None] * workers
        self._last: Optional[Tuple[List[int], List[int]]] = None  # (ids, their shards)
        self._prev: List[Optional[float]] = [None] * workers  # the last raw speed
        self._seconds: List[Optional[float]] = [None] * workers  # the last compute time
        self._warm = [False] * workers  # a worker's first measurement is its warm-up

    def forget(self, worker: int) -> None:
        """Forget what was measured of ``worker``: it is timed afresh."""
        self.rates[worker] = self._prev[worker] = self._seconds[worker] = None
        self.before[worker] = self.after[worker] = None
        self._warm[worker] = False
        self._last = None

    def lag(self, worker: int) -> float:
        """Seconds ``worker`` adds to a step besides its compute (0 until measured)."""
        return (self.before[worker] or 0.0) + (self.after[worker] or 0.0)

    def observe(self, worker: int, samples: int, seconds: float,
                before: Optional[float] = None) -> None:
        """Worker ``worker`` computed ``samples`` samples in ``seconds``;
        its part came in ``before`` seconds of other time after its shard
        went out (None: not measured). A shard of no samples, or a time too
        short to measure, says nothing about the speed and is ignored."""
        self._check(worker)
        if samples <= 0 or not seconds > 1e-6:
            return
        if not self._warm[worker]:
            # a first step pays for lazy set-up (allocations, kernels picked,
            # caches filled): its time says little about the next ones
            self._warm[worker] = True
            return
        if before is not None:
            self.before[worker] = self._smooth(self.before[worker], max(0.0, before))
        rate = samples / seconds
        self._seconds[worker] = seconds
        old = self.rates[worker]
        if old is None:
            self.rates[worker] = rate
            return
        # two measurements in a row far off the same way, and close to each
        # other, are a machine that changed speed (throttled, another job):
        # follow it at once. Bursty noise (a CPU quota's period longer than
        # a step) is far off too, but not twice alike: it is only smoothed.
        prev, self._prev[worker] = self._prev[worker], rate
        if prev is not None and _far(rate, old) and _far(prev, old) and \
                (rate > old) == (prev > old) and not _far(rate, prev):
            self.rates[worker] = (rate + prev) / 2
        else:
            self.rates[worker] = self._smooth(old, rate)

    def ended(self, worker: int, seconds: float) -> None:
        """A step went on ``seconds`` after the part of ``worker``, its
        last one in, came in: the rest of that worker's part of the
        exchange, at its speed (and over its link)."""
        self._check(worker)
        if self._warm[worker] and seconds >= 0.0:
            self.after[worker] = self._smooth(self.after[worker], seconds)

    def _check(self, worker: int) -> None:
        if not 0 <= worker < self.workers:
            raise ValueError(f"worker {worker} is not one of the {self.workers} workers")

    def _smooth(self, old: Optional[float], new: float) -> float:
        return new if old is None else (1.0 - self.smoothing) * old + self.smoothing * new

    def shards(self, total: int, active: Optional[Sequence[int]] = None) -> List[int]:
        """The next step's shard sizes, one per worker: they add up to
        ``total``. ``active`` (worker ids; default all) are the workers
        that take part; every other one gets 0 and its speed is kept."""
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        ids = list(range(self.workers)) if active is None else sorted(active)
        if not ids:
            raise ValueError("no active worker to give the samples to")
        rates = [self.rates[i] for i in ids]
        if any(r is None for r in rates):
            sub = equal_shards(total, len(ids))
        else:
            sub = self._proportional(total, [float(r) for r in rates],  # type: ignore[arg-type]
                                     [self.lag(i) for i in ids])
            last = self._last
            if last is not None and last[0] == ids and sum(last[1]) == total and (
                    self._settled(ids) or
                    self._time(sub, ids) >= (1.0 - self.tolerance) * self._time(last[1], ids)):
                sub = last[1]
        self._last = (ids, sub)
        split = [0] * self.workers
        for i, count in zip(ids, sub):
            split[i] = count
        return split

    def _settled(self, ids: Sequence[int]) -> bool:
        """The workers' last compute times plus their lags are within
        :data:`SETTLED` of each other: nobody waits long, so nothing should
        move. Where a step's time is mostly a fixed cost (a tiny model), a
        worker given fewer samples looks slower per sample, and the
        proportional rule alone would take its samples away step after
        step, however equal the times already are."""
        times = [self._seconds[i] for i in ids]
        if any(t is None for t in times):
            return False
        # a step whose compute is this short is all latency: whatever moves
        # saves next to nothing, and the times are mostly scheduling noise
        if max(times) < MIN_COMPUTE:  # type: ignore[type-var]
            return True
        ends = [t + self.lag(i) for t, i in zip(times, ids)]  # type: ignore[operator]
        return max(ends) <= (1.0 + SETTLED) * min(ends)

    def _time(self, split: Sequence[int], ids: Sequence[int]) -> float:
        """The step's predicted time under ``split`` (one count per id in
        ``ids``): its last worker's compute plus lag."""
        return max(c / self.rates[i] + self.lag(i)  # type: ignore[operator]
                   for c, i in zip(split, ids))

    @staticmethod
    def _proportional(total: int, rates: List[float], lags: List[float]) -> List[int]:
        """Whole shards that end alike: ``rates[i] * (t - lags[i])``, at
        least one sample each when there are enough (a worker whose lag
        alone outlasts the others' compute keeps that one)."""
        n = len(rates)
        least = 1 if total >= n else 0
        share = list(range(n))  # the workers above the least
        while True:
            whole = sum(rates[i] for i in share)
            left = total - least * (n - len(share))
            t = (left + sum(rates[i] * lags[i] for i in share)) / whole
            keep = [i for i in share if rates[i] * (t - lags[i]) > least]
            if len(keep) == len(share) or not keep:
                break
            share = keep
        # (with nobody above the least, every one of them is at it)
        ideal = [float(least)] * n
        for i in share:
            ideal[i] = max(0.0, rates[i] * (t - lags[i]))
        split = [int(x) for x in ideal]
        # largest remainder; ties go to the lower worker id, so every run splits alike
        order = sorted(range(n), key=lambda i: (split[i] - ideal[i], i))
        for i in order[:total - sum(split)]:
            split[i] += 1
        if least:
            # a sample for every worker, taken from the largest shards
            for i in range(n):
                if split[i] == 0:
                    split[max(range(n), key=lambda j: (split[j], -j))] -= 1
                    split[i] = 1
        return split


class Shards:
    """A session's shards, step by step: each worker's sample range, the
    scale a timed worker applies to its gradients, and what each step's
    timings said (no I/O: the coordinator sends and reads the messages).

    ``timed[w]`` says worker ``w`` reports its compute time and applies its
    own scale (it was granted the balance entry). For one that does not (a
    reference worker) the coordinator measures when its gradient starts to
    arrive and applies the scale as it sums (:meth:`sums_scales`). With
    ``balance`` the shards follow the measured speeds; without, they are the
    reference's and the timings still show where each step's time went.
    ``weighted`` scales the gradients by their shards even when they do not
    follow the speeds (an elastic session: a step redone by fewer workers
    averages what the full set would have).

    Workers are named by their ids throughout; :meth:`drop` takes one out
    of every later plan (it gets no samples), and the lists that follow the
    connections (:meth:`sums_scales`, :meth:`check_totals`,
    :meth:`timings`) are over :attr:`active` only, in id order.
    """

    def __init__(self, timed: Sequence[bool], balance: bool, *, weighted: bool = False,
                 smoothing: float = SMOOTHING, tolerance: float = TOLERANCE) -> None:
        self.timed = list(timed)
        self.balance = balance
        self.weighted = weighted or balance
        self.balancer = Balancer(len(self.timed), smoothing=smoothing, tolerance=tolerance)
        #: the ids of the workers that take part, in id order
        self.active: List[int] = list(range(len(self.timed)))
        self.step: Optional[int] = None
        self.split: List[int] = [0] * len(self.timed)
        self._starts: List[int] = [0] * len(self.timed)
        self._compute: List[Optional[float]] = [None] * len(self.timed)
        #: seconds from the shards going out to each worker's part coming in
        self._arrival: List[Optional[float]] = [None] * len(self.timed)
        #: ... and to each worker's part of the exchange being done (a mesh's StepReport)
        self._reported: List[Optional[float]] = [None] * len(self.timed)
        self._planned_at: Optional[float] = None  # when the planned step's shards went out

    @property
    def workers(self) -> int:
        """How many workers take part."""
        return len(self.active)

    def drop(self, worker: int) -> None:
        """Take ``worker`` out of every later plan."""
        if worker in self.active:
            self.active.remove(worker)

    def add(self, worker: int, timed: bool) -> None:
        """Put ``worker`` (joining between steps) in every later plan, its
        speed still to be measured (it may be another machine than the one
        that had its id)."""
        if worker not in self.active:
            self.active = sorted(self.active + [worker])
        self.timed[worker] = timed
        self.balancer.forget(worker)

    def plan(self, step: int, total: int, now: Optional[float] = None) -> List[int]:
        """The shard sizes of ``step``, one per worker id (the timings of
        every earlier step are in; a dropped worker's is 0). ``now``
        (time.perf_counter()) is when they go out, which also ends the
        step before: without it no lag is measured."""
        if now is not None:
            self._ended(step, now)
        if self.balance:
            self.split = self.balancer.shards(total, self.active)
        else:
            self.split = [0] * len(self.timed)
            for w, count in zip(self.active, equal_shards(total, len(self.active))):
                self.split[w] = count
        self._starts = shard_starts(self.split)
        self.step = step
        self._planned_at = now
        self._compute = [None] * len(self.timed)
        self._arrival = [None] * len(self.timed)
        self._reported = [None] * len(self.timed)
        return list(self.split)

    def _ended(self, step: int, now: float) -> None:
        """The planned step ended by ``now``: the rest of its last worker's
        part after it came in, until that worker's StepReport (in a mesh,
        where the others' parts of the exchange go on beside it) or the
        step's end, is that worker's. Not for a step called off and redone
        (``step`` is the same), nor one a worker's part of was not timed."""
        if self._planned_at is None or self.step is None or step != self.step + 1:
            return
        arrivals = [(self._arrival[w], w) for w in self.active if self.split[w] > 0]
        if not arrivals or any(a is None for a, _ in arrivals):
            return
        arrival, last = max(arrivals)  # type: ignore[type-var]
        done = self._reported[last]
        if done is None:
            done = now - self._planned_at
        self.balancer.ended(last, done - arrival)  # type: ignore[operator]

    def bounds(self, worker: int) -> Tuple[int, int]:
        """[start, end) of ``worker``'s shard in the planned step."""
        return self._starts[worker], self._starts[worker] + self.split[worker]

    def scale(self, worker: int) -> float:
        """What ``worker`` multiplies its gradients by in the planned step."""
        return sample_scale(self.split[worker], sum(self.split), self.workers) \
            if self.weighted else 1.0

    def sums_scales(self) -> Optional[List[float]]:
        """The scales the coordinator's sum applies, one per active worker
        (1 for a worker that applies its own), or None when none is needed."""
        scales = [1.0 if self.timed[w] else self.scale(w) for w in self.active]
        return None if all(x == 1.0 for x in scales) else scales

    def untimed(self) -> List[int]:
        """The workers whose compute time for the planned step is still to
        be measured here (they report none)."""
        return [w for w in self.active if not self.timed[w] and self._compute[w] is None]

    def observe(self, worker: int, step: int, compute_us: Optional[int],
                now: Optional[float] = None) -> Optional[str]:
        """A StepTiming from ``worker``, read at ``now`` (time.perf_counter());
        ``compute_us`` None: a worker that reports none, whose compute is
        taken to end when its gradient starts to come in, at ``now``.
        Returns why it is refused, or None."""
        if step != self.step:
            return f"StepTiming for step {step} during step {self.step}"
        if self._compute[worker] is not None:
            return f"a second StepTiming for step {step}"
        self.arrived(worker, now)
        arrival = self._arrival[worker]
        if compute_us is None:
            if arrival is None:
                return None  # no clock to measure it on
            compute_us = int(arrival * 1e6)
        seconds = compute_us / 1e6
        self._compute[worker] = seconds
        self.balancer.observe(worker, self.split[worker], seconds,
                              None if arrival is None else arrival - seconds)
        return None

    def arrived(self, worker: int, now: Optional[float]) -> None:
        """``worker``'s part of the planned step started to come in at
        ``now`` (time.perf_counter()), if nothing said so earlier: a
        coordinator that reads the workers one after the other sees when
        each socket turned readable before it reads the StepTiming there."""
        if now is not None and self._planned_at is not None and self._arrival[worker] is None:
            self._arrival[worker] = now - self._planned_at

    def reported(self, worker: int, step: int, now: float) -> None:
        """``worker``'s StepReport for ``step`` came in at ``now``
        (time.perf_counter()): its part of a mesh step's exchange is done."""
        if step == self.step and self._planned_at is not None:
            self._reported[worker] = now - self._planned_at

    def check_totals(self, totals: Sequence[int]) -> Optional[Tuple[int, int, int]]:
        """With unequal shards every worker's count (GradientPayload.total,
        one per active worker) must be in the same proportion to its shard
        (samples, or tokens per sample times samples): returns (worker id,
        expected, got) for the first that is not, or None."""
        counts = [self.split[w] for w in self.active]
        if not self.weighted or len(set(counts)) <= 1:
            return None
        ratios = [Fraction(t, c) for t, c in zip(totals, counts) if c > 0]
        if not ratios:
            return None
        # the ratio most workers share is the right one (ties: the lowest worker's)
        ratio = max(ratios, key=lambda r: (ratios.count(r), -ratios.index(r)))
        for w, count, got in zip(self.active, counts, totals):
            if got != ratio * count:
                return w, int(ratio * count), got
        return None

    def timings(self) -> List[WorkerTiming]:
        """Each active worker's part of the planned step, as far as it is known."""
        return [WorkerTiming(w, self.split[w], self._compute[w], self.balancer.rates[w],
                             self._arrival[w])
                for w in self.active]


class ShardClock:
    """A timed worker's side: when each step's shard came (its ShardScale
    with it), so that the step's StepTiming says how long the compute took,
    and the scale its gradients leave multiplied by (no I/O: the worker
    sends the messages)."""

    def __init__(self) -> None:
        self._step: Optional[int] = None
        self._scale = 1.0
        self._since: Optional[float] = None
        self._scaled: Optional[np.ndarray] = None

    def assigned(self, step: int, scale: float, now: float) -> None:
        """``step``'s shard and ShardScale came in at ``now`` (seconds)."""
        self._step, self._scale, self._since = step, scale, now

    def compute_us(self, step: int, now: float) -> Optional[int]:
        """Microseconds of compute on ``step``'s shard up to ``now``: once
        per step (its first upload), None otherwise or for a step not
        assigned here."""
        if step != self._step or self._since is None:
            return None
        since, self._since = self._since, None
        return int((now - since) * 1e6)

    def scaled(self, step: int, gradients: np.ndarray) -> np.ndarray:
        """``gradients`` times ``step``'s scale, in a buffer kept for the
        next step; a scale of 1 (equal shards) sends them as they are."""
        if step != self._step or self._scale == 1.0:
            return gradients
        src = np.asarray(gradients)
        if self._scaled is None or len(self._scaled) < len(src):
            self._scaled = np.empty(len(src), dtype=np.float32)
        return np.multiply(src, np.float32(self._scale), out=self._scaled[:len(src)])
