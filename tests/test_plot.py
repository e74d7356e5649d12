"""ddpwire plot: a real run's --metrics drawn as SVG and PNG, every series
there; an elastic run's workers leaving and joining; bad input and a
missing matplotlib in one line each."""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from ddpwire.session.balance import WorkerTiming
from ddpwire.session.results import MembershipEvent, StepReport
from test_cli import _session, needs_torch, run

needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason="needs the [plot] extra (matplotlib)")

SVG = "{http://www.w3.org/2000/svg}"
STEPS = 12


def plot(*args: str) -> subprocess.CompletedProcess:
    return run(["plot", *args], timeout=120)


def series(svg_path) -> dict:
    """Each drawn series (its id) -> the steps its line passes through
    (the vertices of its path) and the markers on it."""
    root = ET.parse(svg_path).getroot()
    found = {}
    for g in root.iter(f"{SVG}g"):
        if g.get("id", "").startswith("series-"):
            d = g.find(f"{SVG}path").get("d")
            found[g.get("id")[len("series-"):]] = (len(re.findall(r"[ML]", d)),
                                                   len(g.findall(f".//{SVG}use")))
    return found


def texts(svg_path) -> str:
    return "\n".join("".join(t.itertext()) for t in ET.parse(svg_path).getroot().iter(f"{SVG}text"))


@pytest.fixture(scope="module")
def run_metrics(tmp_path_factory):
    """The --metrics file of a real two-worker run of STEPS steps."""
    tmp = tmp_path_factory.mktemp("run")
    path = tmp / "run.jsonl"
    coord, workers, outputs, _ = _session(
        tmp, ["--steps", str(STEPS), "--samples", "64", "--metrics", str(path)],
        ["--samples", "64", "--threads", "1"])
    assert coord.returncode == 0, outputs[coord.pid][1]
    assert all(w.returncode == 0 for w in workers), [outputs[w.pid][1] for w in workers]
    return path


