"""exchange_many: every peer's send and receive at once in one GIL-free poll
loop (csrc/net.c ddpw_net_exchange_many), the data plane of a mesh reduce.

Full meshes of threads over loopback TCP each send multi-MiB buffers to every
other one before anything is read, so a loop that waited for a send before a
receive would deadlock; the bytes are checked exactly. The failure paths name
the peer at fault with the connection's own PeerLost subclass. The C loop is
also checked on its own under ThreadSanitizer and AddressSanitizer
(tests/c/exchange_check.c)."""
from __future__ import annotations

import pathlib
import shutil
import socket
import subprocess
import threading
import time

import numpy as np
import pytest

import ddpwire
from ddpwire.wire import seal
from ddpwire._core import Connection, exchange_many

ROOT = pathlib.Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
CC = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")

MIB = 1 << 20
JOIN = 60.0  # generous: only reached if something hangs


def tcp_pair():
    with socket.create_server(("127.0.0.1", 0)) as lsock:
        a = socket.create_connection(lsock.getsockname())
        b, _ = lsock.accept()
    a.setblocking(False)
    b.setblocking(False)
    return a, b


def mesh(n):
    """socks[i][j]: peer i's socket to peer j (None on the diagonal)."""
    socks = [[None] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            socks[i][j], socks[j][i] = tcp_pair()
    return socks


def payload(src, dst, size):
    return np.random.default_rng(1000 * src + dst).integers(0, 256, size, dtype=np.uint8)


def split(buf, pieces):
    """buf as `pieces` consecutive views of uneven lengths (some may be empty)."""
    cuts = [0, *(len(buf) * k * k // (pieces * pieces) for k in range(1, pieces)), len(buf)]
    return [memoryview(buf)[a:b] for a, b in zip(cuts, cuts[1:])]


class Spawned(threading.Thread):
    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.result, self.error = fn, None, None
        self.start()

    def run(self):
        try:
            self.result = self.fn()
        except BaseException as exc:  # handed to the test
            self.error = exc

    def join_result(self):
        self.join(JOIN)
        assert not self.is_alive(), "exchange_many did not return"
        if self.error is not None:
            raise self.error
        return self.result


def run_mesh(sizes, send_parts=3, recv_parts=2):
    """Every peer i sends sizes[i][j] bytes to every j != i, all at once, each
    peer in its own thread; returns what each received, checked exactly."""
    n = len(sizes)
    socks = mesh(n)
    conns = [[None if s is None else Connection(s, peer_id=j, lost=ddpwire.WorkerLost)
              for j, s in enumerate(row)] for row in socks]
    got = [[bytearray(sizes[j][i]) if j != i else None for j in range(n)] for i in range(n)]
    try:
        def peer(i):
            sends = [None if j == i else split(payload(i, j, sizes[i][j]), send_parts)
                     for j in range(n)]
            recvs = [None if j == i else split(got[i][j], recv_parts) for j in range(n)]
            exchange_many(conns[i], sends, recvs, 30.0, step=5)

        threads = [Spawned(lambda i=i: peer(i)) for i in range(n)]
        for t in threads:
            t.join_result()
        for i in range(n):
            for j in range(n):
                if i != j:
                    assert np.array_equal(np.frombuffer(got[i][j], np.uint8),
                                          payload(j, i, sizes[j][i])), (i, j)
    finally:
        for row in conns:
            for c in row:
                if c is not None:
                    c.close()


@pytest.mark.parametrize("n", [3, 4])
def test_full_mesh_of_multi_mib_buffers_arrives_exactly(n):
    # far more than the socket buffers hold, written by everyone before reading
    run_mesh([[0 if i == j else 6 * MIB + 1000 * i + 7 * j for j in range(n)] for i in range(n)])


def test_asymmetric_sizes_one_sends_nothing_one_receives_nothing():
    sizes = [[0, 0, 0, 0],  # peer 0 sends nothing to anyone
             [3 * MIB, 0, 5 * MIB, 1],
             [2 * MIB, 0, 0, 4 * MIB],  # peer 1 receives nothing from peer 2
             [5, 4 * MIB + 3, 2 * MIB, 0]]
    run_mesh(sizes, send_parts=1, recv_parts=8)


def test_none_slots_are_skipped_without_looking_at_their_buffers():
    a, b = tcp_pair()
    ca, cb = Connection(a, peer_id=1), Connection(b, peer_id=0)
    try:
        readonly = b"not writable"
        data = payload(0, 1, MIB)
        out = bytearray(MIB)
        peer = Spawned(lambda: exchange_many([None, cb], [[object()], None],
                                             [[readonly], [out]], 30.0))
        exchange_many([None, ca, None], [[readonly], [data], [object()]],
                      [[object()], None, [readonly]], 30.0)
        peer.join_result()
        assert out == data.tobytes()
        exchange_many([None, None], [None, None], [None, None], 1.0)
        exchange_many([], [], [], 1.0)
    finally:
        ca.close()
        cb.close()


class RawPeer:
    """The far end of one connection as plain socket threads: sends
    ``send_bytes`` (then closes when ``close_after``), and reads up to
    ``read_len`` bytes meanwhile."""

    def __init__(self, sock, send_bytes=b"", read_len=0, close_after=False):
        sock.setblocking(True)
        self.sock, self.received = sock, bytearray()
        self.reader = threading.Thread(target=self._read, args=(read_len,), daemon=True)
        self.writer = threading.Thread(target=self._write, args=(send_bytes, close_after),
                                       daemon=True)
        self.reader.start()
        self.writer.start()

    def _read(self, n):
        try:
            while len(self.received) < n:
                chunk = self.sock.recv(min(MIB, n - len(self.received)))
                if not chunk:
                    return
                self.received += chunk
        except OSError:
            pass

    def _write(self, data, close_after):
        try:
            self.sock.sendall(data)
        except OSError:
            pass
        if close_after:
            self.sock.shutdown(socket.SHUT_RDWR)

    def join(self):
        self.writer.join(JOIN)
        self.reader.join(JOIN)
        self.sock.close()


def test_a_peer_closing_mid_stream_is_named_by_its_lost_error():
    (a1, b1), (a2, b2) = tcp_pair(), tcp_pair()
    c1 = Connection(a1, peer_id=1, lost=ddpwire.WorkerLost, peer_name="worker 1")
    c2 = Connection(a2, peer_id=2, lost=ddpwire.WorkerLost, peer_name="worker 2")
    healthy = RawPeer(b1, bytes(2 * MIB), 2 * MIB)
    # sends half of what it owes, then closes both ways
    quitter = RawPeer(b2, bytes(MIB), 0, close_after=True)
    try:
        with pytest.raises(ddpwire.WorkerLost) as info:
            exchange_many([None, c1, c2], [None, [bytes(2 * MIB)], [bytes(2 * MIB)]],
                          [None, [bytearray(2 * MIB)], [bytearray(2 * MIB)]], 30.0, step=9,
                          what="exchanging shards")
        assert (info.value.worker_id, info.value.step) == (2, 9)
        assert "worker 2 disconnected while exchanging shards" in str(info.value)
        assert "of 2097152 bytes" in str(info.value)
    finally:
        c1.close()
        c2.close()
        healthy.join()
        quitter.join()


def test_a_silent_peer_times_out_and_is_named():
    (a1, b1), (a2, b2) = tcp_pair(), tcp_pair()
    c1 = Connection(a1, peer_id=1, lost=ddpwire.CoordinatorLost)
    c2 = Connection(a2, peer_id=2, lost=ddpwire.CoordinatorLost)
    healthy = RawPeer(b1, payload(1, 0, MIB).tobytes(), MIB)
    silent = RawPeer(b2, b"", MIB)  # takes our bytes, never sends its own
    out = bytearray(MIB)
    try:
        with pytest.raises(ddpwire.CoordinatorLost) as info:
            exchange_many([None, c1, c2], [None, [bytes(MIB)], [bytes(MIB)]],
                          [None, [out], [bytearray(16)]], 0.5)
        assert info.value.worker_id == 2
        assert "silent for 0.5 s" in str(info.value)
        assert "received 0 of 16 bytes" in str(info.value)
    finally:
        c1.close()
        c2.close()
        healthy.join()
        silent.join()
    assert out == payload(1, 0, MIB).tobytes()  # the healthy peer was served meanwhile


def test_the_deadline_ends_the_call_though_bytes_keep_trickling():
    a, b = tcp_pair()
    conn = Connection(a, peer_id=4, lost=ddpwire.WorkerLost)
    b.setblocking(True)
    stop = threading.Event()

    def trickle():
        while not stop.wait(0.02):  # a byte now and then: never silent for the timeout
            try:
                b.sendall(b"x")
            except OSError:
                return

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        with pytest.raises(ddpwire.WorkerLost) as info:
            exchange_many([conn], [None], [[bytearray(MIB)]], 30.0,
                          deadline=time.monotonic() + 0.5)
        # only the deadline can end it: a byte moves every 20 ms, the timeout is 30 s
        # (the wording is not checked: Connection.fail() may read time.monotonic()
        # about a millisecond before the deadline and then says "silent for 30 s")
        assert info.value.worker_id == 4
        assert "of 1048576 bytes" in str(info.value)
    finally:
        stop.set()
        t.join(JOIN)
        conn.close()
        b.close()


def test_argument_errors():
    a, b = tcp_pair()
    conn = Connection(a)
    try:
        with pytest.raises(ValueError, match="at most 8"):
            exchange_many([conn], [[b"x"] * 9], [None], 1.0)
        with pytest.raises(ValueError, match="at most 8"):
            exchange_many([conn], [None], [[bytearray(1)] * 9], 1.0)
        with pytest.raises(TypeError, match="writable"):
            exchange_many([conn], [None], [[b"read-only"]], 1.0)
        with pytest.raises(TypeError, match="bytes-like"):
            exchange_many([conn], [[object()]], [None], 1.0)
        with pytest.raises(ValueError, match="1 connections but 2 sends"):
            exchange_many([conn], [None, None], [None], 1.0)
        with pytest.raises(ValueError, match="timeout"):
            exchange_many([conn], [None], [None], float("nan"))
        with pytest.raises(TypeError):
            exchange_many([b], [None], [None], 1.0)
        # the kernels' arguments (their runs: the tests at the end)
        f32, u16 = np.zeros(4, np.float32), np.zeros(4, np.uint16)
        with pytest.raises(ValueError, match="needs a 16-bit codec"):
            exchange_many([conn], [[u16]], [None], 1.0, narrow_from=[f32])
        with pytest.raises(ValueError, match="codec must be one of"):
            exchange_many([conn], [[u16]], [None], 1.0, codec="int8")
        with pytest.raises(ValueError, match="narrow_from.0. has 3 elements, its send 8 bytes"):
            exchange_many([conn], [[u16]], [None], 1.0, codec="bf16", narrow_from=[f32[:3]])
        with pytest.raises(ValueError, match="reduce input 1 has 3 elements, out 4"):
            exchange_many([conn], [None], [[f32]], 1.0,
                          reduce=([f32, f32[:3]], [None, 0], np.zeros(4, np.float32), True, None))
        with pytest.raises(ValueError, match="arrives from no connection"):
            exchange_many([conn], [None], [[f32]], 1.0,
                          reduce=([f32], [3], np.zeros(4, np.float32), True, None))
        with pytest.raises(ValueError, match="is not the buffer received"):
            exchange_many([conn], [None], [[f32]], 1.0,
                          reduce=([f32.copy()], [0], np.zeros(4, np.float32), True, None))
        # nothing was entered or left half-held: the connection still works
        exchange_many([conn], [[b"ok"]], [None], 1.0)
        b.setblocking(True)
        assert b.recv(2) == b"ok"
    finally:
        conn.close()
        b.close()


@pytest.mark.skipif(CC is None, reason="no C compiler on PATH")
@pytest.mark.parametrize("sanitizer", ["thread", "address,undefined"])
def test_c_exchange_many_under_sanitizer(tmp_path, sanitizer):
    exe = tmp_path / "exchange_check"
    build = subprocess.run(
        [CC, "-std=c99", "-O1", "-g", "-Wall", "-Wextra", "-Werror", f"-fsanitize={sanitizer}",
         "-fno-sanitize-recover=all", f"-I{CSRC}", ROOT / "tests" / "c" / "exchange_check.c",
         *(CSRC / name for name in ("net.c", "reduce.c", "link.c", "sealed.c", "aead.c")),
         "-o", exe, "-lpthread", "-lm", "-ldl"],
        capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    # and over sealed links, through the libcrypto this process loaded
    run = subprocess.run([exe, seal.load_libcrypto()], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "WARNING" not in run.stderr and "ERROR" not in run.stderr, run.stderr[-4000:]
    lines = run.stdout.splitlines()
    assert lines == EXCHANGE_CHECK_LINES + ["ok mesh 3 sealed", "ok kernels 5 sealed"], run.stdout


EXCHANGE_CHECK_LINES = [
    "ok mesh 2", "ok mesh 3", "ok mesh 5", "ok eof", "ok timeout", "ok deadline", "ok bounds",
    "ok kernels 0", "ok kernels 5",
]


# ---- the kernels run on the elements as they move ----

def kernel_phases(grads, codec, chunk, divide=True):
    """A reduce-scatter and an allgather over a full mesh of threads with
    exchange_many's kernels, as ddpwire.plane.mesh runs them: each member narrows
    what it sends (16 bits), reduces its own slice as the others' arrive and
    widens what the allgather brings. Returns every member's result and its
    reduce's report."""
    from ddpwire import _core
    from ddpwire.plane.plan import slice_bounds

    n, count = len(grads), len(grads[0])
    bounds = slice_bounds(count, n)
    wide = np.uint16 if codec else np.float32
    socks = mesh(n)
    conns = [[None if s is None else Connection(s, peer_id=j, lost=ddpwire.WorkerLost)
              for j, s in enumerate(row)] for row in socks]
    outs, bads = [None] * n, [None] * n
    _core.set_kernel_chunk(chunk)
    try:
        def member(i):
            g = grads[i]
            lo, hi = bounds[i]
            wire = g if codec is None else np.empty(count, np.uint16)
            inbox = {j: np.empty(hi - lo, wide) for j in range(n) if j != i}
            inputs = [wire[lo:hi] if j == i else inbox[j] for j in range(n)]
            own = np.empty(hi - lo, wide)
            bads[i] = exchange_many(
                conns[i], [None if j == i else [wire[a:b]] for j, (a, b) in enumerate(bounds)],
                [None if j == i else [inbox[j]] for j in range(n)], 30.0, codec=codec,
                narrow_from=None if codec is None else [
                    None if j == i else g[a:b] for j, (a, b) in enumerate(bounds)],
                reduce=(inputs, [None if j == i else j for j in range(n)], own, divide,
                        None if codec is None else g[lo:hi]))
            out = np.full(count, -7.0, np.float32)
            full = out if codec is None else np.empty(count, np.uint16)
            exchange_many(conns[i], [None if j == i else [own] for j in range(n)],
                          [None if j == i else [full[a:b]] for j, (a, b) in enumerate(bounds)],
                          30.0, codec=codec, widen_into=None if codec is None else [
                              None if j == i else out[a:b] for j, (a, b) in enumerate(bounds)])
            if codec is None:
                out[lo:hi] = own
            else:
                _core.from_half(own, out[lo:hi], codec=codec)
            outs[i] = out

        threads = [Spawned(lambda i=i: member(i)) for i in range(n)]
        for t in threads:
            t.join_result()
    finally:
        _core.set_kernel_chunk(0)
        for row in conns:
            for c in row:
                if c is not None:
                    c.close()
    return outs, bads


@pytest.mark.parametrize("codec", [None, "bf16", "fp16"])
@pytest.mark.parametrize("n,count,chunk", [(2, 1, 0), (3, 300_001, 0), (3, 1_001, 3),
                                           (4, 2, 1), (5, 20_011, 7)])
def test_kernels_on_the_moving_elements_give_the_bits_of_whole_vector_passes(codec, n, count,
                                                                           chunk):
    from ddpwire import _core
    rng = np.random.default_rng(count + n)
    grads = [rng.standard_normal(count).astype(np.float32) for _ in range(n)]
    outs, bads = kernel_phases(grads, codec, chunk)
    if codec is None:
        want = _core.mean(grads)
    else:
        want = _core.from_half(_core.mean_half([_core.to_half(g, codec=codec) for g in grads],
                                               codec=codec), codec=codec)
    for out in outs:
        assert np.array_equal(out.view(np.uint32), want.view(np.uint32))
    assert bads == [None] * n


@pytest.mark.parametrize("codec", [None, "bf16"])
def test_the_reduce_reports_the_lowest_input_then_the_lowest_index_across_ranges(codec):
    count = 3_000  # member 1 owns [1000, 2000), reduced 5 elements or more at a time
    grads = [np.ones(count, np.float32) for _ in range(3)]
    grads[2][1003] = np.nan   # the lowest index, from a later input
    grads[1][1900] = np.inf   # a later range, the lowest input holding one
    grads[1][1950] = np.nan
    _, bads = kernel_phases(grads, codec, 5)
    assert bads == [None, (1, 900), None]
