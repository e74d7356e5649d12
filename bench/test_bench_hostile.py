"""The coordinator under hostile clients, measured: how long the join takes
with two silent clients and one trickling client connected before the real
workers, and the coordinator's peak RSS when a client's first frame is a
100 MB block gradient. With $DDPWIRE_BASELINE naming another built checkout
(an older commit), its coordinator is measured beside this one in the same
run ("baseline" cases).

    DDPWIRE_BASELINE=/path/to/old/checkout \\
        python -m pytest bench/test_bench_hostile.py --benchmark-json=bench/results/hostile.json

The coordinator runs in a spawned process of its own (its RSS is its own);
the workers are plain sockets that send a JoinRequest without extensions
(the reference's bytes), which any ddpwire coordinator admits. The
coordinator's ``timeout`` is 5 s, the figure the issue measured with.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import threading
import time

import pytest

import allreduce_procs as procs

COORD_TIMEOUT = 5.0
JOIN_LIMIT = 120.0
TRICKLE_EVERY = 0.5  # seconds between the trickling client's bytes

_ctx = mp.get_context("spawn")


def _coordinator(conn, baseline, workers: int) -> None:
    procs.use_baseline(baseline)
    from ddpwire import Coordinator
    coord = Coordinator(("127.0.0.1", 0), expect_workers=workers, timeout=COORD_TIMEOUT)
    conn.send(coord.local_addr)
    conn.recv()  # the hostile clients are connected
    rss_before = procs.peak_rss_bytes()
    t0 = time.monotonic()
    try:
        coord.wait_for_workers(timeout=JOIN_LIMIT)
        outcome = "joined"
    except Exception as exc:  # the figure is the time to the outcome, whichever it is
        outcome = f"{type(exc).__name__}: {exc}"
    conn.send({"join_time": time.monotonic() - t0, "outcome": outcome,
               "peak_rss": procs.peak_rss_bytes(), "rss_before_join": rss_before})
    coord.close()


def _frame(node_id: str) -> bytes:
    # imported here, in the parent: the coordinator's process must import
    # ddpwire only after it chose which checkout to import it from
    from ddpwire import JoinRequest, encode_frame
    return encode_frame(JoinRequest(node_id=node_id, gpu_count=0, backend="cpu"))


def _plain_worker(addr, results, i, done: threading.Event) -> None:
    """Join, then stay connected until the coordinator has reported: a
    worker that leaves before the join completes gives its slot back."""
    try:
        with socket.create_connection(addr, timeout=JOIN_LIMIT) as s:
            s.sendall(_frame(f"bench-{i}"))
            results[i] = len(s.recv(64)) > 0
            done.wait(JOIN_LIMIT)
    except OSError:
        results[i] = False


def _run(baseline, scenario: str):
    parent, child = _ctx.Pipe()
    proc = _ctx.Process(target=_coordinator, args=(child, baseline, 2), daemon=True)
    proc.start()
    addr = tuple(parent.recv())
    strays = []
    stop = threading.Event()
    threads = []
    if scenario == "strays":
        strays = [socket.create_connection(addr) for _ in range(3)]
        frame = _frame("trickle" * 3)

        def trickle(sock=strays[2]):
            for b in frame[:-1]:
                if stop.wait(TRICKLE_EVERY):
                    return
                try:
                    sock.send(bytes([b]))
                except OSError:
                    return
        threads.append(threading.Thread(target=trickle, daemon=True))
    elif scenario == "bomb":
        bomb = socket.create_connection(addr)
        strays = [bomb]
        # a whole BlockGradientPayload of 99,999,997 bytes as the first frame:
        # 24,999,990 component sizes, then one gradient element (the frame
        # the issue measured: the sizes used to become a Python list)
        count = 24_999_990
        head = (99_999_997).to_bytes(4, "big") + bytes([0x08]) + (0).to_bytes(8, "little") \
            + (0).to_bytes(4, "little") * 3 + count.to_bytes(4, "little")
        tail = (1).to_bytes(8, "little") + (0).to_bytes(4, "little")

        def flood(sock=bomb):
            try:
                sock.sendall(head)
                chunk = (1).to_bytes(4, "little") * (1 << 18)
                left = 4 * count
                while left > 0 and not stop.is_set():
                    left -= sock.send(chunk[:left])
                sock.sendall(tail)
            except OSError:
                return
        threads.append(threading.Thread(target=flood, daemon=True))
    for t in threads:
        t.start()
    time.sleep(0.3)  # the hostile clients are accepted first
    results = [None, None]
    reported = threading.Event()
    workers = [threading.Thread(target=_plain_worker, args=(addr, results, i, reported),
                                daemon=True) for i in range(2)]
    for w in workers:
        w.start()
    # the real workers are connected and queued too: what is timed from
    # "go" is the coordinator's own work, not this process starting threads
    time.sleep(2.0 if scenario == "bomb" else 0.3)
    parent.send("go")
    summary = parent.recv()
    reported.set()
    stop.set()
    for s in strays:
        s.close()
    for w in workers:
        w.join(JOIN_LIMIT)
    proc.join(30)
    summary["workers_joined"] = results
    return summary


def _cases():
    cases = []
    baseline = os.environ.get(procs.BASELINE_ENV)
    for scenario in ("none", "strays", "bomb"):
        cases.append(pytest.param(None, scenario, id=f"{scenario}-ddpwire"))
        if baseline:
            cases.append(pytest.param(baseline, scenario, id=f"{scenario}-baseline"))
    return cases


@pytest.mark.parametrize("baseline,scenario", _cases())
def test_join_under_hostile_clients(benchmark, baseline, scenario):
    benchmark.group = f"join with {scenario}"
    summaries = []
    benchmark.pedantic(lambda: summaries.append(_run(baseline, scenario)), rounds=1,
                       iterations=1)
    s = summaries[-1]
    benchmark.extra_info.update(scenario=scenario, code="baseline" if baseline else "ddpwire",
                                **s)
