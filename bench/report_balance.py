"""Where a balanced step's time goes, from bench/test_bench_balance.py's JSON.

For every session the benchmark ran: its throughput and ratio (where it
has one), the median step, and per worker (by its share of a core) the
median shard and the medians of each phase its own report times (waiting
for the shard, computing, inside the allreduce, applying the average);
for sessions of more than one worker, how long after the last worker
called its allreduce the last one got the average back, split by whether
the slowest worker or another was the last to arrive, and how long after
the mean of the workers' calls the last one came (what their jitter costs
a step, however well the shards are sized), with each worker's standard
deviation of its compute. For test_rounds,
every round's solos, together throughput and ratio. A run with
DDPWIRE_BALANCE_TRACE=1 adds each traced call's (bench/balance_trace.py)
median start and end against the step's last arrival, the coordinator's
among them.

    python bench/report_balance.py bench/results/bench-balance.json

Phases and arrival times come from the workers' clocks (time.perf_counter:
one clock for all the processes of one host); the first WARMUP steps of a
session are left out, as in the benchmark.
"""
from __future__ import annotations

import json
import statistics
import sys
from typing import Dict, List, Tuple

WARMUP = 5


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def _spread(values: List[float]) -> str:
    if not values:
        return "none"
    values = sorted(values)
    return (f"median {_ms(statistics.median(values))} ms, p10 {_ms(values[len(values) // 10])}, "
            f"p90 {_ms(values[9 * len(values) // 10])} (n={len(values)})")


def session_lines(info: dict) -> List[str]:
    lines = []
    names: List[str] = info.get("worker_phases", [])
    phases: Dict[str, list] = info.get("worker_phases_s", {})
    speeds: Dict[str, float] = info.get("worker_speeds", {})
    steps = info.get("step_times_s", [])[WARMUP:]
    if steps:
        lines.append(f"  median step {_ms(statistics.median(steps))} ms")
    for wid in sorted(phases, key=lambda w: -speeds[w]):
        rows = phases[wid][WARMUP:]
        shards = [s[int(wid)] for s in info["shards"][WARMUP:]]
        parts = ", ".join(f"{name[:-2].replace('_', ' ')} {_ms(statistics.median(r[i] for r in rows))}"
                          for i, name in enumerate(names) if not name.endswith("_at"))
        lines.append(f"  worker {wid} at {int(speeds[wid] * 100)}%: shard "
                     f"{statistics.median(shards):.0f}, ms: {parts}")
    if len(phases) > 1 and "called_at" in names:
        called, done = names.index("called_at"), names.index("averaged_at")
        order = sorted(phases, key=lambda w: -speeds[w])
        steps = min(len(phases[w]) for w in order)
        # each step's last arrival, and whether the slowest worker made it
        arrivals = [max(phases[w][k][called] for w in order) for k in range(steps)]
        slow_last = [max(order, key=lambda w: phases[w][k][called]) == order[-1]
                     for k in range(steps)]
        tails: Dict[bool, List[float]] = {True: [], False: []}
        for k in range(WARMUP, steps):
            tails[slow_last[k]].append(max(phases[w][k][done] for w in order) - arrivals[k])
        lines.append(f"  last arrival to last average, slowest arrived last: {_spread(tails[True])}")
        lines.append(f"  last arrival to last average, another arrived last: {_spread(tails[False])}")
        # what noise costs a balanced step: it waits for the last call, not
        # the average one, and each worker's compute jitters step to step
        late = [max(phases[w][k][called] for w in order) -
                statistics.mean(phases[w][k][called] for w in order) for k in range(WARMUP, steps)]
        compute = names.index("compute_s")
        jitter = ", ".join(
            f"{int(speeds[w] * 100)}% "
            f"{_ms(statistics.pstdev(r[compute] for r in phases[w][WARMUP:]))}" for w in order)
        lines.append(f"  last call after the mean call: {_spread(late)}; compute sd, ms: {jitter}")
        if info.get("worker_traces"):
            lines.extend(trace_lines(info, order, called, arrivals, slow_last))
    return lines


