"""Each step's shards sized by the workers' measured step times.

Arithmetic only (no I/O): the coordinator feeds :class:`Balancer` each
worker's compute time for its shard, as the worker reported it
(StepTiming, docs/extensions.md "Shards by measured speed"), the lags
outside its compute, and each step's measured time end to end; it asks for
the next step's shard sizes.

The rules, and why:

- A worker's time to deliver its part (from the shards going out to its
  part coming in: its compute, and what it does outside it, an optimizer
  step, a stop before its upload, a CPU quota's stall wherever it falls)
  is a fixed part plus a part per sample
  (:class:`ddpwire.session.step_model.StepModel`, fitted robustly over its recent
  steps): the fixed part does not shrink with the shard, and a rule that
  takes samples per second of the whole time as the speed starves a worker
  given few samples for good. Where only the compute is known (a worker's
  own report, without the coordinator's clock), the model is of that.
- A step ends when the last worker's part is in and the rest of the
  exchange is done: when a worker is the last one in, that rest is its lag
  (a slow machine or link pays it at its own speed whatever its shard),
  the median of its last :data:`LAGS` measurements; 0 until measured.
- The shards minimise the predicted step, ``max(fixed_i + lag_i +
  per_sample_i * c_i)``, over whole samples adding up to the step's total,
  with none below :data:`FLOOR` of an equal share (at least one sample):
  a worker keeps enough samples that its time per sample can be measured,
  and so can win its share back. No worker gets 0: it would still compute,
  send and wait for every step, so a shard of none saves only the floor's
  samples.
- The split moves only when the predicted step is shorter by more than the
  model's own error (two standard errors of the noisiest worker's time at
  its shard, and at least :data:`TOLERANCE` of the step), and away
  from equal shards only when equal shards are predicted to lose by as
  much. Identical workers stay at equal shards; noise moves nothing.
- A move is at most a halving or a doubling of any shard, and half the
  way while a worker's fixed and per-sample parts are not told apart (one
  shard size measured): a wrong model costs a step or two, not a run.
- The model leaves equal shards only where the workers' parts come in
  further apart than :data:`TOLERANCE` of the step past their noise
  (:meth:`Balancer.room`): with one shard size seen it cannot tell the
  noise of a few steps from a slower worker. A move off equal shards that
  the model undoes by itself was the noise's (on a shared machine the
  parts come in apart for a while, one worker's and then another's): the
  model then keeps equal shards for :data:`STAY_FIRST` steps, twice that
  after its next return, at most :data:`STAY_MOST`, unless a worker's
  speed jumps; and the trial of the move, brought forward, is called off.
- The guard (``guard=True``, ``--balance auto``): trials of other splits
  now and then, on measured step times, their cost bounded, and the
  model trusted only as far as they bear it out (:mod:`ddpwire.session.guard`).
  Once the lost trials' budget is spent the model leaves equal shards
  only where the parts come in apart past :data:`SPENT_SIGMAS` standard
  errors (:meth:`Balancer.room`): no trial could then check a move made on
  the fit alone (identical workers on a busy machine, whose fits' noise
  points anywhere, stay equal), while a worker that really is slower is
  still followed.
- A worker's first measurement (its warm-up) is left out. Until every
  worker has been timed once, the split is the reference's (``T // n``,
  the rest to the last), which is also the split of a coordinator that
  does not balance.

The average over unequal shards is the sample-weighted mean
``sum(c_i * g_i) / sum(c_i)``: each worker multiplies its mean gradient by
:func:`sample_scale` (``n * c_i / T`` in float32) before it leaves, and
every averaging path divides the sum by ``n`` as it always has. With equal
shards the scale is exactly 1 and the bits are the reference's.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from fractions import Fraction
from typing import Deque, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from .guard import Guard
from .splits import FLOOR, equal_shards, floor_shard, largest_remainder, shard_starts
from .step_model import JUMP_STEPS, StepModel, median, spread

__all__ = ["CHOICES", "FLOOR", "LAGS", "ROOM_LEAST", "ROOM_STEPS", "SPENT_SIGMAS", "TOLERANCE",
           "Balancer", "ShardClock", "Shards", "WorkerTiming", "equal_shards", "sample_scale",
           "shard_starts"]

#: ``--balance`` on the command line to ``Coordinator(balance=)``
CHOICES: Dict[str, Union[bool, str]] = {"auto": "auto", "on": True, "off": False}
#: lag measurements whose median is a worker's lag
LAGS = 9
#: the smallest predicted saving (a fraction of the step) worth a move
TOLERANCE = 0.03
#: equal steps every worker is measured at after one changed speed
MEASURE_STEPS = 4
#: the most steps a split the model said to keep stays before it is asked again
QUIET_MOST = 16
#: steps the model keeps equal shards after it came back to them by itself
#: (a move that the next fits undo was the noise's), doubled each time, at most
STAY_FIRST = 32
STAY_MOST = 256
#: recent steps whose medians say how far apart the workers' parts come in
#: (the room the model has to leave equal shards), and the fewest at one
#: split that do
ROOM_STEPS = 31
ROOM_LEAST = 9
#: standard errors past which the parts must come in apart for the model to
#: leave equal shards once no trial can check the move: the test is made at
#: every step, and a move nothing checks stays
SPENT_SIGMAS = 3.0

#: the guard's states (Balancer.state)
EQUAL, BALANCED, PROBE, HELD = "equal", "balanced", "probe", "held"


def sample_scale(count: int, total: int, workers: int) -> float:
    """The factor a worker with ``count`` of the step's ``total`` samples
    multiplies its mean gradient by, so that the plain mean over the
    ``workers`` (a sum divided by ``workers``) is the sample-weighted one:
    ``workers * count / total`` rounded once to float32; 1.0 when ``total``
    is 0 (nothing to weight)."""
    if total <= 0 or workers * count == total:
        return 1.0  # (an equal share: no numpy scalar on the coordinator's every step)
    return float(np.float32(workers * count / total))


@dataclass
class WorkerTiming:
    """One worker's part of a finished step, as the coordinator saw it."""

    worker_id: int
    samples: int
    #: seconds of compute the worker reported (None: it reports none)
    compute: Optional[float]
    #: samples per second of its per-sample part (None until measured)
    rate: Optional[float]
    #: seconds from the step's shards going out to its part coming in (None: not measured)
    arrival: Optional[float] = None
    #: fitted seconds of its compute whatever its shard (None until measured)
    fixed: Optional[float] = None
    #: fitted seconds of its compute per sample (None until measured)
    per_sample: Optional[float] = None
    #: the worker as a user knows it: its node id and host
    name: str = ""


