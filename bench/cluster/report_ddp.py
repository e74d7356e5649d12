"""A markdown table from the cluster DDP benchmark's JSON
(bench/cluster/test_bench_ddp_cluster.py):

    python bench/cluster/report_ddp.py bench/results/cluster-ddp-1g.json

One row per rank count: each kind's median step (from its rounds' spans,
first rank's start to last rank's end) and its ratio to gloo's in the same
file (DDP's, FSDP2's and DDP's of a bfloat16 model in tables of their
own), with the commit and the
link rate the run recorded.

    python bench/cluster/report_ddp.py --trace bench/results/cluster-ddp-1g-trace4.json

For a run with DDPWIRE_DDP_TRACE=1 (bench/ddp_step.py), the timed steps'
timeline instead: per kind and bucket, medians in ms from the first rank's
first bucket of the step, of the last rank's hand-over and the last rank's
completion; and on the rank links each bucket's reduce-scatter (from the
last rank's start to the last rank's end) and allgather (from there to the
last rank's end), beside the link's time for the bytes each rank sends in
that phase ((N-1)/N of the bucket, 2 or 4 bytes an element).
"""
from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from typing import Dict

KINDS = ("ddp-gloo", "ddp-ddpwire", "ddp-ddpwire-bf16", "ddp-ddpwire-int8",
         "ddp-ddpwire-baseline", "ddp-ddpwire-bf16-baseline", "ddp-ddpwire-bf16-free")
LABELS = {"ddp-ddpwire": "ddpwire", "ddp-ddpwire-bf16": "ddpwire bf16",
          "ddp-ddpwire-int8": "ddpwire int8",
          "ddp-ddpwire-baseline": "baseline", "ddp-ddpwire-bf16-baseline": "bf16 baseline",
          "ddp-ddpwire-bf16-free": "bf16, free kernels",
          "fsdp-ddpwire": "ddpwire", "fsdp-ddpwire-baseline": "baseline",
          "bf16model-ddpwire": "ddpwire", "bf16model-ddpwire-baseline": "baseline"}
#: the same model under FSDP2: a table of its own, against FSDP on gloo
FSDP_KINDS = ("fsdp-gloo", "fsdp-ddpwire", "fsdp-ddpwire-baseline")
#: the model in bfloat16 under DDP: a table of its own
BF16_MODEL_KINDS = ("bf16model-gloo", "bf16model-ddpwire", "bf16model-ddpwire-baseline")
#: columns shown only where the file has them
OPTIONAL = ("ddp-ddpwire-int8", "ddp-ddpwire-baseline", "ddp-ddpwire-bf16-baseline",
            "ddp-ddpwire-bf16-free", "fsdp-ddpwire-baseline", "bf16model-ddpwire-baseline")


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
    rows = [f"`{path}`: commit {commit.get('id', '?')[:7]}"
            f"{' (dirty)' if commit.get('dirty') else ''}, links "
            f"{(rate or 0) / 1e9:g} Gbit/s"]
    titles = {KINDS: "DDP", FSDP_KINDS: "FSDP2", BF16_MODEL_KINDS: "DDP, the model in bfloat16"}
    for family, title in titles.items():
        if not any(k in by for by in med.values() for k in family):
            continue
        kinds = [k for k in family[1:]
                 if k not in OPTIONAL or any(k in by for by in med.values())]
        rows += ["", f"{title}:", "",
                 "| ranks | gloo ms | " + " | ".join(f"{LABELS[k]} ms | / gloo" for k in kinds)
                 + " |", "|---:|---:|" + "---:|---:|" * len(kinds)]
        for n in sorted(med):
            by = med[n]
            gloo = by.get(family[0])
            cells = [str(n), f"{gloo * 1e3:.0f}" if gloo else "–"]
            for kind in kinds:
                value = by.get(kind)
                cells.append(f"{value * 1e3:.0f}" if value else "–")
                cells.append(f"{value / gloo:.2f}x" if value and gloo else "–")
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.0f}"


def timeline(path: str) -> str:
    """The traced run's bucket and phase tables, headed by its commit."""
    with open(path) as f:
        data = json.load(f)
    commit = data.get("commit_info", {})
    out = [f"`{path}`: commit {commit.get('id', '?')[:7]}"
           f"{' (dirty)' if commit.get('dirty') else ''}", "",
           "| ranks | kind | bucket MiB | last hand-over ms | last done ms |",
           "|---:|:---|---:|---:|---:|"]
    phase_rows = ["| ranks | kind | bucket MiB | reduce-scatter ms | allgather ms | link ms "
                  "| / link |", "|---:|:---|---:|---:|---:|---:|---|"]
    for b in data["benchmarks"]:
        info = b["extra_info"]
        ranks = info.get("buckets")
        if not ranks:
            continue
        n, kind, warmup = info["workers"], info["kind"], info["warmup"]
        label = LABELS.get(kind, "gloo")
        # per step and bucket index: every rank's (issued, done)
        seen: Dict[tuple, list] = defaultdict(list)
        for trace in ranks:
            for step, index, count, issued, done in trace:
                if step >= warmup:
                    seen[(step, index)].append((count, issued, done))
        starts = {step: min(i for (s, _), v in seen.items() if s == step for _, i, _ in v)
                  for step, _ in seen}
        by_bucket: Dict[int, list] = defaultdict(list)
        for (step, index), v in seen.items():
            if len(v) == len(ranks):
                by_bucket[index].append((v[0][0], max(i for _, i, _ in v) - starts[step],
                                         max(d for _, _, d in v) - starts[step]))
        for index in sorted(by_bucket):
            rows = by_bucket[index]
            out.append(f"| {n} | {label} | {rows[0][0] * 4 / 2**20:.0f} | "
                       f"{_ms(statistics.median(r[1] for r in rows))} | "
                       f"{_ms(statistics.median(r[2] for r in rows))} |")
        phased = info.get("phases")
        if not phased:
            continue
        first = min(starts.values())
        # per seq: every rank's [phase, start, end], from the timed steps only
        runs: Dict[int, Dict[str, list]] = defaultdict(lambda: defaultdict(list))
        for stamps in phased:
            for phase, seq, count, start, end in stamps:
                if start >= first:
                    runs[seq][phase].append((count, start, end))
        sizes: Dict[int, list] = defaultdict(list)
        for seq, phases in runs.items():
            rs, ag = phases.get("reduce_scatter", []), phases.get("allgather", [])
            if len(rs) != len(phased) or len(ag) != len(phased):
                continue
            rs_end = max(e for _, _, e in rs)
            sizes[rs[0][0]].append((rs_end - max(s for _, s, _ in rs),
                                    max(e for _, _, e in ag) - rs_end))
        width = 2 if kind.startswith("ddp-ddpwire-bf16") else 4
        for count in sorted(sizes, key=lambda c: -len(sizes[c])):
            spans = sizes[count]
            link = count * width * (n - 1) / n * 8 / info["worker_rate_bps"] * 1e9
            rs = statistics.median(x[0] for x in spans)
            ag = statistics.median(x[1] for x in spans)
            phase_rows.append(f"| {n} | {label} | {count * 4 / 2**20:.0f} | {_ms(rs)} | {_ms(ag)} "
                              f"| {_ms(link)} | {rs / link:.2f}x / {ag / link:.2f}x |")
    return "\n".join(out + [""] + phase_rows)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "--trace":
        print("\n\n".join(timeline(p) for p in args[1:]))
    else:
        print("\n\n".join(table(p) for p in args))
