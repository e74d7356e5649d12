"""Mismatched machines (issue 22): do workers of unequal speed train at
close to the sum of their solo throughputs once the shards follow their
measured speeds?

Slower machines are emulated with cgroup v1 CPU quotas: every worker
process (bench/balance_worker.py: a real forward and backward pass of a
256-512-512-10 MLP over its shard, one torch thread) runs in a cgroup of its
own, /sys/fs/cgroup/cpu/ddpwire-bench-<name>, with cpu.cfs_period_us 100000
and cpu.cfs_quota_us 100000 (a whole core), 50000 or 25000. The coordinator
runs here, in this process, with its default topology.

In one run, in this order:

- each quota's solo throughput: that worker alone, all 2,048 samples of a
  step (``test_solo``);
- the pair (100% + 25%) and the trio (100% + 50% + 25%) together, with
  equal shards (balance off) and with shards by speed (balance on); the
  ratio is the together throughput over the sum of the solos of the same
  run (``test_together``);
- ``test_rounds``: DDPWIRE_BALANCE_ROUNDS (default 3) rounds, each every
  solo and then the balanced set-up back to back, pair and trio: a ratio
  per round and their median (the machine's speed drifts between runs
  minutes apart, which moves the ratio of ``test_together``);
- a pair (100% + 50%) where the full-speed worker's quota drops to 25% after
  step 29 of 60 (``test_slowdown``): the coordinator's per-step JSON lines
  go to bench/results/balance-slowdown.jsonl (bench/balance_plot.py draws them), and
  ``follow_steps`` counts the steps from the first slowed one until that
  worker's shard is within 10% of its new steady value, and stays there.

- the same MLP through a plain DDP script on backend ddpwire
  (``test_ddp_solo``, ``test_ddp_together``; bench/balance_ddp_rank.py):
  each speed's rank alone, then each set-up together with an even split
  (what DistributedSampler gives) and with BalancedBatchSampler +
  balanced_hook; ``test_ddp_together_small_on_service`` runs the balanced
  set-ups again with their small allreduces on the service (the path
  before shared memory took every float32 allreduce), the baseline in the
  same run.

Throughput is samples per second over the measured steps (after
:data:`WARMUP` steps), from the coordinator's end-of-step times; the
benchmark's own time is the whole ``serve`` call (warm-up included).

    PYTHONPATH=$PWD python -m pytest bench/test_bench_balance.py \
        --benchmark-json bench/results/bench-balance.json -q

DDPWIRE_BALANCE_STEPS (default 40) sets the measured steps,
DDPWIRE_BALANCE_SAMPLES (default 2048) the samples per step,
DDPWIRE_BALANCE_PIN=0 leaves the processes where the scheduler puts
them (by default each emulated machine is pinned: ``placement``),
DDPWIRE_BALANCE_TRACE=1 runs the workers through bench/balance_trace.py
(each exchange's calls timed, ``worker_traces`` in the JSON) and times the
coordinator's wait for the StepReports and its StepCommit in this process
(``coordinator_trace``),
DDPWIRE_BALANCE_PERIOD_US (default 10000) the CFS period (the quotas scale
with it; another period's slowdown lines go to
bench/results/balance-slowdown-<period>us.jsonl), and DDPWIRE_BASELINE another
checkout (built, as bench/ddp_procs.py takes it): ``test_rounds`` runs
each round's set-up with its shard rules too (the Balancer of its
ddpwire/session/balance.py, the coordinator staying this checkout's), and
``test_ddp_rounds`` each round's DDP set-up with its ddpwire, beside this
checkout's, in alternating order (``baseline_*`` in each round). Needs
root (a writable /sys/fs/cgroup/cpu) and torch; skips otherwise.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import pytest

import balance_trace  # bench/, beside this file
from allreduce_procs import BASELINE_ENV, baseline_commit
from ddpwire import Coordinator
from ddpwire.session.metrics import MetricsFile
from ddpwire.cli.serve import serve

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKER = HERE / "balance_worker.py"
TRACER = HERE / "balance_trace.py"
CGROUP_ROOT = Path("/sys/fs/cgroup/cpu")
PREFIX = "ddpwire-bench-"

SAMPLES = int(os.environ.get("DDPWIRE_BALANCE_SAMPLES", "2048"))
WARMUP = 5
MEASURED = int(os.environ.get("DDPWIRE_BALANCE_STEPS", "40"))
# 10 ms: a 100 ms period is longer than a step, and a quota that runs at full
# speed for a quarter of each period and then stalls is no slower machine
PERIOD_US = int(os.environ.get("DDPWIRE_BALANCE_PERIOD_US", "10000"))
#: share of one core -> the worker's cgroup name
SPEEDS = {1.0: "full", 0.5: "half", 0.25: "quarter"}
SETUPS = {"pair": (1.0, 0.25), "trio": (1.0, 0.5, 0.25)}
#: the slowdown run: the first worker drops from FROM to TO after step AT - 1
SLOWDOWN = dict(speeds=(1.0, 0.5), frm=1.0, to=0.25, at=30, steps=60)
#: another period's run keeps the default's file
SLOWDOWN_JSONL = HERE / "results" / ("balance-slowdown.jsonl" if PERIOD_US == 10000 else
                                     f"balance-slowdown-{PERIOD_US}us.jsonl")
FOLLOW_WITHIN = 0.10
#: test_rounds: rounds of (every solo, then the balanced set-up)
ROUNDS = int(os.environ.get("DDPWIRE_BALANCE_ROUNDS", "3"))
#: run the workers through bench/balance_trace.py (their calls timed)
TRACE = os.environ.get("DDPWIRE_BALANCE_TRACE") == "1"
#: pin the emulated machines to CPUs of their own where there are enough (placement())
PIN = os.environ.get("DDPWIRE_BALANCE_PIN", "1") == "1"
#: another built checkout, whose shard rules the rounds run beside this one's
BASELINE = os.environ.get(BASELINE_ENV)


def baseline_balancer(checkout: str):
    """A factory of another checkout's Balancer (n workers -> one), its
    ddpwire/session/balance.py loaded on its own (it is arithmetic only), taking
    what this checkout's Shards tell a Balancer and dropping what it did
    not know (the lags: before / ended)."""
    spec = importlib.util.spec_from_file_location(
        "ddpwire_baseline_balance", Path(checkout) / "ddpwire" / "balance.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    old = module.Balancer
    lags = "ended" in old.__dict__

    class Baseline(old):  # type: ignore[misc,valid-type]
        def observe(self, worker, samples, seconds, before=None):
            if lags:
                super().observe(worker, samples, seconds, before)
            else:
                super().observe(worker, samples, seconds)

        def ended(self, worker, seconds):
            if lags:
                super().ended(worker, seconds)

    return Baseline


def in_turn(r: int, this, baseline):
    """(this(), baseline()) of round ``r``, the baseline first in odd rounds
    so that neither always runs second; (this(), None) without one."""
    if baseline is None:
        return this(), None
    if r % 2:
        old = baseline()
        return this(), old
    new = this()
    return new, baseline()


def baseline_summary(rounds: List[dict]) -> dict:
    """What a rounds test adds to its JSON with :data:`BASELINE` (none without)."""
    if BASELINE is None:
        return {}
    return dict(baseline_commit=baseline_commit(BASELINE),
                vs_baseline=[x["vs_baseline"] for x in rounds],
                vs_baseline_median=statistics.median(x["vs_baseline"] for x in rounds),
                baseline_ratios=[x["baseline_ratio"] for x in rounds])


def placement(speeds: Sequence[float]) -> Tuple[List[Optional[int]], Optional[int]]:
    """(each worker's CPU, the coordinator's CPU), None where nothing is
    pinned. Emulated machines are separate machines: two of them on one
    core take turns, and the scheduler moves them about, so a full-speed
    worker that shares a core with a quota'd one computes slower than it
    does alone. The fastest worker gets CPU 0, the next ones a CPU each
    while there are more, and the rest, with the coordinator, the last CPU
    (on 2 cores: the full-speed worker alone, everything else on CPU 1,
    whose quotas add up to under one core)."""
    cpus = sorted(os.sched_getaffinity(0))
    if not PIN or len(cpus) < 2:
        return [None] * len(speeds), None
    order = sorted(range(len(speeds)), key=lambda i: (-speeds[i], i))
    where: List[Optional[int]] = [None] * len(speeds)
    for rank, i in enumerate(order):
        where[i] = cpus[min(rank, len(cpus) - 1)]
    return where, cpus[-1]


#: what each worker's report times per step (bench/balance_worker.py)
PHASES = ("shard_wait_s", "compute_s", "allreduce_s", "apply_s", "called_at", "averaged_at",
          "allreduce_cpu_s")
JOIN_TIMEOUT = 120.0
RUN_TIMEOUT = 300.0

#: solo samples/s of this run, by speed (test_solo fills it, test_together reads it)
SOLO: Dict[float, float] = {}


def quota_us(speed: float) -> int:
    return int(round(speed * PERIOD_US))


# ---- cgroups ----

def _cgroups_writable() -> Optional[str]:
    """None when cgroups can be made here, else why not."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed (the workers train a torch MLP)"
    if not (CGROUP_ROOT / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {CGROUP_ROOT}"
    probe = CGROUP_ROOT / f"{PREFIX}probe-{os.getpid()}"
    try:
        probe.mkdir()
        (probe / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (probe / "cpu.cfs_quota_us").write_text(str(PERIOD_US))
    except OSError as exc:
        return f"cannot make a cpu cgroup under {CGROUP_ROOT} ({exc}); run as root"
    finally:
        try:
            probe.rmdir()
        except OSError:
            pass
    return None


@pytest.fixture(scope="module", autouse=True)
def _need_cgroups():
    why = _cgroups_writable()
    if why is not None:
        pytest.skip(f"balance benchmark needs cgroup quotas: {why}")


class Cgroup:
    """/sys/fs/cgroup/cpu/ddpwire-bench-<name> with a quota of ``speed`` cores."""

    def __init__(self, name: str, speed: float) -> None:
        self.path = CGROUP_ROOT / f"{PREFIX}{name}"
        self.path.mkdir(exist_ok=True)
        (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        self.set(speed)

    def set(self, speed: float) -> None:
        (self.path / "cpu.cfs_quota_us").write_text(str(quota_us(speed)))

    def stat(self) -> Dict[str, int]:
        lines = (self.path / "cpu.stat").read_text().split("\n")
        return {k: int(v) for k, v in (x.split() for x in lines if x.strip())}

    def remove(self) -> None:
        """rmdir once its processes have gone (a few tries: exit takes a moment)."""
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
        self.path.rmdir()  # raise: a cgroup left behind should be seen


# ---- one session ----

class Session:
    """A coordinator here and one worker process per speed, each in its cgroup."""

    def __init__(self, speeds: Sequence[float], balance: bool, steps: int,
                 on_step=None, tag: str = "", balancer=None) -> None:
        self.speeds = list(speeds)
        self.balance = balance
        #: the shard rules' class, n workers -> a Balancer (None: the checkout's)
        self.balancer = balancer
        self.steps = steps
        self.on_step = on_step
        self.tmp = tempfile.TemporaryDirectory(prefix="ddpwire-balance-")
        self.cgroups: List[Cgroup] = []
        self.procs: List[subprocess.Popen] = []
        self.logs: List[Path] = []
        self.reports: list = []
        self.ends: List[float] = []
        self.coord: Optional[Coordinator] = None
        self.tag = tag
        #: each worker's cgroup cpu.stat at the end (nr_periods, nr_throttled, throttled_time)
        self.cgroup_stats: List[Dict[str, int]] = []
        #: worker id -> speed, and the workers' output, kept by close()
        self.by_id: Optional[Dict[int, float]] = None
        #: worker id -> each step's seconds in PHASES, from the worker's report
        self.phases: Dict[int, List[List[float]]] = {}
        #: worker id -> its traced calls (with DDPWIRE_BALANCE_TRACE=1)
        self.traces: Dict[int, list] = {}
        #: the coordinator's traced calls (with DDPWIRE_BALANCE_TRACE=1)
        self.coordinator_trace: list = []
        #: each worker's CPU, by position (placement()); this thread's affinity before
        self.cpus: List[Optional[int]] = []
        self._affinity: Optional[set] = None
        self.log_text = ""

    def start(self):
        """pedantic's setup (not timed): cgroups, workers, the join."""
        cpus, mine = placement(self.speeds)
        if mine is not None:
            # this thread serves the steps (the coordinator's own threads
            # start from it and inherit it); close() gives the rest back
            self._affinity = os.sched_getaffinity(0)
            os.sched_setaffinity(0, {mine})
        self.cpus = cpus
        self.coord = Coordinator(("127.0.0.1", 0), len(self.speeds), balance=self.balance,
                                 timeout=RUN_TIMEOUT, join_timeout=JOIN_TIMEOUT,
                                 samples_per_step=SAMPLES)
        host, port = self.coord.local_addr[:2]
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   OPENBLAS_NUM_THREADS="1")
        for i, speed in enumerate(self.speeds):
            name = f"{SPEEDS[speed]}{self.tag}-{i}"
            cg = Cgroup(name, speed)
            self.cgroups.append(cg)
            log = Path(self.tmp.name) / f"worker-{i}.log"
            self.logs.append(log)
            with open(log, "w") as out:
                trace = ([str(TRACER), str(Path(self.tmp.name) / f"trace-{i}.json")]
                         if TRACE else [])
                self.procs.append(subprocess.Popen(
                    [sys.executable, *trace, str(WORKER), "--connect", f"{host}:{port}",
                     "--cgroup", str(cg.path), "--samples", str(SAMPLES),
                     *(["--cpus", str(cpus[i])] if cpus[i] is not None else []),
                     "--timeout", str(RUN_TIMEOUT),
                     "--report", str(Path(self.tmp.name) / f"report-{i}.json")],
                    stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT)))
        self.coord.wait_for_workers()
        if self.balancer is not None:
            assert self.coord.shards is not None
            self.coord.shards.balancer = self.balancer(len(self.speeds))
        return (), {}

    def _step(self, report) -> None:
        self.ends.append(time.perf_counter())
        self.reports.append(report)
        if self.on_step is not None:
            self.on_step(self, report)

    def serve(self) -> None:
        """pedantic's target (timed): the whole run."""
        assert self.coord is not None
        tracing = balance_trace.traced_here() if TRACE else contextlib.nullcontext([])
        with tracing as events:
            try:
                serve(self.coord, steps=self.steps, total_samples=SAMPLES, on_step=self._step)
            finally:
                self.coordinator_trace = events

    def close(self) -> None:
        if self.coord is not None:
            self.coord.close()
        if self._affinity is not None:
            os.sched_setaffinity(0, self._affinity)
            self._affinity = None
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()  # a process of ours that hung
                p.wait()
        for cg in self.cgroups:
            self.cgroup_stats.append(cg.stat())
            cg.remove()
        try:
            self.by_id = self._worker_speeds()
        except (OSError, ValueError):
            self.by_id = None  # a worker that failed wrote no report
        self.log_text = self._worker_logs()
        self.tmp.cleanup()

    def _worker_logs(self) -> str:
        return "\n".join(f"--- worker {i} ---\n{log.read_text()[-3000:]}"
                         for i, log in enumerate(self.logs) if log.exists())

    def _worker_speeds(self) -> Dict[int, float]:
        """worker id -> the speed (share of a core) its process ran at."""
        ids = {}
        for i, speed in enumerate(self.speeds):
            report = json.loads((Path(self.tmp.name) / f"report-{i}.json").read_text())
            ids[report["worker"]] = speed
            self.phases[report["worker"]] = [
                [s[k] for k in PHASES] for s in report["steps"]]
            if TRACE:
                self.traces[report["worker"]] = json.loads(
                    (Path(self.tmp.name) / f"trace-{i}.json").read_text())
        return ids

    def throughput(self, warmup: int = WARMUP) -> float:
        """samples/s over the steps after ``warmup``."""
        span = self.ends[-1] - self.ends[warmup - 1]
        return (len(self.ends) - warmup) * SAMPLES / span


def run_session(benchmark, speeds, balance, steps, on_step=None, tag=""):
    session = Session(speeds, balance, steps, on_step=on_step, tag=tag)
    load = os.getloadavg()[0]
    try:
        benchmark.pedantic(session.serve, setup=session.start, rounds=1, iterations=1)
    finally:
        session.close()
    benchmark.extra_info.update(loadavg_1min_before=load, **session_info(session))
    return session, session.by_id


def check_ended(session: "Session") -> Dict[int, float]:
    """A closed session ended well: every worker exited 0 and reported;
    returns worker id -> speed."""
    for p in session.procs:
        assert p.returncode == 0, session.log_text
    assert session.by_id is not None, session.log_text
    return session.by_id


def session_info(session: "Session") -> dict:
    """What a closed session that ended well leaves for the JSON."""
    by_id = check_ended(session)
    return dict(
        samples_per_step=SAMPLES, steps=session.steps, cfs_period_us=PERIOD_US,
        pinned=PIN, worker_cpus=session.cpus,
        worker_speeds={str(k): v for k, v in sorted(by_id.items())},
        step_times_s=[r.step_time for r in session.reports],
        shards=[[w.samples for w in r.workers] for r in session.reports],
        compute_s=[[w.compute for w in r.workers] for r in session.reports],
        final_loss=session.reports[-1].global_loss,
        cgroup_stats=session.cgroup_stats, worker_phases=list(PHASES),
        worker_phases_s={str(k): v for k, v in sorted(session.phases.items())},
        **({"worker_traces": {str(k): v for k, v in sorted(session.traces.items())},
            "coordinator_trace": session.coordinator_trace} if TRACE else {}))


def run_plain(speeds, balance, steps, tag="", balancer=None) -> "Session":
    """One session outside pytest-benchmark's timing (test_rounds times its own)."""
    session = Session(speeds, balance, steps, tag=tag, balancer=balancer)
    try:
        session.start()
        session.serve()
    finally:
        session.close()
    check_ended(session)
    return session


def _percent(speed: float) -> str:
    return f"{int(speed * 100)}%"


# ---- solo, together ----

@pytest.mark.parametrize("speed", sorted(SPEEDS, reverse=True), ids=_percent)
def test_solo(benchmark, speed):
    benchmark.group = "solo"
    session, _ = run_session(benchmark, [speed], False, WARMUP + MEASURED)
    rate = session.throughput()
    SOLO[speed] = rate
    benchmark.extra_info.update(kind="solo", speed=speed, warmup=WARMUP, measured=MEASURED,
                                samples_per_s=rate)


CASES = [(setup, balance) for setup in SETUPS for balance in (False, True)]


@pytest.mark.parametrize("setup,balance", CASES,
                         ids=[f"{s}-{'on' if b else 'off'}" for s, b in CASES])
def test_together(benchmark, setup, balance):
    speeds = SETUPS[setup]
    benchmark.group = f"together {setup} " + "+".join(_percent(s) for s in speeds)
    session, by_id = run_session(benchmark, speeds, balance, WARMUP + MEASURED, tag=setup)
    rate = session.throughput()
    measured = session.reports[WARMUP:]
    # each speed's mean shard over the measured steps
    shard_of = {}
    for wid, speed in by_id.items():
        shard_of[_percent(speed)] = statistics.mean(r.workers[wid].samples for r in measured)
    solos = [SOLO.get(s) for s in speeds]
    solo_sum = sum(solos) if all(x is not None for x in solos) else None
    info = benchmark.extra_info
    info.update(kind="together", setup=setup, speeds=list(speeds), balance=balance,
                warmup=WARMUP, measured=MEASURED, samples_per_s=rate,
                mean_shard_by_speed=shard_of,
                solo_samples_per_s=solos, solo_sum=solo_sum,
                ratio=None if solo_sum is None else rate / solo_sum,
                step_time_median_s=statistics.median(r.step_time for r in measured),
                waited_for_speed=[None if r.waited_for is None else by_id[r.waited_for]
                                  for r in measured])


@pytest.mark.parametrize("setup", list(SETUPS))
def test_rounds(benchmark, setup):
    """This machine's speed drifts between sessions (a shared VM: the same
    solo differs by 15% from one minute to the next), so one solo run and
    one together run minutes apart give a ratio that moves with it. Here
    each of :data:`ROUNDS` rounds runs every solo and then the balanced
    set-up back to back; the ratio of each round, and their median. One
    more set of solos closes the run, so that every together run also has
    a ratio against the mean of the solos just before and just after it
    (``ratio_bracketed``), which a steady drift of the machine's speed
    moves less. With :data:`BASELINE` every round also runs the set-up
    with that commit's Balancer, before this checkout's in odd rounds and
    after it in even ones (``baseline_*``, and ``vs_baseline``: this
    checkout's samples/s over the baseline's)."""
    speeds = SETUPS[setup]
    baseline = None if BASELINE is None else baseline_balancer(BASELINE)
    benchmark.group = f"rounds {setup} " + "+".join(_percent(s) for s in speeds)
    steps = WARMUP + MEASURED
    rounds: List[dict] = []

    def run():
        for r in range(ROUNDS):
            solos = [run_plain([s], False, steps, tag=f"r{r}").throughput() for s in speeds]
            together, old = in_turn(
                r, lambda: run_plain(speeds, True, steps, tag=f"{setup}r{r}"),
                None if baseline is None else lambda: against(baseline, r))
            rate = together.throughput()
            old = old or {}
            if old:
                old.update(baseline_ratio=old["baseline_samples_per_s"] / sum(solos),
                           vs_baseline=rate / old["baseline_samples_per_s"],
                           baseline_first=bool(r % 2))
            rounds.append(dict(solo_samples_per_s=solos, samples_per_s=rate, **old,
                               ratio=rate / sum(solos),
                               step_time_median_s=statistics.median(
                                   x.step_time for x in together.reports[WARMUP:]),
                               shards=[[w.samples for w in x.workers] for x in together.reports],
                               worker_speeds={str(k): v for k, v in
                                              sorted(check_ended(together).items())}))

    def against(rules, r: int) -> dict:
        x = run_plain(speeds, True, steps, tag=f"{setup}b{r}", balancer=rules)
        return dict(baseline_samples_per_s=x.throughput(),
                    baseline_shards=[[w.samples for w in y.workers] for y in x.reports],
                    baseline_step_time_median_s=statistics.median(
                        y.step_time for y in x.reports[WARMUP:]))

    def close() -> List[float]:
        return [run_plain([s], False, steps, tag="close").throughput() for s in speeds]

    benchmark.pedantic(run, rounds=1, iterations=1)
    after = [x["solo_samples_per_s"] for x in rounds[1:]] + [close()]
    for x, later in zip(rounds, after):
        x["solo_after_samples_per_s"] = later
        x["ratio_bracketed"] = x["samples_per_s"] / statistics.mean(
            [sum(x["solo_samples_per_s"]), sum(later)])
    bracketed = [x["ratio_bracketed"] for x in rounds]
    ratios = [x["ratio"] for x in rounds]
    benchmark.extra_info.update(kind="rounds", setup=setup, speeds=list(speeds), balance=True,
                                cfs_period_us=PERIOD_US, samples_per_step=SAMPLES,
                                warmup=WARMUP, measured=MEASURED, rounds=rounds,
                                ratios=ratios, ratio_median=statistics.median(ratios),
                                ratios_bracketed=bracketed,
                                ratio_bracketed_median=statistics.median(bracketed),
                                ratio_min=min(ratios), ratio_max=max(ratios),
                                **baseline_summary(rounds))


# ---- mid-run slowdown ----

def follow_steps(shards: Sequence[int], at: int, within: float = FOLLOW_WITHIN,
                 tail: int = 10) -> Tuple[Optional[int], Optional[int], float]:
    """(steps until shards[at:] first comes within ``within`` of its steady
    value, steps until it comes within and stays, the steady value: the
    median of the last ``tail`` steps); None where it never does."""
    steady = statistics.median(shards[-tail:])
    near = [abs(s - steady) <= within * steady for s in shards]
    first = next((k - at for k in range(at, len(shards)) if near[k]), None)
    stays = next((k - at for k in range(at, len(shards)) if all(near[k:])), None)
    return first, stays, steady


def test_slowdown(benchmark):
    cfg = SLOWDOWN
    benchmark.group = "slowdown"
    changed = {}

    def on_step(session, report):
        if report.step == cfg["at"] - 1:
            session.cgroups[0].set(cfg["to"])  # before the next step's shards go out
            changed["at"] = time.perf_counter()

    SLOWDOWN_JSONL.parent.mkdir(exist_ok=True)
    metrics = MetricsFile(str(SLOWDOWN_JSONL))

    def write(session, report):
        metrics.write(report)
        on_step(session, report)

    try:
        session, by_id = run_session(benchmark, cfg["speeds"], True, cfg["steps"],
                                     on_step=write, tag="slow")
    finally:
        metrics.close()
    slowed = next(w for w, s in by_id.items() if s == cfg["frm"])  # worker 0's process
    shards = [r.workers[slowed].samples for r in session.reports]
    first, stays, steady = follow_steps(shards, cfg["at"])
    before = statistics.median(shards[cfg["at"] - 10:cfg["at"]])
    benchmark.extra_info.update(
        kind="slowdown", balance=True, speeds=list(cfg["speeds"]), slowed_worker=slowed,
        quota_from=quota_us(cfg["frm"]), quota_to=quota_us(cfg["to"]), changed_after_step=cfg["at"] - 1,
        slowed_shards=shards, shard_before=before, shard_steady_after=steady,
        follow_within=FOLLOW_WITHIN, follow_steps_first=first, follow_steps_stays=stays,
        throughput_before=(cfg["at"] - WARMUP) * SAMPLES /
        (session.ends[cfg["at"] - 1] - session.ends[WARMUP - 1]),
        throughput_after=(cfg["steps"] - cfg["at"] - 10) * SAMPLES /
        (session.ends[-1] - session.ends[cfg["at"] + 9]),
        metrics_jsonl=str(SLOWDOWN_JSONL.relative_to(ROOT)))
    assert first is not None, shards


# ---- the same through a DDP script ----

DDP_RANK = HERE / "balance_ddp_rank.py"


def free_port() -> int:
    """A port for torch's store; ddpwire's service takes the next one up."""
    import socket
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as t:
            try:
                t.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
#: samples/s of each speed's rank alone (test_ddp_solo fills it)
DDP_SOLO: Dict[float, float] = {}


class DdpRun:
    """One DDP run on backend ddpwire, one rank per speed, each in its
    cgroup (with ``env`` added to its environment): :meth:`start`, then
    :meth:`wait`, then :meth:`finish` for samples/s over the steps after
    WARMUP, from rank 0's step ends."""

    def __init__(self, tmp_path: Path, speeds: Sequence[float], balance: bool,
                 env: Optional[Dict[str, str]] = None, tag: str = "") -> None:
        self.tmp_path, self.speeds, self.balance, self.env = tmp_path, list(speeds), balance, env
        self.steps = WARMUP + MEASURED
        self.groups = [Cgroup(f"ddp{tag}{i}", s) for i, s in enumerate(speeds)]
        self.cpus, _ = placement(speeds)  # rank 0, the fastest, hosts the coordinator
        self.port = free_port()
        self.procs: List[subprocess.Popen] = []
        self.load = os.getloadavg()[0]
        self.tag = tag

    def start(self):
        for rank, group in enumerate(self.groups):
            rank_env = dict(os.environ, **(self.env or {}), RANK=str(rank),
                            WORLD_SIZE=str(len(self.speeds)), MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(self.port), OMP_NUM_THREADS="1")
            cpu = self.cpus[rank]
            self.procs.append(subprocess.Popen(
                [sys.executable, str(DDP_RANK), "--balance", "on" if self.balance else "off",
                 "--steps", str(self.steps), "--samples", str(SAMPLES),
                 "--cgroup", str(group.path), *(["--cpus", str(cpu)] if cpu is not None else []),
                 "--report", str(self.tmp_path / f"ddp{self.tag}{rank}.json")],
                env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        return (), {}

    def wait(self) -> None:
        for p in self.procs:
            p.wait(RUN_TIMEOUT)

    def finish(self) -> Tuple[float, dict]:
        """(samples/s, what the JSON keeps of the run); every process is
        gone and every cgroup removed after it, whatever happened."""
        try:
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
            logs = "\n".join(p.stdout.read() for p in self.procs if p.stdout is not None)
        finally:
            for group in self.groups:
                group.remove()
        assert [p.returncode for p in self.procs] == [0] * len(self.speeds), logs
        reports = [json.loads((self.tmp_path / f"ddp{self.tag}{r}.json").read_text())
                   for r in range(len(self.speeds))]
        ends = reports[0]["ends"]
        rate = (len(ends) - WARMUP) * SAMPLES / (ends[-1] - ends[WARMUP - 1])
        return rate, dict(
            kind="ddp", speeds=self.speeds, balance=self.balance, samples_per_step=SAMPLES,
            pinned=PIN, rank_cpus=self.cpus, rank_env=self.env or {}, steps=self.steps,
            cfs_period_us=PERIOD_US, loadavg_1min_before=self.load, samples_per_s=rate,
            batch_sizes=[r["sizes"] for r in reports])


def run_ddp(benchmark, tmp_path, speeds, balance: bool,
            env: Optional[Dict[str, str]] = None) -> float:
    """A :class:`DdpRun` timed by pytest-benchmark; returns its samples/s."""
    run = DdpRun(tmp_path, speeds, balance, env)
    try:
        benchmark.pedantic(run.wait, setup=run.start, rounds=1, iterations=1)
    finally:
        rate, info = run.finish()
    benchmark.extra_info.update(info)
    return rate


def ddp_plain(tmp_path, speeds, balance: bool, env: Optional[Dict[str, str]] = None,
              tag: str = "") -> float:
    """A :class:`DdpRun` outside pytest-benchmark's timing (test_ddp_rounds times its own)."""
    run = DdpRun(tmp_path, speeds, balance, env, tag)
    try:
        run.start()
        run.wait()
    finally:
        rate, _ = run.finish()
    return rate


@pytest.mark.parametrize("speed", sorted(SPEEDS, reverse=True), ids=_percent)
def test_ddp_solo(benchmark, tmp_path, speed):
    benchmark.group = "ddp solo"
    DDP_SOLO[speed] = run_ddp(benchmark, tmp_path, [speed], False)


@pytest.mark.parametrize("setup,balance", CASES,
                         ids=[f"{s}-{'on' if b else 'off'}" for s, b in CASES])
def test_ddp_together(benchmark, tmp_path, setup, balance):
    ddp_together(benchmark, tmp_path, setup, balance)


def ddp_together(benchmark, tmp_path, setup: str, balance: bool,
                 env: Optional[Dict[str, str]] = None) -> None:
    """A set-up's DDP run, with its ratio to the solos of this run."""
    speeds = SETUPS[setup]
    benchmark.group = f"ddp {setup} " + "+".join(_percent(s) for s in speeds)
    rate = run_ddp(benchmark, tmp_path, speeds, balance, env)
    solos = [DDP_SOLO.get(s) for s in speeds]
    solo_sum = sum(solos) if all(x is not None for x in solos) else None
    benchmark.extra_info.update(setup=setup, solo_samples_per_s=solos, solo_sum=solo_sum,
                                ratio=None if solo_sum is None else rate / solo_sum)


#: the balanced runs' small allreduces (the hook's per-step timings) on the
#: service, as every float32 allreduce under 64 KiB went before shared
#: memory took them all (DDPWIRE_SHM_MIN_BYTES's default of 4 bytes): the
#: baseline of test_ddp_together's balanced cases, in the same run
SMALL_ON_SERVICE = {"DDPWIRE_SHM_MIN_BYTES": str(64 << 10)}


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_ddp_together_small_on_service(benchmark, tmp_path, setup):
    ddp_together(benchmark, tmp_path, setup, True, SMALL_ON_SERVICE)


@pytest.mark.parametrize("setup", list(SETUPS))
def test_ddp_rounds(benchmark, tmp_path, setup):
    """test_rounds through the DDP script: each of :data:`ROUNDS` rounds
    runs every speed's rank alone and then the balanced set-up; with
    :data:`BASELINE` also the set-up on that checkout's ddpwire (its
    sampler, hook and rules: PYTHONPATH), before this checkout's in odd
    rounds and after it in even ones."""
    speeds = SETUPS[setup]
    benchmark.group = f"ddp rounds {setup} " + "+".join(_percent(s) for s in speeds)
    rounds: List[dict] = []
    old_env = None if BASELINE is None else {"PYTHONPATH": str(Path(BASELINE).resolve())}

    def run():
        for r in range(ROUNDS):
            solos = [ddp_plain(tmp_path, [s], False, tag=f"s{r}{i}")
                     for i, s in enumerate(speeds)]
            rate, old = in_turn(
                r, lambda: ddp_plain(tmp_path, speeds, True, tag=f"t{r}"),
                None if old_env is None else
                lambda: ddp_plain(tmp_path, speeds, True, old_env, tag=f"b{r}"))
            rounds.append(dict(solo_samples_per_s=solos, samples_per_s=rate,
                               ratio=rate / sum(solos),
                               **({} if old is None else dict(
                                   baseline_samples_per_s=old, baseline_ratio=old / sum(solos),
                                   vs_baseline=rate / old, baseline_first=bool(r % 2)))))

    benchmark.pedantic(run, rounds=1, iterations=1)
    ratios = [x["ratio"] for x in rounds]
    benchmark.extra_info.update(
        kind="rounds", setup=setup, speeds=list(speeds), balance=True, ddp=True,
        cfs_period_us=PERIOD_US, samples_per_step=SAMPLES, warmup=WARMUP, measured=MEASURED,
        rounds=rounds, ratios=ratios, ratio_median=statistics.median(ratios),
        ratio_min=min(ratios), ratio_max=max(ratios), **baseline_summary(rounds))
