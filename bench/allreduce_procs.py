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
"""
from __future__ import annotations

import multiprocessing as mp
import os
import resource
import socket
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

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


def _serve(conn, setup: Callable[[], Any], step: Callable[[Any], None],
           finish: Callable[[Any], Dict[str, Any]]) -> None:
    """The child's command loop: report ready, time each step, report the summary."""
    try:
        state = setup()
        conn.send(("ready", None))
        while True:
            cmd = conn.recv()
            if cmd == "step":
                t0 = time.monotonic_ns()
                step(state)
                conn.send(("done", (t0, time.monotonic_ns())))
            elif cmd == "stop":
                # before finish(), whose checks allocate temporaries of their own
                peak = peak_rss_bytes()
                summary = finish(state)
                summary["peak_rss"] = peak
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


def _ddpwire_coordinator(conn, n: int, size: int, steps: int, pipelined: bool = True,
                         socket_threads: bool = False, baseline: Optional[str] = None,
                         host: str = "127.0.0.1") -> None:
    try:
        use_baseline(baseline)
        from ddpwire import Coordinator

        count = size // 4
        # host: bench/cluster binds the coordinator's address in its own namespace
        coord = Coordinator((host, 0), expect_workers=n, timeout=REPLY_TIMEOUT,
                            max_frame=size + 4096, socket_threads=socket_threads)
        conn.send(("addr", coord.local_addr))
        coord.wait_for_workers()
        out = np.empty(count, dtype=np.float32)
        times = []
        for s in range(steps):
            t0 = time.monotonic_ns()
            if pipelined:
                # collect, average and send back in one pass
                result = coord.allreduce(s, out=out)
            else:
                result = coord.collect_and_reduce(s, out=out)
                coord.broadcast_averaged(s, result)
            # (start, every head in, reply sent): the wait for the heads, then the rest
            times.append((t0, t0 + int(result.wait_time * 1e9), time.monotonic_ns()))
        coord.shutdown_workers()
        coord.close()
        # before the check, whose temporaries are the benchmark's, not ddpwire's
        peak = peak_rss_bytes()
        conn.send(("summary", {"peak_rss": peak, "times": times,
                               "average_ok": _check_average(out, n)}))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


def _ddpwire_worker(conn, addr: Tuple[str, int], rank: int, n: int, size: int,
                    pipelined: bool = True, socket_threads: bool = False,
                    baseline: Optional[str] = None) -> None:
    def setup():
        use_baseline(baseline)
        from ddpwire import Worker

        count = size // 4
        worker = Worker.connect(addr, gpu_count=0, backend="cpu", timeout=REPLY_TIMEOUT,
                                max_frame=size + 4096, socket_threads=socket_threads)
        # joining order decides worker_id; the data follows it so the average is checkable
        grads = worker_gradients(worker.worker_id, count)
        return {"worker": worker, "grads": grads, "out": np.empty(count, dtype=np.float32),
                "step": 0}

    def step(st):
        if pipelined:
            # sends the gradients while the average comes back
            st["worker"].allreduce(st["step"], st["grads"], 1.0, 0, 1, out=st["out"])
        else:
            st["worker"].send_gradients(st["step"], st["grads"], 1.0, 0, 1)
            st["worker"].receive_averaged(out=st["out"])
        st["step"] += 1

    def finish(st):
        st["worker"].close()
        return {"average_ok": _check_average(st["out"], n)}

    _serve(conn, setup, step, finish)


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
        if self.kind in ("ddpwire", "ddpwire-threads", "ddpwire-classic", "ddpwire-baseline"):
            # "ddpwire-classic": the two-call path (collect_and_reduce then
            # broadcast_averaged; send_gradients then receive_averaged);
            # "ddpwire-threads": the pipelined path with socket threads (the
            # coordinator's receiving and sending thread per connection, each
            # worker's sending thread); plain "ddpwire": the same, one poll
            # loop per process
            pipelined = self.kind != "ddpwire-classic"
            threads = self.kind == "ddpwire-threads"
            baseline = None
            if self.kind == "ddpwire-baseline":
                baseline = os.environ.get(BASELINE_ENV)
                if not baseline:
                    raise ValueError(f"kind ddpwire-baseline needs ${BASELINE_ENV}")
            conn, proc = self._spawn(_ddpwire_coordinator,
                                     (self.n, self.size, self.steps, pipelined, threads, baseline),
                                     "ddpwire-coordinator")
            self.coordinator = (conn, proc)
            addr = _reply(conn, proc, "addr")
            for rank in range(self.n):
                self._add(_ddpwire_worker,
                          (addr, rank, self.n, self.size, pipelined, threads, baseline),
                          f"ddpwire-worker-{rank}")
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
