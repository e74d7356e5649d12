"""bench/report_balance.py: where a balanced step's time goes, read back
from a benchmark JSON built here (the phases, the split by who arrived last)."""
from __future__ import annotations

import json
import os
import sys

import pytest

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
if not os.path.isfile(os.path.join(_BENCH, "report_balance.py")):
    # the sdist ships tests/ but not bench/
    pytest.skip("bench/ is not in this tree", allow_module_level=True)
sys.path.insert(0, _BENCH)
try:
    import report_balance
finally:
    sys.path.remove(_BENCH)

PHASES = ["shard_wait_s", "compute_s", "allreduce_s", "apply_s", "called_at", "averaged_at",
          "allreduce_cpu_s"]


def _pair(steps: int) -> dict:
    """Worker 0 at 100%, worker 1 at 25%; step k starts at k seconds. The
    slow one arrives last on even steps (the average 9 ms after it), the
    fast one on odd steps (2 ms after it)."""
    fast, slow = [], []
    for k in range(steps):
        t = float(k)
        slow_last = k % 2 == 0
        fast_call, slow_call = (t + 0.040, t + 0.041) if slow_last else (t + 0.041, t + 0.040)
        tail = 0.009 if slow_last else 0.002
        done = max(fast_call, slow_call) + tail
        fast.append([0.0001, 0.040, done - fast_call, 0.0005, fast_call, done, 0.0015])
        slow.append([0.0001, 0.040, done - slow_call, 0.0005, slow_call, done, 0.0016])
    return {"name": "test_together[pair-on]", "extra_info": {
        "kind": "together", "cfs_period_us": 10000, "samples_per_s": 40000.0, "ratio": 0.85,
        "worker_speeds": {"0": 1.0, "1": 0.25}, "step_times_s": [0.05] * steps,
        "shards": [[1700, 348]] * steps, "worker_phases": PHASES,
        "worker_phases_s": {"0": fast, "1": slow}}}


def test_the_report_splits_the_wait_by_who_arrived_last(tmp_path):
    rounds = {"name": "test_rounds[pair]", "extra_info": {
        "kind": "rounds", "cfs_period_us": 10000, "ratio_median": 0.81, "ratio_min": 0.7,
        "ratio_max": 0.9, "rounds": [{"solo_samples_per_s": [40000.0, 9000.0],
                                      "samples_per_s": 39690.0, "ratio": 0.81,
                                      "step_time_median_s": 0.05,
                                      "solo_after_samples_per_s": [36000.0, 9000.0],
                                      "ratio_bracketed": 39690.0 / 47000.0}],
        "ratio_bracketed_median": 39690.0 / 47000.0}}
    path = tmp_path / "balance.json"
    path.write_text(json.dumps({"commit_info": {"id": "0123456789", "dirty": False},
                                "benchmarks": [_pair(25), rounds]}))
    text = report_balance.report(str(path))
    assert text.startswith(f"{path}: commit 0123456")
    assert "test_together[pair-on]: period 10000 us, 40000 samples/s, ratio 0.850" in text
    # 20 steps after the 5 of warm-up: 10 with the slow worker last, 10 with the fast
    assert "slowest arrived last: median 9.0 ms, p10 9.0, p90 9.0 (n=10)" in text
    assert "another arrived last: median 2.0 ms, p10 2.0, p90 2.0 (n=10)" in text
    # the calls 1 ms apart: the last comes 0.5 ms after their mean; no jitter
    assert "last call after the mean call: median 0.5 ms, p10 0.5, p90 0.5 (n=20); " \
           "compute sd, ms: 100% 0.0, 25% 0.0" in text
    assert "worker 1 at 25%: shard 348, ms: shard wait 0.1, compute 40.0" in text
    assert "allreduce cpu 1.6" in text
    assert "ratio median 0.810 (min 0.700, max 0.900)" in text
    assert "round 0: solos 40000 + 9000 samples/s, together 39690, ratio 0.810" in text
    assert "against the solos before and after: median 0.844" in text
    assert "; solos after 36000 + 9000, ratio 0.844" in text


