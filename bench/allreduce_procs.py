"""Process groups for the allreduce benchmark: ddpwire, gloo and raw loopback TCP.

Every participant runs in its own spawned process and waits on a pipe for
the parent's "step" command, so the parent times one step exactly as a
trainer would see it: all workers start together, and the step ends when
the last one holds the average. Each worker also stamps its own start and
end with CLOCK_MONOTONIC (shared by every process on Linux), which gives a
second figure free of the pipe round trip.

torch is imported only inside the gloo processes: the ddpwire coordinator's
peak RSS must not include it.

The kind "ddpwire-baseline" runs the "ddpwire" path from another built
checkout of ddpwire, named by $DDPWIRE_BASELINE (e.g. a worktree of an older
commit with its extension built in place), so a change is measured against
what it replaced in the same run.

Every ddpwire kind is one row of :data:`DDPWIRE_KINDS` (the Coordinator's
and the Workers' keyword arguments, the call path), so a new variant is a
new row, not another branch in the process bodies.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import resource
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

import numpy as np

MiB = 1 << 20
# a child that does not answer in this long is wedged: fail instead of hanging the run
REPLY_TIMEOUT = 300.0

_ctx = mp.get_context("spawn")


def peak_rss_bytes() -> int:
    """This process's peak resident set size (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


_PERIOD = 997


def worker_gradients(rank: int, count: int) -> np.ndarray:
    """A deterministic float32 vector per rank whose average is known exactly.

    Element j is (j mod 997) / 2 + rank: multiples of 0.5 far below 2**24,
    so every partial sum is exact in float32 whatever the summation order.
    """
    pattern = np.arange(_PERIOD, dtype=np.float32) * np.float32(0.5) + np.float32(rank)
    return np.resize(pattern, count)


def _check_average(avg: np.ndarray, n: int) -> bool:
    # the mean of ranks 0..n-1 is (n - 1) / 2; only the final division can round
    expected = np.arange(_PERIOD, dtype=np.float32) * np.float32(0.5) + np.float32((n - 1) / 2)
    return bool(np.allclose(avg, np.resize(expected, len(avg)), rtol=1e-6, atol=0))


# ---- 16-bit compression: the expected result, computed without ddpwire ----

HALF_KINDS = ("bf16", "fp16")
_SPREAD_SEED = 0xDD9


