"""Markdown tables for bench/results/notebook.md from two pytest-benchmark JSON files:

    python bench/report_session.py bench/results/engine-before-after.json bench/results/hostile.json

- engine: the median step time of the default path ("ddpwire") against the
  same path from the baseline checkout ("ddpwire-baseline"), the two-call path
  that sends nothing before every gradient is checked ("ddpwire-classic") and
  gloo, per size and worker count, as ratios within the same run;
- hostile: the join time and the coordinator's peak RSS per scenario, this
  checkout against the baseline.
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from typing import Callable, Dict, Tuple

MiB = 1 << 20


def medians(data: dict, value: Callable[[dict], float]) -> Dict[Tuple[int, int], Dict[str, float]]:
    """{(size MiB, workers): {kind: value(benchmark)}} of a pytest-benchmark
    JSON whose cases carry kind, size_bytes and workers (the raw TCP check
    left out)."""
    med: Dict[Tuple[int, int], Dict[str, float]] = defaultdict(dict)
    for b in data["benchmarks"]:
        info = b["extra_info"]
        if info["kind"] == "tcp":
            continue
        med[(info["size_bytes"] // MiB, info["workers"])][info["kind"]] = value(b)
    return med


def engine(path: str) -> str:
    data = json.load(open(path))
    med = medians(data, lambda b: b["stats"]["median"])
    rows = ["| size | workers | ddpwire (ms) | baseline (ms) | ddpwire / baseline "
            "| classic / ddpwire | ddpwire / gloo |", "|---|---|---|---|---|---|---|"]

    def ms(t):
        return f"{t * 1e3:.1f}" if t else "–"

    def ratio(a, b):
        return f"{a / b:.2f}" if a and b else "–"
    for (size, n), k in sorted(med.items()):
        d, base = k.get("ddpwire"), k.get("ddpwire-baseline")
        rows.append(f"| {size} MiB | {n} | {ms(d)} | {ms(base)} | {ratio(d, base)} | "
                    f"{ratio(k.get('ddpwire-classic'), d)} | {ratio(d, k.get('gloo'))} |")
    commit = data.get("commit_info", {})
    return (f"commit {commit.get('id', '?')[:12]}{' (dirty)' if commit.get('dirty') else ''}, "
            f"{data.get('machine_info', {}).get('cpu', {}).get('count', '?')} cores\n\n"
            + "\n".join(rows))


def hostile(path: str) -> str:
    data = json.load(open(path))
    rows = ["| scenario | code | join time (s) | outcome | coordinator peak RSS (MiB) "
            "| RSS before the join (MiB) |", "|---|---|---|---|---|---|"]
    for b in data["benchmarks"]:
        e = b["extra_info"]
        rows.append(f"| {e['scenario']} | {e['code']} | {e['join_time']:.3f} | {e['outcome']} | "
                    f"{e['peak_rss'] / MiB:.0f} | {e['rss_before_join'] / MiB:.0f} |")
    commit = data.get("commit_info", {})
    return (f"commit {commit.get('id', '?')[:12]}{' (dirty)' if commit.get('dirty') else ''}\n\n"
            + "\n".join(rows))


def main(argv) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    print(engine(argv[1]))
    print()
    print(hostile(argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
