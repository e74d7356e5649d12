"""Markdown tables for bench/results/notebook.md from the JSON of the torch benchmarks
(bench/test_bench_ddp.py, bench/test_bench_torch_allreduce.py):

    python bench/report_ddp.py bench/results/ddp-bench.json [more.json ...]

One row per rank count: gloo's and ddpwire's median (and spread) in ms and
the ratio ddpwire / gloo, both measured in the same run, with the commit and
machine the run recorded; where the run had a baseline checkout
($DDPWIRE_BASELINE: bench/ddp_procs.py), its median and ddpwire / baseline,
and the same for each ddpwire variant it ran (bench/ddp_procs.py VARIANTS,
e.g. "ddpwire-service").
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
    # the baseline first, then any variant, each with its own two columns
    others = sorted({k for by in med.values() for k in by} - {"gloo", "ddpwire"},
                    key=lambda k: (k != "ddpwire-baseline", k))
    names = {k: "baseline" if k == "ddpwire-baseline" else k for k in others}
    rows = [head, "", "| ranks | gloo median ms (IQR) | ddpwire median ms (IQR) | ddpwire / gloo |"
            + "".join(f" {names[k]} median ms (IQR) | ddpwire / {names[k]} |" for k in others),
            "|---:|---:|---:|---:|" + "---:|---:|" * len(others)]

    def cell(s: dict) -> str:
        return f"{s['median'] * 1e3:.1f} ({s['iqr'] * 1e3:.1f})" if s else "–"

    def ratio(a: dict, b: dict) -> str:
        return f"{a['median'] / b['median']:.2f}" if a and b else "–"
    for n in sorted(med):
        g, d = med[n].get("gloo"), med[n].get("ddpwire")
        rows.append(f"| {n} | {cell(g)} | {cell(d)} | {ratio(d, g)} |" + "".join(
            f" {cell(med[n].get(k))} | {ratio(d, med[n].get(k))} |" for k in others))
    return "\n".join(rows)


if __name__ == "__main__":
    print("\n\n".join(table(p) for p in sys.argv[1:]))
