"""One allreduce step (send gradients, receive the average) over loopback:
ddpwire against torch.distributed's gloo backend, with the raw loopback TCP
rate of the machine, all in the same run. "ddpwire" is the pipelined path
(Coordinator.allreduce, Worker.allreduce) in one poll loop per process,
"ddpwire-threads" the same with socket threads (socket_threads=True on the
coordinator and the workers), "ddpwire-classic" the two-call one (collect_and_reduce +
broadcast_averaged, send_gradients + receive_averaged). Any other row of
allreduce_procs.DDPWIRE_KINDS can be named in DDPWIRE_BENCH_KINDS too:
"ddpwire-star", "ddpwire-mesh" (topology forced), "ddpwire-bf16" and
"ddpwire-fp16" (the mesh with 16-bit gradients, checked bit for bit against
numpy and with their error in extra_info).

    python -m pytest bench/test_bench_allreduce.py --benchmark-json=bench/allreduce.json
    python bench/plot_allreduce.py bench/allreduce.json

DDPWIRE_BENCH_SIZES="1,16" (MiB) restricts the sweep for a quick run,
DDPWIRE_BENCH_WORKERS="2" the worker counts, DDPWIRE_BENCH_KINDS="ddpwire,gloo"
the kinds and DDPWIRE_BENCH_ROUNDS=20 the rounds at every size. With DDPWIRE_BASELINE set to another built checkout, the kind
"ddpwire-baseline" runs the default path from there, in the same run:

    DDPWIRE_BASELINE=/path/to/old/checkout python -m pytest bench/test_bench_allreduce.py ...
Each round is one step of all workers at once; its time runs from the
parent's "step" command to the last worker holding the average. The
workers' own monotonic stamps (first start to last end) are kept in
extra_info as ``step_spans``.
"""
from __future__ import annotations

import os
import statistics

import pytest

import allreduce_procs as procs

MiB = procs.MiB
KINDS = ("ddpwire", "ddpwire-threads", "ddpwire-classic", "gloo")


def _ints(name: str, default: str, least: int):
    raw = os.environ.get(name, default)
    try:
        values = [int(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        raise pytest.UsageError(f"{name} must be numbers like '1,16', got {raw!r}")
    if not values or min(values) < least:
        raise pytest.UsageError(f"{name} must name values of at least {least}, got {raw!r}")
    return values


def _sizes_mib():
    return _ints("DDPWIRE_BENCH_SIZES", "1,16,64,256", 1)


def _kinds():
    kinds = [k.strip() for k in os.environ.get("DDPWIRE_BENCH_KINDS", ",".join(KINDS)).split(",")
             if k.strip()]
    if os.environ.get(procs.BASELINE_ENV) and "ddpwire-baseline" not in kinds:
        kinds.insert(1, "ddpwire-baseline")
    return kinds


WORKER_COUNTS = _ints("DDPWIRE_BENCH_WORKERS", "2,3,4", 1)


def _rounds(size_mib: int) -> int:
    if os.environ.get("DDPWIRE_BENCH_ROUNDS"):
        return _ints("DDPWIRE_BENCH_ROUNDS", "", 1)[0]
    # the big sizes take seconds a step on two shared cores: fewer rounds keep the sweep short
    if size_mib <= 4:
        return 20
    if size_mib <= 16:
        return 10
    if size_mib <= 64:
        return 5
    return 3


WARMUP = 1
SIZES_MIB = _sizes_mib()

# size-major, so each size's figures are taken close together in time
CASES = []
for _mib in SIZES_MIB:
    CASES.append(pytest.param("tcp", 1, _mib, id=f"{_mib}MiB-tcp"))
    for _n in WORKER_COUNTS:
        # ddpwire-classic: the two-call path, as a baseline for the pipelined one;
        # ddpwire-threads: the pipelined one with socket threads
        for _kind in _kinds():
            CASES.append(pytest.param(_kind, _n, _mib, id=f"{_mib}MiB-N{_n}-{_kind}"))


@pytest.mark.parametrize("kind,n,size_mib", CASES)
def test_allreduce_step(benchmark, kind, n, size_mib):
    size = size_mib * MiB
    rounds = _rounds(size_mib)
    benchmark.group = f"{size_mib} MiB"
    group = procs.ProcessGroup(kind, n, size, steps=WARMUP + rounds)
    summary = procs.run_rounds(benchmark, group, rounds, WARMUP)
    spans = procs.step_spans(group.step_stamps[WARMUP:])
    info = benchmark.extra_info
    info.update(kind=kind, workers=n, size_bytes=size, rounds=rounds, warmup=WARMUP,
                step_spans=spans, step_span_median=statistics.median(spans),
                worker_peak_rss=[w["peak_rss"] for w in summary["workers"]])
    if kind == "tcp":
        info["bytes_per_round"] = size
    else:
        # every worker (and the coordinator) must have computed the right average
        assert all(w["average_ok"] for w in summary["workers"]), summary["workers"]
        info["payload_bytes_per_step"] = n * size
        if kind in procs.DDPWIRE_KINDS and procs.ddpwire_kind(kind).compression:
            info["max_abs_error"] = max(w["max_abs_error"] for w in summary["workers"])
            info["relative_error"] = max(w["relative_error"] for w in summary["workers"])
    coord = summary["coordinator"]
    if coord is not None:
        # None: this coordinator did not hold the average (the mesh reduce)
        assert coord["average_ok"] is not False, "the coordinator's average is wrong"
        timed = coord["times"][WARMUP:]
        info.update(coordinator_peak_rss=coord["peak_rss"],
                    coordinator_step_times=[(e - s) / 1e9 for s, _, e in timed],
                    # Coordinator.allreduce: waiting for every head, then the pipelined
                    # pass (receive, average and send back at once)
                    # None where the result reports no wait (the mesh reduce)
                    coordinator_head_wait_times=[None if c is None else (c - s) / 1e9
                                                 for s, c, _ in timed],
                    coordinator_pass_times=[None if c is None else (e - c) / 1e9
                                            for _, c, e in timed],
                    coordinator_bytes_per_step=2 * n * size)
