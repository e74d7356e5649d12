"""Two shard splits compared by their measured step times: the guard's evidence.

Arithmetic only (no I/O). A model of each worker's step predicts well
where the time a worker costs a step falls where it is measured; a CPU
quota that stalls a worker inside the exchange, after its part came in,
is charged to the last one in, and the model then points the wrong way.
So :class:`ddpwire.session.balance.Balancer` (``--balance auto``) tries another
split now and then and keeps it where the clock says it is faster.

A :class:`Trial` runs the current split (the base) and a challenger in
turns, :data:`BLOCK` timed steps a turn (each turn's first step, a change
of split, carries the change's cost and is not timed), and looks at the
times after each pair of turns:

- a turn's mean is one sample. Step times are not independent draws
  (under a CPU quota a burst is followed by a stall, and the sum over a few
  quota periods is steady where one step is not): means of consecutive
  steps (batch means) are, nearly. Each challenger turn is set against the
  mean of the base turns before and after it, so a drift of the machine's
  speed, linear over a few turns, cancels, which arms run one after the
  other would read as a difference;
- the challenger wins when, after :data:`WIN_PAIRS` pairs, those
  differences show it faster by ``margin`` (a fraction of the base's step)
  and by more than :data:`SIGMAS` standard errors of their mean. A win is
  looked for twice, at sample sizes fixed in advance (looked for after
  every pair, the noise would find one at one of them): halfway, after
  :data:`EARLY_PAIRS` pairs, only a clear one, :data:`EARLY_MARGIN` times
  the margin and past O'Brien and Fleming's boundary (``SIGMAS *
  sqrt(WIN_PAIRS / EARLY_PAIRS)`` standard errors), so a split that wins
  by far (a held worker at the floor) runs half a trial, not a whole one;
  a difference too small to see by the end is not worth a move. An
  outlier (a collection) widens its side's spread, and so makes a win
  harder, never easier;
- it loses as soon as it cannot win, from :data:`MIN_PAIRS` pairs on (even
  the noise's benefit of the doubt would not bring it to the margin): a
  split far off the best costs a few turns, not a trial. After the first
  pair, whose one difference has no spread, the noise is the spread of
  the two turns' steps: a challenger that clearly cannot win loses there
  (a floor's far split costs one turn, not two), while steps that come
  as a quota's bursts and stalls spread too wide for a verdict that soon.

The burden of proof is on the split that is not the reference (equal
shards, what a coordinator that does not balance runs), whichever arm it
is: against a ``reference`` challenger the rules above run the other way
round, and equal shards take over unless the base is shown faster than
them by the margin. Identical workers whose noise once let a split win
(at 64 samples the MLP's step is nearly all fixed part: a floor costs
about what equal shards do) go back to equal shards at their next trial
of them, where a win that bar would keep the split for good.

A caller whose step times come some steps late gets up to :data:`TURN_MOST`
steps for a turn's times to come in; a caller that times nothing runs no
challenger at all.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

from .step_model import spread

__all__ = ["BLOCK", "EARLY_MARGIN", "EARLY_PAIRS", "LOST", "MIN_PAIRS", "SIGMAS", "TURN_MOST",
           "Trial", "WIN_PAIRS", "WON"]

#: timed steps a turn
BLOCK = 5
#: the most steps a turn runs waiting for its times to come in
TURN_MOST = 4 * (BLOCK + 1)
#: pairs of turns before a loss can be seen, and the pairs a win is judged on
MIN_PAIRS = 2
WIN_PAIRS = 8
#: the pairs after which a clear win is looked for, and how many margins it must clear
EARLY_PAIRS = 4
EARLY_MARGIN = 3.0
#: standard errors of the difference a win must clear
SIGMAS = 3.0

#: a trial's verdicts (Trial.verdict)
WON, LOST = "won", "lost"


class Trial:
    """The base split (``arms[0]``) against a challenger (``arms[1]``), each
    given as (kind, split), in alternating turns; :attr:`verdict` is None
    while it runs, then :data:`WON` (the challenger is faster) or
    :data:`LOST`."""

    def __init__(self, ident: int, arms: Sequence[Tuple[str, List[int]]],
                 margin: float, reference: bool = False) -> None:
        if len(arms) != 2:
            raise ValueError(f"a trial compares two splits, got {len(arms)}")
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {margin!r}")
        self.ident = ident
        self.arms: List[Tuple[str, List[int]]] = [(k, list(s)) for k, s in arms]
        self.margin = margin
        #: the challenger is the reference split (equal shards): it takes
        #: over unless the base is shown faster than it by the margin
        self.reference = reference
        #: each arm's turns: the step times of each
        self.turns: List[List[List[float]]] = [[[]], []]
        self.at = 0          # the arm whose turn it is
        self._steps = 0      # steps planned in this turn
        #: steps planned for each arm, timed or not
        self.steps = [0, 0]
        #: the challenger's steps as they came in, its turns' untimed first
        #: steps too: what it cost (they are no evidence of its speed)
        self._paid: List[float] = []
        self.verdict: Optional[str] = None
        #: the verdict was clear (taken halfway, the split that had to show
        #: itself faster shown so by far): noise or a moment of the machine
        #: is not what made it
        self.clear = False

    def next_arm(self) -> Optional[int]:
        """The arm the next step runs, or None once there is a verdict."""
        if self.verdict is not None:
            return None
        turn = self.turns[self.at][-1]
        if len(turn) >= BLOCK or self._steps >= TURN_MOST:
            if not turn:
                # nothing came in: a caller that times no step (or too late to use)
                self.verdict = LOST
                return None
            if self.at == 1:
                self._judge()
                if self.verdict is not None:
                    return None
            self.at = 1 - self.at
            self.turns[self.at].append([])
            self._steps = 0
        self._steps += 1
        self.steps[self.at] += 1
        return self.at

    def on_base_for(self, steps: int) -> bool:
        """Whether the last ``steps`` steps all ran the base, in this turn."""
        return self.at == 0 and self._steps >= steps

    def stop(self) -> None:
        """End the trial as lost where it stands (the guard's budget is
        spent): the challenger is not shown faster."""
        if self.verdict is None:
            self.verdict = LOST

    def record(self, arm: int, seconds: float, timed: bool = True) -> None:
        """A step of ``arm``'s turn under way took ``seconds`` end to end;
        ``timed`` False: it carried a change of split, which it pays for
        (:meth:`cost`) but is no evidence of the arm's speed."""
        if arm != self.at or self.verdict is not None:
            return
        if arm == 1:
            self._paid.append(seconds)
        if timed:
            self.turns[arm][-1].append(seconds)

    def means(self, arm: int) -> List[float]:
        """``arm``'s turns' mean step times (the turns that have any)."""
        return [sum(t) / len(t) for t in self.turns[arm] if t]

    def mean(self, arm: int) -> float:
        """``arm``'s step time: the mean of its turns' means."""
        means = self.means(arm)
        return sum(means) / len(means)

    def cost(self, ahead: int = 0) -> float:
        """Seconds the challenger's steps cost beyond the base's: its steps
        (the untimed first of each turn too), and ``ahead`` more, times how
        much slower a step of it was than the base's mean (0 when it was
        not slower, or either arm has no time). The untimed first steps
        count: a far challenger shows its cost on its first step, before
        its turn has a timed one."""
        if not self.means(0) or not self._paid:
            return 0.0
        excess = sum(self._paid) / len(self._paid) - self.mean(0)
        return max(0.0, excess) * (self.steps[1] + ahead)

    def _judge(self) -> None:
        base, other = self.means(0), self.means(1)
        pairs = len(other)
        if pairs == 1 and len(base) == 1:
            self._judge_first()
            return
        if pairs < MIN_PAIRS or len(base) < pairs:
            return
        # each challenger turn against the base turns on either side of it
        # (the last has only the one before): a drift of the machine's
        # speed, linear over a few turns, cancels
        gains = [(base[k] + base[k + 1]) / 2 - other[k] if k + 1 < len(base) else
                 base[k] - other[k] for k in range(pairs)]
        gain = sum(gains) / pairs
        noise = SIGMAS * spread(gains) / math.sqrt(pairs)
        needed = self.margin * sum(base) / len(base)
        # the split that must show itself faster (the challenger, or the
        # base against the reference), its gain, and the verdict if it does
        shown, won = (-gain, LOST) if self.reference else (gain, WON)
        lost = WON if self.reference else LOST
        if pairs >= WIN_PAIRS:
            # the last look for a win, at a sample size fixed in advance (a
            # win looked for at every pair would be found by noise at one of them)
            self.verdict = won if shown > max(needed, noise) else lost
        elif pairs == EARLY_PAIRS and \
                shown > max(EARLY_MARGIN * needed, noise * math.sqrt(WIN_PAIRS / EARLY_PAIRS)):
            self.verdict, self.clear = won, True  # a clear win, halfway
        elif shown + noise < needed:
            self.verdict = lost

    def _judge_first(self) -> None:
        """After the first pair: decided where, past :data:`SIGMAS`
        standard errors of the two turns' own steps, the split that must
        show itself faster cannot."""
        turns = (self.turns[0][0], self.turns[1][0])
        if any(len(t) < 3 for t in turns):
            return
        base, other = (sum(t) / len(t) for t in turns)
        noise = SIGMAS * math.hypot(*(spread(t) / math.sqrt(len(t)) for t in turns))
        shown = other - base if self.reference else base - other
        if shown + noise < self.margin * base:
            self.verdict = WON if self.reference else LOST
