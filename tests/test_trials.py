"""Two splits compared by measured step times (ddpwire.session.trials), arithmetic only."""
from __future__ import annotations

import random

import pytest

from ddpwire.session.trials import (
    BLOCK, EARLY_PAIRS, LOST, MIN_PAIRS, TURN_MOST, WIN_PAIRS, WON, Trial,
)


def run(trial: Trial, time):
    """Each step as a caller runs it: the arm planned, its time
    (``time(arm, step)``) fed back, the first step of a turn (a change of
    split) untimed. Returns the arms in order."""
    order, last, step = [], 0, 0  # (the split before the trial is the base)
    while (arm := trial.next_arm()) is not None:
        order.append(arm)
        trial.record(arm, time(arm, step), timed=arm == last)
        last, step = arm, step + 1
    return order


def trial() -> Trial:
    return Trial(1, [("current", [2, 2]), ("nudge 0", [1, 3])], 0.02)


def test_a_faster_challenger_wins_at_the_planned_look():
    t = trial()
    order = run(t, lambda arm, step: [10.0, 9.5][arm] * (1 + 0.01 * (step % 3)))
    assert t.verdict == WON
    # alternating turns, each a change and BLOCK timed steps (the base's
    # first turn keeps the split before it: it is all timed)
    assert order[:BLOCK] == [0] * BLOCK
    assert order[BLOCK:2 * BLOCK + 1] == [1] * (BLOCK + 1)
    assert len(t.turns[1]) == WIN_PAIRS  # short of a clear win: looked for there
    assert t.mean(1) == pytest.approx(9.595, rel=0.01)


def test_a_challenger_faster_by_far_wins_halfway():
    """Three margins and more faster, past the stricter boundary: the win
    is taken at EARLY_PAIRS; a faster challenger short of that runs the
    whole trial."""
    rng = random.Random(5)
    t = trial()
    run(t, lambda arm, step: [10.0, 6.0][arm] * rng.uniform(0.9, 1.1))
    assert t.verdict == WON and len(t.turns[1]) == EARLY_PAIRS
    t = trial()
    run(t, lambda arm, step: [10.0, 9.5][arm] * rng.uniform(0.99, 1.01))
    assert t.verdict == WON and len(t.turns[1]) == WIN_PAIRS
    # (a clear gain, but too noisy to be sure of halfway)
    t = trial()
    run(t, lambda arm, step: [10.0, 8.0][arm] * rng.choice([0.4, 1.6]))
    assert len(t.turns[1]) != EARLY_PAIRS or t.verdict != WON


def test_a_clearly_slower_challenger_loses_at_the_first_look():
    t = trial()
    run(t, lambda arm, step: [10.0, 15.0][arm])
    # its turn's own steps (and the base's) leave no doubt: one turn
    assert t.verdict == LOST and len(t.turns[1]) == 1
    # steps too spread to tell at the first pair: later looks tell
    rng = random.Random(3)
    t = trial()
    run(t, lambda arm, step: [10.0, 15.0][arm] * rng.choice([0.3, 1.7]))
    assert t.verdict == LOST and len(t.turns[1]) >= MIN_PAIRS


def test_a_quotas_bursts_and_stalls_do_not_lose_a_faster_challenger_at_once():
    """Under a quota a step is a burst or a stall; a turn whose steps fall
    on more stalls looks slower, and its own steps' spread says how far to
    trust that: a challenger 15% faster is not lost on its first turn."""
    t = trial()
    for seconds in (3e-3, 15e-3, 3e-3, 15e-3, 3e-3):  # the base: two stalls in five
        assert t.next_arm() == 0
        t.record(0, seconds)
    assert t.next_arm() == 1
    t.record(1, 0.85 * 3e-3, timed=False)
    for seconds in (15e-3, 3e-3, 15e-3, 3e-3, 15e-3):  # the challenger: three
        assert t.next_arm() == 1
        t.record(1, 0.85 * seconds)
    assert t.next_arm() == 0 and t.verdict is None  # looks 11% slower, and is judged later


