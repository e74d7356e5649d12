"""What sealing costs a link (issue 42), on loopback, side by side in one run:
64 MiB sent from one thread and received by another over a TCP connection
in the clear and sealed (AES-256-GCM records, ddpwire/seal.py), and a
memcpy of the same bytes (numpy's copyto) as the yardstick.

Each transfer's sender and receiver time their own thread's CPU time
(time.thread_time, which counts the GIL-free C too): the sealed side's
extra CPU seconds per GB over the clear one is what sealing (sender) and
opening (receiver) cost on one core, beside what memcpy costs per GB.

    PYTHONPATH=$PWD python -m pytest bench/test_bench_seal.py \\
        --benchmark-json=bench/results/seal-<commit>.json -q

DDPWIRE_SEAL_MIB sets the size (default 64).
"""
from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest

from ddpwire import _core, seal

MIB = int(os.environ.get("DDPWIRE_SEAL_MIB", "64"))
SIZE = MIB << 20
GB = 1e9


def _pair(sealed: bool):
    with socket.create_server(("127.0.0.1", 0)) as lsock:
        a = socket.create_connection(lsock.getsockname())
        b, _ = lsock.accept()
    for s in (a, b):
        s.setblocking(False)
    ca, cb = _core.Connection(a), _core.Connection(b)
    if sealed:
        seal.load_libcrypto()
        k1, k2 = os.urandom(32), os.urandom(32)
        ca.seal(k1, k2)
        cb.seal(k2, k1)
    return ca, cb


def _transfer(ca, cb, data: np.ndarray, out: np.ndarray, cpu: dict) -> None:
    def send() -> None:
        t = time.thread_time()
        ca.send_parts([data], 60)
        cpu["send"] += time.thread_time() - t

    sender = threading.Thread(target=send)
    sender.start()
    t = time.thread_time()
    cb.recv_into(out, 60)
    cpu["recv"] += time.thread_time() - t
    sender.join()


@pytest.mark.parametrize("kind", ["memcpy", "clear", "sealed"])
def test_seal_cost(benchmark, kind):
    data = np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8)
    out = np.zeros_like(data)
    out[:] = 1  # its pages touched: no round pays their first faults
    cpu = {"send": 0.0, "recv": 0.0}
    benchmark.group = f"{MIB} MiB over loopback"
    if kind == "memcpy":
        def once() -> None:
            t = time.thread_time()
            np.copyto(out, data)
            cpu["send"] += time.thread_time() - t
        benchmark.pedantic(once, rounds=5, warmup_rounds=1)
        rounds = 6
    else:
        ca, cb = _pair(kind == "sealed")
        benchmark.pedantic(lambda: _transfer(ca, cb, data, out, cpu), rounds=5, warmup_rounds=1)
        rounds = 6
        ca.close()
        cb.close()
    assert np.array_equal(out, data)
    gb = rounds * SIZE / GB
    benchmark.extra_info.update(
        kind=kind, bytes=SIZE, cpu_send_s_per_gb=cpu["send"] / gb,
        cpu_recv_s_per_gb=cpu["recv"] / gb, wall_gb_per_s=SIZE / GB / benchmark.stats["median"])
