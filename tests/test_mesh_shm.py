"""The mesh's shared-memory data plane (ddpwire.plane.shm.SharedPlane): every
worker on this host, so the coordinator grants it and the steps go through
one shared segment; tests/test_mesh.py runs its own tests on both planes.

Workers run as threads (each maps the segment for itself) except where a
process must die.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from ddpwire import Coordinator
from ddpwire.plane import shm
from ddpwire.wire.errors import NonFiniteGradient, WorkerLost

from mesh_session import (ADDR, TIMEOUT, Session, bits, gradients, halted_step,
                          run_flat_steps, untouched_out_step)
from session_helpers import reference_allreduce

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(not shm.enabled() or not os.path.isdir("/dev/shm"),
                                reason="no POSIX shared memory here")


@pytest.fixture(autouse=True)
def shm_on(monkeypatch):
    monkeypatch.delenv("DDPWIRE_SHM", raising=False)


def segments_of(pid):
    return [e for e in os.listdir("/dev/shm") if e.startswith(f"ddpw-{pid:x}-")]


@pytest.mark.parametrize("n,count", [(2, 1), (2, 65_537), (3, 100_003), (4, 1 << 18), (4, 5)])
def test_shared_memory_steps_give_the_reference_bits(n, count):
    grads = gradients(n, count, seed=n * count)
    before = set(os.listdir("/dev/shm"))
    s = run_flat_steps(grads)
    assert s.planes == {i: True for i in range(n)}
    want = reference_allreduce(grads)
    for i in range(n):
        assert np.array_equal(bits(s.results[i][0]), bits(want))
    # the name went as soon as every worker had attached
    assert not segments_of(os.getpid())
    assert set(os.listdir("/dev/shm")) <= before


@pytest.fixture
def planes_made(monkeypatch):
    """How many workers set up a shared plane (a mesh that fails drops its own)."""
    made = []
    init = shm.SharedPlane.__init__

    def counting(self, segment, **kw):
        made.append(segment.rank)
        init(self, segment, **kw)
    monkeypatch.setattr(shm.SharedPlane, "__init__", counting)
    return made


def test_a_nan_halts_with_nothing_written_into_out(planes_made):
    count = 40_000
    grads = gradients(3, count, seed=5)
    grads[2][30_001] = np.nan
    grads[1][39_999] = np.inf
    body = untouched_out_step(grads, np.float32(-7.25))

    s, halted = halted_step(3, body)
    assert sorted(planes_made) == [0, 1, 2]
    # the lowest worker holding one, then its first element
    assert (halted.worker_id, halted.index) == (1, 39_999)
    assert sorted(s.errors) == [0, 1, 2]
    for exc in s.errors.values():
        assert isinstance(exc, NonFiniteGradient) and exc.worker_id == 1 and exc.step == 0


def test_a_non_finite_value_in_a_worker_s_own_slice_is_reported_with_its_value(planes_made):
    # a worker reads its own slice from its gradients, never from its input
    # region: the report must come from there, with the value itself
    count = 40_000  # worker 1's slice: [13328, 26656)
    grads = gradients(3, count, seed=7)
    grads[1][20_000] = np.inf        # worker 1's first: this one
    grads[1][20_001] = -np.inf
    grads[2][19_000] = np.nan        # same slice, a later worker

    def body(w):
        out = np.zeros(count, dtype=np.float32)
        w.allreduce(0, grads[w.worker_id], 1.0, 1, 1, out=out)

    s, halted = halted_step(3, body)
    assert sorted(planes_made) == [0, 1, 2]
    assert (halted.worker_id, halted.index, halted.value) == (1, 20_000, np.inf)
    for exc in s.errors.values():
        assert isinstance(exc, NonFiniteGradient)
        assert (exc.worker_id, exc.index, exc.value) == (1, 20_000, np.inf)


def test_a_worker_that_leaves_after_its_report_is_named_and_nothing_is_applied(planes_made):
    count = 300_000
    grads = gradients(3, count, seed=6)
    sentinel = np.float32(3.5)

    def body(w):
        w.allreduce(0, grads[w.worker_id], 1.0, 1, 1)
        out = np.full(count, sentinel, dtype=np.float32)
        w.send_gradients(1, grads[w.worker_id], 1.0, 1, 1)
        if w.worker_id == 2:
            return "left"  # reported, then gone before the go-ahead's barrier
        try:
            w.receive_averaged(out=out)
        finally:
            assert (out == sentinel).all() or np.array_equal(bits(out),
                                                             bits(reference_allreduce(grads)))

    s = Session(3, body, timeout=5.0)
    try:
        s.coord.allreduce(0)
        try:
            s.coord.allreduce(1)
        except WorkerLost as exc:
            assert exc.worker_id == 2
    finally:
        s.join()
    assert sorted(planes_made) == [0, 1, 2]
    assert s.results[2] == "left"
    assert sorted(s.errors) == [0, 1]
    for exc in s.errors.values():
        assert isinstance(exc, WorkerLost) and exc.worker_id == 2 and exc.step == 1, exc


def test_a_worker_that_cannot_attach_keeps_everyone_on_the_links(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("attach refused by the test")
    monkeypatch.setattr(shm.Segment, "attach", classmethod(refuse))
    grads = gradients(3, 50_001, seed=7)
    s = run_flat_steps(grads)
    assert s.coord.mesh
    assert s.planes == {0: False, 1: False, 2: False}
    want = reference_allreduce(grads)
    for i in range(3):
        assert np.array_equal(bits(s.results[i][0]), bits(want))
    assert not segments_of(os.getpid())


@pytest.mark.parametrize("how", ["env", "coordinator"])
def test_shared_memory_turned_off_keeps_the_links(monkeypatch, how):
    coordinator = None
    if how == "env":
        monkeypatch.setenv("DDPWIRE_SHM", "0")
    else:
        coordinator = {"shared_memory": False}
    grads = gradients(2, 10_000, seed=8)
    s = run_flat_steps(grads, **(coordinator or {}))
    assert s.planes == {0: False, 1: False}
    assert np.array_equal(bits(s.results[0][0]), bits(reference_allreduce(grads)))


def test_compression_keeps_the_links():
    grads = gradients(2, 1000, seed=9)
    s = run_flat_steps(grads, compression="bf16")
    assert s.planes == {0: False, 1: False}


WORKER = r"""
import os, sys
import numpy as np
from ddpwire import Worker
host, port, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
w = Worker.connect((host, port), timeout=10.0)
print("pid", w.worker_id, os.getpid(), flush=True)
g = np.random.default_rng(w.worker_id).standard_normal(200_000).astype(np.float32)
try:
    for step in range(steps):
        if w.worker_id == 0 and step == 2:
            os._exit(17)  # the segment's creator dies mid-session
        w.allreduce(step, g, 1.0, 1, 1)
        print("plane", w._mesh_step.mesh.plane is not None, flush=True)
    print("done", flush=True)
