"""Helpers for session tests: workers in threads, raw peers, and the one
reference of every flat allreduce (:func:`reference_allreduce`)."""
from __future__ import annotations

import socket
import threading
from typing import Any, Callable, List, Optional, Sequence

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


# ---- the one reference of every flat allreduce the tests check ----
#
# numpy's float32 steps, each correctly rounded, one element-wise operation
# at a time, so any reassociation or other rounding in the kernels, the
# star, the mesh, the shared segment or the rank links shows. The 16-bit
# roundings are written here on the integer bits, independently of the
# kernels' own (tests/test_half.py checks the kernels against them).

def to_half_bits(x: Any, codec: str) -> np.ndarray:
    """float32 to 16-bit words ("bf16" or "fp16"), round to nearest even.
    A NaN keeps its sign, gets the quiet bit and keeps the top payload bits
    (the module's rule; numpy's own NaN casts vary from loop to loop)."""
    x = np.asarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    if codec == "bf16":
        kept = u >> 16
        dropped = u & 0xFFFF
        up = (dropped > 0x8000) | ((dropped == 0x8000) & ((kept & 1) == 1))
        out = (kept + up).astype(np.uint16)
        out[nan] = (kept[nan] | 0x0040).astype(np.uint16)
        return out
    if codec == "fp16":
        with np.errstate(all="ignore"):
            out = x.astype(np.float16).view(np.uint16).copy()
        out[nan] = (((u[nan] >> 16) & 0x8000) | 0x7E00
                    | ((u[nan] >> 13) & 0x3FF)).astype(np.uint16)
        return out
    raise ValueError(f"codec must be 'bf16' or 'fp16', got {codec!r}")


def from_half_bits(h: Any, codec: str) -> np.ndarray:
    """16-bit words ("bf16" or "fp16") widened to float32, exactly (a NaN
    keeps its sign and payload)."""
    h = np.asarray(h).view(np.uint16)
    if codec == "bf16":
        return (h.astype(np.uint32) << 16).view(np.float32)
    if codec == "fp16":
        out = h.view(np.float16).astype(np.float32).view(np.uint32).copy()
        nan = (h & 0x7FFF) > 0x7C00
        w = h[nan].astype(np.uint32)
        out[nan] = ((w & 0x8000) << 16) | 0x7F800000 | ((w & 0x3FF) << 13)
        return out.view(np.float32)
    raise ValueError(f"codec must be 'bf16' or 'fp16', got {codec!r}")


#: elements per scale in the int8 codec (csrc/int8.h; written here again,
#: so the reference does not take it from the code under test)
INT8_BLOCK = 256


def int8_round_trip(x: Any) -> np.ndarray:
    """float32 through the int8 codec and back, written from its definition
    in numpy: per block of 256 elements, scale = max |x| / 127 (one float32
    step lower where 127 x scale would overflow; NaN for a block holding a
    NaN or inf), code = x / scale rounded to nearest even and clamped to
    ±127 (0 for a scale of 0 or NaN), value = code × scale, all in float32."""
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    n = len(x)
    pad = (-n) % INT8_BLOCK
    blocks = np.concatenate([x, np.zeros(pad, np.float32)]).reshape(-1, INT8_BLOCK)
    with np.errstate(all="ignore"):
        bad = ~np.isfinite(blocks).all(axis=1)
        scale = np.abs(blocks).max(axis=1) / np.float32(127)
        # within a rounding of float32's largest, one step lower: 127 x scale stays finite
        over = ~bad & ~(scale * np.float32(127) <= np.finfo(np.float32).max)
        scale[over] = np.nextafter(scale[over], np.float32(0))
        scale[bad] = np.nan
        usable = ~bad & (scale > 0)
        safe = np.where(usable, scale, np.float32(1))
        codes = np.rint(np.clip(blocks / safe[:, None], -127, 127))
        codes[~usable] = 0
        # a code is a byte: -0.0 rounds to the code 0, which decodes as +0
        out = codes.astype(np.int8).astype(np.float32) * scale[:, None].astype(np.float32)
    return out.reshape(-1)[:n].astype(np.float32)


def _round_trip(x: np.ndarray, codec: str) -> np.ndarray:
    if codec == "int8":
        return int8_round_trip(x)
    return from_half_bits(to_half_bits(x, codec), codec)


def reference_allreduce(vectors: Sequence[Any], op: Any = "avg",
                        codec: Optional[str] = None) -> np.ndarray:
    """What every member of a flat allreduce must end with, bit for bit.

    float32 (``codec`` None): the sum in member order, ((x0 + x1) + x2) ...,
    then for AVG one true division by n. With ``codec`` "bf16" or "fp16":
    each input rounded once to 16 bits (nearest even) and widened, summed
    as above, divided, the result rounded once to 16 bits and widened; with
    "int8" the same, each rounding :func:`int8_round_trip`.
    ``op`` is "avg" or "sum", or an enum (ReduceOp, Op) of that name.
    NaN and infinities go through as numpy's float32 arithmetic takes them.
    """
    name = (op if isinstance(op, str) else op.name).lower()
    if name not in ("avg", "sum"):
        raise ValueError(f"op must be avg or sum, got {op!r}")
    xs = [np.asarray(v, dtype=np.float32) for v in vectors]
    if not xs:
        raise ValueError("no vectors to reduce")
    if codec is not None:
        xs = [_round_trip(x, codec) for x in xs]
    with np.errstate(all="ignore"):  # overflow and NaN are part of the contract
        acc = np.array(xs[0], dtype=np.float32, copy=True)
        for x in xs[1:]:
            acc = np.add(acc, x, dtype=np.float32)
        if name == "avg":
            acc = np.divide(acc, np.float32(len(xs)), dtype=np.float32)
    if codec is not None:
        acc = _round_trip(acc, codec)
    return acc


def exact_mean(vectors: Sequence[Any]) -> np.ndarray:
    """The float32 average of :func:`reference_allreduce` (its older name)."""
    return reference_allreduce(vectors)


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