@needs_torch
@needs_matplotlib
@pytest.mark.slow
def test_a_real_runs_metrics_draw_every_series(run_metrics, tmp_path):
    lines = [json.loads(x) for x in run_metrics.read_text().splitlines()]
    names = [w["name"] for w in lines[0]["workers"]]
    assert len(lines) == STEPS and len(names) == 2 and all("@" in n for n in names)

    proc = plot(str(run_metrics), "-o", str(tmp_path / "out.svg"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"ddpwire: wrote {tmp_path / 'out.svg'} ({STEPS} steps)"
    drawn = series(tmp_path / "out.svg")
    # one line per figure, each through every step, no gap, no lone step
    assert drawn == {name: (STEPS, 0) for name in [
        "loss", "throughput", "step-time", "shard-w0", "shard-w1",
        "compute-w0", "compute-w1", "wait-w0", "wait-w1"]}
    words = texts(tmp_path / "out.svg")
    for word in ["loss", "samples/s", "shard", "step time", "compute", "wait", "step",
                 run_metrics.name]:
        assert word in words
    for i, name in enumerate(names):
        assert f"worker {i} ({name})" in words

    png = tmp_path / "out.png"
    proc = plot(str(run_metrics), "-o", str(png), "--title", "a title")
    assert proc.returncode == 0, proc.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width >= 600 and height >= 600 and len(data) > 20_000

    # without -o: next to the metrics, .svg for .jsonl
    proc = plot(str(run_metrics))
    assert proc.returncode == 0, proc.stderr
    assert series(run_metrics.with_suffix(".svg")) == drawn


def _step(step, workers, membership=()) -> str:
    """A --metrics line as the coordinator writes it (StepReport.as_json)."""
    timings = [WorkerTiming(worker_id=w, samples=shard, compute=0.01, rate=None, arrival=0.012,
                            name=f"node{w}@10.0.0.{w}") for w, shard in workers]
    report = StepReport(step=step, global_loss=2.0 - step / 10, accuracy=0.5, samples=64,
                        allreduce_time=0.001, step_time=0.02, workers=timings,
                        membership=list(membership))
    return json.dumps(report.as_json()) + "\n"


def elastic_metrics(path) -> None:
    """Workers 0 and 1 for steps 0-4; worker 1 lost during step 5 (called
    off and computed again without it); worker 2 in for step 8 alone,
    leaving during step 8 after its average went out."""
    left = MembershipEvent(step=5, worker_id=1, why="worker 1 disconnected", workers=1,
                           committed=False, name="node1@10.0.0.1")
    joined = MembershipEvent(step=8, worker_id=2, why="joined from node2@10.0.0.2", workers=2,
                             committed=False, joined=True, name="node2@10.0.0.2")
    gone = MembershipEvent(step=8, worker_id=2, why="worker 2 disconnected", workers=1,
                           committed=True, name="node2@10.0.0.2")
    path.write_text("".join(
        _step(s, [(0, 32), (1, 32)] if s < 5 else [(0, 44), (2, 20)] if s == 8 else [(0, 64)],
              [left] if s == 5 else [joined, gone] if s == 8 else ())
        for s in range(10)))


@needs_matplotlib
def test_workers_leaving_and_joining_are_marked(tmp_path):
    metrics = tmp_path / "elastic.jsonl"
    elastic_metrics(metrics)
    proc = plot(str(metrics), "-o", str(tmp_path / "e.svg"), "--event", "3")
    assert proc.returncode == 0, proc.stderr
    drawn = series(tmp_path / "e.svg")
    assert drawn["loss"] == (10, 0)
    assert drawn["shard-w0"] == (10, 0)
    # worker 1 stops at step 4; worker 2's one step shows as a marker
    assert drawn["shard-w1"] == drawn["compute-w1"] == (5, 0)
    assert drawn["shard-w2"] == drawn["wait-w2"] == (1, 1)
    words = texts(tmp_path / "e.svg")
    assert "worker 1 (node1@10.0.0.1) left" in words
    assert "worker 2 (node2@10.0.0.2) joined" in words
    assert "worker 2 (node2@10.0.0.2) left" in words


@pytest.mark.parametrize("content,message", [
    (None, "cannot read {path}: No such file or directory"),
    ("", "{path} holds no steps (an empty metrics file)"),
    ("\n  \n", "{path} holds no steps (an empty metrics file)"),
    ("good\n\n{\"step\": 2, \"loss\n", "{path} line 3 is not JSON: "),
    ("good\n[1, 2]\n", "{path} line 2 is not a step of a --metrics file"),
    ("good\n{\"loss\": 1.0}\n", "{path} line 2 is not a step of a --metrics file"),
    ("good\n\xff\xfe\n", "{path} line 2 is not JSON: "),
], ids=["missing", "empty", "blank", "not-json", "not-an-object", "no-step", "not-utf8"])
def test_bad_input_is_one_line(tmp_path, content, message):
    path = tmp_path / "m.jsonl"
    if content is not None:
        good = _step(0, [(0, 32), (1, 32)]).strip()
        path.write_bytes(content.replace("good", good).encode("latin-1"))
    proc = plot(str(path), "-o", str(tmp_path / "out.svg"))
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ddpwire: error: " + message.format(path=path)), lines[0]
    assert not (tmp_path / "out.svg").exists()


@pytest.mark.parametrize("out", ["out.pdf", "out", "m.jsonl"])
def test_an_output_it_cannot_write_is_a_usage_error(tmp_path, out):
    path = tmp_path / "m.jsonl"
    path.write_text(_step(0, [(0, 64)]))
    proc = plot(str(path), "-o", str(tmp_path / out))
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "ddpwire: error: " in proc.stderr
    assert path.read_text() == _step(0, [(0, 64)])


def test_without_matplotlib_it_says_how_to_install_it(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(_step(0, [(0, 64)]))
    code = ("import sys; sys.modules['matplotlib'] = None; from ddpwire.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "plot", str(path)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr == ("ddpwire: error: ddpwire plot needs matplotlib, not installed here: "
                           "pip install 'ddpwire[plot]'\n")
    assert not path.with_suffix(".svg").exists()


def test_help_has_no_markup():
    proc = plot("--help")
    assert proc.returncode == 0 and "usage: ddpwire plot" in proc.stdout
    assert "`" not in proc.stdout and "pip install 'ddpwire[plot]'" in proc.stdout
