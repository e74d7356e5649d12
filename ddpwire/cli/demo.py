"""`ddpwire demo`: a coordinator here and N worker processes on loopback,
training a real model on a real data set, then checking that every worker
ended with bit-identical weights."""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any, Dict, List, Optional, Tuple

from .._text import counted
from ..wire.auth import load_token
from ..session.balance import CHOICES
from ..session.coordinator import Coordinator
from ..wire.errors import DdpwireError
from ..session.metrics import MetricsFile
from ..session.progress import ProgressBar, unit
from ..session.results import StepReport
from .serve import serve
from ..plane.threads import default_threads
from .torch_check import require_torch

__all__ = ["run_demo", "WorkerDied"]

log = logging.getLogger("ddpwire.demo")


class WorkerDied(DdpwireError):
    """A demo worker process exited with an error before training ended."""


def node_id(index: int) -> str:
    """The demo's worker process ``index``'s node id: the coordinator's lines
    name a worker by its id (join order) and node, the demo's by process."""
    return f"demo{index}"


def _worker_command(args: argparse.Namespace, model: str, addr, index: int, report: str,
                    threads: int) -> List[str]:
    cmd = [sys.executable, "-m", "ddpwire", "worker", "--connect", f"{addr[0]}:{addr[1]}",
           "--node-id", node_id(index),
           "--model", model, "--samples", str(args.inner_samples), "--blocks", str(args.blocks),
           "--sync-every", str(args.sync_every),
           "--lr", str(args.lr), "--seed", str(args.seed), "--timeout", str(args.timeout),
           "--report", report, "--log-level", "WARNING", "--threads", str(threads)]
    if args.heartbeat is not None:
        cmd += ["--heartbeat", str(args.heartbeat)]
    if args.per_block:
        # block messages carry no loss: the progress reads the workers' own
        cmd += ["--per-block", "--step-lines"]
    if args.device:
        cmd += ["--device", args.device]
    return cmd


class _Watch:
    """Watches the worker processes from a thread: the first one to exit with
    an error interrupts the main thread (blocked joining or in a step), so the
    demo stops at once instead of waiting out its timeouts.

    The interruption is SIGUSR1 to the main thread, with a handler installed
    here for the while: a blocking receive returns EINTR and the handler
    raises the worker's death. Not SIGINT: a process started with SIGINT
    ignored (a background job of a non-interactive shell, many service
    managers) keeps it ignored, and the demo would wait out its timeouts."""

    WAKE = signal.SIGUSR1

    def __init__(self, procs: List[subprocess.Popen]) -> None:
        self.procs = procs
        self.dead: Optional[int] = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # no signal once __exit__ has begun
        self._main = threading.main_thread().ident
        self._thread = threading.Thread(target=self._run, name="ddpwire-demo-watch", daemon=True)

    def __enter__(self) -> "_Watch":
        self._previous = signal.signal(self.WAKE, self._woken)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._stop.set()
        self._thread.join(5.0)
        signal.signal(self.WAKE, self._previous)

    def _woken(self, _signum: int, _frame: object) -> None:
        raise self.failure()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            for i, p in enumerate(self.procs):
                if p.poll() not in (None, 0):
                    with self._lock:
                        if self._stop.is_set():
                            return
                        self.dead = i
                        signal.pthread_kill(self._main, self.WAKE)
                    return

    def failure(self) -> WorkerDied:
        p = self.procs[self.dead]
        return WorkerDied(f"worker process {self.dead} exited with code {p.returncode} "
                          f"before training ended (its error is above)")


class _StepLines:
    """Every worker's own loss and counts per step (the JSON lines of
    ``ddpwire worker --step-lines``), read from its stdout on a thread of
    its own, pooled for the progress lines of per-block steps.

    A worker prints a step's line as the step ends, right after it received
    the last average, so the line of a step the coordinator has just
    finished may still be on its way: :meth:`pooled` waits for it, at most
    ``timeout`` seconds."""

    def __init__(self, procs: List[subprocess.Popen], timeout: float) -> None:
        self._timeout = timeout
        self._cond = threading.Condition()
        self._figures: List[Dict[int, Tuple[float, int, int]]] = [{} for _ in procs]
        self._ended = [False] * len(procs)
        self._threads = [threading.Thread(target=self._read, args=(i, p.stdout), daemon=True,
                                          name=f"ddpwire-demo-steps-{i}")
                         for i, p in enumerate(procs)]
        for t in self._threads:
            t.start()

    def _read(self, i: int, stream: Any) -> None:
        try:
            for line in stream:
                try:
                    d = json.loads(line)
                    figures = (float(d["loss"]), int(d["correct"]), int(d["total"]))
                    step = int(d["step"])
                except (ValueError, KeyError, TypeError):
                    continue  # not a step line
                with self._cond:
                    self._figures[i][step] = figures
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._ended[i] = True
                self._cond.notify_all()

    def pooled(self, step: int) -> Optional[Tuple[float, float]]:
        """(loss, accuracy) of ``step`` over every worker's shard, weighted
        by its samples; None when some worker's line did not come."""
        with self._cond:
            self._cond.wait_for(lambda: all(step in f or ended for f, ended
                                            in zip(self._figures, self._ended)), self._timeout)
            got = [f.get(step) for f in self._figures]
            for f in self._figures:  # the bar asks in step order: earlier ones are done with
                for old in [k for k in f if k <= step]:
                    del f[old]
        if any(g is None for g in got):
            log.warning("no loss for step %d: some worker's figures did not come", step)
            return None
        total = sum(g[2] for g in got)  # type: ignore[index]
        loss = sum(g[0] * g[2] for g in got) / max(total, 1)  # type: ignore[index]
        return loss, sum(g[1] for g in got) / max(total, 1)  # type: ignore[index]

    def close(self, timeout: float) -> None:
        """Wait for the readers (the workers have exited: their stdout ended)."""
        for t in self._threads:
            t.join(timeout)


