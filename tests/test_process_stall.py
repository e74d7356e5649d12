"""A worker process frozen (SIGSTOP) inside a step: the coordinator names
it, never the live worker that waits for it (docs/sessions.md, "The mesh:
who averages, and what fails how"), on the star and on the mesh, over
shared memory and over TCP links, with and without heartbeats."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

import ddpwire
from ddpwire import Coordinator
from ddpwire.plane import shm
from ddpwire.session.mesh_control import MESH_BLAME_GRACE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# short, so the test stays short, and far above a loopback step of 1000 elements
TIMEOUT = 4.0
HEARTBEAT = 0.25
SILENCE = 1.5  # the heartbeat_timeout, both sides: six heartbeats, slack for a loaded machine
SLOW = MESH_BLAME_GRACE + 0.5

# Worker 1 stops itself once it holds step 2's shard, before any byte of its
# step leaves, so worker 0 is always the one left waiting on a peer. In the
# slow cases worker 0 computes for SLOW first, longer than the coordinator's
# grace, so that its wait for worker 1 starts well after the coordinator's.
WORKER = r"""
import os, signal, sys, time
import numpy as np
from ddpwire import Worker

port, timeout, heartbeat, silence, slow = sys.argv[1:6]
beats = {} if heartbeat == "0" else dict(heartbeat=float(heartbeat),
                                          heartbeat_timeout=float(silence))
w = Worker.connect(("127.0.0.1", int(port)), timeout=float(timeout), node_id=str(os.getpid()),
                   **beats)
print("worker", w.worker_id, flush=True)
g = np.full(1000, w.worker_id + 1.0, np.float32)
try:
    while True:
        shard = w.receive_shard()
        if shard is None:
            break
        if shard.step == 2:
            if w.worker_id == 1:
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                time.sleep(float(slow))
        w.allreduce(shard.step, g, 1.0, 1, 4)
        plane = w._mesh_step.mesh is not None and w._mesh_step.mesh.plane is not None
        print("step", shard.step, "mesh", w.uses_mesh, "plane", plane, flush=True)
except Exception as exc:
    print("error", type(exc).__name__, getattr(exc, "worker_id", None),
          getattr(exc, "step", None), exc, flush=True)
finally:
    w.close()
"""

CASES = [
    # (topology, shared memory, heartbeats, worker 0's compute time in step 2)
    pytest.param("star", False, False, 0.0, id="star"),
    pytest.param("star", False, True, 0.0, id="star-heartbeats"),
    pytest.param("mesh", True, False, 0.0, id="mesh-shm"),
    pytest.param("mesh", True, True, 0.0, id="mesh-shm-heartbeats"),
    pytest.param("mesh", True, False, SLOW, id="mesh-shm-slow-peer-wait"),
    pytest.param("mesh", False, False, 0.0, id="mesh-tcp"),
    pytest.param("mesh", False, True, 0.0, id="mesh-tcp-heartbeats"),
    pytest.param("mesh", False, False, SLOW, id="mesh-tcp-slow-peer-wait"),
]


def _finish(procs, stalled):
    """Every worker's output: the stopped one is woken and killed, the
    others end by themselves (their step fails once the coordinator closes
    or their wait for the stopped one runs out) or are killed."""
    outs = []
    for p in procs:
        if p.pid == stalled:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
    for p in procs:
        try:
            outs.append(p.communicate(timeout=6 * TIMEOUT)[0])
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
            outs.append(p.communicate()[0])
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("topology,shared_memory,heartbeats,slow", CASES)
def test_a_frozen_worker_is_named_not_the_live_one_waiting_for_it(topology, shared_memory,
                                                                     heartbeats, slow):
    if shared_memory and (not shm.enabled() or not os.path.isdir("/dev/shm")):
        pytest.skip("no POSIX shared memory here")
    beats = dict(heartbeat=HEARTBEAT, heartbeat_timeout=SILENCE) if heartbeats else {}
    coord = Coordinator(("127.0.0.1", 0), 2, timeout=TIMEOUT, join_timeout=60,
                        topology=topology, shared_memory=shared_memory, **beats)
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("DDPWIRE_SHM", None)
    args = [str(coord.local_addr[1]), str(TIMEOUT), str(HEARTBEAT if heartbeats else 0),
            str(SILENCE), str(slow)]
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, *args], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    stalled = None
    try:
        coord.wait_for_workers()
        stalled = int(coord.workers[1].node_id)
        coord.set_total_samples(8)
        for step in (0, 1):
            coord.send_shard_assignments(step)
            coord.allreduce(step)
        coord.send_shard_assignments(2)
        with pytest.raises(ddpwire.WorkerLost) as info:
            coord.allreduce(2)
    finally:
        coord.close()
        if stalled is None:  # the join failed: nobody is stopped yet
            for p in procs:
                p.kill()
        outs = _finish(procs, stalled)
    assert info.value.worker_id == 1 and info.value.step == 2, (info.value, outs)
    assert coord.mesh == (topology == "mesh")
    by_id = {}
    for text in outs:
        lines = text.splitlines()
        assert lines and lines[0].startswith("worker "), text
        by_id[int(lines[0].split()[1])] = text
    # the steps ran on the plane the case means to exercise
    assert f"step 1 mesh {topology == 'mesh'} plane {shared_memory}" in by_id[0], by_id[0]
