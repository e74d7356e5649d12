"""Sealed over clear from the cluster benchmarks' JSON (docs/results.md,
"Sealed links"): each sealed kind's median step over the clear one's of the
same run and N, and every process's CPU seconds per step summed, clear ->
sealed.

    python bench/cluster/report_seal.py bench/results/cluster-*seal*-<commit>*.json
"""
from __future__ import annotations

import json
import statistics
import sys
from typing import Dict, Optional, Tuple

#: sealed kind -> the clear kind it is compared with
PAIRS = {"ddp-ddpwire-sealed": "ddp-ddpwire-clear",
         "ddp-ddpwire-sealed-baseline": "ddp-ddpwire-clear",
         "ddpwire-mesh-sealed": "ddpwire-mesh-clear",
         "ddpwire-star-sealed": "ddpwire-star-clear"}


def load(path: str) -> Dict[Tuple[str, int], Tuple[float, Optional[float]]]:
    """(kind, workers) -> (median step in s, median summed CPU s per step)."""
    out = {}
    for b in json.load(open(path))["benchmarks"]:
        e = b["extra_info"]
        cpu = e.get("step_cpu_s")
        summed = statistics.median(sum(s) for s in zip(*cpu)) if cpu else None
        out[(e["kind"], e["workers"])] = (b["stats"]["median"], summed)
    return out


def main(paths) -> None:
    for path in paths:
        print(path)
        runs = load(path)
        for (kind, n), (step, cpu) in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            clear = runs.get((PAIRS.get(kind, ""), n))
            if clear is None:
                continue
            cpus = f"{clear[1]:.3f} -> {cpu:.3f} s" if cpu is not None and clear[1] else "-"
            print(f"  N={n} {kind}: {step * 1e3:.1f} ms / {clear[0] * 1e3:.1f} ms = "
                  f"{step / clear[0]:.3f}x  CPU a step {cpus}")


if __name__ == "__main__":
    main(sys.argv[1:])
