"""``ddpwire demo``: a coordinator here and N worker processes on loopback,
training a real model on a real data set, then checking that every worker
ended with bit-identical weights."""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from typing import List

from .coordinator import Coordinator
from .errors import DdpwireError
from .progress import ProgressBar
from .serve import serve

__all__ = ["run_demo"]

log = logging.getLogger(__name__)


def _worker_command(args: argparse.Namespace, model: str, addr, report: str) -> List[str]:
    cmd = [sys.executable, "-m", "ddpwire", "worker", "--connect", f"{addr[0]}:{addr[1]}",
           "--model", model, "--samples", str(args.samples), "--blocks", str(args.blocks),
           "--lr", str(args.lr), "--seed", str(args.seed), "--timeout", str(args.timeout),
           "--report", report, "--log-level", "WARNING"]
    if args.per_block:
        cmd.append("--per-block")
    if args.device:
        cmd += ["--device", args.device]
    return cmd


def run_demo(args: argparse.Namespace, *, model: str) -> int:
    """Train for ``args.steps`` steps with ``args.workers`` local workers;
    0 when every worker finished with the same weights."""
    if args.workers < 1:
        raise ValueError(f"--workers must be at least 1, got {args.workers}")
    out = sys.stdout
    with tempfile.TemporaryDirectory(prefix="ddpwire-demo-") as tmp, \
            Coordinator(("127.0.0.1", 0), expect_workers=args.workers, timeout=args.timeout,
                        join_timeout=max(args.timeout, 120.0)) as coord:
        addr = coord.local_addr
        reports = [os.path.join(tmp, f"worker{i}.json") for i in range(args.workers)]
        print(f"ddpwire demo: {args.workers} workers on {addr[0]}:{addr[1]}, model {model}, "
              f"{args.steps} steps of {args.samples} samples"
              f"{', per-block' if args.per_block else ''}", file=out, flush=True)
        procs = [subprocess.Popen(_worker_command(args, model, addr, r)) for r in reports]
        try:
            coord.wait_for_workers()
            for info in coord.workers:
                log.info("worker %d: %s (%s)", info.worker_id, info.node_id, info.backend)
            bar = ProgressBar(args.steps, stream=out)
            t0 = time.perf_counter()
            steps = serve(coord, steps=args.steps, total_samples=args.samples,
                          per_block=args.per_block, num_blocks=args.blocks, on_step=bar.update)
            elapsed = time.perf_counter() - t0
            for p in procs:
                p.wait(timeout=args.timeout)
        except (DdpwireError, subprocess.TimeoutExpired):
            for p in procs:
                p.kill()
            raise
        failed = [i for i, p in enumerate(procs) if p.returncode != 0]
        if failed:
            raise DdpwireError(f"worker processes {failed} exited with an error")
        results = []
        for path in reports:
            with open(path) as f:
                results.append(json.load(f))
    digests = {r["weights_sha256"] for r in results}
    first = min(results, key=lambda r: r["worker_id"])
    allreduce_ms = 1000 * sum(s.allreduce_time for s in steps) / max(len(steps), 1)
    print(f"held-out accuracy {100 * first['held_out_accuracy']:.1f}% "
          f"(loss {first['held_out_loss']:.4f})", file=out)
    print(f"throughput {args.steps * args.samples / elapsed:,.0f} samples/s over {elapsed:.2f} s; "
          f"allreduce {allreduce_ms:.2f} ms per step", file=out)
    if len(digests) == 1:
        print(f"weights identical on all {len(results)} workers (sha256 {first['weights_sha256'][:16]})",
              file=out)
        return 0
    print(f"weights DIFFER between workers: {len(digests)} distinct digests", file=out)
    return 1