def trace_lines(info: dict, order: List[str], called: int, arrivals: List[float],
                slow_last: List[bool]) -> List[str]:
    """Each traced call's median start and end (ms after the step's last
    arrival, ``arrivals``) and thread CPU, per worker, over the steps the
    slowest worker arrived last and over the others (``slow_last``)."""
    phases, traces, speeds = info["worker_phases_s"], info["worker_traces"], info["worker_speeds"]
    steps = len(arrivals)
    # a worker's call goes with the step of its last allreduce called before
    # the call started; the coordinator's (timed in the benchmark's process)
    # with the step whose last arrival came before the call ended (its wait
    # for the reports starts before any worker of the step has called)
    sources = [(f"worker {w} at {int(speeds[w] * 100)}%", traces[w],
                [phases[w][k][called] for k in range(steps)], 1) for w in order]
    if info.get("coordinator_trace"):
        sources.append(("the coordinator", info["coordinator_trace"], arrivals, 2))
    lines = []
    for case, want in (("slowest arrived last", True), ("another arrived last", False)):
        lines.append(f"  traced calls, {case} (ms from the last arrival: start, end; thread CPU):")
        cases = max(1, sum(1 for k in range(WARMUP, steps) if slow_last[k] == want))
        for who, events, calls, at in sources:
            per: Dict[str, List[Tuple[float, float, float]]] = {}
            for event in events:
                name, start, end, cpu = event
                k = max((j for j in range(steps) if calls[j] <= event[at]), default=None)
                if k is None or k < WARMUP or slow_last[k] != want:
                    continue
                per.setdefault(name, []).append((start - arrivals[k], end - arrivals[k], cpu))
            for name, rows in sorted(per.items(), key=lambda kv: statistics.median(
                    r[0] for r in kv[1])):
                lines.append(f"    {who}, {name}: "
                             f"{_ms(statistics.median(r[0] for r in rows))}, "
                             f"{_ms(statistics.median(r[1] for r in rows))}; "
                             f"{_ms(statistics.median(r[2] for r in rows))} "
                             f"(per step: {len(rows) / cases:.0f})")
    return lines


def report(path: str) -> str:
    data = json.load(open(path))
    commit = data.get("commit_info", {})
    out = [f"{path}: commit {commit.get('id', '?')[:7]}{' (dirty)' if commit.get('dirty') else ''}"]
    for bench in data["benchmarks"]:
        info = bench["extra_info"]
        head = f"{bench['name']}: " + ", ".join(
            ([f"period {info['cfs_period_us']} us"] if "cfs_period_us" in info else []) +
            ([f"{info['samples_per_s']:.0f} samples/s"] if "samples_per_s" in info else []))
        if info.get("ratio") is not None:
            head += f", ratio {info['ratio']:.3f}"
        if info.get("kind") == "link":
            head += (f", {info['case']}" + (f", topology {info['topology']}" if "topology" in info
                                            else "") +
                     f": median step {_ms(info['step_time_median_s'])} ms, mean shards " +
                     " / ".join(f"{x:.0f}" for x in info["mean_shards"]) +
                     ("" if info.get("vs_alone") is None else
                      f", {info['vs_alone']:.3f} of worker 0 alone") +
                     ("" if info.get("balanced_vs_baseline") is None else
                      f"; this checkout's balanced / baseline {info['baseline_commit']}: "
                      f"{info['balanced_vs_baseline']:.3f}"))
        if info.get("kind") == "rounds":
            head += (f", ratio median {info['ratio_median']:.3f} "
                     f"(min {info['ratio_min']:.3f}, max {info['ratio_max']:.3f})")
            if "ratio_bracketed_median" in info:
                head += (f", against the solos before and after: median "
                         f"{info['ratio_bracketed_median']:.3f}")
            if "vs_baseline_median" in info:
                head += (f"; baseline {info['baseline_commit']}: ratios " +
                         ", ".join(f"{x:.3f}" for x in info["baseline_ratios"]) +
                         f", this / baseline median {info['vs_baseline_median']:.3f}")
        out.append(head)
        for r, rnd in enumerate(info.get("rounds", [])):
            out.append(f"  round {r}: solos " +
                       " + ".join(f"{x:.0f}" for x in rnd["solo_samples_per_s"]) +
                       f" samples/s, together {rnd['samples_per_s']:.0f}, "
                       f"ratio {rnd['ratio']:.3f}" +
                       ("" if "step_time_median_s" not in rnd else
                        f", median step {_ms(rnd['step_time_median_s'])} ms") +
                       ("" if "ratio_bracketed" not in rnd else
                        "; solos after " + " + ".join(f"{x:.0f}" for x in rnd["solo_after_samples_per_s"]) +
                        f", ratio {rnd['ratio_bracketed']:.3f}") +
                       ("" if "vs_baseline" not in rnd else
                        f"; baseline ({'first' if rnd['baseline_first'] else 'second'}) "
                        f"{rnd['baseline_samples_per_s']:.0f}, ratio {rnd['baseline_ratio']:.3f},"
                        f" this / baseline {rnd['vs_baseline']:.3f}"))
        out.extend(session_lines(info))
    return "\n".join(out)


if __name__ == "__main__":
    print("\n\n".join(report(p) for p in sys.argv[1:]))
