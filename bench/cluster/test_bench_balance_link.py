"""Shards net of a slow uplink (issue 22): two machines of one speed, one
of them sending through an uplink slower than the other's (a laptop on
Wi-Fi beside a wired box). DDPWIRE_LINK_TOPOLOGY (default mesh) is the
coordinator's ``--topology``: on the star each worker's gradient crosses
its own uplink to the coordinator after its compute; on the mesh the slow
worker's slices cross it in the reduce-scatter and again in the allgather.

Each emulated machine is a network namespace with a hostname of its own
(bench/cluster/plan.py; no shared memory): the coordinator (``ddpwire
coordinator``, its ``--metrics`` lines kept) and two workers
(bench/balance_worker.py: the balance benchmark's MLP, one torch thread,
each pinned to a CPU of its own where there are two). Every link runs at
DDPWIRE_LINK_FAST (default 10gbit) both ways, except worker 1's uplink, at
DDPWIRE_LINK_SLOW (default 400mbit): its 1.6 MB gradient takes about 32 ms
to leave, half a full-speed step's compute. Cases, in one run:

- ``alone``: worker 0 alone, the whole batch;
- ``equal``: both, ``--balance off`` (``T // 2`` each);
- ``balanced``: both, ``--balance on``, this checkout's coordinator;
- ``baseline``: both, ``--balance on``, the coordinator of the checkout
  $DDPWIRE_BASELINE names (built; its shard rules), when it is set.

Throughput is samples per second over the steps after WARMUP, from the
coordinator's step times. Needs root and iproute2; skips otherwise.

    DDPWIRE_BASELINE=/path/to/older/checkout python -m pytest \\
        bench/cluster/test_bench_balance_link.py --benchmark-json F -q
    python bench/report_balance.py F
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

import pytest

from allreduce_procs import BASELINE_ENV, baseline_commit

from . import net, params, plan, shaping

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
WORKER = HERE.parent / "balance_worker.py"
PREFIX = "ddpwl"
PORT = 29400
SAMPLES = int(os.environ.get("DDPWIRE_BALANCE_SAMPLES", "2048"))
WARMUP = 5
MEASURED = int(os.environ.get("DDPWIRE_BALANCE_STEPS", "40"))
FAST = params.parse_rate(os.environ.get("DDPWIRE_LINK_FAST", "10gbit"))
SLOW = params.parse_rate(os.environ.get("DDPWIRE_LINK_SLOW", "400mbit"))
BASELINE = os.environ.get(BASELINE_ENV)
TOPOLOGY = os.environ.get("DDPWIRE_LINK_TOPOLOGY", "mesh")
TIMEOUT = 300.0
CASES = ["alone", "equal", "balanced"] + (["baseline"] if BASELINE else [])
#: samples/s of each case of this run (the ratios read them)
RATES: Dict[str, float] = {}


@pytest.fixture(scope="module")
def link_plan():
    """A coordinator and two workers, worker 1's uplink slow; removed at the end."""
    reason = net.why_unavailable()
    if reason:
        pytest.skip(reason)
    p = plan.make_plan(2, FAST, FAST, prefix=PREFIX)
    slow = dataclasses.replace(p.workers[1], rate=SLOW)
    p = dataclasses.replace(p, workers=[p.workers[0], slow])
    cluster = net.Cluster(p)
    try:
        cluster.__enter__()
        # setup_commands shaped both ways at its rate: the downlink (the
        # bridge's port towards the worker) goes back to the fast rate
        subprocess.run(shaping.tbf_command(p.bridge_netns, slow.port, FAST), check=True,
                       capture_output=True, timeout=net.CMD_TIMEOUT)
    except (net.NetworkUnavailable, subprocess.CalledProcessError) as exc:
        cluster.close()
        pytest.skip(f"cannot build the emulated network: {exc}")
    try:
        yield p
    finally:
        cluster.close()


def _in(machine: plan.Machine, argv: List[str], env: Dict[str, str], out) -> subprocess.Popen:
    """``argv`` on ``machine``: its namespace, a hostname of its own."""
    return subprocess.Popen(
        net.exec_prefix(machine.netns) + ["unshare", "--uts", "sh", "-c",
                                          'hostname "$0" && exec "$@"', machine.role, *argv],
        env=env, stdout=out, stderr=subprocess.STDOUT, cwd=str(ROOT))


