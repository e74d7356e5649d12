"""What the ddpwire command says when the command line is wrong: the
command's words (its flags, never the Python API's keywords), exit status 2
as --help promises, and found before anything listens or trains."""
from __future__ import annotations

import subprocess
import sys

import pytest

from ddpwire import Coordinator
from ddpwire.cli import FLAGS
from ddpwire.wire.errors import OptionError

PY = [sys.executable, "-m", "ddpwire"]

#: what the Python API calls things, which a command-line user never typed
KEYWORDS = ("elastic=True", "expect_workers", "min_workers", "per_block", "samples_per_step",
            "topology=", "compression=", "resume=")


def command(args, timeout=60):
    return subprocess.run(PY + args, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("args,says", [
    (["--workers", "2", "--resume"], "--resume picks up an elastic session's run: it needs --elastic"),
    (["--workers", "2", "--min-workers", "2"], "--min-workers ends an elastic run early: it needs --elastic"),
    (["--workers", "2", "--elastic", "--min-workers", "3"], "--min-workers must be from 1 to --workers (2), got 3"),
    (["--workers", "0"], "argument --workers: a whole number from 1; got '0'"),
    (["--workers", "2", "--timeout", "0"], "--timeout must be a finite number of seconds > 0"),
    (["--workers", "2", "--join-timeout", "-1"], "--join-timeout must be a finite number of seconds > 0"),
    (["--workers", "2", "--samples", "-1"], "--samples must be >= 0, got -1"),
    (["--workers", "2", "--elastic", "--topology", "mesh"], "--elastic averages on the star: --topology mesh"),
    (["--workers", "2", "--topology", "star", "--compression", "bf16"],
     "--compression travels on the mesh: it cannot go with --topology star"),
    (["--workers", "2", "--elastic", "--per-block"], "--elastic runs flat steps: it cannot go with --per-block"),
    (["--workers", "2", "--metrics", "/nonexistent-ddpwire/m.jsonl"],
     "--metrics /nonexistent-ddpwire/m.jsonl: the folder /nonexistent-ddpwire does not exist"),
    (["--workers", "2", "--token-file", "/nonexistent-ddpwire/token"],
     "--token-file: cannot read the token file /nonexistent-ddpwire/token"),
])
def test_a_bad_coordinator_command_line_says_so_in_flags_and_exits_2(args, says):
    proc = command(["coordinator", "--bind", "127.0.0.1:0", "--join-timeout", "30"] + args)
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr
    assert not any(k in proc.stderr for k in KEYWORDS), proc.stderr
    # refused before listening: nothing was opened for workers to join
    assert "listening" not in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_metrics_folder_is_checked_before_the_demo_starts_workers(tmp_path):
    proc = command(["demo", "--metrics", str(tmp_path / "missing" / "m.jsonl")])
    assert proc.returncode == 2
    assert f"the folder {tmp_path / 'missing'} does not exist" in proc.stderr
    assert "ddpwire demo:" not in proc.stdout  # no session was started


def test_a_folder_given_as_the_report_file_is_refused_before_the_worker_joins(tmp_path):
    # port 9 (discard) on loopback: nothing there, and nothing is tried
    proc = command(["worker", "--connect", "127.0.0.1:9", "--report", str(tmp_path)])
    assert proc.returncode == 2
    assert f"--report {tmp_path}: that is a folder, not a file" in proc.stderr


def test_the_python_api_still_speaks_its_keywords():
    with pytest.raises(OptionError) as caught:
        Coordinator(("127.0.0.1", 0), 2, resume=True)
    assert str(caught.value) == "resume picks up an elastic session's run: it needs elastic=True"
    assert isinstance(caught.value, ValueError)  # what callers caught before
    assert caught.value.spelled(FLAGS) == "--resume picks up an elastic session's run: it needs --elastic"


def test_a_literal_with_braces_in_an_option_message_is_kept_as_given():
    with pytest.raises(OptionError) as caught:
        Coordinator(("127.0.0.1", 0), 2, timeout={"a": 1})
    assert "got {'a': 1}" in str(caught.value)