def test_traced_calls_line_up_against_the_last_arrival_the_coordinator_s_too(tmp_path):
    bench = _pair(25)
    info = bench["extra_info"]
    phases = info["worker_phases_s"]
    traces = {"0": [], "1": []}
    coordinator = []
    for k in range(25):
        last = max(phases[w][k][4] for w in ("0", "1"))
        for w in ("0", "1"):
            call = phases[w][k][4]
            # each worker's StepReport leaves 1 ms after the last arrival
            traces[w].append(["send a frame", last + 0.001, last + 0.0011, 0.0001])
            assert call <= last + 0.001
        # the coordinator waits from before any arrival to 1.5 ms after the
        # last, and its go-ahead takes 0.2 ms from there
        coordinator.append(["coordinator: every StepReport", last - 0.030, last + 0.0015, 0.0003])
        coordinator.append(["coordinator: StepCommit to all", last + 0.0016, last + 0.0018, 0.0002])
    info["worker_traces"] = traces
    info["coordinator_trace"] = coordinator
    path = tmp_path / "balance.json"
    path.write_text(json.dumps({"commit_info": {"id": "0123456789", "dirty": False},
                                "benchmarks": [bench]}))
    text = report_balance.report(str(path))
    assert "worker 1 at 25%, send a frame: 1.0, 1.1; 0.1 (per step: 1)" in text
    # matched by their ends: the wait began before the step's first arrival
    assert "the coordinator, coordinator: every StepReport: -30.0, 1.5; 0.3 (per step: 1)" in text
    assert "the coordinator, coordinator: StepCommit to all: 1.6, 1.8; 0.2 (per step: 1)" in text


def test_the_tracer_s_targets_are_ddpwire_s_methods_today():
    # bench/balance_trace.py wraps methods by name: one that moved would
    # end every traced worker at its start
    sys.path.insert(0, _BENCH)
    try:
        import balance_trace
    finally:
        sys.path.remove(_BENCH)
    for traced in (balance_trace.TRACED, balance_trace.COORDINATOR_TRACED):
        found = balance_trace.targets(traced)
        assert [name for _, _, name in found] == [name for _, _, name in traced]
        for owner, method, _ in found:
            assert callable(getattr(owner, method)), (owner, method)
    # traced_here puts every method back
    before = [getattr(o, m) for o, m, _ in balance_trace.targets(balance_trace.COORDINATOR_TRACED)]
    with balance_trace.traced_here() as events:
        assert events == []
        assert [getattr(o, m) for o, m, _ in balance_trace.targets(
            balance_trace.COORDINATOR_TRACED)] != before
    assert [getattr(o, m) for o, m, _ in balance_trace.targets(
        balance_trace.COORDINATOR_TRACED)] == before


def test_rounds_beside_a_baseline_and_through_ddp(tmp_path):
    """test_rounds and test_ddp_rounds with DDPWIRE_BASELINE: each round's
    baseline run, which came first, and the ratio of the two; a DDP round
    has no step times of its own."""
    rounds = [{"solo_samples_per_s": [40000.0, 9000.0], "samples_per_s": 44100.0,
               "ratio": 0.9, "baseline_samples_per_s": 39200.0, "baseline_ratio": 0.8,
               "vs_baseline": 1.125, "baseline_first": r % 2 == 1} for r in range(2)]
    bench = {"name": "test_ddp_rounds[pair]", "extra_info": {
        "kind": "rounds", "ddp": True, "cfs_period_us": 10000, "ratio_median": 0.9,
        "ratio_min": 0.9, "ratio_max": 0.9, "rounds": rounds, "baseline_commit": "a97ce3a",
        "baseline_ratios": [0.8, 0.8], "vs_baseline": [1.125, 1.125], "vs_baseline_median": 1.125}}
    path = tmp_path / "balance.json"
    path.write_text(json.dumps({"commit_info": {"id": "0123456789", "dirty": True},
                                "benchmarks": [bench]}))
    text = report_balance.report(str(path))
    assert "; baseline a97ce3a: ratios 0.800, 0.800, this / baseline median 1.125" in text
    assert ("round 0: solos 40000 + 9000 samples/s, together 44100, ratio 0.900; "
            "baseline (second) 39200, ratio 0.800, this / baseline 1.125") in text
    assert "round 1: solos 40000 + 9000 samples/s, together 44100, ratio 0.900; " \
           "baseline (first)" in text


def test_the_slow_uplink_cases(tmp_path):
    """bench/cluster/test_bench_balance_link.py: no CFS period; each case's
    step, shards, and its throughput against the fast worker alone."""
    bench = {"name": "test_slow_uplink[baseline]", "extra_info": {
        "kind": "link", "case": "baseline", "topology": "star", "samples_per_s": 29166.0,
        "step_time_median_s": 0.069, "mean_shards": [1015.2, 1032.8], "vs_alone": 0.846,
        "balanced_vs_baseline": 1.019, "baseline_commit": "a97ce3a"}}
    path = tmp_path / "link.json"
    path.write_text(json.dumps({"commit_info": {"id": "0123456789"}, "benchmarks": [bench]}))
    assert ("test_slow_uplink[baseline]: 29166 samples/s, baseline, topology star: median "
            "step 69.0 ms, mean shards 1015 / 1033, 0.846 of worker 0 alone; this checkout's "
            "balanced / baseline a97ce3a: 1.019") in report_balance.report(str(path))
