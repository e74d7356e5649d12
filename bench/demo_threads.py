"""Demo throughput with torch's default thread count per worker (each worker
takes every core) against the default split (cores / workers), as the demo
prints it. Writes the raw runs and the medians as JSON.

    python bench/demo_threads.py --out bench/results/demo-threads.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys

from ddpwire.plane.threads import usable_cores

THROUGHPUT = re.compile(r"throughput ([\d,]+) samples/s over ([\d.]+) s; allreduce ([\d.]+) ms")


def run_demo(workers: int, steps: int, samples: int, threads: str) -> dict:
    cmd = [sys.executable, "-m", "ddpwire", "demo", "--workers", str(workers), "--steps", str(steps),
           "--samples", str(samples), "--log-level", "WARNING"]
    if threads != "split":
        cmd += ["--threads", threads]
    # torch's default must be the real default: no thread variables inherited
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"demo failed: {' '.join(cmd)}\n{proc.stderr}")
    m = THROUGHPUT.search(proc.stdout)
    header = proc.stdout.splitlines()[0]
    return {"threads": threads, "header": header, "samples_per_s": int(m.group(1).replace(",", "")),
            "train_s": float(m.group(2)), "allreduce_ms_per_step": float(m.group(3))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    runs = []
    for _ in range(args.repeats):  # interleaved, so a noisy neighbour hits both
        for threads in ("0", "split"):
            runs.append(run_demo(args.workers, args.steps, args.samples, threads))
    before = statistics.median(r["samples_per_s"] for r in runs if r["threads"] == "0")
    after = statistics.median(r["samples_per_s"] for r in runs if r["threads"] == "split")
    import torch

    result = {
        "command": f"python bench/demo_threads.py --workers {args.workers} --steps {args.steps} "
                   f"--samples {args.samples} --repeats {args.repeats} --out {args.out}",
        "before": "--threads 0: torch's default threads in every worker",
        "after": "default: usable cores // workers threads per worker",
        "cores": usable_cores(),
        "machine": platform.machine(), "python": platform.python_version(), "torch": torch.__version__,
        "median_samples_per_s_before": before, "median_samples_per_s_after": after,
        "ratio_after_over_before": round(after / before, 2),
        "runs": runs,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"before {before:,.0f} samples/s, after {after:,.0f} samples/s: x{after / before:.2f}")


if __name__ == "__main__":
    main()