def spread_gradients(rank: int, count: int) -> np.ndarray:
    """Standard-normal float32 values per rank, for the compressed kinds.

    worker_gradients' multiples of 0.5 are nearly all exact in fp16, which
    would report no error at all; these need rounding at every stage, so the
    recorded error is what 16 significant bits cost on gradient-like data.
    """
    return np.random.default_rng((_SPREAD_SEED, rank)).standard_normal(count, dtype=np.float32)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 to bfloat16 bit patterns (uint16), rounding to nearest, ties to even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    # adding 0x7FFF plus the kept part's lowest bit rounds half to even; a carry
    # out of the mantissa bumps the exponent, which is right (and max float -> inf)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    out = rounded.astype(np.uint16)
    nan = np.isnan(x)
    # the add could carry a NaN's payload into inf; keep it NaN (quiet bit set)
    out[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return out


def bf16_widen(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns to float32 (exact)."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_half(x: np.ndarray, compression: str) -> np.ndarray:
    """``x`` rounded to the 16-bit format and widened back to float32."""
    if compression == "bf16":
        return bf16_widen(bf16_bits(x))
    if compression == "fp16":
        # numpy's float32 -> float16 rounds to nearest even and overflows to inf,
        # which is the rounding wanted, not something to warn about
        with np.errstate(over="ignore"):
            return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)
    raise ValueError(f"compression must be one of {HALF_KINDS}, got {compression!r}")


def expected_compressed_average(grads: Iterable[np.ndarray], compression: str) -> np.ndarray:
    """What every worker must hold after a compressed step, in worker order.

    Each gradient rounded to 16 bits and widened, summed in float32 one
    worker after another (starting from worker 0's value, so the sign of an
    all-zero element follows the data), divided by N in float32, rounded to
    16 bits, widened.
    """
    acc, n = None, 0
    for g in grads:
        half = round_half(g, compression)
        if acc is None:
            acc = half.copy()
        else:
            acc += half
        n += 1
    if acc is None:
        raise ValueError("no gradients")
    return round_half(acc / np.float32(n), compression)


def compressed_check(avg: np.ndarray, n: int, compression: str) -> Dict[str, Any]:
    """Bit-for-bit check of a compressed average, and its error against float32.

    The error is measured against the float32 average of the unrounded
    gradients (summed in float64, so summation order does not enter it);
    ``relative_error`` divides by that average's largest magnitude.
    """
    count = len(avg)
    expected = expected_compressed_average(
        (spread_gradients(r, count) for r in range(n)), compression)
    exact = np.zeros(count, dtype=np.float64)
    for r in range(n):
        exact += spread_gradients(r, count)
    exact = (exact / n).astype(np.float32)
    ok = bool(np.array_equal(np.asarray(avg, dtype=np.float32).view(np.uint32),
                             expected.view(np.uint32)))
    err = float(np.max(np.abs(avg.astype(np.float64) - exact))) if count else 0.0
    scale = float(np.max(np.abs(exact))) if count else 0.0
    return {"average_ok": ok, "max_abs_error": err,
            "relative_error": err / scale if scale else 0.0}


def _serve(conn, setup: Callable[[], Any], step: Callable[[Any], None],
           finish: Callable[[Any], Dict[str, Any]]) -> None:
    """The child's command loop: report ready, time each step (and the CPU
    time the process spent in it, every thread's), report the summary."""
    try:
        state = setup()
        conn.send(("ready", None))
        cpu = []
        while True:
            cmd = conn.recv()
            if cmd == "step":
                t0, c0 = time.monotonic_ns(), time.process_time()
                step(state)
                cpu.append(time.process_time() - c0)
                conn.send(("done", (t0, time.monotonic_ns())))
            elif cmd == "stop":
                # before finish(), whose checks allocate temporaries of their own
                peak = peak_rss_bytes()
                summary = finish(state)
                summary["peak_rss"] = peak
                summary["step_cpu_s"] = cpu
                conn.send(("summary", summary))
                return
            else:
                raise ValueError(f"unknown command {cmd!r}")
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


# ---- ddpwire ----

BASELINE_ENV = "DDPWIRE_BASELINE"


def use_baseline(path: Optional[str]) -> None:
    """Import ddpwire from ``path`` in this (spawned) process, not from here."""
    if path:
        sys.path.insert(0, path)


def baseline_commit(checkout: str) -> str:
    """The commit another checkout is at (with "+" when it has changes)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", checkout, *args], check=True, capture_output=True,
                              text=True).stdout.strip()
    return git("rev-parse", "--short", "HEAD") + ("+" if git("status", "--porcelain") else "")


@dataclass(frozen=True)
class DdpwireKind:
    """How one benchmark kind builds ddpwire's two sides.

    ``coordinator`` and ``worker`` are keyword arguments passed as they are to
    ``Coordinator`` and ``Worker.connect``, on top of the benchmark's own
    (address, timeouts, max_frame); ``pipelined`` picks ``allreduce`` over
    the two-call path; ``baseline`` imports ddpwire from $DDPWIRE_BASELINE.
    """

    coordinator: Mapping[str, Any] = field(default_factory=dict)
    worker: Mapping[str, Any] = field(default_factory=dict)
    pipelined: bool = True
    baseline: bool = False

    @property
    def topology(self) -> str:
        """"star", "mesh", or "auto" (the library's choice, the default)."""
        return self.coordinator.get("topology", "auto")

    @property
    def compression(self) -> Optional[str]:
        """None, or the 16-bit format gradients travel in."""
        return self.coordinator.get("compression")

    @property
    def bytes_per_element(self) -> int:
        """On the wire."""
        return 2 if self.compression else 4


#: the token of the sealed and clear kinds (a benchmark's, not a secret)
BENCH_TOKEN = "ddpwire-bench-token"

# one poll loop per process unless a kind says otherwise, as the first
# published numbers were taken, so new kinds differ from "ddpwire" in one thing
_LOOP = {"socket_threads": False}

DDPWIRE_KINDS: Dict[str, DdpwireKind] = {
    # the library's default reduce (topology "auto")
    "ddpwire": DdpwireKind(_LOOP, _LOOP),
    # the two-call path: collect_and_reduce + broadcast_averaged,
    # send_gradients + receive_averaged
    "ddpwire-classic": DdpwireKind(_LOOP, _LOOP, pipelined=False),
    # a receiving and a sending thread per connection on the coordinator,
    # a sending thread on each worker
    "ddpwire-threads": DdpwireKind({"socket_threads": True}, {"socket_threads": True}),
    # the library decides threads by core count and vector size, as a user gets it
    "ddpwire-auto": DdpwireKind({"socket_threads": None}, {"socket_threads": None}),
    "ddpwire-baseline": DdpwireKind(_LOOP, _LOOP, baseline=True),
    "ddpwire-bf16-baseline": DdpwireKind({**_LOOP, "topology": "mesh", "compression": "bf16"},
                                         _LOOP, baseline=True),
    # the star through the coordinator whatever "auto" would pick, so the
    # earlier "ddpwire" figures stay comparable
    "ddpwire-star": DdpwireKind({**_LOOP, "topology": "star"}, _LOOP),
    # the star with every connection's receive buffer left to the kernel,
    # not bounded against incast (ddpwire.plane.incast)
    "ddpwire-star-sysrcv": DdpwireKind({**_LOOP, "topology": "star", "receive_window": None},
                                       _LOOP),
    # the mesh over its links even on one host, so the earlier "ddpwire-mesh"
    # figures stay comparable; "ddpwire-shm" the same mesh in shared memory
    "ddpwire-mesh": DdpwireKind({**_LOOP, "topology": "mesh", "shared_memory": False}, _LOOP),
    "ddpwire-shm": DdpwireKind({**_LOOP, "topology": "mesh", "shared_memory": True}, _LOOP),
    "ddpwire-bf16": DdpwireKind({**_LOOP, "topology": "mesh", "compression": "bf16"}, _LOOP),
    "ddpwire-fp16": DdpwireKind({**_LOOP, "topology": "mesh", "compression": "fp16"}, _LOOP),
    # the mesh links under the system's TCP congestion control, not the
    # library's choice (ddpwire.plane.mesh.DEFAULT_CONGESTION)
    "ddpwire-mesh-systcp": DdpwireKind({**_LOOP, "topology": "mesh", "shared_memory": False},
                                       {**_LOOP, "tcp_congestion": None}),
    # the mesh with no part of the vector through the coordinator's link
    # (the default "auto" gives it 0.75/(N+1) from 3 workers on other hosts),
    # and with fixed parts, the sweep that chose "auto"
    "ddpwire-mesh-noshare": DdpwireKind({**_LOOP, "topology": "mesh", "shared_memory": False,
                                         "coordinator_share": 0}, _LOOP),
    # with a token, sealed (every link in AES-256-GCM records: ddpwire.wire.seal)
    # and in the clear: the join is the same, the frames after it differ
    "ddpwire-mesh-sealed": DdpwireKind({**_LOOP, "topology": "mesh", "shared_memory": False,
                                        "token": BENCH_TOKEN}, {**_LOOP, "token": BENCH_TOKEN}),
    "ddpwire-mesh-clear": DdpwireKind({**_LOOP, "topology": "mesh", "shared_memory": False,
                                       "token": BENCH_TOKEN, "encrypt": False},
                                      {**_LOOP, "token": BENCH_TOKEN, "encrypt": False}),
    "ddpwire-star-sealed": DdpwireKind({**_LOOP, "topology": "star", "token": BENCH_TOKEN},
                                       {**_LOOP, "token": BENCH_TOKEN}),
    "ddpwire-star-clear": DdpwireKind({**_LOOP, "topology": "star", "token": BENCH_TOKEN,
                                       "encrypt": False},
                                      {**_LOOP, "token": BENCH_TOKEN, "encrypt": False}),
    **{f"ddpwire-share{round(x * 100)}": DdpwireKind(
        {**_LOOP, "topology": "mesh", "shared_memory": False, "coordinator_share": x}, _LOOP)
       for x in (0.1, 0.15, 0.2, 0.25)},
}


def ddpwire_kind(kind: str) -> DdpwireKind:
    """The table's row for ``kind``; a clear error for a name not in it."""
    try:
        return DDPWIRE_KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown ddpwire kind {kind!r}; known: {', '.join(DDPWIRE_KINDS)}") \
            from None


def _construct(kind: str, what: str, factory: Callable[..., Any], extra: Mapping[str, Any],
               **base: Any) -> Any:
    """``factory(**base, **extra)``, naming the kind and the missing parameter
    when this ddpwire does not take one of ``extra`` (a kind coded against an
    API that has not landed must fail loudly, not run as something else)."""
    import inspect

    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        # no signature to read (an extension type): the call's own TypeError will do
        params = None
    takes_any = params is None or any(p.kind is inspect.Parameter.VAR_KEYWORD
                                      for p in params.values())
    missing = [k for k in extra if not takes_any and k not in params]
    if missing:
        import ddpwire

        raise TypeError(f"kind {kind!r} needs {what}({', '.join(f'{k}=...' for k in missing)}), "
                        f"which the ddpwire at {os.path.dirname(ddpwire.__file__)} does not take")
    return factory(**base, **extra)


def kind_gradients(spec: DdpwireKind, rank: int, count: int) -> np.ndarray:
    """The vector a worker of this kind sends: checkable exactly in float32,
    or spread over many magnitudes when it travels in 16 bits."""
    return spread_gradients(rank, count) if spec.compression else worker_gradients(rank, count)


def check_kind_average(spec: DdpwireKind, avg: np.ndarray, n: int) -> Dict[str, Any]:
    """``average_ok`` (and, compressed, the error figures) for one process's result."""
    if spec.compression:
        return compressed_check(avg, n, spec.compression)
    return {"average_ok": _check_average(avg, n)}


def _ddpwire_coordinator(conn, kind: str, n: int, size: int, steps: int,
                         baseline: Optional[str] = None, host: str = "127.0.0.1") -> None:
    try:
        spec = ddpwire_kind(kind)
        use_baseline(baseline)
        from ddpwire import Coordinator

        count = size // 4
        # host: bench/cluster binds the coordinator's address in its own namespace
        coord = _construct(kind, "Coordinator", Coordinator, spec.coordinator,
                           bind=(host, 0), expect_workers=n, timeout=REPLY_TIMEOUT,
                           max_frame=size + 4096)
        conn.send(("addr", coord.local_addr))
        coord.wait_for_workers()
        # NaN until written: a coordinator that does not hold the average (the
        # mesh reduce, where out= is refused) leaves it so, and is then not checked
        out = np.full(count, np.nan, dtype=np.float32)
        into = None if coord.mesh else out
        times = []
        for s in range(steps):
            t0 = time.monotonic_ns()
            if spec.pipelined:
                # collect, average and send back in one pass
                result = coord.allreduce(s, out=into)
            else:
                result = coord.collect_and_reduce(s, out=into)
                coord.broadcast_averaged(s, result)
            wait = getattr(result, "wait_time", None)
            # (start, every head in, reply sent): the wait for the heads, then the rest
            times.append((t0, None if wait is None else t0 + int(wait * 1e9),
                          time.monotonic_ns()))
        coord.shutdown_workers()
        coord.close()
        # before the check, whose temporaries are the benchmark's, not ddpwire's
        peak = peak_rss_bytes()
        summary: Dict[str, Any] = {"peak_rss": peak, "times": times,
                                   "topology": "mesh" if coord.mesh else "star",
                                   # a baseline ddpwire may predate the share
                                   "coordinator_share": getattr(coord, "share", 0) / 65536}
        if count and np.isnan(out).all():
            summary["average_ok"] = None
        else:
            summary.update(check_kind_average(spec, out, n))
        conn.send(("summary", summary))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


def _ddpwire_worker(conn, kind: str, addr: Tuple[str, int], rank: int, n: int, size: int,
                    baseline: Optional[str] = None) -> None:
    spec = ddpwire_kind(kind)

    def setup():
        use_baseline(baseline)
        from ddpwire import Worker

        count = size // 4
        worker = _construct(kind, "Worker.connect", Worker.connect, spec.worker,
                            addr=addr, gpu_count=0, backend="cpu", timeout=REPLY_TIMEOUT,
                            max_frame=size + 4096)
        # joining order decides worker_id; the data follows it so the average is checkable
        grads = kind_gradients(spec, worker.worker_id, count)
        return {"worker": worker, "grads": grads, "out": np.empty(count, dtype=np.float32),
                "step": 0}

    def step(st):
        if spec.pipelined:
            # sends the gradients while the average comes back
            st["worker"].allreduce(st["step"], st["grads"], 1.0, 0, 1, out=st["out"])
        else:
            st["worker"].send_gradients(st["step"], st["grads"], 1.0, 0, 1)
            st["worker"].receive_averaged(out=st["out"])
        st["step"] += 1

    def finish(st):
        conn_ = st["worker"].channel.conn
        # a baseline ddpwire may predate sealed links
        sealed = bool(getattr(conn_, "sealed", False))
        st["worker"].close()
        return {**check_kind_average(spec, st["out"], n), "sealed": sealed}

    _serve(conn, setup, step, finish)


def start_ddpwire(group: "ProcessGroup", launch_coordinator: Callable[[tuple], Tuple[Any, Any]],
                  add_worker: Callable[[int, tuple], None], baseline: Optional[str],
                  host: Optional[str] = None) -> None:
    """Start a ddpwire kind's coordinator and workers through the caller's
    launchers (spawned here, ``ip netns exec`` in bench/cluster), so both
    pass the bodies the same arguments."""
    coord_args: tuple = (group.kind, group.n, group.size, group.steps, baseline)
    if host is not None:
        coord_args += (host,)
    conn, proc = launch_coordinator(coord_args)
    group.coordinator = (conn, proc)
    addr = _reply(conn, proc, "addr")
    for rank in range(group.n):
        add_worker(rank, (group.kind, addr, rank, group.n, group.size, baseline))


# ---- gloo ----

def _gloo_worker(conn, port: int, rank: int, n: int, size: int,
                 host: str = "127.0.0.1") -> None:
    def setup():
        # bench/cluster sets its own interface; rank 0's store listens on host
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        import torch
        import torch.distributed as dist

        # n processes share two cores: more intra-op threads would only contend
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}",
                                rank=rank, world_size=n)
        tensor = torch.from_numpy(worker_gradients(rank, size // 4))
        dist.barrier()
        return {"dist": dist, "tensor": tensor}

    def step(st):
        st["dist"].all_reduce(st["tensor"])
        st["tensor"] /= n

    def finish(st):
        # after the first step every rank holds the average, which later steps keep
        ok = _check_average(st["tensor"].numpy(), n)
        st["dist"].destroy_process_group()
        return {"average_ok": ok}

    _serve(conn, setup, step, finish)


# ---- raw loopback TCP ----

def _tcp_receiver(conn, size: int, host: str = "127.0.0.1") -> None:
    def setup():
        listener = socket.create_server((host, 0))
        conn.send(("addr", listener.getsockname()))
        sock, _ = listener.accept()
        listener.close()
        return {"sock": sock, "buf": bytearray(size)}

    def step(st):
        view = memoryview(st["buf"])
        got = 0
        while got < size:
            k = st["sock"].recv_into(view[got:], min(size - got, 16 * MiB))
            if k == 0:
                raise ConnectionError("sender closed early")
            got += k
        # one byte back so the sender cannot start the next round early
        st["sock"].sendall(b"\x01")

    def finish(st):
        st["sock"].close()
        return {}

    _serve(conn, setup, step, finish)


def _tcp_sender(conn, addr: Tuple[str, int], size: int) -> None:
    def setup():
        sock = socket.create_connection(addr)
        data = np.ones(size, dtype=np.uint8)
        return {"sock": sock, "data": memoryview(data)}

    def step(st):
        st["sock"].sendall(st["data"])
        if st["sock"].recv(1) != b"\x01":
            raise ConnectionError("receiver closed early")

    def finish(st):
        st["sock"].close()
        return {}

    _serve(conn, setup, step, finish)


# ---- the parent's side ----

def _reply(conn, proc, want: str) -> Any:
    if not conn.poll(REPLY_TIMEOUT):
        raise TimeoutError(f"{proc.name} sent nothing for {REPLY_TIMEOUT:g} s (waiting for {want})")
    kind, value = conn.recv()
    if kind == "error":
        raise RuntimeError(f"{proc.name} failed:\n{value}")
    if kind != want:
        raise RuntimeError(f"{proc.name} sent {kind!r}, expected {want!r}")
    return value


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcessGroup:
    """N step-serving child processes (plus, for ddpwire, a coordinator).

    ``step()`` runs one step on every worker at once and returns the
    workers' (start, end) monotonic stamps; ``stop()`` returns the
    summaries and reaps the processes.
    """

    def __init__(self, kind: str, n: int, size: int, steps: int) -> None:
        self.kind, self.n, self.size, self.steps = kind, n, size, steps
        self.procs: List[mp.Process] = []
        self.conns: List[Any] = []
        self.coordinator: Optional[Tuple[Any, mp.Process]] = None
        self.step_stamps: List[List[Tuple[int, int]]] = []
        try:
            self._start()
        except BaseException:
            self.kill()
            raise

    def _spawn(self, target, args, name: str):
        parent, child = _ctx.Pipe()
        proc = _ctx.Process(target=target, args=(child, *args), name=name, daemon=True)
        proc.start()
        child.close()
        return parent, proc

    def _start(self) -> None:
        if self.kind in DDPWIRE_KINDS:
            baseline = None
            if ddpwire_kind(self.kind).baseline:
                baseline = os.environ.get(BASELINE_ENV)
                if not baseline:
                    raise ValueError(f"kind {self.kind} needs ${BASELINE_ENV}")
            start_ddpwire(
                self,
                lambda args: self._spawn(_ddpwire_coordinator, args, "ddpwire-coordinator"),
                lambda rank, args: self._add(_ddpwire_worker, args, f"ddpwire-worker-{rank}"),
                baseline)
        elif self.kind == "gloo":
            port = _free_port()
            for rank in range(self.n):
                self._add(_gloo_worker, (port, rank, self.n, self.size), f"gloo-rank-{rank}")
        elif self.kind == "tcp":
            self._add(_tcp_receiver, (self.size,), "tcp-receiver")
            addr = _reply(self.conns[0], self.procs[0], "addr")
            self._add(_tcp_sender, (addr, self.size), "tcp-sender")
        else:
            raise ValueError(f"unknown kind {self.kind!r}")
        for conn, proc in zip(self.conns, self.procs):
            _reply(conn, proc, "ready")

    def _add(self, target, args, name: str) -> None:
        conn, proc = self._spawn(target, args, name)
        self.conns.append(conn)
        self.procs.append(proc)

    def step(self) -> List[Tuple[int, int]]:
        for conn in self.conns:
            conn.send("step")
        stamps = [_reply(conn, proc, "done") for conn, proc in zip(self.conns, self.procs)]
        self.step_stamps.append(stamps)
        return stamps

    def stop(self) -> Dict[str, Any]:
        """Summaries of every process; raises if any failed or computed a wrong average."""
        try:
            for conn in self.conns:
                conn.send("stop")
            workers = [_reply(conn, proc, "summary") for conn, proc in zip(self.conns, self.procs)]
            coord = None
            if self.coordinator is not None:
                conn, proc = self.coordinator
                coord = _reply(conn, proc, "summary")
            for proc in self.procs + ([self.coordinator[1]] if self.coordinator else []):
                proc.join(30)
        finally:
            self.kill()
        return {"workers": workers, "coordinator": coord}

    def kill(self) -> None:
        procs = self.procs + ([self.coordinator[1]] if self.coordinator else [])
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(10)


def run_rounds(benchmark, group: Any, rounds: int, warmup: int) -> Dict[str, Any]:
    """Time ``rounds`` steps of ``group`` after ``warmup`` with
    pytest-benchmark, then stop it; returns its summary. On any failure every
    child is killed (the failing child's traceback is in the exception)."""
    try:
        benchmark.pedantic(group.step, rounds=rounds, warmup_rounds=warmup, iterations=1)
        # --benchmark-disable runs the target once; the coordinator still expects every step
        while len(group.step_stamps) < warmup + rounds:
            group.step()
    except BaseException:
        group.kill()
        raise
    return group.stop()


def step_spans(step_stamps: List[List[Tuple[int, int]]]) -> List[float]:
    """Seconds from the first worker's start to the last worker's end, per step."""
    return [(max(e for _, e in stamps) - min(s for s, _ in stamps)) / 1e9
            for stamps in step_stamps]