def _torch_default() -> str:
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    return f"OMP_NUM_THREADS={omp}" if omp else "torch's default"


def run_demo(args: argparse.Namespace, *, model: str) -> int:
    """Train for ``args.steps`` steps with ``args.workers`` local workers;
    0 when every worker finished with the same weights."""
    require_torch("ddpwire demo")

    threads = default_threads(args.workers) if args.threads is None else args.threads
    out = sys.stdout
    with tempfile.TemporaryDirectory(prefix="ddpwire-demo-") as tmp, \
            Coordinator(("127.0.0.1", 0), expect_workers=args.workers, timeout=args.timeout,
                        heartbeat=args.heartbeat,
                        join_timeout=max(args.timeout, 120.0), samples_per_step=args.samples,
                        per_block=args.per_block, balance=CHOICES[args.balance],
                        elastic=getattr(args, "elastic", False),
                        # the workers read $DDPWIRE_TOKEN too, when it is set
                        token=load_token(None)) as coord:
        addr = coord.local_addr
        reports = [os.path.join(tmp, f"worker{i}.json") for i in range(args.workers)]
        print(f"ddpwire demo: {counted(args.workers, 'worker')} on {addr[0]}:{addr[1]}, "
              f"model {model}, {counted(args.steps * args.sync_every, 'step')} of "
              f"{counted(args.inner_samples, 'sample')}"
              f"{', per-block' if args.per_block else ''}"
              f"{f', averaged every {args.sync_every} (local steps)' if args.sync_every > 1 else ''}; "
              f"torch threads per worker: {threads or _torch_default()}", file=out, flush=True)
        # Own sessions: a Ctrl-C at the terminal reaches the demo alone, which
        # then stops its workers, instead of every process printing it.
        procs = [subprocess.Popen(_worker_command(args, model, addr, i, r, threads),
                                  start_new_session=True,
                                  stdout=subprocess.PIPE if args.per_block else None, text=True)
                 for i, r in enumerate(reports)]
        lines = _StepLines(procs, args.timeout) if args.per_block else None
        bar = ProgressBar(args.steps, stream=out, label=unit(args.sync_every))
        # an elastic run goes on without a worker that dies: nothing to stop
        watch = _Watch(procs) if not getattr(args, "elastic", False) else contextlib.nullcontext()
        try:
            try:
                with watch:
                    coord.wait_for_workers()
                    for info in coord.workers:
                        log.info("worker %d: %s (%s)", info.worker_id, info.node_id, info.backend)
                    bar = ProgressBar(args.steps, stream=out, label=unit(args.sync_every),
                                      pooled=lines.pooled if lines is not None else None)
                    with contextlib.ExitStack() as keep:
                        metrics = keep.enter_context(MetricsFile(args.metrics)) \
                            if args.metrics else None

                        def on_step(report: StepReport) -> None:
                            bar.update(report)
                            if metrics is not None:
                                metrics.write(report)
                        steps = serve(coord, steps=args.steps, total_samples=args.samples,
                                      per_block=args.per_block, num_blocks=args.blocks,
                                      on_step=on_step)
            except (KeyboardInterrupt, DdpwireError):
                # a worker that died is the cause, whatever the coordinator saw
                if isinstance(watch, _Watch) and watch.dead is not None:
                    raise watch.failure() from None
                raise
            finally:
                bar.close()
            for i, p in enumerate(procs):
                try:
                    p.wait(timeout=args.timeout)
                except subprocess.TimeoutExpired:
                    raise DdpwireError(f"worker process {i} still running {args.timeout:g} s "
                                       f"after training ended") from None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            if lines is not None:
                lines.close(args.timeout)
        failed = [i for i, p in enumerate(procs) if p.returncode != 0]
        if failed and not getattr(args, "elastic", False):
            raise DdpwireError(f"worker processes {failed} exited with an error")
        for i in failed:
            print(f"worker process {i} (node {node_id(i)}) ended mid-run (exit status "
                  f"{procs[i].returncode}): the run went on without it", file=out)
        if len(failed) == len(procs):
            raise DdpwireError("every worker process ended with an error")
        results = []
        for i, path in enumerate(reports):
            if i not in failed:
                with open(path) as f:
                    results.append(json.load(f))
    return _summary(args, steps, bar, results, out)


def _summary(args: argparse.Namespace, steps, bar: ProgressBar, results: List[dict], out) -> int:
    digests = {r["weights_sha256"] for r in results}
    first = min(results, key=lambda r: r["worker_id"])
    allreduce_ms = 1000 * sum(s.allreduce_time for s in steps) / max(len(steps), 1)
    elapsed = bar.last - bar.start
    print(f"held-out accuracy {100 * first['held_out_accuracy']:.1f}% "
          f"(loss {first['held_out_loss']:.4f})", file=out)
    print(f"throughput {bar.throughput:,.0f} samples/s over {elapsed:.2f} s; "
          f"allreduce {allreduce_ms:.2f} ms per step", file=out)
    if len(results) == 1:
        print(f"weights of the only worker (sha256 {first['weights_sha256'][:16]})", file=out)
        return 0
    if len(digests) == 1:
        print(f"weights identical on all {len(results)} workers (sha256 {first['weights_sha256'][:16]})",
              file=out)
        return 0
    print(f"weights DIFFER between workers: {len(digests)} distinct digests", file=out)
    return 1