def test_what_a_challenger_cost_counts_its_untimed_first_steps():
    """A turn's first step carries the change of split: it is no evidence
    of the challenger's speed, but it is paid for, and it shows the cost
    before the turn has a timed step."""
    t = trial()
    for _ in range(BLOCK):
        assert t.next_arm() == 0
        t.record(0, 10.0)
    assert t.next_arm() == 1
    assert t.cost(ahead=1) == 0.0  # nothing of the challenger in yet
    t.record(1, 40.0, timed=False)  # the change of split, and a far challenger
    assert t.means(1) == []  # no evidence
    assert t.cost() == pytest.approx(30.0)
    assert t.cost(ahead=1) == pytest.approx(60.0)
    assert t.next_arm() == 1
    t.record(1, 20.0)
    assert t.means(1) == [20.0]
    assert t.cost() == pytest.approx(20.0 * 2)  # (40 + 20) / 2 - 10 a step, two steps


def test_a_difference_inside_the_noise_never_wins():
    rng = random.Random(4)
    t = trial()
    run(t, lambda arm, step: [10.0, 9.7][arm] * rng.uniform(0.5, 1.5))
    assert t.verdict == LOST
    assert len(t.turns[1]) <= WIN_PAIRS


def test_identical_splits_win_rarely():
    """The noise alone: one trial in fifty at most (the balancer moves
    nudges of a shrinking size, and the other way wins back)."""
    rng = random.Random(7)
    wins = 0
    for _ in range(4000):  # (about 1.8% over many seeds: 72 expected, sd 8.5)
        t = trial()
        run(t, lambda arm, step: 10.0 * rng.uniform(0.85, 1.15))
        wins += t.verdict == WON
    assert wins <= 100, wins


def test_quota_bursts_and_stalls_sum_steady_over_a_turn():
    """A step is 3 ms or 15 ms as a quota's period falls, their mean
    steady over a turn: a 15% faster challenger is seen."""
    t = trial()
    run(t, lambda arm, step: [1.0, 0.85][arm] * (3e-3 if step % 2 else 15e-3))
    assert t.verdict == WON


def test_an_outlier_in_the_base_does_not_make_a_win():
    t = trial()
    run(t, lambda arm, step: 80.0 if (arm, step) == (0, 14) else 10.0 - 0.01 * (step % 2))
    assert t.verdict == LOST


def test_a_caller_that_times_nothing_runs_no_challenger():
    t = trial()
    order = []
    while (arm := t.next_arm()) is not None:
        order.append(arm)
    assert order == [0] * TURN_MOST
    assert t.verdict == LOST


def test_a_trial_takes_two_splits_and_a_margin():
    with pytest.raises(ValueError, match="two splits"):
        Trial(1, [("current", [2, 2])], 0.02)
    with pytest.raises(ValueError, match="margin"):
        Trial(1, [("current", [2, 2]), ("equal", [2, 2])], 1.5)


def _reference() -> Trial:
    return Trial(1, [("current", [3, 1]), ("equal", [2, 2])], 0.05, reference=True)


@pytest.mark.parametrize("seed", range(5))
def test_equal_shards_take_over_where_the_split_is_not_shown_faster(seed):
    """Against the reference (equal shards) the burden of proof is the
    other way round: arms of one speed, noisy, give equal shards back;
    the same trial with any other challenger keeps the base."""
    rng = random.Random(seed)
    noisy = lambda arm, step: 10.0 * rng.uniform(0.85, 1.15)  # noqa: E731
    t = _reference()
    run(t, noisy)
    assert t.verdict == WON
    t = Trial(1, [("current", [3, 1]), ("floor 1", [3, 1])], 0.05)
    run(t, noisy)
    assert t.verdict == LOST


def test_a_split_shown_faster_than_equal_shards_keeps_its_place():
    """The base (a held worker at the floor, say) faster by far: the
    reference challenger loses, halfway; faster than the margin but by
    less, at the planned look; by less than the margin, equal shards win."""
    rng = random.Random(3)
    t = _reference()
    run(t, lambda arm, step: [6.0, 10.0][arm] * rng.uniform(0.9, 1.1))
    assert t.verdict == LOST and t.clear and len(t.turns[1]) == EARLY_PAIRS
    t = _reference()
    run(t, lambda arm, step: [9.0, 10.0][arm] * rng.uniform(0.99, 1.01))
    assert t.verdict == LOST and len(t.turns[1]) == WIN_PAIRS
    t = _reference()
    run(t, lambda arm, step: [9.8, 10.0][arm] * rng.uniform(0.99, 1.01))
    assert t.verdict == WON and len(t.turns[1]) < WIN_PAIRS
