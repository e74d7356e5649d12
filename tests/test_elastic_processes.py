"""Elastic sessions with worker processes: one killed (SIGKILL) or stopped
(SIGSTOP past the heartbeat timeout) at step 20 of 60; the others go on; the
killed one, restarted, or the stopped one, resumed, joins again about 10
steps later with the session's state; all three end with bit-identical
weights equal to one process's on the whole batch, and every sample of
every step was used exactly once."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from ddpwire import Coordinator  # noqa: E402
from ddpwire.cli.serve import serve  # noqa: E402
from ddpwire.torch import classification_batch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import elastic_script as script  # noqa: E402
from test_elastic import check_every_sample_once  # noqa: E402

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parent / "elastic_script.py"
STEPS, FAULT_AT, BACK_AT, REJOIN_AT = 60, 20, 25, 31


def one_process_weights(steps):
    """The unfaulted run: one process on each step's whole batch."""
    one = script.trainer(None)
    for step in range(steps):
        one.model.zero_grad()
        rows = one.dataset.rows(one.sampler.indices(step, 0, script.TOTAL))
        loss, _, _ = classification_batch(one.model, *rows)
        loss.backward()
        one.optimizer.step()
    return [p.detach() for p in one.model.parameters()]


@pytest.mark.parametrize("fault", ["sigkill", "sigstop"])
def test_a_run_goes_on_without_a_lost_worker_and_ends_as_one_unfaulted_process(tmp_path, fault):
    # a stopped worker is dropped once its heartbeats stop for script.SILENCE;
    # a slow one (the first step, on a busy machine) keeps the 30 s
    coord = Coordinator(("127.0.0.1", 0), 3, elastic=True, samples_per_step=script.TOTAL,
                        timeout=30.0, heartbeat=0.2, heartbeat_timeout=script.SILENCE,
                        join_timeout=60)
    host, port = coord.local_addr
    outs = [tmp_path / f"worker{i}.pt" for i in range(3)]
    procs = []
    try:
        for i in range(3):
            # the one killed kills itself inside step FAULT_AT, holding its shard
            extra = [str(FAULT_AT)] if fault == "sigkill" and i == 1 else []
            procs.append(subprocess.Popen([sys.executable, str(SCRIPT), host, str(port),
                                           str(outs[i])] + extra))
            coord.wait_for_workers(count=i + 1)
        by_worker = {}
        for i, p in enumerate(procs):
            by_worker[i] = p  # joined in order: worker id i is process i

        def on_step(report):
            if fault == "sigstop" and report.step == FAULT_AT - 1:
                os.kill(by_worker[1].pid, signal.SIGSTOP)
            if report.step == BACK_AT:
                if fault == "sigstop":
                    os.kill(by_worker[1].pid, signal.SIGCONT)
                else:
                    assert procs[1].wait(10) == -signal.SIGKILL
                    procs[1] = subprocess.Popen([sys.executable, str(SCRIPT), host, str(port),
                                                 str(outs[1])])
            if report.step == REJOIN_AT - 1:
                # a slow start must not race the run's end: wait for it here
                coord.wait_for_workers(count=3, timeout=60)
        reports = serve(coord, steps=STEPS, total_samples=script.TOTAL, on_step=on_step)
        codes = [p.wait(60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        coord.close()
    assert codes == [0, 0, 0]
    # back by the wait at REJOIN_AT at the latest, or at a step boundary
    # before it, as soon as its join completed
    joined = coord.membership[-1].step
    assert BACK_AT < joined <= REJOIN_AT
    assert [(e.step, e.worker_id, e.workers, e.committed, e.joined)
            for e in coord.membership] == [(FAULT_AT, 1, 2, False, False),
                                           (joined, 1, 3, False, True)]
    assert [e.worker_id for e in reports[FAULT_AT].membership] == [1]
    assert [e.worker_id for e in reports[joined].membership] == [1]
    check_every_sample_once(coord, STEPS, script.TOTAL)
    assert [set(shards) for _, shards in coord.shard_log] == \
        [{0, 1, 2}] * FAULT_AT + [{0, 2}] * (joined - FAULT_AT) + [{0, 1, 2}] * (STEPS - joined)
    ends = [torch.load(out) for out in outs]
    for i in (0, 2):
        assert ends[i]["steps"] == STEPS and ends[i]["redone"] == [(FAULT_AT, [1], 2)]
    back = ends[1]
    # a restarted process applied the steps from its join on; a resumed one
    # also those before it stopped (what it did meanwhile was left behind)
    assert back["steps"] == STEPS - joined + (FAULT_AT if fault == "sigstop" else 0)
    assert back["joins"][-1] == joined and back["next_step"] == STEPS
    if fault == "sigstop":
        # resumed, it heard it was dropped, and joined again
        assert [s for s, _ in back["dropped"]] == [FAULT_AT]
        assert "dropped this worker during step 20" in back["dropped"][0][1]
        assert back["joins"] == [None, joined]
    for other in (ends[1], ends[2]):
        for a, b in zip(ends[0]["weights"], other["weights"]):
            assert torch.equal(a, b)
    for a, b in zip(ends[0]["weights"], one_process_weights(STEPS)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_coordinator_killed_and_restarted_picks_the_run_up_where_its_workers_are(tmp_path):
    """The coordinator process SIGKILLs itself while step 20's shards are
    being computed; the workers keep their state, wait, and join the
    restarted coordinator (--resume), which goes on from step 20."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "shards.jsonl"
    coordinator = [sys.executable, str(Path(__file__).resolve().parent / "elastic_coordinator.py"),
                   str(port), str(STEPS), str(script.TOTAL), str(log)]
    first = subprocess.Popen(coordinator + ["--die-at", str(FAULT_AT)])
    outs = [tmp_path / f"worker{i}.pt" for i in range(3)]
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), "127.0.0.1", str(port), str(out)])
             for out in outs]
    try:
        assert first.wait(120) == -signal.SIGKILL
        second = subprocess.Popen(coordinator + ["--resume"])
        assert second.wait(120) == 0
        codes = [p.wait(60) for p in procs]
    finally:
        for p in procs + [first] + ([second] if "second" in locals() else []):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0, 0, 0]
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    # every step averaged exactly once, over the two coordinators, its shards tiling the batch
    assert [x["step"] for x in lines] == list(range(STEPS))
    assert {x["first"] for x in lines[FAULT_AT:]} == {FAULT_AT}
    for x in lines:
        bounds = sorted(tuple(b) for b in x["shards"].values())
        assert bounds[0][0] == 0 and bounds[-1][1] == script.TOTAL
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    ends = [torch.load(out) for out in outs]
    for end in ends:
        assert end["resumed"] == [FAULT_AT] and end["steps"] == STEPS
    for other in ends[1:]:
        for a, b in zip(ends[0]["weights"], other["weights"]):
            assert torch.equal(a, b)
    for a, b in zip(ends[0]["weights"], one_process_weights(STEPS)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
