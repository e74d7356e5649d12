"""One averaging step over an emulated cluster: ddpwire's star and mesh against gloo's ring.

Every machine is a network namespace whose link to a common bridge is
shaped with tc tbf in both directions (see cluster/plan.py and
cluster/shaping.py); the coordinator has a namespace of its own and each
worker (and gloo rank) one of its own. Needs root and iproute2; skips
otherwise. Not part of the default test run (testpaths = tests):

    python -m pytest bench/cluster/test_bench_cluster.py \\
        --benchmark-json=bench/results/cluster-1g.json
    DDPWIRE_CLUSTER_COORD_RATE=10gbit DDPWIRE_CLUSTER_SIZES=16 \\
        python -m pytest bench/cluster/test_bench_cluster.py \\
        --benchmark-json=bench/results/cluster-10g-coord.json
    python bench/cluster/report.py bench/results/cluster-1g.json bench/results/cluster-10g-coord.json
    python bench/cluster/plot.py bench/results/cluster.png bench/results/cluster-1g.json bench/results/cluster-10g-coord.json

Parameters (environment): DDPWIRE_CLUSTER_SIZES (MiB, default "16,64"),
DDPWIRE_CLUSTER_WORKERS ("2,4"), DDPWIRE_CLUSTER_COORD_RATE and
DDPWIRE_CLUSTER_WORKER_RATE (tc rates, default "1gbit"),
DDPWIRE_CLUSTER_ROUNDS (timed steps per case, default 3, after one warm-up),
DDPWIRE_CLUSTER_TCP (the TCP congestion control every machine starts its
sockets with, gloo's included; default: the host's, which is recorded; a
namespace may only pick one the host lists in
net.ipv4.tcp_allowed_congestion_control, so add it there first) and
DDPWIRE_CLUSTER_KINDS (default "ddpwire-star,ddpwire-mesh,ddpwire-bf16,gloo";
every kind is a row of bench/allreduce_procs.py's DDPWIRE_KINDS: "ddpwire"
is the library's default reduce (topology "auto"), "ddpwire-star" and
"ddpwire-mesh" force one, "ddpwire-bf16" and "ddpwire-fp16" are the mesh
with 16-bit gradients, "ddpwire-classic", "ddpwire-threads" and
"ddpwire-auto" the call-path and socket-thread variants).

The compressed kinds are checked bit for bit against the result computed
in numpy (allreduce_procs.expected_compressed_average), and record their
error against the float32 average in extra_info.

Per size, a raw TCP transfer from worker 0's namespace to the
coordinator's ("tcp") checks that the shaping gives the rate asked for.
The time of a step is from the first worker's start to the last worker
holding the average (the workers' CLOCK_MONOTONIC stamps), as in
bench/test_bench_allreduce.py, whose process bodies run here unchanged.
"""
from __future__ import annotations

import importlib.util
import statistics

import pytest

from . import net, report, shaping
from .conftest import PARAMS
from .nodes import ClusterGroup, procs

MiB = 1 << 20
WARMUP = 1

CASES = []
for _mib in PARAMS.sizes_mib:
    CASES.append(pytest.param("tcp", 1, _mib, id=f"{_mib}MiB-tcp"))
    for _n in PARAMS.workers:
        for _kind in PARAMS.kinds:
            CASES.append(pytest.param(_kind, _n, _mib, id=f"{_mib}MiB-N{_n}-{_kind}"))


@pytest.mark.parametrize("kind,n,size_mib", CASES)
def test_cluster_step(benchmark, cluster_plan, kind, n, size_mib):
    if kind == "gloo" and importlib.util.find_spec("torch") is None:
        pytest.skip("gloo needs torch")
    size = size_mib * MiB
    rounds = PARAMS.rounds
    benchmark.group = f"{size_mib} MiB"
    group = ClusterGroup(kind, n, size, WARMUP + rounds, cluster_plan)
    summary = procs.run_rounds(benchmark, group, rounds, WARMUP)
    spans = group_spans(group)
    median = statistics.median(spans)
    coord_rate, worker_rate = PARAMS.coord_rate, PARAMS.worker_rate
    info = benchmark.extra_info
    info.update(kind=kind, workers=n, size_bytes=size, rounds=rounds, warmup=WARMUP,
                step_spans=spans, step_span_median=median,
                # how far apart the workers got the average: a star or mesh
                # whose flows share a link unevenly ends late for one of them
                end_spreads=[(max(e for _, e in st) - min(e for _, e in st)) / 1e9
                             for st in group.step_stamps[WARMUP:]],
                coord_rate_bps=coord_rate, worker_rate_bps=worker_rate,
                tbf_burst_coord=shaping.burst_bytes(coord_rate),
                tbf_burst_worker=shaping.burst_bytes(worker_rate),
                tbf_latency_ms=shaping.LATENCY_MS,
                tcp_congestion=net.congestion_in(cluster_plan.workers[0].netns))
    if kind == "tcp":
        # worker 0's link out, then the coordinator's link in
        info["path_rate_bps"] = min(coord_rate, worker_rate)
        info["goodput_bps"] = size * 8 / median
        info["shaping_accuracy"] = info["goodput_bps"] / info["path_rate_bps"]
        return
    assert all(w["average_ok"] for w in summary["workers"]), summary["workers"]
    # each worker's CPU seconds per timed step, all its threads
    info["step_cpu_s"] = [w.get("step_cpu_s", [])[WARMUP:] for w in summary["workers"]]
    if kind.startswith("ddpwire"):
        # sealed only where a token is set and encryption left on
        assert all(w.get("sealed", False) == kind.endswith("-sealed")
                   for w in summary["workers"]), summary["workers"]
    if kind != "gloo":
        spec = procs.ddpwire_kind(kind)
        # the one the coordinator chose ("auto" picks the mesh when it can)
        info.update(topology=summary["coordinator"]["topology"], compression=spec.compression,
                    coordinator_share=summary["coordinator"].get("coordinator_share", 0.0))
    info.update(report.link_figures(report.topology(info), report.bytes_per_element(info),
                                    n, size, median, coord_rate, worker_rate,
                                    info.get("coordinator_share", 0.0)))
    if kind != "gloo":
        if spec.compression:
            # every worker holds the same bits (checked above), so the same error
            info["max_abs_error"] = max(w["max_abs_error"] for w in summary["workers"])
            info["relative_error"] = max(w["relative_error"] for w in summary["workers"])
    coord = summary["coordinator"]
    if coord is not None:
        if kind != "gloo" and procs.ddpwire_kind(kind).topology == "star":
            # the star's average is computed there: not writing it is a failure too
            assert coord["average_ok"] is not None, "the star's coordinator holds no average"
        # None: the coordinator did not hold the average (the mesh), nothing to check
        assert coord["average_ok"] is not False, "the coordinator's average is wrong"
        info["coordinator_step_times"] = [(e - s) / 1e9 for s, _, e in coord["times"][WARMUP:]]


def group_spans(group: ClusterGroup):
    """Seconds from the first worker's start to the last one's end, timed steps only."""
    return procs.step_spans(group.step_stamps[WARMUP:])