class Balancer:
    """Shard sizes for ``workers`` workers that minimise the predicted step.

    :meth:`observe` feeds one worker's compute time for a shard (and the
    lag before its part came in), :meth:`ended` the rest of a step after
    its last worker's part came in, :meth:`stepped` a step's measured time
    end to end; :meth:`shards` returns a step's sizes. ``guard`` (``--balance
    auto``) tries other splits now and then and keeps the one the measured
    step times say is faster (module docstring); ``planned``, the steps the
    run is planned to take (None: not known), bounds what the trials cost.
    """

    def __init__(self, workers: int, *, guard: bool = True,
                 tolerance: float = TOLERANCE, planned: Optional[int] = None) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        if not 0.0 <= tolerance < 1.0:
            raise ValueError(f"tolerance must be in [0, 1), got {tolerance!r}")
        self.workers = workers
        self.tolerance = tolerance
        #: each worker's fitted compute time (ddpwire.session.step_model.StepModel)
        self.models = [StepModel() for _ in range(workers)]
        self._before: List[Deque[float]] = [deque(maxlen=LAGS) for _ in range(workers)]
        self._after: List[Deque[float]] = [deque(maxlen=LAGS) for _ in range(workers)]
        self._lags = [0.0] * workers  # each worker's after, kept as it comes
        # each worker's recent (shard, seconds to its part coming in), and
        # recent steps end to end: the room the model has to move
        self._arrivals: List[Deque[Tuple[int, float]]] = \
            [deque(maxlen=ROOM_STEPS) for _ in range(workers)]
        self._steps: Deque[float] = deque(maxlen=ROOM_STEPS)
        self._warm = [False] * workers  # a worker's first measurement is its warm-up
        # (ids, their shards, the total, its equal split) of the step before
        self._last: Optional[Tuple[List[int], List[int], int, List[int]]] = None
        #: where the shards stand: equal, balanced (the model's split), probe
        #: (a trial's steps, or equal ones measuring after a jump) or held
        #: (the model lost a trial: the split the trials found faster)
        self.state = EQUAL
        # step -> (the trial it ran for, its arm, whether its split changed)
        self._planned: Dict[int, Tuple[Optional[int], int, bool]] = {}
        #: the trials of other splits (``guard``; None: the model alone)
        self.guard: Optional[Guard] = Guard(planned) if guard else None
        self._jumps = 0        # the models' jumps seen (a jump is re-measured at equal shards)
        self._measure = 0      # equal steps left to measure after a jump
        self._quiet = 0        # steps the split stays before the model is asked again
        self._backoff = 1
        self._stay = 0         # steps the model keeps equal shards yet
        self._stay_next = STAY_FIRST  # ... after its next way back to them

    # ---- what is measured ----

    @property
    def rates(self) -> List[Optional[float]]:
        """Each worker's samples per second of its per-sample part (None
        until measured; inf where no time per sample shows)."""
        return [None if m.per_sample is None else
                (1.0 / m.per_sample if m.per_sample > 0 else math.inf) for m in self.models]

    @property
    def before(self) -> List[Optional[float]]:
        """Each worker's seconds from a shard going out to its part coming
        in, outside its compute (median; None: not yet measured)."""
        return [median(d) if d else None for d in self._before]

    @property
    def after(self) -> List[Optional[float]]:
        """Each worker's seconds a step went on after its part came in,
        when it was the last one in (median; None: not yet measured)."""
        return [median(d) if d else None for d in self._after]

    def forget(self, worker: int) -> None:
        """Forget what was measured of ``worker``: it is timed afresh."""
        self._check(worker)
        self.models[worker] = StepModel()
        self._before[worker].clear()
        self._after[worker].clear()
        self._arrivals[worker].clear()
        self._update_lag(worker)
        self._warm[worker] = False
        self._last = None

    def lag(self, worker: int) -> float:
        """Seconds ``worker`` adds to a step after its part came in, when
        it is the last one in (0 until measured): the time before is in
        its model."""
        return self._lags[worker]

    def _update_lag(self, worker: int) -> None:
        after = self._after[worker]
        self._lags[worker] = median(after) if after else 0.0

    def observe(self, worker: int, samples: int, seconds: float,
                before: Optional[float] = None) -> None:
        """Worker ``worker`` computed ``samples`` samples in ``seconds``;
        its part came in ``before`` seconds of other time after its shard
        went out (None: not measured). A shard of no samples, or a time too
        short to measure, says nothing and is ignored."""
        self._check(worker)
        if samples <= 0 or not seconds > 1e-6:
            return
        if not self._warm[worker]:
            # a first step pays for lazy set-up (allocations, kernels picked,
            # caches filled): its time says little about the next ones
            self._warm[worker] = True
            return
        if before is not None:
            # the model is of the whole time to the part coming in: what a
            # worker does outside its compute (its optimizer step, a stop
            # before its upload, a CPU quota's stall wherever it falls) is
            # part of the step it delivers, and may grow with its shard too
            before = max(0.0, before)
            self._before[worker].append(before)
            seconds += before
        self.models[worker].add(samples, seconds)
        self._arrivals[worker].append((samples, seconds))

    def ended(self, worker: int, seconds: float) -> None:
        """A step went on ``seconds`` after the part of ``worker``, its
        last one in, came in: the rest of that worker's part of the
        exchange, at its speed (and over its link)."""
        self._check(worker)
        if self._warm[worker] and seconds >= 0.0:
            self._after[worker].append(seconds)
            self._update_lag(worker)

    def stepped(self, step: int, seconds: float) -> None:
        """``step`` (as :meth:`shards` planned it) took ``seconds`` end to
        end: what the guard compares. A step whose split changed is left
        out (it carries the change's own cost)."""
        planned = self._planned.pop(step, None)
        if planned is None or not seconds > 0.0:
            return
        trial, arm, changed = planned
        self._steps.append(seconds)
        if self.guard is not None:
            self.guard.record(trial, arm, seconds, changed)

    def _check(self, worker: int) -> None:
        if not 0 <= worker < self.workers:
            raise ValueError(f"worker {worker} is not one of the {self.workers} workers")

    # ---- the split ----

    def shards(self, total: int, active: Optional[Sequence[int]] = None,
               step: Optional[int] = None) -> List[int]:
        """The shard sizes of ``step``, one per worker: they add up to
        ``total``. ``active`` (worker ids; default all) are the workers
        that take part; every other one gets 0 and its model is kept.
        ``step`` names the step for :meth:`stepped` (None: not timed)."""
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        ids = list(range(self.workers)) if active is None else sorted(active)
        if not ids:
            raise ValueError("no active worker to give the samples to")
        last = self._last
        if last is not None and last[0] == ids and last[2] == total:
            current: Optional[List[int]] = last[1]
            equal = last[3]
        else:
            # another set of workers or total: start over
            current, equal = None, equal_shards(total, len(ids))
            self._restart()
        if total < len(ids) or not all(self.models[i].measured for i in ids):
            sub, arm = equal, None
        else:
            sub, arm = self._decide(total, ids, equal, current if current is not None else equal)
        if step is not None:
            guard = self.guard
            trial = guard.trial.ident if arm is not None and guard is not None \
                and guard.trial is not None else None
            self._planned[step] = (trial, arm or 0, current is not None and sub != current)
            self._planned.pop(step - 64, None)  # a step never timed
        self._last = (ids, sub, total, equal)
        self.state = PROBE if arm is not None or self._measure else \
            HELD if not self._trusted() else EQUAL if sub == equal else BALANCED
        split = [0] * self.workers
        for i, count in zip(ids, sub):
            split[i] = count
        return split

    @property
    def notes(self) -> List[str]:
        """Why the shards left the model's split, newest last (the caller logs them)."""
        return self.guard.notes if self.guard is not None else []

    def _trusted(self) -> bool:
        return self.guard is None or self.guard.trusted

    def _restart(self) -> None:
        if self.guard is not None:
            self.guard.restart()
        self._quiet, self._backoff, self._measure = 0, 1, 0
        self._stay, self._stay_next = 0, STAY_FIRST

    def _decide(self, total: int, ids: List[int], equal: List[int],
                current: List[int]) -> Tuple[List[int], Optional[int]]:
        """The split of the next step, and the arm of the trial it runs for (None: none)."""
        self._stay = max(0, self._stay - 1)
        jumps = sum(m.jumps for m in self.models)
        if jumps != self._jumps:
            # a worker changed speed: one shard size cannot say whether its
            # fixed or its per-sample part did, so every worker is measured
            # at an equal shard too before the model moves the split on
            self._jumps = jumps
            self._quiet, self._backoff = 0, 1
            real = self.guard.jumped(JUMP_STEPS) if self.guard is not None else True
            if real:
                for arrivals in self._arrivals:
                    arrivals.clear()  # how far apart they came in before says nothing now
                self._stay, self._stay_next = 0, STAY_FIRST  # a real change is followed at once
            if real and current != equal and self._trusted():
                self._measure = MEASURE_STEPS
        if self._measure:
            self._measure -= 1
            return equal, None
        if self.guard is not None:
            split, arm = self.guard.next(
                current, equal,
                lambda: self._best(total, ids) if all(self.models[i].ready for i in ids) else None,
                lambda: self._slowest(current, ids))
            if arm is not None:
                return split, arm
            current = split
        if not self._trusted():
            return current, None
        if self._quiet > 0:
            # the model said stay: it is asked again after 1, 2, 4 ... 16
            # steps (a jump asks at once), so a settled step costs the
            # coordinator next to nothing on its way to the next one
            self._quiet -= 1
            return current, None
        sub = self._model_split(total, ids, equal, current)
        if sub == current:
            self._quiet, self._backoff = self._backoff - 1, min(2 * self._backoff, QUIET_MOST)
        else:
            self._quiet, self._backoff = 0, 1
            if current == equal and self.guard is not None:
                self.guard.left_equal()
            elif sub == equal:
                # the model undid its own move off equal shards: the fits
                # that made it were noise (on a shared machine the parts come
                # in apart for a while, one worker then another: dozens of
                # such moves a run, each a few steps at a worse split and a
                # trial)
                self._stay, self._stay_next = self._stay_next, min(2 * self._stay_next, STAY_MOST)
                if self.guard is not None:
                    self.guard.back_to_equal()
        return sub, None

    def room(self, split: Sequence[int], ids: Sequence[int],
             sigmas: float = 2.0) -> Optional[float]:
        """How far apart the workers' parts came in at ``split`` (one count
        per id in ``ids``), each part's time to come in and the rest of the
        exchange after it when it was the last one in, the medians of their
        recent steps at these shards, less ``sigmas`` standard errors of the
        difference (never below 0), a fraction of the median step: what
        the model's fit could save by moving samples, as far as the workers'
        own times show (a CPU quota's stall inside the exchange does not
        show here: the trials see it). A worker never the last one in is
        taken to have the longest rest measured (a faster worker's rest is
        not known, and taking it for less would call the last one's rest
        room). None until each worker has :data:`ROOM_LEAST` steps at its
        shard and one of them has been the last one in."""
        measured = [self._lags[i] for i in ids if self._after[i]]
        if not measured:
            return None
        ends = []  # (median, its standard error) per worker
        for i, count in zip(ids, split):
            times = [t for c, t in self._arrivals[i] if c == count]
            if len(times) < ROOM_LEAST:
                return None
            # its part in, and the rest of the exchange when it is the last
            # one in; a median's standard error is about 1.25 the mean's
            rest = self._lags[i] if self._after[i] else max(measured)
            ends.append((median(times) + rest, 1.25 * spread(times) / math.sqrt(len(times))))
        if len(self._steps) < ROOM_LEAST:
            return None
        first, last = min(ends), max(ends)
        # less standard errors of the difference: workers of one speed
        # come in apart by as much, by chance (and the noise that spread
        # them also misleads the model's fit)
        apart = last[0] - first[0] - sigmas * math.hypot(first[1], last[1])
        return max(0.0, apart) / median(self._steps)

    def _slowest(self, split: Sequence[int], ids: Sequence[int]) -> List[int]:
        """The workers' positions in ``ids``, the one whose part the model
        has coming in last at ``split`` first (one not measured yet last)."""
        def end(k: int) -> float:
            model = self.models[ids[k]]
            return model.predict(split[k]) + self.lag(ids[k]) if model.measured else -1.0
        return sorted(range(len(ids)), key=lambda k: (-end(k), k))

    def predict(self, split: Sequence[int], ids: Sequence[int]) -> float:
        """The step's predicted seconds under ``split`` (one count per id in
        ``ids``): its last worker's compute plus lag."""
        return max(self.models[i].predict(c) + self.lag(i) for c, i in zip(split, ids))

    def _model_split(self, total: int, ids: List[int], equal: List[int],
                     current: List[int]) -> List[int]:
        if not all(self.models[i].ready for i in ids):
            return current
        target = self._best(total, ids)
        best = self.predict(target, ids)
        # two standard errors of the noisiest worker's time: a gain smaller
        # than that is as likely the noise of a few steps as a real one
        error = 2.0 * max(self.models[i].error for i in ids)

        def worth(leaving: List[int]) -> bool:
            step = self.predict(leaving, ids)
            return step - best > max(self.tolerance * step, error)
        if not worth(equal):
            return equal  # not worth leaving equal shards
        if current == equal:
            if self._stay:
                return equal  # it came back here by itself not long ago
            # once the lost trials' budget is spent no trial could check a
            # move off equal shards, and a fit's noise alone must not make
            # one: the parts must be seen coming in apart, past more noise
            spent = self.guard is not None and not self.guard.can_check()
            room = self.room(current, ids, sigmas=SPENT_SIGMAS if spent else 2.0)
            if (room is None and spent) or (room is not None and room <= self.tolerance):
                # the parts come in together: the model's gain is its noise
                # (the fewer sizes it has seen, the more it reads into it)
                return equal
        if not worth(current):
            return current
        provisional = any(self.models[i].provisional for i in ids)
        return self._toward(current, target, total, 0.5 if provisional else 1.0)

    def _best(self, total: int, ids: List[int]) -> List[int]:
        """Whole shards, none below the floor, that minimise the predicted
        step: every shard above the floor ends at one time ``t``,
        ``(t - base_i) / per_sample_i`` samples each (water-filling: a
        worker whose share at ``t`` is under the floor keeps the floor, and
        ``t`` is found again for the others)."""
        n = len(ids)
        floor = floor_shard(total, n)
        base = [self.models[i].fixed + self.lag(i) for i in ids]  # type: ignore[operator]
        slope = [max(self.models[i].per_sample, 1e-12) for i in ids]  # type: ignore[type-var]
        above = list(range(n))
        while True:
            weight = sum(1.0 / slope[k] for k in above)
            left = total - floor * (n - len(above))
            t = (left + sum(base[k] / slope[k] for k in above)) / weight
            keep = [k for k in above if (t - base[k]) / slope[k] > floor]
            if len(keep) == len(above) or not keep:
                break
            above = keep
        ideal = [float(floor)] * n
        if len(keep) == len(above):
            for k in above:
                ideal[k] = (t - base[k]) / slope[k]
        else:
            ideal = [total / n] * n  # (nobody above the floor: the floor is an equal share)
        return largest_remainder(ideal, total)

    @staticmethod
    def _toward(current: List[int], target: List[int], total: int, most: float) -> List[int]:
        """A step from ``current`` toward ``target``: at most ``most`` of
        the way, and no shard more than halved or doubled."""
        alpha = most
        for c, t in zip(current, target):
            if t > 2 * c:
                alpha = min(alpha, c / (t - c))
            elif 2 * t < c:
                alpha = min(alpha, (c / 2) / (c - t))
        ideal = [c + alpha * (t - c) for c, t in zip(current, target)]
        return largest_remainder(ideal, total)


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
    averages what the full set would have). ``planned``: the steps the run
    is planned to take (None: not known; the trials' budget, ddpwire.session.guard).

    Workers are named by their ids throughout; :meth:`drop` takes one out
    of every later plan (it gets no samples), and the lists that follow the
    connections (:meth:`sums_scales`, :meth:`check_totals`,
    :meth:`timings`) are over :attr:`active` only, in id order.
    """

    def __init__(self, timed: Sequence[bool], balance: Union[bool, str], *,
                 weighted: bool = False, tolerance: float = TOLERANCE,
                 names: Optional[Sequence[str]] = None, planned: Optional[int] = None) -> None:
        self.timed = list(timed)
        #: "auto" (shards by speed where they win: the guard), True or False
        self.mode = balance
        self.balance = balance is True or balance == "auto"
        self.weighted = weighted or self.balance
        self.balancer = Balancer(len(self.timed), guard=balance == "auto", tolerance=tolerance,
                                 planned=planned)
        #: each worker's name as a user knows it (its node id and host)
        self.names: List[str] = list(names) if names is not None else [""] * len(self.timed)
        #: the ids of the workers that take part, in id order
        self.active: List[int] = list(range(len(self.timed)))
        self.step: Optional[int] = None
        self.split: List[int] = [0] * len(self.timed)
        self._starts: List[int] = [0] * len(self.timed)
        self._noted = 0  # the balancer's notes already handed out
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

    def add(self, worker: int, timed: bool, name: str = "") -> None:
        """Put ``worker`` (joining between steps) in every later plan, its
        speed still to be measured (it may be another machine than the one
        that had its id)."""
        if worker not in self.active:
            self.active = sorted(self.active + [worker])
        self.timed[worker] = timed
        self.names[worker] = name
        self.balancer.forget(worker)

    def plan(self, step: int, total: int, now: Optional[float] = None) -> List[int]:
        """The shard sizes of ``step``, one per worker id (the timings of
        every earlier step are in; a dropped worker's is 0). ``now``
        (time.perf_counter()) is when they go out, which also ends the
        step before: without it no lag is measured."""
        if now is not None:
            self._ended(step, now)
        if self.balance:
            self.split = self.balancer.shards(total, self.active, step)
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
        if self.balance:
            self.balancer.stepped(self.step, now - self._planned_at)
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
        rates, models = self.balancer.rates, self.balancer.models
        return [WorkerTiming(w, self.split[w], self._compute[w], rates[w], self._arrival[w],
                             models[w].fixed, models[w].per_sample, self.names[w])
                for w in self.active]

    @property
    def state(self) -> str:
        """Where the shards stand: "off" (equal, not balancing), or the
        balancer's "equal", "balanced", "probe" (equal steps the guard
        compares with) or "held" (back to equal: balancing did not win)."""
        return self.balancer.state if self.balance else "off"

    def notes(self) -> List[str]:
        """What the balancer said since the last call (why it went back to
        equal shards): for the caller to log."""
        new = self.balancer.notes[self._noted:]
        self._noted = len(self.balancer.notes)
        return new


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
