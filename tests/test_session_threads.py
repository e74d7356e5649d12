"""Socket threads: the coordinator's receiving and sending thread per
worker connection (csrc/threaded.c) and the worker's sending thread
(csrc/sender.c). Who is blamed when two workers fail in different ways,
Ctrl-C while the threads run, nothing left behind after a step, and the
defaults.

Results (bit-identical averages, NaN halts, lost and silent workers) are
checked for both stream loops in test_session_pipeline.py and
test_session_faults.py."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import ddpwire
from ddpwire import Coordinator, encode_frame
from ddpwire.wire.messages import GradientPayload

from session_helpers import exact_mean, join_up_to, raw_join, spawn, start_workers

ADDR = ("127.0.0.1", 0)
LOOPS = pytest.mark.parametrize("socket_threads", [False, True], ids=["one-loop", "threads"])
PROC = Path("/proc/self")
TESTS = str(Path(__file__).resolve().parent)


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
    with Coordinator(ADDR, topology="star", expect_workers=2, timeout=0.5, ring_bytes=1 << 20,
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

    def counts(like=None):
        # a joined thread leaves /proc a moment after pthread_join returns
        for _ in range(200):
            now = len(os.listdir(PROC / "task")), len(os.listdir(PROC / "fd"))
            if now == like or like is None:
                break
            time.sleep(0.01)
        return now

    # every step ends at a barrier of the workers and this thread, so each
    # count sees the same threads and sockets: nothing of a step still running
    barrier = threading.Barrier(n + 1, timeout=30)
    with Coordinator(ADDR, topology="star", expect_workers=n, ring_bytes=64 * 1024, socket_threads=True) as coord:
        def body(w):
            for step in range(steps):
                avg = w.allreduce(step, grads[w.worker_id], 1.0, 1, 1)
                assert np.array_equal(avg.gradients, want)
                barrier.wait()  # step over
                barrier.wait()  # counted
        threads = start_workers(coord, n, body, socket_threads=True)
        out = np.empty(size, np.float32)
        seen = []
        for step in range(steps):
            coord.allreduce(step, out=out)
            assert np.array_equal(out, want)
            barrier.wait()
            seen.append(counts(like=seen[0] if seen else None))
            barrier.wait()
        for t in threads:
            t.join_result()
    assert seen == [seen[0]] * steps


def interrupted_thread_counts(script: str) -> tuple:
    """Run ``script`` (it prints "blocked", then blocks in ddpwire, then on
    KeyboardInterrupt prints "interrupted BEFORE AFTER" thread counts and
    exits 3), send it SIGINT, and return (BEFORE, AFTER). The scripts keep
    their peers out of the signalled process: its only threads are the ones
    ddpwire starts, so the counts compare like with like."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "blocked"
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 3
        word, before, after = proc.stdout.readline().split()
        assert word == "interrupted"
        return int(before), int(after)
    finally:
        proc.kill()


# a peer in a process of its own: joins (or answers a join) and then only
# does what it is told on its stdin: "full N", "half N" (send that much of a
# GradientPayload of N elements), or nothing (hold the connection, never read)
PEER = """
import socket, sys, time
import numpy as np
sys.path.insert(0, {tests!r})
import ddpwire
from ddpwire import encode_frame
from ddpwire.wire.messages import GradientPayload
from session_helpers import recv_frame
role, port = sys.argv[1], int(sys.argv[2])
if role == "coordinator":
    lsock = socket.create_server(("127.0.0.1", port))
    print(lsock.getsockname()[1], flush=True)
    conn, _ = lsock.accept()
    recv_frame(conn)
    conn.sendall(encode_frame(ddpwire.JoinAccepted(worker_id=0, total_workers=1)))
else:
    conn = socket.create_connection(("127.0.0.1", port))
    conn.sendall(encode_frame(ddpwire.JoinRequest(node_id=role, gpu_count=0, backend="cpu")))
    me = recv_frame(conn).worker_id
    how, n = sys.stdin.readline().split()
    frame = encode_frame(GradientPayload(step=0, worker_id=me, gradients=np.ones(int(n), np.float32),
                                         loss=1.0, correct=1, total=1))
    conn.sendall(frame if how == "full" else frame[: len(frame) // 2])
    print("sent", flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not PROC.exists(), reason="counts threads through /proc")
def test_ctrl_c_stops_the_threaded_stream_and_joins_its_threads():
    """Worker 0 sends all, worker 1 half its frame and then nothing: the
    coordinator's threads wait on worker 1 until Ctrl-C."""
    before, after = interrupted_thread_counts(f"""
        import os, subprocess, sys, time

        def settled(want):
            # a joined thread leaves /proc a moment after pthread_join returns
            for _ in range(200):
                n = len(os.listdir("/proc/self/task"))
                if n == want:
                    break
                time.sleep(0.01)
            return n
        from ddpwire import Coordinator
        peer = {PEER.format(tests=TESTS)!r}
        coord = Coordinator(("127.0.0.1", 0), expect_workers=2, timeout=600, socket_threads=True,
                            topology="star")
        port = str(coord.local_addr[1])
        peers = [subprocess.Popen([sys.executable, "-c", peer, f"w{{k}}", port],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                 for k in range(2)]
        coord.wait_for_workers()
        for p, how in zip(peers, ("full", "half")):
            p.stdin.write(how + " 100000\\n")
            p.stdin.flush()
            assert p.stdout.readline().strip() == "sent"
        before = len(os.listdir("/proc/self/task"))
        print("blocked", flush=True)
        try:
            coord.allreduce(0)
        except KeyboardInterrupt:
            print("interrupted", before, settled(before), flush=True)
            sys.exit(3)
        finally:
            for p in peers:
                p.kill()
    """)
    assert after == before