except Exception as exc:
    print("error", type(exc).__name__, getattr(exc, "worker_id", None),
          getattr(exc, "step", None), flush=True)
finally:
    w.close()
"""


def test_a_killed_creator_is_named_and_leaves_no_segment():
    coord = Coordinator(ADDR, 3, timeout=10.0, join_timeout=TIMEOUT)
    host, port = coord.local_addr[:2]
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("DDPWIRE_SHM", None)
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, host, str(port), "4"], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(3)]
    try:
        coord.wait_for_workers()
        coord.allreduce(0)
        coord.allreduce(1)
        with pytest.raises(WorkerLost) as info:
            coord.allreduce(2)
        assert info.value.worker_id == 0 and info.value.step == 2
    finally:
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=3 * TIMEOUT)[0])
            except subprocess.TimeoutExpired:
                p.kill()
                outs.append(p.communicate()[0])
        coord.close()
    lines = {}
    for text in outs:
        wid = pid = None
        for line in text.splitlines():
            if line.startswith("pid "):
                _, wid, pid = line.split()
                wid, pid = int(wid), int(pid)
        assert wid is not None, text
        lines[wid] = (pid, text)
    pid0, text0 = lines[0]
    assert [p.returncode for p in procs].count(17) == 1
    assert "plane True" in text0
    for wid in (1, 2):
        assert "plane True" in lines[wid][1]
        assert "error WorkerLost 0 2" in lines[wid][1], lines[wid][1]
    assert not segments_of(pid0)
