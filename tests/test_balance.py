"""The shard sizes by measured speed (ddpwire.balance), arithmetic only."""
from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpwire.balance import Balancer, equal_shards, sample_scale, shard_starts


def run(balancer: Balancer, speeds, total: int, steps: int, noise: float = 0.0, seed: int = 0):
    """Shards of each step when worker i computes ``speeds[i]`` samples/s."""
    rng = random.Random(seed)
    history = []
    for _ in range(steps):
        split = balancer.shards(total)
        history.append(split)
        for w, (count, speed) in enumerate(zip(split, speeds)):
            balancer.observe(w, count, count / speed * (1.0 + rng.uniform(-noise, noise)))
    return history


def test_equal_until_every_worker_is_timed_past_its_warm_up():
    b = Balancer(3)
    assert b.shards(100) == equal_shards(100, 3) == [33, 33, 34]
    for w in range(3):
        b.observe(w, 33, 0.1 * (w + 1))  # warm-ups: left out
    assert b.rates == [None, None, None]
    b.observe(0, 33, 0.1)
    b.observe(1, 33, 0.1)
    assert b.shards(100) == [33, 33, 34]  # worker 2 not timed yet
    b.observe(2, 33, 0.1)
    assert b.rates == [330.0, 330.0, 330.0]


@given(total=st.integers(0, 100_000), speeds=st.lists(st.floats(0.01, 1e4), min_size=1, max_size=8))
@settings(max_examples=200, deadline=None)
def test_shards_add_up_and_keep_every_worker_measured(total, speeds):
    b = Balancer(len(speeds))
    for split in run(b, speeds, total, 3):
        assert sum(split) == total
        assert all(c >= 0 for c in split)
        if total >= len(speeds):
            assert min(split) >= 1


def test_settles_in_proportion_to_speed_within_a_few_steps():
    speeds = [4000.0, 1000.0]
    history = run(Balancer(2), speeds, 2048, 12, noise=0.05)
    for split in history[2:]:
        assert abs(split[0] - 2048 * 0.8) <= 2048 * 0.03, history
    # and it stays put: noise of 5% moves nothing once settled
    assert len({tuple(s) for s in history[4:]}) <= 2, history


def test_three_workers_at_100_50_25_percent():
    history = run(Balancer(3), [1000.0, 500.0, 250.0], 2100, 8)
    assert history[-1] == [1200, 600, 300]


def test_follows_a_machine_that_slows_down_within_five_steps():
    b = Balancer(2)
    run(b, [1000.0, 1000.0], 1000, 6)
    assert b.shards(1000) == [500, 500]
    history = run(b, [1000.0, 250.0], 1000, 5)
    # the slow one's ideal is 200; within 5 steps within 10% of it
    assert abs(history[-1][1] - 200) <= 20, history
    assert history[-1][1] < history[1][1] < history[0][1], history


def test_no_flapping_by_a_sample_or_two():
    b = Balancer(2, tolerance=0.03)
    run(b, [1000.0, 1000.0], 1001, 3)
    first = b.shards(1001)
    b.observe(0, first[0], first[0] / 1005.0)
    b.observe(1, first[1], first[1] / 995.0)
    assert b.shards(1001) == first


def test_a_zero_shard_or_a_zero_time_says_nothing():
    b = Balancer(2)
    b.observe(0, 5, 1.0)
    b.observe(1, 5, 1.0)  # the warm-ups
    b.observe(0, 0, 1.0)
    b.observe(1, 10, 0.0)
    assert b.rates == [None, None]
    with pytest.raises(ValueError, match="worker 2"):
        b.observe(2, 1, 1.0)


def test_fewer_samples_than_workers():
    b = Balancer(4)
    run(b, [10.0, 1.0, 1.0, 1.0], 3, 3)
    assert sum(b.shards(3)) == 3


def test_sample_scale():
    assert sample_scale(512, 1024, 2) == 1.0
    assert sample_scale(0, 1024, 2) == 0.0
    assert sample_scale(7, 0, 3) == 1.0
    assert sample_scale(800, 1000, 2) == np.float32(1.6)
    assert shard_starts([3, 0, 5]) == [0, 3, 3]


