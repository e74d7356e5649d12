"""Markdown tables for docs/benchmarks.md from the JSON of the torch benchmarks
(bench/test_bench_ddp.py, bench/test_bench_torch_allreduce.py):

    python bench/report_ddp.py docs/ddp-bench.json [more.json ...]

One row per rank count: gloo's and ddpwire's median (and spread) in ms and
the ratio ddpwire / gloo, both measured in the same run, with the commit and
machine the run recorded.
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from typing import Dict


def table(path: str) -> str:
    data = json.load(open(path))
    med: Dict[int, Dict[str, dict]] = defaultdict(dict)
    for b in data["benchmarks"]:
        info = b["extra_info"]
        med[info["ranks"]][info["backend"]] = b["stats"]
    commit = data.get("commit_info", {})
    head = (f"`{path}`: commit {commit.get('id', '?')[:7]}"
            f"{' (dirty)' if commit.get('dirty') else ''}, "
            f"{data.get('machine_info', {}).get('cpu', {}).get('count', '?')} cores")
    rows = [head, "", "| ranks | gloo median ms (IQR) | ddpwire median ms (IQR) | ddpwire / gloo |",
            "|---:|---:|---:|---:|"]
    for n in sorted(med):
        g, d = med[n].get("gloo"), med[n].get("ddpwire")

        def cell(s):
            return f"{s['median'] * 1e3:.1f} ({s['iqr'] * 1e3:.1f})" if s else "–"
        ratio = f"{d['median'] / g['median']:.2f}" if g and d else "–"
        rows.append(f"| {n} | {cell(g)} | {cell(d)} | {ratio} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print("\n\n".join(table(p) for p in sys.argv[1:]))
