"""Shards by speed as a user meets them (issue 38): the ``ddpwire`` command
with its defaults, real processes on this host, against ``--balance off``
in the same run.

- ``test_identical``: two and three identical workers, the demo MLP and
  the demo transformer, 64, 512 and 4096 samples a step. Each round runs
  ``--balance auto`` (the default) and ``--balance off`` back to back, in
  alternating order; the ratio is auto's throughput over off's (over the
  rounds: their geometric mean and its 95% interval, ``ratio_geometric``:
  on this machine one run's ratio spreads ±15%, so a goal of 0.98x needs
  the interval, not a run), and the shards at the end are compared with
  equal ones: the last step's (``final_shards``) and the split the run
  kept (``kept_shards``: a run may end inside a trial).
- ``test_held``: two workers, one (``--node-id held``) held to a quarter of
  a core by a cgroup v1 cpu quota with a 10 ms period, the same models and
  sizes: ``--balance auto``, ``off``, and a sweep of fixed splits (the held
  worker's share, through bench/fixed_split_coordinator.py: the oracle a
  user could not know), every setting once a round for
  DDPWIRE_BALANCE_CLI_HELD_ROUNDS rounds (default 3), the order turned by
  one each round. The ratios are of medians: auto over the best fixed
  split and auto over off.

Throughput is every sample over the sum of the steps' times in the
coordinator's ``--metrics`` (start-up and the join left out: they are the
same whatever the balance); the done line's figure over the wall time is
kept beside it (``throughput_wall``), and so is each stretch of steps at
one split (``trace``: what put the shards where they ended). A run is
``DDPWIRE_BALANCE_CLI_STEPS`` steps (default 3000), fewer where that would
be more than the model's sample budget (12 M samples for the MLP, 2 M for
the transformer), and never under 300.

    PYTHONPATH=$PWD python -m pytest bench/test_bench_balance_cli.py \\
        --benchmark-json bench/results/balance-cli.json -q

DDPWIRE_BALANCE_CLI_ROUNDS (default 2) sets the rounds of test_identical,
DDPWIRE_BALANCE_CLI_SIZES (default 64,512,4096) the sizes,
DDPWIRE_BALANCE_CLI_MODELS (default mlp,transformer) the models,
DDPWIRE_BALANCE_CLI_SHARES the held worker's fixed shares swept;
DDPWIRE_BASELINE (a built checkout of an older commit) adds its ``auto`` to
each round of test_identical, the order turned by one each round.
test_held needs root (a writable /sys/fs/cgroup/cpu) and skips otherwise;
both need torch.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FIXED = HERE / "fixed_split_coordinator.py"
CGROUP = Path("/sys/fs/cgroup/cpu/ddpwire-bench-cli-held")
PERIOD_US = 10_000
HELD_SPEED = 0.25

STEPS = int(os.environ.get("DDPWIRE_BALANCE_CLI_STEPS", "3000"))
ROUNDS = int(os.environ.get("DDPWIRE_BALANCE_CLI_ROUNDS", "2"))
SIZES = [int(x) for x in os.environ.get("DDPWIRE_BALANCE_CLI_SIZES", "64,512,4096").split(",")]
MODELS = os.environ.get("DDPWIRE_BALANCE_CLI_MODELS", "mlp,transformer").split(",")
#: samples a run may take, per model (the transformer is ~8x slower a sample)
BUDGET = {"mlp": 12_000_000, "transformer": 2_000_000}
#: the held worker's shares swept for the oracle
SHARES = tuple(float(x) for x in os.environ.get(
    "DDPWIRE_BALANCE_CLI_SHARES", "0.35,0.3,0.25,0.2,0.15,0.1").split(","))
#: a built checkout of an older commit: its ``auto`` runs beside this one's in each
#: round of test_identical (baseline_ratios, over the same round's ``off``)
BASELINE = Path(os.environ["DDPWIRE_BASELINE"]) if os.environ.get("DDPWIRE_BASELINE") else None
#: rounds of test_held (each setting once a round; medians compared)
HELD_ROUNDS = int(os.environ.get("DDPWIRE_BALANCE_CLI_HELD_ROUNDS", "3"))

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                reason="the workers train a torch model")


def steps_for(model: str, samples: int) -> int:
    return max(300, min(STEPS, BUDGET[model] // samples))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(root: Path) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_cli(workers: int, model: str, samples: int, steps: int, balance: str, *,
            held: bool = False, share: Optional[float] = None, root: Path = ROOT) -> dict:
    """One run of ``ddpwire coordinator`` and ``workers`` ``ddpwire worker``
    processes on loopback; ``held``: the first worker joins as ``held``
    inside the quota's cgroup; ``share``: the coordinator pins that
    worker's share (bench/fixed_split_coordinator.py); ``root``: the
    checkout whose ddpwire every process runs."""
    port = _port()
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        args = ["coordinator", "--bind", f"127.0.0.1:{port}", "--workers", str(workers),
                "--steps", str(steps), "--samples", str(samples), "--balance", balance,
                "--metrics", str(metrics), "--join-timeout", "120"]
        cmd = [sys.executable, str(FIXED), str(share)] + args if share is not None else \
            [sys.executable, "-m", "ddpwire"] + args
        env = _env(root)
        # every process starts in ``root``: ``python -m`` puts its working
        # directory first on the path, ahead of PYTHONPATH, and a baseline
        # started from this checkout would run this checkout's ddpwire
        coord = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, env=env, cwd=str(root))
        procs = []
        for i in range(workers):
            w = [sys.executable, "-m", "ddpwire", "worker", "--connect", f"127.0.0.1:{port}",
                 "--samples", str(samples), "--model", model, "--log-level", "WARNING",
                 "--timeout", "120"]
            if held and i == 0:
                w += ["--node-id", "held"]
                # the quota holds the worker from its first instruction on
                w = ["sh", "-c", f'echo $$ > {CGROUP}/tasks && exec "$@"', "sh"] + w
            procs.append(subprocess.Popen(w, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                          text=True, env=env, cwd=str(root)))
        try:
            out, _ = coord.communicate(timeout=1800)
            errs = [p.communicate(timeout=120)[1] for p in procs]
        finally:
            for p in [coord] + procs:
                if p.poll() is None:
                    p.kill()
        if coord.returncode != 0 or any(p.returncode != 0 for p in procs):
            raise RuntimeError(f"run failed ({cmd}): {out[-2000:]} {[e[-500:] for e in errs]}")
        lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    # the done line's figure (thousands separated) is over the wall time,
    # start-up and the join included; the ratios are of the steps' own time
    done = re.search(r"done: .*?, ([0-9][0-9,.]*) samples/s", out)
    step_s = sum(x["step_time_s"] for x in lines)
    last = lines[-1]["workers"]
    trace = _stretches(lines)
    return {
        "balance": balance, "share": share, "steps": steps,
        "throughput": sum(x["samples"] for x in lines) / step_s,
        "throughput_wall": float(done.group(1).replace(",", "")) if done else None,
        # each stretch of steps at one split and state:
        # [first step, steps, state, shards, its mean step in seconds]
        "trace": trace,
        # the mean step in each state, and the steps' time in it
        "step_s_by_state": {s: [sum(t) / len(t), sum(t)] for s, t in _by_state(lines).items()},
        "final_shards": [w["shard"] for w in last],
        # the split the run kept at its end: a run may end inside a trial,
        # its last step a challenger's
        "kept_shards": next((s[3] for s in reversed(trace) if s[2] != "probe"),
                            [w["shard"] for w in last]),
        "names": [w.get("name", "") for w in last],
        "states": {s: sum(1 for x in lines if x.get("balance") == s)
                   for s in {x.get("balance") for x in lines}},
        "fixed_s": [w.get("fixed_s") for w in last],
        "per_sample_s": [w.get("per_sample_s") for w in last],
    }


def _stretches(lines: List[dict]) -> List[list]:
    """The run's splits and the balancer's states, a stretch of steps each
    (what put the shards where they ended: trials, the model or neither)."""
    out: List[list] = []
    for x in lines:
        key = (x.get("balance"), [w["shard"] for w in x["workers"]])
        if out and (out[-1][2], out[-1][3]) == key:
            out[-1][1] += 1
            out[-1][4] += x["step_time_s"]
        else:
            out.append([x.get("step"), 1, key[0], key[1], x["step_time_s"]])
    for stretch in out:
        stretch[4] = round(stretch[4] / stretch[1], 6)  # its mean step
    return out


def _by_state(lines: List[dict]) -> Dict[str, List[float]]:
    """Each state's step times (a probe's cost against the held split's)."""
    out: Dict[str, List[float]] = {}
    for x in lines:
        out.setdefault(x.get("balance"), []).append(x["step_time_s"])
    return out