def test_the_scaled_plain_mean_is_the_sample_weighted_mean():
    rng = np.random.default_rng(1)
    counts = [1200, 600, 300]
    grads = [rng.standard_normal(1000).astype(np.float32) for _ in counts]
    scaled = [g * np.float32(sample_scale(c, sum(counts), 3)) for g, c in zip(grads, counts)]
    plain = (scaled[0] + scaled[1] + scaled[2]) / np.float32(3)
    exact = sum(c * g.astype(np.float64) for c, g in zip(counts, grads)) / sum(counts)
    np.testing.assert_allclose(plain, exact, rtol=1e-5, atol=1e-6)


def test_the_count_check_names_the_worker_out_of_proportion():
    from ddpwire.balance import Shards

    shards = Shards([True] * 3, True)
    shards.plan(0, 300)
    assert shards.check_totals([100, 100, 100]) is None  # equal shards: nothing to check
    for _ in range(2):  # a warm-up, then a measurement
        for w, c in enumerate([200, 60, 40]):
            shards.balancer.observe(w, 100, 100 / c)
    shards.plan(1, 300)
    assert shards.split == [200, 60, 40]
    assert shards.check_totals([200, 60, 40]) is None
    assert shards.check_totals([1600, 480, 320]) is None  # 8 tokens a sample
    assert shards.check_totals([1600, 481, 320]) == (1, 480, 481)
    assert shards.check_totals([1601, 480, 320]) == (0, 1600, 1601)  # the odd one out, not worker 1
    assert shards.scale(0) == np.float32(2.0) and shards.scale(2) == np.float32(0.4)


def test_bursty_noise_is_smoothed_not_followed():
    """A CPU quota whose period is longer than a step makes a worker's
    times swing threefold from step to step: its shards must not swing too."""
    b = Balancer(2)
    history = []
    for step in range(40):
        split = b.shards(1000)
        history.append(split[1])
        b.observe(0, split[0], split[0] / 4000.0)
        burst = 3.0 if step % 2 else 1.0  # alternately 1x and 3x its mean time
        b.observe(1, split[1], split[1] / 1000.0 * burst / 2.0)
    late = history[10:]
    assert max(late) - min(late) <= 0.2 * sum(late) / len(late), history


def test_a_fixed_cost_does_not_drain_the_smaller_shard():
    """Two equal machines whose step is mostly a fixed cost (0.6 ms, plus
    3 us a sample) and noisy: the proportional rule alone would take the
    samples of whichever looked slower step after step."""
    import random
    rng = random.Random(3)
    b = Balancer(2)
    history = []
    for _ in range(60):
        split = b.shards(256)
        history.append(split[1])
        for w in range(2):
            b.observe(w, split[w], (0.6e-3 + 3e-6 * split[w]) * rng.uniform(0.93, 1.07))
    assert min(history) >= 100, history


def test_steps_of_a_few_milliseconds_keep_the_reference_split():
    """Below MIN_COMPUTE a step is all latency: the equal split (and with
    it the reference's bits) stays, however the times jitter."""
    from ddpwire.balance import MIN_COMPUTE
    b = Balancer(2)
    for step in range(20):
        split = b.shards(256)
        assert split == [128, 128]
        b.observe(0, 128, MIN_COMPUTE * 0.2)
        b.observe(1, 128, MIN_COMPUTE * (0.3 if step % 3 else 0.9))


def run_lagged(balancer: Balancer, speeds, lags, tails, total: int, steps: int):
    """As :func:`run`, each worker also ``lags[i]`` seconds outside its
    compute before its part comes in, and the step going on ``tails[i]``
    after the last one's part."""
    history = []
    for _ in range(steps):
        split = balancer.shards(total)
        history.append(split)
        arrivals = []
        for w, (count, speed) in enumerate(zip(split, speeds)):
            balancer.observe(w, count, count / speed, lags[w])
            arrivals.append((count / speed + lags[w], w))
        balancer.ended(max(arrivals)[1], tails[max(arrivals)[1]])
    return history


def test_a_lag_outside_the_compute_is_net_of_the_shards():
    """Two machines of one speed, one with 40 ms of its step outside its
    compute (an optimizer step on a slow CPU, a slow link): the shards make
    compute plus lag end alike, c = r * (t - lag), not compute alone."""
    history = run_lagged(Balancer(2), [1000.0, 1000.0], [0.0, 0.040], [0.0, 0.0], 1000, 8)
    # t = (1000 + 1000 * 0.04) / 2000 = 0.52 s: 520 and 480 samples
    assert history[-1] == [520, 480], history
    assert history[0] == [500, 500]


