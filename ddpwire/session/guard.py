"""The guard of shards by speed (``--balance auto``): when a trial runs,
which split it tries, and what its verdict changes. Arithmetic only (no
I/O); :class:`ddpwire.session.balance.Balancer` asks it once a step.

The model of each worker's step (ddpwire.session.step_model) is trusted only as
far as the clock bears it out:

- now and then (after :data:`GUARD_FIRST` steps, then twice as long each
  time nothing wins, at most :data:`GUARD_LAST`; within GUARD_FIRST steps
  of the model leaving equal shards, and then against equal shards
  whatever the turn: a move the fit made on noise costs every step until
  a trial undoes it) a :class:`ddpwire.session.trials.Trial` runs
  the current split against one challenger and keeps the challenger where
  its measured steps are faster past their noise by :data:`GUARD_WIN`;
- the challengers take turns: equal shards, the split the last trial kept,
  the model's own (once it lost: it comes back by winning), each worker
  at the floor (under a CPU quota the step is a staircase in the held
  worker's shard, flat until its part fits in the quota's burst: small
  moves from equal show nothing there; the worker the model has coming
  in last first: at the floor it is the soonest to win, and costs the
  least where it loses), and the current split nudged each
  way (ddpwire.session.splits.nudged, :data:`NUDGE` of
  the smaller of the shards samples move between). A way that wins is
  tried again at once, twice as bold (at most :data:`NUDGE_MOST`); when it
  then loses, the other way is tried by half (past the best, likely); a
  way that loses is tried half as bold (at least :data:`NUDGE_LEAST`). A
  challenger other than a nudge that lost sits out the next 1, 2, 4 ... 64
  trials: a split far off the best costs every step it runs. A split
  other than equal shards that wins is tried again at once, and kept only
  if it wins that trial too: a move that noise or a shared machine's
  moment let win once costs every step after it (a clear win, taken
  halfway through its trial, is kept at once: ddpwire.session.trials),
  and each win sets the trials' pace back to every :data:`GUARD_FIRST`
  steps; going back to equal shards (the reference's split) takes one
  trial, which equal shards win unless the split they challenge is shown
  faster than them by GUARD_WIN (the burden of proof is on every split
  but equal shards: ddpwire.session.trials);
- the trials that lost may cost at most :data:`TRIAL_BUDGET` of the time
  run (each lost trial's challenger steps, times how much slower they
  were), or of :data:`GUARD_LAST` steps while the run is shorter (a run's
  first trials find the most: a far challenger that loses first must not
  hold back the rest for hundreds of steps), or of the planned run where
  that is shorter still (the coordinator's ``--steps``: a run of 400 steps
  cannot pay for 640's trials). A trial starts only within that budget,
  and one under way stops, lost, before the challenger's step whose
  excess would take the budget past it. The budget is overdrawn by at
  most the excess of a challenger's first step: it carries the change of
  split and is no evidence of the challenger's speed, but it is paid for,
  and its time is in before the next step is planned. Where nothing wins,
  the trials cost a bounded share of the run, however long or short it
  is. Once the budget is spent the model moves nothing off equal shards
  on its fit alone (:meth:`Guard.can_check`: no trial could check the
  move), only where the parts are seen coming in apart
  (ddpwire.session.balance). Nothing a worker reports says when a
  trial could win: a worker under a CPU quota whose compute fits in the
  quota's burst (its other threads' time spends the rest) computes as fast
  as the others and comes in with them, and stalls
  inside the exchange (measured, 4096 samples, a quarter core: both
  workers' computes 1.5 ms, their parts in at 2.0 ms, the step 8.8 ms);
  only the step's time shows it;
- when the model's split loses, the model moves nothing more until a split
  of its own wins a trial, and :attr:`Guard.notes` says why once. The split
  then follows the trials alone: a CPU quota that stalls a worker after
  its part came in misleads the model (the stall is charged to whoever
  came in last), and makes the step a staircase in the shard (one stall a
  step until the held worker's part fits in its quota's burst) that no
  fitted line draws; trials do not care where a stall falls.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .splits import at_floor, nudged
from .trials import WON, Trial

__all__ = ["GUARD_FIRST", "GUARD_LAST", "GUARD_WIN", "NUDGE", "NUDGE_LEAST", "NUDGE_MOST",
           "TRIAL_BUDGET", "Guard"]

#: steps before the first trial (and after a split won one), and the most between two
GUARD_FIRST = 20
GUARD_LAST = 640
#: by how much (a fraction of the current split's step) another split must win a
#: trial: a split a little faster on a machine whose workers share cores with
#: the coordinator is contention, not a machine's speed
GUARD_WIN = 0.05
#: the most of the time run that lost trials may cost (Guard.budget)
TRIAL_BUDGET = 0.02
#: a way's first nudge, a fraction of the smaller of the shards samples move
#: between; halved after that way lost a trial, doubled after it won one,
#: within these bounds
NUDGE = 0.5
NUDGE_LEAST = 0.02
NUDGE_MOST = 0.5
#: the most trials a losing challenger sits out
BENCH_MOST = 64


class Guard:
    """Trials of other splits, and the trust they leave in the model."""

    def __init__(self, planned: Optional[int] = None) -> None:
        if planned is not None and planned < 0:
            raise ValueError(f"planned must be >= 0 steps, got {planned}")
        #: the steps the run is planned to take (None or 0: not known)
        self.planned = planned or None
        #: why the shards left the model's split, newest last (the caller logs them)
        self.notes: List[str] = []
        #: trials started (each one's id)
        self.trials = 0
        self._fallbacks = 0
        self._turn = 0         # whose turn it is among the challengers
        self.run = 0.0         #: seconds of every step recorded
        self.spent = 0.0       #: seconds lost trials cost (their challengers' excess)
        self._recorded = 0     # steps recorded
        self.restart()

    def restart(self) -> None:
        """Another set of workers or total: nothing measured holds."""
        #: the trial under way
        self.trial: Optional[Trial] = None
        #: whether the model moves the split (False: it lost a trial)
        self.trusted = True
        self._kept: Optional[List[int]] = None  # the split the last trial kept
        # split -> (trials it sits out yet, how many its next loss benches it for)
        self._bench: Dict[Tuple[int, ...], Tuple[int, int]] = {}
        self._nudge: Dict[int, float] = {}  # each way's nudge, by its giver
        self._push: Optional[str] = None    # the nudge that won last: tried first again
        self._pushed_back = False           # the push is the way back, after one too far
        self._since = 0                     # steps since the last trial ended
        self._again: Optional[List[Tuple[str, List[int]]]] = None  # a win to confirm
        self._confirming = False            # the trial under way is a confirmation
        self._moved = False                 # the model left equal shards: equal is next
        self._since_before = 0              # _since before that brought the trial forward
        self._interval = GUARD_FIRST

    def jumped(self, settle: int) -> bool:
        """A worker's model saw its speed jump (``settle``: the steps a jump
        takes to show). True when that is a change of the machine to
        measure again, False when it is a trial's doing: a model rescaled
        to a challenger's times sees the base's as a jump back, for
        ``settle`` steps or so."""
        if self.trial is not None and self.trial.on_base_for(2 * settle):
            self.trial = None  # seen at the current split alone, past that: a real change
        if self.trial is None and (self._since > 2 * settle or not self.trials):
            self._bench = {}  # what lost before the change may win now
            return True
        return False

    def left_equal(self) -> None:
        """The model moved the split off equal shards: a trial within
        :data:`GUARD_FIRST` steps (the trials' pace kept), against equal
        shards whatever the turn (benched or not): a move the fit made on
        noise costs every step until a trial undoes it, and only equal
        shards undo it in one."""
        if not self._moved:
            self._since_before = self._since
        self._since = max(self._since, self._interval - GUARD_FIRST)
        self._moved = True

    def back_to_equal(self) -> None:
        """The model came back to equal shards by itself before the trial
        of its move started: that trial is off (a trial brought forward for
        a move that is gone would try some other split instead, and a
        model that moves on noise brought dozens a run forward)."""
        if self._moved and self.trial is None:
            self._since = min(self._since, self._since_before)
            self._moved = False

    def _step(self) -> float:
        """The mean step so far (0 before any)."""
        return self.run / self._recorded if self._recorded else 0.0

    def budget(self) -> float:
        """Seconds the lost trials may have cost by now (module docstring):
        :data:`TRIAL_BUDGET` of the time run, or of :data:`GUARD_LAST`
        steps (or the planned run's, where fewer) at the mean step while
        the run is shorter."""
        least = GUARD_LAST if self.planned is None else min(GUARD_LAST, self.planned)
        return TRIAL_BUDGET * max(self.run, least * self._step())

    def can_check(self) -> bool:
        """Whether a trial may start within the budget: what a move of the
        model's off equal shards on its fit alone needs (a trial checks it
        within :data:`GUARD_FIRST` steps)."""
        return self.spent <= self.budget()

    def record(self, trial: Optional[int], arm: int, seconds: float,
               changed: bool = False) -> None:
        """A step of ``trial``'s ``arm`` (as :meth:`next` planned it; None:
        no trial's) took ``seconds`` end to end; ``changed``: its split
        was not the step before's, so it carries the change's cost and is
        no trial's evidence."""
        self.run += seconds
        self._recorded += 1
        if self.trial is not None and trial == self.trial.ident:
            self.trial.record(arm, seconds, timed=not changed)

    def next(self, current: List[int], equal: List[int],
             model: Callable[[], Optional[List[int]]],
             slowest: Optional[Callable[[], Sequence[int]]] = None,
             ) -> Tuple[List[int], Optional[int]]:
        """The next step's split and the arm of the trial it runs for; or,
        with no arm (None), the split the step keeps (a verdict may have
        changed it). ``model``: the model's best split (None: not known);
        ``slowest``: the workers (positions in ``current``), the one whose
        part comes in last first (None: in their order)."""
        if self.trial is None and self._again is not None:
            # a win, tried again at once before it is kept
            self.trials += 1
            self.trial = Trial(self.trials, self._again, GUARD_WIN)
            self._again, self._confirming = None, True
        if self.trial is None:
            self._since += 1
            if self._since <= self._interval or not self.can_check():
                return current, None
            arms = self._arms(current, equal, model)
            if len(arms) < 2:
                return current, None
            # one challenger a trial, in turn: every split at once would cost
            # as much as it could find
            kinds = dict(arms[1:])
            if self._moved and "equal" in kinds:
                pick = "equal"
            elif self._push in kinds:
                pick = self._push
            else:
                # the kinds in a fixed order, whichever are here: a rotation
                # over the arms here would pass over some kinds for good
                # while others sit out
                # (the floors by rank: the turn of the k-th slowest, whoever that is now)
                ranks = list(slowest()) if slowest is not None else range(len(current))
                order = ["equal", "kept", "model"] + [f"floor {w}" for w in ranks] + [
                    f"nudge {w}" for w in range(len(current))]
                at = next(k for k in range(len(order))
                          if order[(self._turn + k) % len(order)] in kinds)
                pick = order[(self._turn + at) % len(order)]
                self._turn += at + 1
            challenger = (pick, kinds[pick])
            self._moved = False
            self.trials += 1
            self.trial = Trial(self.trials, [arms[0], challenger], GUARD_WIN,
                               reference=challenger[1] == list(equal))
        elif self.trial.at == 1 and self.spent + self.trial.cost(ahead=1) > self.budget():
            self.trial.stop()  # its next step would overdraw the budget: lost where it stands
        arm = self.trial.next_arm()
        if arm is not None:
            return self.trial.arms[arm][1], arm
        return self._verdict(self.trial, equal), None

    def _arms(self, current: List[int], equal: List[int],
              model: Callable[[], Optional[List[int]]]) -> List[Tuple[str, List[int]]]:
        arms: List[Tuple[str, List[int]]] = [("current", current)]

        def add(kind: str, split: Optional[List[int]]) -> None:
            if split is not None and all(split != s for _, s in arms) and \
                    (kind.startswith("nudge") or (kind == "equal" and self._moved)
                     or self._bench.get(tuple(split), (0, 1))[0] <= 0):
                arms.append((kind, split))
        add("equal", equal)
        add("kept", self._kept)
        if not self.trusted:
            add("model", model())
        for worker in range(len(current)):
            add(f"floor {worker}", at_floor(current, worker))
        for giver in range(len(current)):
            add(f"nudge {giver}", nudged(current, giver, self._nudge.get(giver, NUDGE)))
        return arms

    def _verdict(self, trial: Trial, equal: Sequence[int]) -> List[int]:
        self.trial, self._since = None, 0
        base = trial.arms[0][1]
        kind, split = trial.arms[1]
        for key, (left, length) in list(self._bench.items()):
            self._bench[key] = (left - 1, length)
        giver = int(kind.split()[1]) if kind.startswith("nudge") else None
        confirmed, self._confirming = self._confirming, False
        if trial.verdict == WON and split != list(equal) and not confirmed and not trial.clear:
            self._again = [trial.arms[0], trial.arms[1]]  # tried again before it is kept
            return base
        if trial.verdict != WON:
            self.spent += trial.cost()
            if giver is None:
                length = self._bench.get(tuple(split), (0, 1))[1]
                self._bench[tuple(split)] = (length, min(2 * length, BENCH_MOST))
            else:
                self._nudge[giver] = max(self._nudge.get(giver, NUDGE) / 2, NUDGE_LEAST)
            if self._push is not None and giver is not None and not self._pushed_back \
                    and len(base) == 2:
                # past the best that way, likely: back the other way, by half
                self._push = f"nudge {1 - giver}"
                self._nudge[1 - giver] = self._nudge[giver]
                self._pushed_back = True
            elif self._push is not None:
                self._push = None  # that way is spent: the others' turns again
            # the split stands: trials come ever less often
            self._interval = min(2 * self._interval, GUARD_LAST)
            self._kept = base
            return base
        if kind == "model":
            self.trusted = True
        elif self.trusted:
            # the model's split lost to one it did not choose: the model
            # moves nothing until a split of its own wins a trial
            self.trusted = False
            self._fallbacks += 1
            if self._fallbacks == 1:
                mine = "equal shards" if base == list(equal) else "shards by speed"
                theirs = "equal shards" if split == list(equal) else f"shards {split}"
                self.notes.append(
                    f"balancing is not winning: a step took {1000 * trial.mean(0):.2f} ms with "
                    f"{mine} against {1000 * trial.mean(1):.2f} ms with {theirs} (means); "
                    f"the shards follow measured step times from here")
        if giver is not None:
            # a way that wins: bolder, and tried again at once
            self._nudge[giver] = min(2 * self._nudge.get(giver, NUDGE), NUDGE_MOST)
            self._push, self._pushed_back = kind, False
            self._since = GUARD_FIRST
        else:
            self._push = None
        self._interval = GUARD_FIRST
        self._kept = split
        return split
