"""A markdown table of bench/test_bench_allreduce.py's JSON: per size and
worker count, every kind's median step (first worker's start to last
worker's end, the workers' own clocks) and its ratio to gloo in the same run.

    python bench/report_kinds.py bench/results/allreduce-shm.json
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from report_session import medians  # noqa: E402  (the path above)


def table(path: str) -> str:
    data = json.load(open(path))
    med = medians(data, lambda b: b["extra_info"]["step_span_median"])
    commit = data.get("commit_info", {})
    rows = [f"`{path}`: commit {commit.get('id', '?')[:7]}"
            f"{' (dirty)' if commit.get('dirty') else ''}", "",
            "| size | workers | kind | median ms | / gloo |", "|---:|---:|:---|---:|---:|"]
    for (size, n), kinds in sorted(med.items()):
        gloo = kinds.get("gloo")
        for kind, t in sorted(kinds.items(), key=lambda kv: (kv[0] == "gloo", kv[0])):
            ratio = f"{t / gloo:.2f}x" if gloo and kind != "gloo" else "–"
            rows.append(f"| {size} MiB | {n} | {kind} | {t * 1e3:.1f} | {ratio} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print("\n\n".join(table(p) for p in sys.argv[1:]))
