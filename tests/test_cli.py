"""The ddpwire command: demo, standalone coordinator, worker, torchrun launch, errors."""
from __future__ import annotations

import importlib.util
import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest

import ddpwire
from ddpwire import cli
from ddpwire.session.launch import Launch, from_environment, parse_addr
from ddpwire.session.progress import PaceLog, ProgressBar, unit
from ddpwire.cli.serve import StepReport
from ddpwire.plane.threads import (
    connections_to, default_threads, threads_per_worker, usable_cores, workers_here,
)

PY = [sys.executable, "-m", "ddpwire"]

# the worker side and the demo train with torch (the [torch] extra); a wheel
# tested without it (cibuildwheel) runs the rest
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="needs the [torch] extra (PyTorch, scikit-learn)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args, timeout=240, **kw):
    return subprocess.run(PY + args, capture_output=True, text=True, timeout=timeout, **kw)


@needs_torch
def test_demo_trains_two_workers_to_identical_weights():
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = run(["demo", "--workers", "2", "--steps", "6", "--samples", "128"], env=env)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "step 6/6" in out and "allreduce" in out and "loss" in out and "acc" in out
    assert "held-out accuracy" in out and "samples/s" in out
    assert "weights identical on all 2 workers" in out
    # two workers share the cores instead of each taking them all
    assert out.splitlines()[0].endswith(f"torch threads per worker: {threads_per_worker(2)}")


@needs_torch
def test_local_steps_average_once_a_round_and_keep_the_workers_identical(tmp_path):
    """--sync-every 5: 20 inner steps are 4 averaged rounds of 5 times the samples."""
    proc = run(["demo", "--workers", "2", "--steps", "20", "--samples", "64", "--sync-every", "5"])
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "20 steps of 64 samples, averaged every 5 (local steps)" in out.splitlines()[0]
    assert "round 4/4" in out and "weights identical on all 2 workers" in out


@pytest.mark.parametrize("extra,why", [
    (["--steps", "21", "--sync-every", "5"], "not a whole number of rounds"),
    (["--steps", "20", "--sync-every", "5", "--per-block"], "needs flat steps"),
])
def test_local_steps_that_cannot_work_are_refused_in_one_line(extra, why):
    proc = run(["coordinator", "--workers", "1", "--bind", "127.0.0.1:0"] + extra)
    assert proc.returncode == 2 and why in proc.stderr, proc.stderr


@needs_torch
def test_per_block_demo_shows_loss_and_accuracy_as_it_trains():
    # block messages carry no loss: the progress lines pool the workers' own
    # figures for the step they show, while training runs
    proc = run(["demo", "--workers", "2", "--steps", "4", "--samples", "64", "--per-block"])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    progress = [line for line in lines if line.startswith("step ")]
    steps = [int(line.split()[1].split("/")[0]) for line in progress]
    assert steps[0] == 1 and steps[-1] == 4 and steps == sorted(set(steps))
    assert all(" loss " in line and " acc " in line and "%" in line and "samples/s" in line
               for line in progress), proc.stdout
    # nothing printed again after training: the summary follows the last step
    assert lines.index(progress[-1]) + 1 == next(i for i, line in enumerate(lines)
                                                 if line.startswith("held-out accuracy"))
    assert "weights identical on all 2 workers" in proc.stdout


@needs_torch
@pytest.mark.parametrize("sigint", [signal.SIG_DFL, signal.SIG_IGN], ids=["sigint", "sigint-ignored"])
def test_demo_stops_when_a_worker_process_dies(sigint):
    # no CUDA here: the workers exit at once; the demo must say so, not wait
    # out its join timeout and then report that nobody joined; also where it
    # started with SIGINT ignored, as a background job of a script is
    import torch
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA, where --device cuda fails")
    proc = run(["demo", "--workers", "2", "--steps", "3", "--device", "cuda", "--timeout", "3600"],
               preexec_fn=lambda: signal.signal(signal.SIGINT, sigint))
    assert proc.returncode == 1
    assert "ddpwire: error: worker process" in proc.stderr
    assert "before training ended" in proc.stderr
    assert "joined within" not in proc.stderr