def test_the_rest_of_the_exchange_is_counted_for_the_last_worker():
    """A 4x slower worker whose part of the exchange, when it comes in
    last, keeps the step 20 ms longer than the fast one's (2 ms): its share
    shrinks until it is no longer the one waited for."""
    b = Balancer(2)
    history = run_lagged(b, [4000.0, 1000.0], [0.0, 0.0], [0.002, 0.020], 2000, 12)
    assert b.after[1] == pytest.approx(0.020) and b.after[0] == pytest.approx(0.002)
    # proportional alone: 1600 / 400 (0.4 s each), then 0.42 s with its rest;
    # net of it: 4000 * (t - 0.002) + 1000 * (t - 0.020) = 2000, t = 0.4056
    # (384 first, with only the slow one's rest measured; the 2 samples
    # the fast one's rest then moves are under the tolerance)
    assert abs(history[-1][1] - 386) <= 2 and history[-1][1] < 400, history
    assert b._time(history[-1], [0, 1]) < b._time([1600, 400], [0, 1])


def test_a_lag_of_the_unmeasured_counts_as_nothing():
    b = Balancer(2)
    run(b, [1000.0, 1000.0], 1000, 3)
    assert b.before == [None, None] and b.lag(0) == 0.0
    assert b.shards(1000) == [500, 500]
    b.ended(0, 0.5)
    assert b.after[0] == 0.5 and b.lag(0) == 0.5
    b.forget(0)
    assert b.before[0] is None and b.after[0] is None


def test_a_lag_longer_than_the_step_keeps_one_sample():
    b = Balancer(3)
    history = run_lagged(b, [1000.0, 1000.0, 1000.0], [0.0, 0.0, 1.0], [0.0] * 3, 300, 6)
    assert history[-1] == [150, 149, 1], history


def test_shards_measure_each_arrival_and_the_last_ones_rest():
    """Shards on the coordinator's clock: an arrival is counted from when
    the shards went out, the rest of the step from the last arrival to the
    next plan; a step redone (the same number) measures no rest."""
    from ddpwire.balance import Shards

    shards = Shards([True, True], True)
    now = 100.0
    for step in range(3):
        shards.plan(step, 1000, now)
        shards.observe(0, step, 200_000, now + 0.201)
        shards.arrived(1, now + 0.230)  # its socket turned readable then:
        shards.observe(1, step, 200_000, now + 0.300)  # its StepTiming read later
        now += 0.250
    timing = shards.timings()
    assert [t.arrival for t in timing] == pytest.approx([0.201, 0.230])
    shards.plan(3, 1000, now)  # step 2 ended 20 ms after worker 1's part came in
    b = shards.balancer
    assert b.after == [None, pytest.approx(0.020)]
    assert b.before == [pytest.approx(0.001), pytest.approx(0.030)]
    assert shards.split[0] > shards.split[1]
    after = b.after[1]
    shards.plan(3, 1000, now + 5.0)  # step 3 redone: no rest measured
    assert b.after[1] == after
    assert shards.observe(0, 2, 1, now) == "StepTiming for step 2 during step 3"
    shards.plan(4, 1000)  # no clock: an untimed worker's arrival measures nothing
    assert shards.observe(0, 4, None, None) is None and shards.timings()[0].compute is None


def test_in_a_mesh_the_rest_is_the_last_ones_until_its_report():
    """A mesh step goes on after its last part came in while every worker
    averages its slice: only the last one's time to its StepReport is its
    own (the others' is the same whoever came last)."""
    from ddpwire.balance import Shards

    shards = Shards([True, True], True)
    for step in range(3):
        now = 10.0 * step
        shards.plan(step, 1000, now)
        shards.observe(0, step, 100_000, now + 0.100)
        shards.observe(1, step, 100_000, now + 0.110)
        shards.reported(1, step, now + 0.112)
        shards.reported(0, step, now + 0.125)  # a slow slice of its own
        shards.reported(0, step + 1, now + 0.5)  # another step's: ignored
    shards.plan(3, 1000, 30.0)
    assert shards.balancer.after == [None, pytest.approx(0.002)]
