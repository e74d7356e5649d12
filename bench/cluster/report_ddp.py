"""A markdown table from the cluster DDP benchmark's JSON
(bench/cluster/test_bench_ddp_cluster.py):

    python bench/cluster/report_ddp.py docs/cluster-ddp-1g.json

One row per rank count: each kind's median step (from its rounds' spans,
first rank's start to last rank's end) and its ratio to gloo's in the same
file, with the commit and the link rate the run recorded.
"""
from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from typing import Dict

KINDS = ("ddp-gloo", "ddp-ddpwire", "ddp-ddpwire-bf16", "ddp-ddpwire-baseline")
LABELS = {"ddp-ddpwire": "ddpwire", "ddp-ddpwire-bf16": "ddpwire bf16",
          "ddp-ddpwire-baseline": "baseline"}


def table(path: str) -> str:
    """The file's table, headed by its commit."""
    with open(path) as f:
        data = json.load(f)
    med: Dict[int, Dict[str, float]] = defaultdict(dict)
    rate = None
    for b in data["benchmarks"]:
        info = b["extra_info"]
        med[info["workers"]][info["kind"]] = statistics.median(info["step_spans"])
        rate = info.get("worker_rate_bps", rate)
    commit = data.get("commit_info", {})
    # the baseline's column only where the file has it
    kinds = [k for k in KINDS[1:] if k != "ddp-ddpwire-baseline"
             or any(k in by for by in med.values())]
    rows = [f"`{path}`: commit {commit.get('id', '?')[:7]}"
            f"{' (dirty)' if commit.get('dirty') else ''}, links "
            f"{(rate or 0) / 1e9:g} Gbit/s", "",
            "| ranks | gloo ms | " + " | ".join(f"{LABELS[k]} ms | / gloo" for k in kinds) + " |",
            "|---:|---:|" + "---:|---:|" * len(kinds)]
    for n in sorted(med):
        by = med[n]
        gloo = by.get("ddp-gloo")
        cells = [str(n), f"{gloo * 1e3:.0f}" if gloo else "–"]
        for kind in kinds:
            value = by.get(kind)
            cells.append(f"{value * 1e3:.0f}" if value else "–")
            cells.append(f"{value / gloo:.2f}x" if value and gloo else "–")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    print("\n\n".join(table(p) for p in sys.argv[1:]))
