"""How a ``ddpwire worker`` process judges the end of an elastic run
(issue 39, item 11): by the last step the session reached, not by how many
steps this process ran. A worker that joined the run late, or was dropped
and joined again, ran fewer steps than ``--steps``: when the run ends
normally it exits 0 all the same; when its coordinator really stops the run
early it exits 3 and names the session's step.

The workers are real ``ddpwire worker`` processes on loopback. Where the run
must end normally, the coordinator is hosted here (the standalone command's
options, its run's length announced as ``ddpwire coordinator`` does), so
that it waits between two steps for the late worker instead of racing its
start; where it is stopped, it is the ``ddpwire coordinator`` command,
interrupted with SIGINT.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List

import pytest

from ddpwire import Coordinator
from ddpwire.cli import EXIT_STOPPED
from ddpwire.wire.extensions import Extension, encode_u64
from ddpwire.cli.serve import serve

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="needs the [torch] extra (PyTorch, scikit-learn)")]

PY = [sys.executable, "-m", "ddpwire"]
SAMPLES = 64
#: generous: a loaded 2-core machine, each process importing torch
WAIT = 180.0
STOPPED_LINE = "ddpwire: the coordinator stopped the run"


def sigint_default() -> None:
    """In a child before exec: SIGINT as a terminal gives it, whatever this
    process inherited (a background job's shell leaves it ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: ``python -c STANDBY GO ARGS...``: the ``ddpwire`` command with ARGS, once
#: the file GO exists; torch and the demo's data are loaded meanwhile, so a
#: worker that joins late joins when the test says, not seconds later
STANDBY = f"""
import os, sys, time
from ddpwire.torch.job import build_task
build_task("mlp")
give_up = time.monotonic() + {WAIT}
while not os.path.exists(sys.argv[1]):
    if time.monotonic() > give_up:
        sys.exit("the test never said go")
    time.sleep(0.02)
from ddpwire.cli import main
sys.exit(main(sys.argv[2:]))
"""


class Proc:
    """A ``ddpwire`` process whose stdout and stderr go to files (never a
    full pipe), read back at the end. ``standby``: it starts and loads
    torch, and runs the command once :meth:`go` is called."""

    def __init__(self, tmp: Path, name: str, args: List[str], standby: bool = False) -> None:
        self.name = name
        self.out_path, self.err_path = tmp / f"{name}.out", tmp / f"{name}.err"
        self.report_path = tmp / f"{name}.json"
        self.go_path = tmp / f"{name}.go"
        command = [sys.executable, "-c", STANDBY, str(self.go_path)] if standby else PY
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.p = subprocess.Popen(command + args, stdout=out, stderr=err,
                                      preexec_fn=sigint_default)

    def go(self) -> None:
        self.go_path.touch()

    def wait(self) -> int:
        return self.p.wait(timeout=WAIT)

    @property
    def err(self) -> str:
        return self.err_path.read_text()

    @property
    def report(self) -> dict:
        return json.loads(self.report_path.read_text())

    def steps_seen(self) -> int:
        """How many --step-lines lines are written so far."""
        return self.out_path.read_text().count('{"step"')

    def step_lines(self) -> List[dict]:
        """The --step-lines lines written so far (whole lines only)."""
        text = self.out_path.read_text()
        return [json.loads(line) for line in text.splitlines(keepends=True)
                if line.endswith("\n") and line.startswith('{"step"')]

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(timeout=WAIT)


def worker(tmp: Path, name: str, port: int, *extra: str, standby: bool = False) -> Proc:
    return Proc(tmp, name, ["worker", "--connect", f"127.0.0.1:{port}", "--samples", str(SAMPLES),
                            "--threads", "1", "--timeout", str(int(WAIT)), "--node-id", name,
                            "--report", str(tmp / f"{name}.json"), *extra], standby=standby)


def wait_until(what: str, ready: Callable[[], bool], procs: List[Proc]) -> None:
    """Poll ``ready`` until it holds; fail early when a process has ended."""
    give_up = time.monotonic() + WAIT
    while not ready():
        for p in procs:
            if p.p.poll() is not None:
                pytest.fail(f"{p.name} ended (status {p.p.returncode}) before {what}: "
                            f"{p.err[-3000:]}")
        if time.monotonic() > give_up:
            pytest.fail(f"not {what} within {WAIT:g} s")
        time.sleep(0.05)


def assert_ran_to_the_end(p: Proc, steps: int) -> None:
    code, err = p.wait(), p.err
    assert code == 0, err
    assert STOPPED_LINE not in err, err
    report = p.report
    assert report["run_steps"] == steps and report["stopped_early"] is False, report


# ---- the run ends normally ----

STEPS, FAULT_AT = 12, 2


@pytest.mark.parametrize("how", ["joined-late", "dropped-and-rejoined"])
def test_a_worker_that_did_not_run_every_step_of_a_finished_run_exits_0(tmp_path, how):
    """joined-late: worker b is killed after step FAULT_AT and a new worker
    process c takes its place. dropped-and-rejoined: worker b is stopped
    (SIGSTOP) past its heartbeat timeout, dropped, resumed (SIGCONT), and
    joins again from the session's state. Either ran fewer than STEPS
    steps; the run ended normally, so every worker exits 0."""
    stopped = how == "dropped-and-rejoined"
    # a stopped process falls silent; a live one sends a heartbeat every
    # 1.5 s, and gives the coordinator (one every 0.5 s) 4.5 s
    beats = dict(heartbeat=0.5, heartbeat_timeout=5.0) if stopped else {}
    worker_beats = ["--heartbeat", "1.5"] if stopped else []
    coord = Coordinator(("127.0.0.1", 0), 2, elastic=True, samples_per_step=SAMPLES,
                        timeout=WAIT, join_timeout=WAIT,
                        extensions={Extension.STEPS: encode_u64(STEPS)}, **beats)
    port = coord.local_addr[1]
    procs = [worker(tmp_path, name, port, *worker_beats) for name in ("a", "b")]
    a, b = procs
    if not stopped:
        procs.append(worker(tmp_path, "c", port, standby=True))
    state = {"joined_again": False}
    try:
        coord.wait_for_workers()
        b_id = next(w.worker_id for w in coord.workers if w.node_id == "b")

        def on_step(report) -> None:
            if report.step == FAULT_AT:
                if stopped:
                    os.kill(b.p.pid, signal.SIGSTOP)
                else:
                    b.p.kill()
                    assert b.p.wait(timeout=WAIT) == -signal.SIGKILL
                    procs[2].go()
            elif report.step > FAULT_AT and not state["joined_again"]:
                # the step after FAULT_AT dropped b; let the worker that goes
                # on join before the run ends, however slowly it starts
                assert (b_id, False) in [(e.worker_id, e.joined) for e in coord.membership]
                if stopped:
                    os.kill(b.p.pid, signal.SIGCONT)
                coord.wait_for_workers(count=2, timeout=WAIT)
                state["joined_again"] = True
        serve(coord, steps=STEPS, total_samples=SAMPLES, on_step=on_step)
        assert state["joined_again"]
        goes_on = b if stopped else procs[2]
        for p in (a, goes_on):
            assert_ran_to_the_end(p, STEPS)
        assert a.report["steps"] == STEPS
        # the worker that went on ran fewer steps than the run has
        assert 0 < goes_on.report["steps"] < STEPS
        assert goes_on.report["weights_sha256"] == a.report["weights_sha256"]
        if stopped:
            assert "joining again" in b.err
    finally:
        for p in procs:
            if p.p.poll() is None:
                os.kill(p.p.pid, signal.SIGCONT)
            p.kill()
        coord.close()


# ---- the coordinator stops the run ----

def test_a_worker_that_joined_late_still_says_when_the_coordinator_stopped_the_run(tmp_path):
    """ddpwire coordinator --elastic, interrupted (SIGINT) after a worker
    process joined late: every worker exits 3 and names the session's step,
    the late one too."""
    port = free_port()
    coord = Proc(tmp_path, "coordinator",
                 ["coordinator", "--bind", f"127.0.0.1:{port}", "--workers", "2", "--elastic",
                  "--steps", "100000000", "--samples", str(SAMPLES),
                  "--timeout", str(int(WAIT)), "--join-timeout", str(int(WAIT))])
    a = worker(tmp_path, "a", port, "--step-lines")
    b = worker(tmp_path, "b", port)
    c = worker(tmp_path, "c", port, "--step-lines", standby=True)
    procs = [coord, a, b, c]
    try:
        wait_until("a ran 3 steps", lambda: a.steps_seen() >= 3, procs)
        b.kill()
        c.go()
        wait_until("c joined late and ran 3 steps", lambda: c.steps_seen() >= 3, [coord, a, c])
        coord.p.send_signal(signal.SIGINT)
        assert coord.wait() == 128 + signal.SIGINT, coord.err
        reached = {}
        for p in (a, c):
            code, err = p.wait(), p.err
            assert code == EXIT_STOPPED, err
            last = err.strip().splitlines()[-1]
            assert last.startswith(STOPPED_LINE + " after ") and \
                last.endswith(" of 100000000 steps"), err
            reached[p.name] = int(last[len(STOPPED_LINE + " after "):].split()[0])
            assert p.report["stopped_early"] is True
        # the session's step, the same for both, not the late one's own count
        assert reached["c"] == reached["a"] == a.report["steps"]
        assert c.report["steps"] < reached["c"]
        assert c.step_lines()[0]["step"] > 0
    finally:
        for p in procs:
            p.kill()