def run_case(p: plan.Plan, case: str, tmp: Path) -> dict:
    """One session; returns its metrics lines and the workers' reports."""
    workers = p.workers[:1] if case == "alone" else p.workers
    env = dict(os.environ, OMP_NUM_THREADS="1", DDPWIRE_SHM="0")
    coord_env = dict(env, PYTHONPATH=str(Path(BASELINE).resolve()) if case == "baseline"
                     else str(ROOT))
    metrics = tmp / f"{case}.jsonl"
    cpus = sorted(os.sched_getaffinity(0))
    procs = []
    with open(tmp / f"{case}.log", "w") as log:
        procs.append(_in(p.coordinator, [
            sys.executable, "-m", "ddpwire", "coordinator", "--bind",
            f"{p.coordinator.address}:{PORT}", "--workers", str(len(workers)),
            "--topology", TOPOLOGY, "--balance", "off" if case == "equal" else "on",
            "--metrics", str(metrics), "--steps", str(WARMUP + MEASURED),
            "--samples", str(SAMPLES), "--join-timeout", str(TIMEOUT),
            "--timeout", str(TIMEOUT)], coord_env, log))
        for i, machine in enumerate(workers):
            procs.append(_in(machine, [
                sys.executable, str(WORKER), "--connect", f"{p.coordinator.address}:{PORT}",
                "--samples", str(SAMPLES), "--timeout", str(TIMEOUT),
                *(["--cpus", str(cpus[i])] if len(cpus) > 1 else []),
                "--report", str(tmp / f"{case}-{i}.json")], dict(env, PYTHONPATH=str(ROOT)),
                log))
        try:
            for proc in procs:
                proc.wait(TIMEOUT)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    text = (tmp / f"{case}.log").read_text()
    assert [proc.returncode for proc in procs] == [0] * len(procs), text[-4000:]
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    return {"steps": lines,
            "reports": [json.loads((tmp / f"{case}-{i}.json").read_text())
                        for i in range(len(workers))]}


@pytest.mark.parametrize("case", CASES)
def test_slow_uplink(benchmark, link_plan, case):
    benchmark.group = f"slow uplink {SLOW / 1e6:g} Mbit/s"
    out: Dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="ddpwire-link-") as tmp:
        benchmark.pedantic(lambda: out.update(run_case(link_plan, case, Path(tmp))),
                           rounds=1, iterations=1)
    measured = out["steps"][WARMUP:]
    rate = len(measured) * SAMPLES / sum(s["step_time_s"] for s in measured)
    RATES[case] = rate
    # worker ids follow the order of the joins: each machine's report names its own
    ids = [r["worker"] for r in out["reports"]]
    shards = [[{w["worker"]: w["shard"] for w in s["workers"]}[i] for i in ids]
              for s in out["steps"]]
    alone = RATES.get("alone")
    baseline = RATES.get("balanced") if case == "baseline" else None
    benchmark.extra_info.update(
        kind="link", case=case, topology=TOPOLOGY, fast_bit_s=FAST, slow_uplink_bit_s=SLOW,
        samples_per_step=SAMPLES, warmup=WARMUP, measured=MEASURED, samples_per_s=rate,
        vs_alone=None if alone is None else rate / alone,
        balanced_vs_baseline=None if baseline is None else baseline / rate,
        baseline_commit=baseline_commit(BASELINE) if case == "baseline" and BASELINE else None,
        step_time_median_s=statistics.median(s["step_time_s"] for s in measured),
        # shards, arrivals and compute by machine: the fast link's first
        shards=shards, mean_shards=[statistics.mean(x[i] for x in shards[WARMUP:])
                                    for i in range(len(shards[0]))],
        machine_worker_ids=ids,
        arrivals_s=[[{w["worker"]: w.get("arrival_s") for w in s["workers"]}[i] for i in ids]
                    for s in out["steps"]],
        compute_s=[[{w["worker"]: w["compute_s"] for w in s["workers"]}[i] for i in ids]
                   for s in out["steps"]])

