"""Helpers for session tests: workers in threads, raw peers, exact float32 means."""
from __future__ import annotations

import socket
import threading
from typing import Any, Callable, List

import numpy as np

import ddpwire
from ddpwire import encode_frame


class Thread(threading.Thread):
    """A thread that keeps its target's result or exception for join_result()."""

    def __init__(self, target: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self._target_fn = target
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self._target_fn()
        except BaseException as exc:  # handed to the test thread
            self.error = exc

    def join_result(self, timeout: float = 30.0) -> Any:
        self.join(timeout)
        assert not self.is_alive(), "worker thread did not finish"
        if self.error is not None:
            raise self.error
        return self.result


def spawn(target: Callable[[], Any]) -> Thread:
    t = Thread(target)
    t.start()
    return t


def exact_mean(vectors: List[np.ndarray]) -> np.ndarray:
    """The reference arithmetic: float32 sum in worker order, then / n."""
    acc = vectors[0].astype(np.float32).copy()
    for v in vectors[1:]:
        acc = (acc + v).astype(np.float32)
    return (acc / np.float32(len(vectors))).astype(np.float32)


def raw_join(addr, node_id: str = "raw", timeout: float = 10.0) -> socket.socket:
    """A bare socket that joins like a worker and reads its JoinAccepted."""
    sock = socket.create_connection(addr, timeout=timeout)
    sock.sendall(encode_frame(ddpwire.JoinRequest(node_id=node_id, gpu_count=0, backend="cpu")))
    recv_frame(sock)
    return sock


def recv_frame(sock: socket.socket) -> Any:
    """Read one whole frame from a bare socket and decode it."""
    head = recv_exact(sock, 4)
    length = int.from_bytes(head, "big")
    return ddpwire.decode_frame(head + recv_exact(sock, length))


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk
    return bytes(buf)


def join_up_to(coord, k: int) -> None:
    """Let the coordinator accept workers until k have joined, so that
    worker ids follow the order in which a test starts them."""
    coord.wait_for_workers(count=k)


def start_workers(coord, n: int, body: Callable[[Any], Any], timeout: float = 30,
                  **connect: Any) -> List[Thread]:
    """n workers in threads, joined in order 0..n-1; body(worker) runs in each
    (more Worker.connect keywords in ``connect``)."""
    threads = []
    for _ in range(n):
        def run():
            with ddpwire.Worker.connect(coord.local_addr, 0, "cpu", timeout=timeout,
                                        **connect) as w:
                return body(w)
        threads.append(spawn(run))
        join_up_to(coord, len(threads))
    return threads


def worker_and_raw_peer(coord, **connect: Any):
    """Worker 0 a real Worker (Worker.connect keywords in ``connect``),
    worker 1 a bare socket that joined and will send only what the test sends."""
    good = spawn(lambda: ddpwire.Worker.connect(coord.local_addr, 0, "cpu", **connect))
    join_up_to(coord, 1)
    raw = spawn(lambda: raw_join(coord.local_addr))
    coord.wait_for_workers()
    return good.join_result(), raw.join_result()


def fake_coordinator(behaviour: Callable[[socket.socket], Any]):
    """A bare listening socket that accepts one worker, answers its join, runs
    behaviour(conn) and closes it. Returns (listening socket, thread)."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def run():
        conn, _ = lsock.accept()
        recv_frame(conn)
        conn.sendall(encode_frame(ddpwire.JoinAccepted(worker_id=0, total_workers=1)))
        try:
            return behaviour(conn)
        finally:
            conn.close()
    return lsock, spawn(run)