@needs_torch
def test_ctrl_c_in_the_demo_says_interrupted_once():
    # as a terminal's Ctrl-C does: SIGINT to the demo's whole process group
    demo = subprocess.Popen(PY + ["demo", "--workers", "3", "--steps", "100000000", "--samples", "48"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        for line in demo.stderr:  # the demo logs each worker once all have joined
            if "worker 2:" in line:
                break
        else:
            pytest.fail("the demo ended before its workers joined: " + demo.stdout.read())
        os.killpg(demo.pid, signal.SIGINT)
        out, err = demo.communicate(timeout=120)
    finally:
        demo.kill()
    assert demo.returncode == 130
    assert (out + err).count("interrupted") == 1, err


def test_version_is_the_package_version():
    proc = run(["--version"])
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"ddpwire {ddpwire.__version__}"


@pytest.mark.parametrize("command", [[], ["coordinator"], ["worker"], ["demo"]])
def test_help_has_no_markup(command):
    proc = run([*command, "--help"])
    assert proc.returncode == 0 and "usage: ddpwire" in proc.stdout
    assert "`" not in proc.stdout


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_an_error_starts_on_a_fresh_line(capsys):
    term = FakeTerminal()
    bar = ProgressBar(10, stream=term)
    bar.update(StepReport(0, 1.0, 0.5, 32, 0.001, 0.01))
    assert not term.getvalue().endswith("\n")
    assert cli.main(["coordinator", "--bind", "nohost", "--workers", "1"]) == 1
    assert term.getvalue().endswith("\n") and term.getvalue().count("\n") == 1
    assert "ddpwire: error: bad address" in capsys.readouterr().err
    bar.close()  # a finished line is not broken twice
    assert term.getvalue().count("\n") == 1


def test_missing_torch_is_one_line_with_the_install_hint():
    code = ("import sys; sys.modules['torch'] = None; from ddpwire.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    for command in (["worker", "--connect", "127.0.0.1:9"], ["demo", "--workers", "2"]):
        proc = subprocess.run([sys.executable, "-c", code, *command], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 1, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr
        assert lines[0].startswith(f"ddpwire: error: ddpwire {command[0]} needs PyTorch")
        assert "pip install 'ddpwire[torch]'" in lines[0] and "whl/cpu" in lines[0]


@needs_torch
def test_a_retrying_worker_says_what_it_waits_for():
    port = free_port()
    proc = run(["worker", "--connect", f"127.0.0.1:{port}", "--timeout", "2"])
    assert proc.returncode == 1
    assert f"coordinator at 127.0.0.1:{port} not reachable yet" in proc.stderr
    assert "s left" in proc.stderr


def test_threads_per_worker_split_the_cores():
    cores = usable_cores()
    assert threads_per_worker(1) == cores
    assert threads_per_worker(cores) == 1
    assert threads_per_worker(cores * 4) == 1
    assert threads_per_worker(2) == max(1, cores // 2)
    with pytest.raises(ValueError):
        threads_per_worker(0)
    # OMP_NUM_THREADS (torchrun sets it) is left to torch; else the split
    assert default_threads(2, {"OMP_NUM_THREADS": "3"}) == 0
    assert default_threads(2, {}) == threads_per_worker(2)


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's table of TCP sockets")
def test_connections_to_a_peer_are_counted_from_the_kernel_table():
    with socket.create_server(("127.0.0.1", 0)) as server:
        addr = server.getsockname()
        clients = [socket.create_connection(addr) for _ in range(3)]
        accepted = [server.accept()[0] for _ in clients]
        try:
            # the accepted ends point elsewhere: only the three clients count
            assert connections_to(addr) == 3
            assert workers_here(clients[0], env={}) == 3
        finally:
            for s in clients + accepted:
                s.close()
    assert connections_to(("no-such-host", 1)) is None


def test_connections_table_is_read_in_the_kernels_byte_order(tmp_path):
    import struct
    word = "%08X" % struct.unpack("=I", socket.inet_aton("10.1.2.3"))[0]
    table = tmp_path / "tcp"
    table.write_text(
        "  sl  local_address rem_address   st tx_queue\n"
        f"   0: 0100007F:9C40 {word}:7531 01 0\n"
        f"   1: 0100007F:9C41 {word}:7531 06 0\n"  # TIME_WAIT: gone
        f"   2: 0100007F:9C42 {word}:7532 01 0\n")  # another port
    assert connections_to(("10.1.2.3", 0x7531), {socket.AF_INET: str(table)}) == 1
    assert connections_to(("10.1.2.3", 0x7531), {socket.AF_INET: str(tmp_path / "none")}) is None


def test_workers_here_without_a_table_is_torchruns_count():
    with socket.socket() as unconnected:  # no peer: nothing to count
        assert workers_here(unconnected, env={"LOCAL_WORLD_SIZE": "4"}) == 4
        assert workers_here(unconnected, env={}) == 1


@needs_torch
def test_standalone_coordinator_and_workers(tmp_path):
    port = free_port()
    token = tmp_path / "token"
    token.write_text("a-shared-secret-for-this-test\n")
    # socket threads forced on: the default would not use them for the demo's small model
    coord = subprocess.Popen(PY + ["coordinator", "--bind", f"127.0.0.1:{port}", "--workers", "2",
                                   "--steps", "3", "--samples", "64", "--timeout", "60",
                                   "--socket-threads", "on", "--token-file", str(token),
                                   "--compression", "bf16"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    worker = PY + ["worker", "--connect", f"127.0.0.1:{port}", "--timeout", "60"]
    env = {k: v for k, v in os.environ.items() if k != "DDPWIRE_TOKEN"}
    try:
        # refused before they take a slot, each with one line saying why
        no_token = run(worker[len(PY):] + ["--samples", "64"], env=env)
        wrong_samples = run(worker[len(PY):] + ["--samples", "32", "--token-file", str(token)], env=env)
        reports = [tmp_path / f"w{i}.json" for i in range(2)]
        # one worker reads the token file, the other $DDPWIRE_TOKEN
        workers = [subprocess.Popen(worker + ["--samples", "64", "--report", str(r)] + how,
                                    env=dict(env, **extra), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
                   for r, how, extra in zip(reports, [["--token-file", str(token)], []],
                                            [{}, {"DDPWIRE_TOKEN": token.read_text().strip()}])]
        for p in workers + [coord]:
            p.wait(timeout=240)
    finally:
        for p in [coord] + (workers if "workers" in locals() else []):
            p.kill()
    assert no_token.returncode == 1
    assert no_token.stderr.strip().splitlines()[-1].startswith("ddpwire: error: ")
    assert "requires a token" in no_token.stderr
    assert wrong_samples.returncode == 1
    assert "samples per step differ: coordinator 64, worker 32" in wrong_samples.stderr
    coord_log = coord.stderr.read()
    assert coord.returncode == 0, coord_log
    assert "flat steps run on the mesh between the 2 workers (bf16)" in coord_log
    assert all(p.returncode == 0 for p in workers)
    results = [json.loads(r.read_text()) for r in reports]
    assert sorted(r["worker_id"] for r in results) == [0, 1]
    assert all(r["steps"] == 3 for r in results)
    assert results[0]["weights_sha256"] == results[1]["weights_sha256"]
    assert "a-shared-secret" not in " ".join(coord.args)


@needs_torch
def test_a_per_block_coordinator_refuses_a_flat_worker_at_the_join():
    """The worker hears at the join which flag to add, instead of both sides
    failing at step 0; the coordinator does not claim flat steps on a mesh."""
    port = free_port()
    coord = subprocess.Popen(PY + ["coordinator", "--bind", f"127.0.0.1:{port}", "--workers", "1",
                                   "--steps", "1", "--samples", "32", "--per-block",
                                   "--timeout", "60"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    worker = ["worker", "--connect", f"127.0.0.1:{port}", "--timeout", "60", "--samples", "32"]
    try:
        flat = run(worker)
        per_block = run(worker + ["--per-block", "--blocks", "4"])
        coord.wait(timeout=120)
    finally:
        coord.kill()
    coord_log = coord.stderr.read()
    assert flat.returncode == 1
    assert flat.stderr.strip().splitlines()[-1] == (
        "ddpwire: error: the coordinator refused to admit this worker: this coordinator runs "
        "per-block steps (--per-block); start the worker with --per-block")
    assert per_block.returncode == 0, per_block.stderr
    assert coord.returncode == 0, coord_log
    assert "start the worker with --per-block" in coord_log
    assert "per-block steps run on the star" in coord_log
    assert "flat steps run on" not in coord_log


@needs_torch
def test_torchrun_rank0_hosts_the_coordinator():
    # `python -m torch.distributed.run` is what the torchrun script runs
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    env = dict(os.environ, DDPWIRE_PORT=str(free_port()), OMP_NUM_THREADS="1")
    proc = subprocess.run(torchrun + ["--standalone", "--nproc-per-node", "2", "-m", "ddpwire", "worker",
                           "--steps", "3", "--samples", "64", "--timeout", "60", "--log-level", "WARNING"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # every rank's report is one whole line of its own
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 2
    assert sorted(r["worker_id"] for r in results) == [0, 1]
    # ranks join in order, so worker id and node name agree
    for r in results:
        assert r["node_id"].endswith(f"-rank{r['worker_id']}"), results
    assert results[0]["weights_sha256"] == results[1]["weights_sha256"]


@needs_torch
def test_refused_connection_is_one_clear_line():
    proc = run(["worker", "--connect", f"127.0.0.1:{free_port()}", "--timeout", "0.5"])
    assert proc.returncode == 1
    assert "ddpwire: error: could not reach the coordinator" in proc.stderr
    assert "Traceback" not in proc.stderr


@needs_torch
def test_wrong_address_is_one_clear_line():
    proc = run(["worker", "--connect", "no-such-host.invalid:29400", "--timeout", "5"])
    assert proc.returncode == 1
    assert "bad coordinator address no-such-host.invalid:29400" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_malformed_address_is_one_clear_line():
    proc = run(["coordinator", "--bind", "localhost", "--workers", "1"])
    assert proc.returncode == 1
    assert "bad address 'localhost'" in proc.stderr


def test_port_in_use_is_one_clear_line():
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        proc = run(["coordinator", "--bind", f"127.0.0.1:{port}", "--workers", "1"])
    assert proc.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}: address already in use" in proc.stderr


def test_coordinator_side_never_imports_torch():
    code = ("import sys, ddpwire, ddpwire.cli, ddpwire.cli.demo, ddpwire.cli.serve; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_parse_addr():
    assert parse_addr("10.0.0.2:29400") == ("10.0.0.2", 29400)
    assert parse_addr("[::1]:80") == ("::1", 80)
    for bad in ["host", "host:", ":80", "host:99999", "host:x"]:
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_addr(bad)


def test_torchrun_environment():
    env = {"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500", "RANK": "0", "WORLD_SIZE": "4"}
    launch = from_environment(None, env)
    assert launch == Launch(("10.1.2.3", 29501), 0, 4) and launch.hosts_coordinator
    other = from_environment(None, dict(env, RANK="2", DDPWIRE_PORT="31000"))
    assert other.addr == ("10.1.2.3", 31000) and not other.hosts_coordinator
    explicit = from_environment("h:1", env)
    assert explicit.addr == ("h", 1) and not explicit.hosts_coordinator
    with pytest.raises(ValueError, match="--connect"):
        from_environment(None, {})


class FakeClock:
    """Seconds that pass only when the test says."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _run_bar(bar, clock, steps, seconds_each, samples=32):
    for step in range(steps):
        clock.now += seconds_each
        bar.update(StepReport(step, 1.0 / (step + 1), 0.5, samples, 0.001, seconds_each))


def test_progress_off_a_terminal_shows_every_two_seconds_and_the_ends():
    clock, stream = FakeClock(), io.StringIO()
    bar = ProgressBar(100, stream=stream, clock=clock)
    _run_bar(bar, clock, 100, 0.5)
    lines = stream.getvalue().splitlines()
    # the first step, then each step 2 s after the last line shown, and the last
    assert [int(line.split()[1].split("/")[0]) for line in lines] == [1, *range(5, 100, 4), 100]
    assert lines[-1].startswith("step 100/100 [########################]")
    # every line: loss, accuracy, the throughput of the time since the last line, allreduce
    assert "loss 0.0100" in lines[-1] and "acc  50.0%" in lines[-1]
    assert all("loss " in line and "acc " in line and " 64 samples/s" in line
               and "allreduce   1.00 ms" in line for line in lines[1:-1])
    assert bar.done == 100 and bar.throughput == pytest.approx(64.0)


def test_progress_says_the_time_since_the_start_and_the_time_left():
    clock, stream = FakeClock(), io.StringIO()
    bar = ProgressBar(10000, stream=stream, clock=clock)
    _run_bar(bar, clock, 2401, 0.125)  # lines every 16 steps: 2401 is one, 5:00 in
    last = stream.getvalue().splitlines()[-1]
    assert last.startswith("step  2401/10000") and "elapsed 5:00  left 15:50" in last
    for step in range(2401, 10000):
        clock.now += 0.5
        bar.update(StepReport(step, 1.0 / (step + 1), 0.5, 32, 0.001, 0.5))
    last = stream.getvalue().splitlines()[-1]
    assert "elapsed 1:08:20" in last and "left" not in last  # the last step: nothing left
    assert bar.summary() == "10,000 steps in 1:08:20, 78 samples/s, last loss 0.0001"


def test_progress_of_local_steps_counts_rounds():
    clock, stream = FakeClock(), io.StringIO()
    bar = ProgressBar(20, stream=stream, clock=clock, label=unit(10))
    _run_bar(bar, clock, 20, 0.5)
    assert stream.getvalue().splitlines()[-1].startswith("round 20/20 [")
    assert bar.summary().startswith("20 rounds in 0:10")


def test_a_worker_logs_its_progress_every_half_minute(caplog):
    clock = FakeClock()
    pace = PaceLog(logging.getLogger("ddpwire.worker"), 1000, clock=clock)
    with caplog.at_level(logging.INFO, logger="ddpwire.worker"):
        for step in range(1000):
            clock.now += 0.125
            pace.update(step, 64, 1.0 / (step + 1))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4  # at 30, 60, 90 and 120 s of a 125 s run
    assert lines[0] == ("step 240/1000, loss 0.0042, 512 samples/s on this worker, "
                        "elapsed 0:30, left 1:35")


def test_progress_of_a_long_run_shows_within_seconds():
    # a tenth of 100000 steps was the first line, minutes in
    clock, stream = FakeClock(), io.StringIO()
    bar = ProgressBar(100000, stream=stream, clock=clock)
    _run_bar(bar, clock, 5000, 0.001)
    steps = [int(line.split()[1].split("/")[0]) for line in stream.getvalue().splitlines()]
    assert steps == [1, 2001, 4001]


def test_progress_on_a_terminal_redraws_at_most_ten_times_a_second():
    clock, term = FakeClock(), FakeTerminal()
    bar = ProgressBar(1000, stream=term, clock=clock)
    _run_bar(bar, clock, 1000, 0.01)
    draws = term.getvalue().split("\r")[1:]
    assert len(draws) == 1 + 99 + 1  # the first step, every tenth of a second, the last
    assert draws[-1].startswith("step 1000/1000") and draws[-1].endswith("\n")
    assert all(not d.endswith("\n") for d in draws[:-1])


def test_progress_takes_a_missing_loss_from_the_pooled_figures():
    clock, stream = FakeClock(), io.StringIO()
    asked = []

    def pooled(step):
        asked.append(step)
        return 2.0 + step, 0.25

    bar = ProgressBar(10, stream=stream, clock=clock, pooled=pooled)
    for step in range(10):
        clock.now += 1.0
        bar.update(StepReport(step, None, None, 32, 0.001, 1.0))
    lines = stream.getvalue().splitlines()
    assert asked == [0, 2, 4, 6, 8, 9]  # only the steps that show
    assert all(f"loss {2.0 + s:.4f}  acc  25.0%" in line for s, line in zip(asked, lines))


def test_report_line_goes_out_in_one_write(monkeypatch, tmp_path):
    # torchrun starts every rank with `python -u`: unbuffered, print() writes
    # the text and then its newline, and two ranks' lines could merge
    writes = []
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: writes.append(bytes(data)) or real_write(fd, data))
    with open(tmp_path / "out", "w") as f:
        monkeypatch.setattr(sys, "stdout", f)
        cli.write_line('{"worker_id": 1}')
    assert writes == [b'{"worker_id": 1}\n']
    assert (tmp_path / "out").read_text() == '{"worker_id": 1}\n'


def test_coordinator_share_option():
    parser = cli.build_parser()
    base = ["coordinator", "--workers", "3"]
    assert parser.parse_args(base).coordinator_share == "auto"
    assert parser.parse_args(base + ["--coordinator-share", "0.25"]).coordinator_share == 0.25
    assert parser.parse_args(base + ["--coordinator-share", "0"]).coordinator_share == 0.0
    proc = run(base + ["--coordinator-share", "1.5"])
    assert proc.returncode == 2
    assert "a fraction from 0 to below 1, or auto; got '1.5'" in proc.stderr


def test_receive_window_option():
    parser = cli.build_parser()
    base = ["coordinator", "--workers", "3"]
    assert parser.parse_args(base).receive_window == "auto"
    assert parser.parse_args(base + ["--receive-window", "system"]).receive_window is None
    assert parser.parse_args(base + ["--receive-window", "256K"]).receive_window == 256 << 10
    assert parser.parse_args(base + ["--receive-window", "2m"]).receive_window == 2 << 20
    assert parser.parse_args(base + ["--receive-window", "65536"]).receive_window == 65536
    for bad in ("4K", "2G", "lots", "-1", "K"):
        proc = run(base + ["--receive-window", bad])
        assert proc.returncode == 2, bad
        assert f"auto or system; got {bad!r}" in proc.stderr


def test_coordinator_options_reach_the_coordinator(monkeypatch):
    seen = {}

    class Stop(Exception):
        pass

    def record(bind, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(cli, "Coordinator", record)
    args = cli.build_parser().parse_args(
        ["coordinator", "--workers", "3", "--bind", "127.0.0.1:0",
         "--coordinator-share", "0.2", "--receive-window", "128K"])
    with pytest.raises(Stop):
        cli.run_coordinator(args)
    assert seen["coordinator_share"] == 0.2
    assert seen["receive_window"] == 128 << 10


def _session(tmp_path, coordinator_args, worker_args=(), workers=2, env=None):
    """A `ddpwire coordinator` and ``workers`` `ddpwire worker` processes on
    loopback, run to the end; returns (coordinator, workers, reports)."""
    port = free_port()
    coord = subprocess.Popen(PY + ["coordinator", "--bind", f"127.0.0.1:{port}",
                                   "--workers", str(workers), "--timeout", "60",
                                   *coordinator_args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    reports = [tmp_path / f"w{i}.json" for i in range(workers)]
    procs = [subprocess.Popen(PY + ["worker", "--connect", f"127.0.0.1:{port}", "--timeout", "60",
                                    "--report", str(r), *worker_args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in reports]
    outputs = {}
    try:
        for p in procs + [coord]:
            outputs[p.pid] = p.communicate(timeout=240)
    finally:
        for p in procs + [coord]:
            p.kill()
    return coord, procs, outputs, reports


@needs_torch
def test_a_worker_saves_the_weights_it_ended_with(tmp_path):
    import torch

    from ddpwire.torch.job import build_task, weights_digest

    saved = tmp_path / "model.pt"
    coord, procs, outputs, reports = _session(
        tmp_path, ["--steps", "5", "--samples", "64"], ["--samples", "64", "--save", str(saved)],
        workers=1)
    assert procs[0].returncode == 0, outputs[procs[0].pid][1]
    assert "saved the model after 5 steps to" in outputs[procs[0].pid][1]
    net = build_task("mlp")[0]
    net.load_state_dict(torch.load(saved))
    assert weights_digest(net) == json.loads(reports[0].read_text())["weights_sha256"]
    assert not (tmp_path / "model.pt.part").exists()


@needs_torch
@pytest.mark.parametrize("topology", ["auto", "star"])
def test_workers_on_one_host_share_its_cores_by_default(tmp_path, topology):
    # no --threads, no torchrun: each worker counts the workers of its session
    # on this host once every one has joined, mesh or star
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE")}
    coord, procs, outputs, reports = _session(
        tmp_path, ["--steps", "2", "--samples", "64", "--topology", topology],
        ["--samples", "64"], env=env)
    assert coord.returncode == 0, outputs[coord.pid][1]
    assert all(p.returncode == 0 for p in procs), [outputs[p.pid][1] for p in procs]
    expected = max(1, len(os.sched_getaffinity(0)) // 2)
    assert [json.loads(r.read_text())["threads"] for r in reports] == [expected, expected]


def test_worker_steps_outside_torchrun_is_refused():
    # the coordinator decides how long the run is; a worker's --steps would
    # be silently ignored, so it is refused before anything else happens
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK")}
    proc = run(["worker", "--connect", f"127.0.0.1:{free_port()}", "--steps", "5",
                "--timeout", "30"], env=env)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ddpwire: error: --steps")
    assert "coordinator's --steps" in lines[0]


class _Lines:
    """The lines of a process's stream, read on a thread, so that a test
    waits for a line with a deadline instead of blocking on the pipe."""

    def __init__(self, stream) -> None:
        import queue
        import threading
        self.seen: list = []
        self._queue: "queue.Queue" = queue.Queue()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, predicate, timeout: float = 180.0) -> str:
        """The first line (from here on) for which ``predicate`` holds."""
        import queue
        import time
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no such line within {timeout:g} s: {''.join(self.seen)[-3000:]}")
            if line is None:
                pytest.fail("the stream ended first: " + "".join(self.seen)[-3000:])
            self.seen.append(line)
            if predicate(line):
                return line

    def rest(self, timeout: float = 120.0) -> str:
        """Everything read, once the stream has ended."""
        self._thread.join(timeout)
        while not self._queue.empty():
            line = self._queue.get()
            if line is not None:
                self.seen.append(line)
        return "".join(self.seen)


@needs_torch
@pytest.mark.parametrize("sig,topology", [(signal.SIGTERM, "auto"), (signal.SIGINT, "auto"),
                                          (signal.SIGTERM, "star")],
                         ids=["sigterm", "sigint", "sigterm-star"])
def test_a_stopped_coordinator_tells_its_workers(tmp_path, sig, topology):
    port = free_port()
    coord = subprocess.Popen(PY + ["coordinator", "--bind", f"127.0.0.1:{port}", "--workers", "2",
                                   "--steps", "100000000", "--samples", "64", "--timeout", "60",
                                   "--topology", topology],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reports = [tmp_path / f"w{i}.json" for i in range(2)]
    workers = [subprocess.Popen(PY + ["worker", "--connect", f"127.0.0.1:{port}", "--timeout", "60",
                                      "--samples", "64", "--report", str(r)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for r in reports]
    try:
        coord_err = _Lines(coord.stderr)
        coord_err.wait_for(lambda line: line.startswith("step "))  # training has begun
        coord.send_signal(sig)
        coord_log = coord_err.rest()
        coord.wait(timeout=120)
        outs = [w.communicate(timeout=120) for w in workers]
    finally:
        for p in [coord] + workers:
            p.kill()
    name = "terminated" if sig == signal.SIGTERM else "interrupted"
    assert coord.returncode == 128 + sig, coord_log
    assert coord_log.rstrip().endswith(f"ddpwire: {name}"), coord_log
    for w, (_out, err) in zip(workers, outs):
        assert w.returncode == 3, err
        last = err.strip().splitlines()[-1]
        assert last.startswith("ddpwire: the coordinator stopped the run after "), err
        assert last.endswith(" of 100000000 steps"), err
        assert "bytes)" not in err and "Traceback" not in err, err
    # each worker still reports what it trained
    results = [json.loads(r.read_text()) for r in reports]
    assert all(r["stopped_early"] and r["run_steps"] == 100000000 for r in results)
    assert results[0]["steps"] == results[1]["steps"]


def test_a_lost_peer_is_one_line_without_frame_internals():
    from ddpwire.wire.errors import CoordinatorLost
    exc = CoordinatorLost("coordinator 10.0.0.1:29400 disconnected while waiting for StepCommit "
                          "or Shutdown (0 of 4 bytes)", step=146)
    assert cli._one_line(exc) == ("coordinator 10.0.0.1:29400 disconnected while waiting for "
                                  "StepCommit or Shutdown (step 146)")
    # other errors keep their words
    assert cli._one_line(ValueError("a (1 of 2 bytes) value")) == "a (1 of 2 bytes) value"


def test_counted_agrees_with_its_number():
    from ddpwire._text import counted
    assert [counted(n, "worker") for n in (0, 1, 2)] == ["0 workers", "1 worker", "2 workers"]
    assert counted(1, "CUDA device") == "1 CUDA device"
    assert counted(3, "entry", "entries") == "3 entries"


def test_messages_about_one_worker_say_worker(caplog, capsys):
    import logging
    import threading
    from ddpwire import Coordinator, DdpwireError, JoinRefusedError, Worker
    caplog.set_level(logging.INFO)
    assert cli.main(["coordinator", "--bind", "127.0.0.1:0", "--workers", "1",
                     "--join-timeout", "0.2"]) == 1
    assert "waiting for 1 worker" in caplog.text and "1 workers" not in caplog.text
    assert "0 of 1 worker joined within 0.2 s" in capsys.readouterr().err
    caplog.clear()
    with Coordinator(("127.0.0.1", 0), 1, timeout=10, join_timeout=30) as coord:
        with pytest.raises(DdpwireError, match="only 0 of 1 worker joined"):
            coord.send_shard_assignments(0)
        joined = []
        t = threading.Thread(
            target=lambda: joined.append(Worker.connect(coord.local_addr, timeout=10)))
        t.start()
        coord.wait_for_workers()
        t.join(30)
        with pytest.raises(JoinRefusedError, match="training has started with 1 worker$"):
            Worker.connect(coord.local_addr, timeout=10)
        joined[0].close()
    assert "flat steps run on the mesh of its 1 worker" in caplog.text
    assert "1 workers" not in caplog.text


@needs_torch
def test_a_demo_of_one_worker_says_worker():
    proc = run(["demo", "--workers", "1", "--steps", "1", "--samples", "16"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ddpwire demo: 1 worker on ")
    assert ", model mlp, 1 step of 16 samples;" in proc.stdout.splitlines()[0]
    assert "weights of the only worker (sha256 " in proc.stdout
    assert "1 workers" not in proc.stdout + proc.stderr and "1 steps" not in proc.stdout


@needs_torch
@pytest.mark.slow
def test_an_elastic_coordinator_goes_on_when_a_worker_process_is_killed(tmp_path):
    """ddpwire coordinator --elastic and three ddpwire worker processes: one
    killed mid-run; the run ends with the other two, their weights alike,
    the loss on the coordinator's progress and in its metrics."""
    port = free_port()
    metrics = tmp_path / "metrics.jsonl"
    coord = subprocess.Popen(PY + ["coordinator", "--bind", f"127.0.0.1:{port}", "--workers", "3",
                                   "--steps", "300", "--samples", "96", "--timeout", "60",
                                   "--elastic", "--metrics", str(metrics)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reports = [tmp_path / f"w{i}.json" for i in range(3)]
    workers = []
    try:
        for r in reports:
            workers.append(subprocess.Popen(
                PY + ["worker", "--connect", f"127.0.0.1:{port}", "--timeout", "60",
                      "--samples", "96", "--threads", "1", "--report", str(r)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        wait_for_steps(metrics, 3)
        workers[1].kill()
        for p in workers + [coord]:
            p.wait(timeout=240)
    finally:
        for p in [coord] + workers:
            p.kill()
    coord_log = coord.stderr.read()
    assert coord.returncode == 0, coord_log
    assert workers[1].returncode == -signal.SIGKILL
    assert [p.returncode for p in (workers[0], workers[2])] == [0, 0]
    done = [json.loads(reports[i].read_text()) for i in (0, 2)]
    assert done[0]["weights_sha256"] == done[1]["weights_sha256"]
    assert all(r["steps"] == 300 for r in done)
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(300))
    changes = [e for x in lines for e in x["membership"]]
    assert len(changes) == 1 and changes[0]["workers"] == 2 and not changes[0]["joined"]
    lost = changes[0]["worker"]
    name = changes[0]["name"]
    assert name.endswith("@127.0.0.1")
    assert f"worker {lost} ({name}) left during step {changes[0]['step']}" in coord_log
    assert "going on with 2 workers" in coord_log
    # said once (the bar's line, not the log's too), and the star's reason is --elastic
    assert coord_log.count("left during step") == 1, coord_log
    assert "an elastic session averages there" in coord_log
    assert "does not take part in a mesh" not in coord_log
    # the survivors carry on: news, not a warning
    for p in (workers[0], workers[2]):
        err = p.stderr.read()
        assert f"worker {lost} was lost during step" in err and "WARNING" not in err, err
    assert all(len(x["workers"]) == 2 for x in lines[changes[0]["step"]:])


def wait_for_steps(metrics: Path, steps: int, limit: float = 120.0) -> None:
    """Wait (at most ``limit`` s) until a --metrics file holds ``steps`` steps: the run is
    under way, every worker in it."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.02)
    pytest.fail(f"{metrics} did not reach {steps} steps within {limit:g} s")


def sigint_default() -> None:
    """In a child before exec: SIGINT as a terminal gives it, whatever this
    process inherited (a background job's shell leaves it ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@needs_torch
@pytest.mark.slow
def test_a_worker_stopped_with_ctrl_c_is_named_first_with_what_to_do(tmp_path):
    """Without --elastic, the run ends: the coordinator's line leads with
    the worker that left (not the one that saw it go), and both sides say
    what --elastic would have done."""
    port = free_port()
    metrics = tmp_path / "metrics.jsonl"
    coord = subprocess.Popen(PY + ["coordinator", "--bind", f"127.0.0.1:{port}", "--workers", "2",
                                   "--steps", "100000", "--samples", "64", "--timeout", "60",
                                   "--metrics", str(metrics)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers = []
    try:
        for i in range(2):
            workers.append(subprocess.Popen(
                PY + ["worker", "--connect", f"127.0.0.1:{port}", "--timeout", "60",
                      "--samples", "64", "--threads", "1", "--node-id", f"w{i}"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                preexec_fn=sigint_default))
        wait_for_steps(metrics, 3)
        workers[1].send_signal(signal.SIGINT)
        for p in workers + [coord]:
            p.wait(timeout=120)
    finally:
        for p in [coord] + workers:
            p.kill()
    coord_err, left_err, stays_err = (p.stderr.read() for p in (coord, workers[1], workers[0]))
    assert workers[1].returncode == 130 and "ddpwire: interrupted" in left_err
    assert coord.returncode == 1 and workers[0].returncode == 1
    gone = json.loads(metrics.read_text().splitlines()[0])["workers"]
    gone_id = next(w["worker"] for w in gone if w["name"].startswith("w1@"))
    error = next(line for line in coord_err.splitlines() if line.startswith("ddpwire: error:"))
    assert error.startswith(f"ddpwire: error: worker {gone_id} "), coord_err
    assert "--elastic lets the others go on without it" in coord_err
    # the survivor learns it from the mesh (the worker that left) or from the
    # coordinator ending the run, by timing: one line either way
    assert stays_err.count("ddpwire: error:") == 1 and "Traceback" not in stays_err


@needs_torch
@pytest.mark.slow
@pytest.mark.parametrize("topology", ["star", "mesh"])
def test_with_heartbeats_a_frozen_worker_is_named_long_before_the_timeout(tmp_path, topology):
    """--heartbeat 2 on every side: a worker stopped (SIGSTOP) is named as
    silent for 6 s (three beats), where --timeout 600 alone would hold the
    run for ten minutes."""
    port = free_port()
    metrics = tmp_path / "metrics.jsonl"
    common = ["--timeout", "600", "--heartbeat", "2"]
    coord = subprocess.Popen(PY + ["coordinator", "--bind", f"127.0.0.1:{port}", "--workers", "2",
                                   "--steps", "100000", "--samples", "64", "--metrics",
                                   str(metrics), "--topology", topology] + common,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers = [subprocess.Popen(PY + ["worker", "--connect", f"127.0.0.1:{port}", "--samples", "64",
                                      "--threads", "1", "--node-id", f"w{i}"] + common,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for i in range(2)]
    try:
        wait_for_steps(metrics, 3)
        os.kill(workers[1].pid, signal.SIGSTOP)
        coord.wait(timeout=300)  # well inside --timeout: only the heartbeats can end it
    finally:
        for p in workers:
            os.kill(p.pid, signal.SIGCONT)
        for p in [coord] + workers:
            p.kill()
            p.wait()
    err = coord.stderr.read()
    assert coord.returncode == 1, err
    error = next(line for line in err.splitlines() if line.startswith("ddpwire: error:"))
    assert "(w1@127.0.0.1) silent for 6 s" in error, err


def child_pids(pid: int) -> List[int]:
    """The processes whose parent is ``pid``, in pid order, from /proc (no tool to run)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return sorted(kids)


@needs_torch
@pytest.mark.slow
def test_the_elastic_demo_goes_on_when_one_of_its_workers_is_killed(tmp_path):
    metrics = tmp_path / "m.jsonl"
    demo = subprocess.Popen(PY + ["demo", "--workers", "3", "--elastic", "--steps", "300",
                                  "--samples", "96", "--threads", "1", "--metrics", str(metrics)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_steps(metrics, 3)
        children = child_pids(demo.pid)
        assert len(children) == 3, children
        os.kill(children[1], signal.SIGKILL)
        out, err = demo.communicate(timeout=240)
    finally:
        demo.kill()
    assert demo.returncode == 0, err
    # the demo's process 1 is node demo1, whatever worker id its join gave it
    assert "worker process 1 (node demo1) ended mid-run (exit status -9): the run went on " \
           "without it" in out
    assert "weights identical on all 2 workers" in out
    assert "(demo1@127.0.0.1) left during step" in out
    assert (out + err).count("left during step") == 1
    assert "going on with 2 workers" in out


def test_a_stop_signal_waits_while_a_steps_shards_go_out():
    """A Shutdown between two workers' ShardAssignments would leave one
    inside the step (in a mesh, waiting on the other): the coordinator
    counts as mid-frame from the first assignment to the last."""
    from session_helpers import start_workers

    coord = ddpwire.Coordinator(("127.0.0.1", 0), 2, timeout=10)
    try:
        threads = start_workers(coord, 2, lambda w: w.receive_shard())
        coord.wait_for_workers()
        seen = []
        for chan in coord._roster.channels:
            send_all = chan.send_all

            def recording(msgs, *, step=None, send_all=send_all):
                seen.extend((type(msg).__name__, coord.mid_frame) for msg in msgs)
                return send_all(msgs, step=step)
            chan.send_all = recording
        coord.set_total_samples(8)
        assert not coord.mid_frame
        coord.send_shard_assignments(0)
        assert not coord.mid_frame
        for t in threads:
            t.join_result()
    finally:
        coord.close()
    assert [m for m, _ in seen if m == "ShardAssignment"] == ["ShardAssignment"] * 2
    assert all(mid for _, mid in seen)
