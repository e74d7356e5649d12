"""Peers killed outright (SIGKILL) mid-step: the survivor raises a typed error
naming the lost peer and the step, within its timeout."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import ddpwire
from ddpwire import Coordinator, Worker

from session_helpers import join_up_to, spawn


def test_coordinator_process_killed_mid_step():
    script = textwrap.dedent("""
        import sys, time
        from ddpwire import Coordinator, GradientPayload
        coord = Coordinator(("127.0.0.1", 0), expect_workers=1, topology="star")
        print(coord.local_addr[1], flush=True)
        coord.wait_for_workers()
        coord.set_total_samples(8)
        coord.send_shard_assignments(0)
        head = coord.channel(0).read_head([GradientPayload], step=0)   # the gradients started arriving
        print("collecting", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        with Worker.connect(("127.0.0.1", port), timeout=60) as w:
            shard = w.receive_shard()
            w.send_gradients(shard.step, np.ones(1000, np.float32), 1.0, 1, 8)
            assert proc.stdout.readline().strip() == "collecting"
            proc.send_signal(signal.SIGKILL)
            with pytest.raises(ddpwire.CoordinatorLost) as info:
                w.receive_averaged()
        assert info.value.step == 0
        assert "disconnected" in str(info.value)
    finally:
        proc.kill()
        proc.wait()


def test_worker_process_killed_mid_step():
    script = textwrap.dedent("""
        import sys, time
        import numpy as np
        from ddpwire import Worker
        w = Worker.connect(("127.0.0.1", int(sys.argv[1])), timeout=60)
        shard = w.receive_shard()
        print("computing", flush=True)
        time.sleep(600)
    """)
    with Coordinator(("127.0.0.1", 0), expect_workers=2, timeout=60, topology="star") as coord:
        good = spawn(lambda: Worker.connect(coord.local_addr, timeout=60))
        join_up_to(coord, 1)
        proc = subprocess.Popen([sys.executable, "-c", script, str(coord.local_addr[1])],
                                stdout=subprocess.PIPE, text=True)
        try:
            coord.wait_for_workers()
            w0 = good.join_result()
            coord.set_total_samples(8)
            coord.send_shard_assignments(3)
            assert proc.stdout.readline().strip() == "computing"
            w0.receive_shard()
            w0.send_gradients(3, np.ones(10, np.float32), 1.0, 1, 4)
            proc.send_signal(signal.SIGKILL)
            with pytest.raises(ddpwire.WorkerLost) as info:
                coord.collect_and_reduce(3)
            assert info.value.worker_id == 1 and info.value.step == 3
            assert "disconnected" in str(info.value)
            w0.close()
        finally:
            proc.kill()
            proc.wait()