@pytest.mark.skipif(not PROC.exists(), reason="counts threads through /proc")
def test_ctrl_c_stops_the_workers_sending_thread():
    """The coordinator neither reads nor answers: the worker's sending thread
    is stuck on a full socket while the worker waits for the average. Ctrl-C
    raises in the worker, and its sending thread is gone with the step."""
    before, after = interrupted_thread_counts(f"""
        import os, subprocess, sys, time

        def settled(want):
            # a joined thread leaves /proc a moment after pthread_join returns
            for _ in range(200):
                n = len(os.listdir("/proc/self/task"))
                if n == want:
                    break
                time.sleep(0.01)
            return n
        import numpy as np
        from ddpwire import Worker
        peer = {PEER.format(tests=TESTS)!r}
        fake = subprocess.Popen([sys.executable, "-c", peer, "coordinator", "0"],
                                stdout=subprocess.PIPE, text=True)
        port = int(fake.stdout.readline())
        w = Worker.connect(("127.0.0.1", port), timeout=600, socket_threads=True)
        big = np.ones(8 << 20, np.float32)  # 32 MiB: far more than the socket buffers hold
        before = len(os.listdir("/proc/self/task"))
        print("blocked", flush=True)
        try:
            w.allreduce(0, big, 1.0, 1, 1)
        except KeyboardInterrupt:
            print("interrupted", before, settled(before), flush=True)
            sys.exit(3)
        finally:
            fake.kill()
    """)
    assert after == before


def test_defaults_choose_threads_for_large_vectors_with_cores_to_run_them(monkeypatch):
    from ddpwire.plane import socket_threads as policy
    big, small = policy.MIN_BYTES, policy.MIN_BYTES - 4
    monkeypatch.setattr(policy, "usable_cores", lambda: 4)
    assert policy.for_coordinator(None, 3, big)
    assert not policy.for_coordinator(None, 3, small)  # starting threads costs more than they save
    assert not policy.for_coordinator(None, 4, big)  # a core per worker plus one
    assert not policy.for_coordinator(None, 1, big)  # one worker: nothing to spread
    assert policy.for_coordinator(True, 4, small) and not policy.for_coordinator(False, 3, big)
    assert policy.for_worker(None, big) and not policy.for_worker(None, small)
    assert policy.for_worker(True, small) and not policy.for_worker(False, big)
    monkeypatch.setattr(policy, "usable_cores", lambda: 1)
    assert not policy.for_worker(None, big)


def test_coordinator_and_worker_pass_their_choice_to_the_socket_layer(monkeypatch):
    """What the policy says is what the socket layer is asked for."""
    from ddpwire import _core
    seen = {}
    real_stream, real_exchange = _core.allreduce_stream, _core.Exchange

    def stream(*args, socket_threads, **kw):
        seen["coordinator"] = socket_threads
        return real_stream(*args, socket_threads=socket_threads, **kw)

    def exchange(*args, send_thread, **kw):
        seen["worker"] = send_thread
        return real_exchange(*args, send_thread=send_thread, **kw)
    monkeypatch.setattr(_core, "allreduce_stream", stream)
    monkeypatch.setattr(_core, "Exchange", exchange)
    g = np.ones(10, np.float32)
    for choice in (True, False):
        with Coordinator(ADDR, topology="star", expect_workers=2, socket_threads=choice) as coord:
            threads = start_workers(coord, 2, lambda w: w.allreduce(0, g, 1.0, 1, 1),
                                    socket_threads=choice)
            coord.allreduce(0)
            for t in threads:
                assert np.array_equal(t.join_result().gradients, g)
        assert seen == {"coordinator": choice, "worker": choice}