#: Student's t at 97.5% by degrees of freedom (rounds - 1), for the intervals
T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26,
        10: 2.23, 11: 2.20, 12: 2.18, 13: 2.16, 14: 2.14, 15: 2.13}


def geometric_interval(ratios: List[float]) -> List[float]:
    """[geometric mean, low, high]: the mean of the ratios' logs and its 95%
    interval (Student's t over the rounds), back on the ratios' scale. A
    round's two runs are back to back, so the machine's slow drift falls on
    both: the ratios are paired, and their spread is what is left."""
    logs = [math.log(r) for r in ratios]
    mean = sum(logs) / len(logs)
    if len(logs) < 2:
        return [math.exp(mean)] * 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (len(logs) - 1))
    half = T975.get(len(logs) - 1, 2.0) * sd / math.sqrt(len(logs))
    return [math.exp(mean), math.exp(mean - half), math.exp(mean + half)]


def _median(values: List[float]) -> float:
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


@pytest.mark.parametrize("samples", SIZES)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("workers", [2, 3])
def test_identical(benchmark, workers, model, samples):
    steps = steps_for(model, samples)
    rounds = []

    settings = ["auto", "off"] + (["baseline"] if BASELINE is not None else [])

    def run():
        for r in range(ROUNDS):
            order = settings[r % len(settings):] + settings[:r % len(settings)]
            got = {b: run_cli(workers, model, samples, steps, "auto" if b == "baseline" else b,
                              root=BASELINE if b == "baseline" else ROOT)  # type: ignore[arg-type]
                   for b in order}
            rounds.append(got)
    benchmark.pedantic(run, rounds=1, iterations=1)
    ratios = [g["auto"]["throughput"] / g["off"]["throughput"] for g in rounds]
    if BASELINE is not None:
        benchmark.extra_info.update(
            baseline=str(BASELINE),
            baseline_ratios=[g["baseline"]["throughput"] / g["off"]["throughput"]
                             for g in rounds])
    equal = samples / workers

    def off_equal(which: str) -> List[float]:
        """How far each round's ``which`` split is from equal shards, a fraction of one."""
        return [max(abs(c - equal) for c in g["auto"][which]) / equal for g in rounds]
    geo = geometric_interval(ratios)
    print(f"\nidentical {workers} {model} {samples}: auto/off {geo[0]:.3f} "
          f"(95% {geo[1]:.3f}-{geo[2]:.3f}), rounds {[round(r, 3) for r in ratios]}, shards "
          f"{[g['auto']['final_shards'] for g in rounds]}, kept "
          f"{[g['auto']['kept_shards'] for g in rounds]}", flush=True)
    benchmark.extra_info.update(
        workers=workers, model=model, samples=samples, steps=steps, ratios=ratios,
        ratio_median=_median(ratios), ratio_geometric=geo,
        final_off_equal=off_equal("final_shards"), kept_off_equal=off_equal("kept_shards"),
        rounds=rounds)
    assert all(g["auto"]["final_shards"] for g in rounds)


