"""`ddpwire demo`: a coordinator here and N worker processes on loopback,
training a real model on a real data set, then checking that every worker
ended with bit-identical weights."""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from typing import List, Optional

from .auth import load_token
from .coordinator import Coordinator
from .errors import DdpwireError
from .progress import ProgressBar
from .serve import serve
from .threads import default_threads
from .torch_check import require_torch

__all__ = ["run_demo", "WorkerDied"]

log = logging.getLogger(__name__)


class WorkerDied(DdpwireError):
    """A demo worker process exited with an error before training ended."""


def _worker_command(args: argparse.Namespace, model: str, addr, report: str, threads: int) -> List[str]:
    cmd = [sys.executable, "-m", "ddpwire", "worker", "--connect", f"{addr[0]}:{addr[1]}",
           "--model", model, "--samples", str(args.samples), "--blocks", str(args.blocks),
           "--lr", str(args.lr), "--seed", str(args.seed), "--timeout", str(args.timeout),
           "--report", report, "--log-level", "WARNING", "--threads", str(threads)]
    if args.per_block:
        cmd.append("--per-block")
    if args.device:
        cmd += ["--device", args.device]
    return cmd


class _Watch:
    """Watches the worker processes from a thread: the first one to exit with
    an error interrupts the main thread (blocked joining or in a step), so the
    demo stops at once instead of waiting out its timeouts."""

    def __init__(self, procs: List[subprocess.Popen]) -> None:
        self.procs = procs
        self.dead: Optional[int] = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # no signal once __exit__ has begun
        self._main = threading.main_thread().ident
        self._thread = threading.Thread(target=self._run, name="ddpwire-demo-watch", daemon=True)

    def __enter__(self) -> "_Watch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            for i, p in enumerate(self.procs):
                if p.poll() not in (None, 0):
                    with self._lock:
                        if self._stop.is_set():
                            return
                        self.dead = i
                        # SIGINT to the main thread itself: its blocking receive
                        # returns EINTR and raises KeyboardInterrupt, as on Ctrl-C
                        signal.pthread_kill(self._main, signal.SIGINT)
                    return

    def failure(self) -> WorkerDied:
        p = self.procs[self.dead]
        return WorkerDied(f"worker process {self.dead} exited with code {p.returncode} "
                          f"before training ended (its error is above)")


def _torch_default() -> str:
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    return f"OMP_NUM_THREADS={omp}" if omp else "torch's default"


def run_demo(args: argparse.Namespace, *, model: str) -> int:
    """Train for ``args.steps`` steps with ``args.workers`` local workers;
    0 when every worker finished with the same weights."""
    if args.workers < 1:
        raise ValueError(f"--workers must be at least 1, got {args.workers}")
    require_torch("ddpwire demo")

    threads = default_threads(args.workers) if args.threads is None else args.threads
    out = sys.stdout
    with tempfile.TemporaryDirectory(prefix="ddpwire-demo-") as tmp, \
            Coordinator(("127.0.0.1", 0), expect_workers=args.workers, timeout=args.timeout,
                        join_timeout=max(args.timeout, 120.0), samples_per_step=args.samples,
                        per_block=args.per_block,
                        # the workers read $DDPWIRE_TOKEN too, when it is set
                        token=load_token(None)) as coord:
        addr = coord.local_addr
        reports = [os.path.join(tmp, f"worker{i}.json") for i in range(args.workers)]
        print(f"ddpwire demo: {args.workers} workers on {addr[0]}:{addr[1]}, model {model}, "
              f"{args.steps} steps of {args.samples} samples"
              f"{', per-block' if args.per_block else ''}; "
              f"torch threads per worker: {threads or _torch_default()}", file=out, flush=True)
        # Own sessions: a Ctrl-C at the terminal reaches the demo alone, which
        # then stops its workers, instead of every process printing it.
        procs = [subprocess.Popen(_worker_command(args, model, addr, r, threads), start_new_session=True)
                 for r in reports]
        bar = ProgressBar(args.steps, stream=out)
        watch = _Watch(procs)
        try:
            try:
                with watch:
                    coord.wait_for_workers()
                    for info in coord.workers:
                        log.info("worker %d: %s (%s)", info.worker_id, info.node_id, info.backend)
                    bar = ProgressBar(args.steps, stream=out)
                    steps = serve(coord, steps=args.steps, total_samples=args.samples,
                                  per_block=args.per_block, num_blocks=args.blocks, on_step=bar.update)
            except (KeyboardInterrupt, DdpwireError):
                # a worker that died is the cause, whatever the coordinator saw
                if watch.dead is not None:
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
        failed = [i for i, p in enumerate(procs) if p.returncode != 0]
        if failed:
            raise DdpwireError(f"worker processes {failed} exited with an error")
        results = []
        for path in reports:
            with open(path) as f:
                results.append(json.load(f))
    return _summary(args, steps, bar, results, out)


def _summary(args: argparse.Namespace, steps, bar: ProgressBar, results: List[dict], out) -> int:
    digests = {r["weights_sha256"] for r in results}
    first = min(results, key=lambda r: r["worker_id"])
    if args.per_block:
        # block messages carry no loss: the workers' own figures, pooled per step
        _print_training_curve(results, args.steps, out)
    allreduce_ms = 1000 * sum(s.allreduce_time for s in steps) / max(len(steps), 1)
    elapsed = bar.last - bar.start
    print(f"held-out accuracy {100 * first['held_out_accuracy']:.1f}% "
          f"(loss {first['held_out_loss']:.4f})", file=out)
    print(f"throughput {bar.throughput:,.0f} samples/s over {elapsed:.2f} s; "
          f"allreduce {allreduce_ms:.2f} ms per step", file=out)
    if len(digests) == 1:
        print(f"weights identical on all {len(results)} workers (sha256 {first['weights_sha256'][:16]})",
              file=out)
        return 0
    print(f"weights DIFFER between workers: {len(digests)} distinct digests", file=out)
    return 1


def _print_training_curve(results: List[dict], steps: int, out) -> None:
    """Loss and accuracy over all workers' shards, at about ten steps of the run."""
    n = min(len(r["train_loss"]) for r in results)
    shown = sorted({min(n - 1, i * max(1, n // 10)) for i in range(10)} | {n - 1}) if n else []
    for step in shown:
        total = sum(r["train_total"][step] for r in results)
        loss = sum(r["train_loss"][step] * r["train_total"][step] for r in results) / max(total, 1)
        correct = sum(r["train_correct"][step] for r in results)
        print(f"step {step + 1:>{len(str(steps))}}/{steps}  train loss {loss:.4f}  "
              f"acc {100 * correct / max(total, 1):5.1f}%", file=out)
