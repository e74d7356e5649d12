"""Splits compared by measured step times (ddpwire.trials), arithmetic only."""
from __future__ import annotations

import pytest

from ddpwire.trials import ARM_MOST, ARM_STEPS, Trial, beats


def test_a_win_must_beat_the_noise_and_the_margin():
    base = [10.0, 10.2, 9.8, 10.1]
    assert beats(base, [9.0, 9.1, 8.9, 9.0], 0.02)
    assert not beats(base, [9.9, 10.0, 9.9, 10.0], 0.02)  # under the margin
    assert not beats([10.0, 14.0, 6.0, 12.0], [9.0, 13.0, 5.0, 11.0], 0.02)  # in the noise
    assert not beats(base, [], 0.02) and not beats([], base, 0.02)


def test_one_long_step_is_dropped_a_stall_that_comes_back_is_not():
    base = [10.0, 10.0, 10.0, 10.0]
    assert beats(base, [9.0, 9.0, 9.0, 40.0], 0.02)  # one outlier
    assert not beats(base, [9.0, 15.0, 9.0, 15.0], 0.02)  # every other step


def run(trial: Trial, times):
    """Each step: the arm it ran and its time (``times[arm]``), the way a
    caller times steps (the first at a new split left out)."""
    order, last = [], None
    while (arm := trial.next_arm()) is not None:
        order.append(arm)
        if arm == last:
            trial.record(arm, times[arm])
        last = arm
    return order


def test_each_arm_runs_until_its_times_are_in_then_the_next():
    trial = Trial(1, [("current", [2, 2]), ("nudge", [1, 3]), ("nudge", [3, 1])])
    order = run(trial, [10.0, 12.0, 8.0])
    # the first arm keeps the split before it: every step of it is timed
    assert order == [0] * ARM_STEPS + [1] * ARM_STEPS + [2] * ARM_STEPS
    assert trial.winner(0.02) == 2


def test_a_caller_that_times_nothing_runs_no_other_arm():
    trial = Trial(1, [("current", [2, 2]), ("equal", [3, 1])])
    order = []
    while (arm := trial.next_arm()) is not None:
        order.append(arm)
    assert order == [0] * ARM_MOST
    assert trial.winner(0.02) is None


def test_nothing_wins_where_nothing_is_faster():
    trial = Trial(1, [("current", [2, 2]), ("nudge", [1, 3])])
    run(trial, [10.0, 10.1])
    assert trial.winner(0.02) is None


def test_a_trial_needs_two_splits():
    with pytest.raises(ValueError, match="at least two splits"):
        Trial(1, [("current", [2, 2])])