@pytest.fixture(scope="module")
def held_cgroup():
    if not (CGROUP.parent / "cpu.cfs_quota_us").exists():
        pytest.skip("no cgroup v1 cpu controller")
    try:
        CGROUP.mkdir(exist_ok=True)
        (CGROUP / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (CGROUP / "cpu.cfs_quota_us").write_text(str(int(HELD_SPEED * PERIOD_US)))
    except OSError as exc:
        pytest.skip(f"cannot make a cpu cgroup ({exc}); run as root")
    yield CGROUP
    for _ in range(50):
        try:
            CGROUP.rmdir()
            return
        except OSError:
            time.sleep(0.1)


@pytest.mark.parametrize("samples", SIZES)
@pytest.mark.parametrize("model", MODELS)
def test_held(benchmark, held_cgroup, model, samples):
    steps = steps_for(model, samples)
    kinds = ["auto", "off"] + [f"share {share}" for share in SHARES]
    runs: Dict[str, List[dict]] = {k: [] for k in kinds}

    def one(kind: str) -> dict:
        if kind.startswith("share "):
            return run_cli(2, model, samples, steps, "on", held=True, share=float(kind[6:]))
        return run_cli(2, model, samples, steps, kind, held=True)

    def run():
        # every setting once a round, each round's order turned by one, so
        # that the machine's drift falls on every setting alike
        for r in range(HELD_ROUNDS):
            for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
                runs[kind].append(one(kind))
    benchmark.pedantic(run, rounds=1, iterations=1)
    medians = {k: _median([x["throughput"] for x in v]) for k, v in runs.items()}
    fixed = {k: v for k, v in medians.items() if k.startswith("share")}
    best = max(fixed, key=fixed.get)  # type: ignore[arg-type]
    auto = medians["auto"]
    print(f"\nheld {model} {samples}: auto/best {auto / fixed[best]:.3f} ({best}), auto/off "
          f"{auto / medians['off']:.3f}, medians {dict((k, round(v)) for k, v in medians.items())}",
          flush=True)
    benchmark.extra_info.update(
        model=model, samples=samples, steps=steps, rounds_run=HELD_ROUNDS, best_fixed=best,
        medians=medians, auto_over_best=auto / fixed[best], auto_over_off=auto / medians["off"],
        runs=runs)
