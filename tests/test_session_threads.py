"""The coordinator's stream on one thread per worker connection
(csrc/threaded.c): who is blamed when two workers fail in different ways,
Ctrl-C while the threads run, and nothing left behind after a step.

Results (bit-identical averages, NaN halts, lost and silent workers) are
checked for both stream loops in test_session_pipeline.py and
test_session_faults.py."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import ddpwire
from ddpwire import Coordinator, encode_frame
from ddpwire.messages import GradientPayload

from session_helpers import exact_mean, join_up_to, raw_join, spawn, start_workers

ADDR = ("127.0.0.1", 0)
LOOPS = pytest.mark.parametrize("socket_threads", [False, True], ids=["one-loop", "threads"])
PROC = Path("/proc/self")


def payload(step, worker_id, g):
    return encode_frame(GradientPayload(step=step, worker_id=worker_id, gradients=g, loss=1.0,
                                        correct=1, total=1))


@LOOPS
def test_worker_owing_bytes_is_blamed_before_one_that_does_not_read(socket_threads):
    """Worker 0 sends its whole frame and never reads the reply, so sends to
    it stall; worker 1 trickles a few bytes past the middle of its frame for
    longer than the timeout, then stops. Worker 0's socket goes quiet first,
    but only worker 1 owes anything: it is the one named."""
    size = 8 << 20  # a 32 MiB reply: far more than the socket buffers hold
    g = np.ones(size, np.float32)
    with Coordinator(ADDR, expect_workers=2, timeout=0.5, ring_bytes=1 << 20,
                     max_frame=2 * 4 * size, socket_threads=socket_threads) as coord:
        raws = []
        for k in range(2):
            raws.append(spawn(lambda k=k: raw_join(coord.local_addr, node_id=f"raw{k}")))
            join_up_to(coord, k + 1)
        s0, s1 = (t.join_result() for t in raws)
        full = payload(0, 1, g)
        half = len(full) // 2

        def trickle():
            s1.sendall(full[:half])
            for k in range(8):
                time.sleep(0.2)
                s1.sendall(full[half + 4 * k: half + 4 * k + 4])
        senders = [spawn(lambda: s0.sendall(payload(0, 0, g))), spawn(trickle)]
        with pytest.raises(ddpwire.WorkerLost) as info:
            coord.allreduce(0)
        for t in senders:
            t.join_result()
        s0.close()
        s1.close()
    assert (info.value.worker_id, info.value.step) == (1, 0)
    assert "silent for 0.5 s" in str(info.value)


@pytest.mark.skipif(not PROC.exists(), reason="counts threads and descriptors through /proc")
def test_threaded_steps_leave_no_thread_or_descriptor_behind():
    n, size, steps = 3, 200_003, 12
    rng = np.random.default_rng(5)
    grads = [rng.standard_normal(size).astype(np.float32) for _ in range(n)]
    want = exact_mean(grads)

    def counts():
        return len(os.listdir(PROC / "task")), len(os.listdir(PROC / "fd"))

    with Coordinator(ADDR, expect_workers=n, ring_bytes=64 * 1024, socket_threads=True) as coord:
        def body(w):
            for step in range(steps):
                avg = w.allreduce(step, grads[w.worker_id], 1.0, 1, 1)
                assert np.array_equal(avg.gradients, want)
        threads = start_workers(coord, n, body)
        out = np.empty(size, np.float32)
        coord.allreduce(0, out=out)
        after_first = counts()
        for step in range(1, steps):
            # every worker waits on this step, so the same threads and
            # sockets are alive each time we count
            assert counts() == after_first
            coord.allreduce(step, out=out)
            assert np.array_equal(out, want)
        for t in threads:
            t.join_result()


@pytest.mark.skipif(not PROC.exists(), reason="counts threads through /proc")
def test_ctrl_c_stops_the_threaded_stream_and_joins_its_threads():
    tests_dir = str(Path(__file__).resolve().parent)
    script = textwrap.dedent(f"""
        import os, sys, threading
        sys.path.insert(0, {tests_dir!r})
        import numpy as np
        from ddpwire import Coordinator, encode_frame
        from ddpwire.messages import GradientPayload
        from session_helpers import join_up_to, raw_join, spawn

        coord = Coordinator(("127.0.0.1", 0), expect_workers=2, timeout=600,
                            socket_threads=True)
        raws = []
        for k in range(2):
            raws.append(spawn(lambda k=k: raw_join(coord.local_addr, node_id=f"raw{{k}}")))
            join_up_to(coord, k + 1)
        s0, s1 = (t.join_result() for t in raws)
        g = np.ones(100_000, np.float32)
        frames = [encode_frame(GradientPayload(step=0, worker_id=k, gradients=g, loss=1.0,
                                               correct=1, total=1)) for k in range(2)]
        s0.sendall(frames[0])
        s1.sendall(frames[1][: len(frames[1]) // 2])  # then silent: the stream waits on it
        before = len(os.listdir("/proc/self/task"))
        print("blocked", flush=True)
        try:
            coord.allreduce(0)
        except KeyboardInterrupt:
            print("interrupted", before, len(os.listdir("/proc/self/task")), flush=True)
            sys.exit(3)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "blocked"
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 3
        word, before, after = proc.stdout.readline().split()
        assert word == "interrupted"
        assert int(after) == int(before)
    finally:
        proc.kill()


def test_default_chooses_threads_only_with_a_core_per_worker_and_a_large_vector(monkeypatch):
    from ddpwire import coordinator as mod
    class Head:
        def __init__(self, count):
            self.gradient_count = count
    big, small = [Head(1 << 18)], [Head((1 << 18) - 1)]  # 1 MiB, and one element less
    with Coordinator(ADDR, expect_workers=1) as coord:
        coord._channels = [object()] * 3
        monkeypatch.setattr(mod, "_usable_cores", lambda: 4)
        assert coord._use_socket_threads(big)
        assert not coord._use_socket_threads(small)  # starting threads would cost more than they save
        monkeypatch.setattr(mod, "_usable_cores", lambda: 3)
        assert not coord._use_socket_threads(big)
        coord.socket_threads = True
        assert coord._use_socket_threads(small)
        coord.socket_threads = False
        monkeypatch.setattr(mod, "_usable_cores", lambda: 64)
        assert not coord._use_socket_threads(big)
        coord._channels = [object()]
        coord.socket_threads = None
        assert not coord._use_socket_threads(big)  # one worker: nothing to spread
        coord._channels = []
