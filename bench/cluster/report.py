"""Markdown tables from the cluster benchmark's pytest-benchmark JSON.

    python bench/cluster/report.py docs/cluster-1g.json [docs/cluster-10g-coord.json ...]

One table per file: the shaping check (raw TCP goodput against the path's
rate), then per size and worker count the median step of each kind, the
ratios to gloo, the utilisation of the coordinator's link and of a worker's
link under ddpwire's star (payload bytes over the step time, against the
link rate; TCP/IP and Ethernet headers make ~95.6% the most a 1500-byte MTU
allows),
and the two floors at the given rates: the star's N·size through the
coordinator's link each way (or size through a worker's, if that is
slower) and the ring's 2·(N−1)/N·size through every link each way.
"""
from __future__ import annotations

import json
import sys
from typing import Dict, List, Tuple

MiB = 1 << 20


def load(path: str) -> Tuple[dict, List[dict]]:
    """The file's commit info and each benchmark's extra_info."""
    with open(path) as f:
        data = json.load(f)
    return data.get("commit_info", {}), [b["extra_info"] for b in data["benchmarks"]]


def star_floor(n: int, size: int, coord_rate: int, worker_rate: int) -> float:
    """Seconds a star step needs at least: N·size through the coordinator's link
    and size through each worker's, each way, at the link rates."""
    return max(n * size * 8 / coord_rate, size * 8 / worker_rate)


def ring_floor(n: int, size: int, rate: int) -> float:
    """Seconds a ring allreduce needs at least: 2·(N−1)/N·size through each link each way."""
    return 2 * (n - 1) / n * size * 8 / rate


def _rate(bps: int) -> str:
    return f"{bps / 1e9:g} Gbit/s"


def table(path: str) -> str:
    """The markdown for one JSON file."""
    commit, infos = load(path)
    first = infos[0]
    coord_rate, worker_rate = first["coord_rate_bps"], first["worker_rate_bps"]
    lines = [f"`{path}`: coordinator link {_rate(coord_rate)}, worker links "
             f"{_rate(worker_rate)}, commit {commit.get('id', '?')[:7]}"
             f"{' (dirty)' if commit.get('dirty') else ''}, "
             f"{first['rounds']} timed steps per case after {first['warmup']} warm-up", ""]
    tcp = [i for i in infos if i["kind"] == "tcp"]
    if tcp:
        lines += ["| raw TCP, worker 0 to coordinator | median ms | goodput Mbit/s | "
                  "of the path's rate |", "|---|---:|---:|---:|"]
        for i in tcp:
            lines.append(f"| {i['size_bytes'] // MiB} MiB | {i['step_span_median'] * 1e3:.0f} | "
                         f"{i['goodput_bps'] / 1e6:.0f} | {i['shaping_accuracy']:.1%} |")
        lines.append("")
    steps: Dict[Tuple[int, int], Dict[str, dict]] = {}
    for i in infos:
        if i["kind"] != "tcp":
            steps.setdefault((i["size_bytes"], i["workers"]), {})[i["kind"]] = i
    if not steps:
        return "\n".join(lines)
    kinds = [k for k in ("ddpwire", "ddpwire-classic", "ddpwire-threads", "ddpwire-auto", "gloo")
             if any(k in v for v in steps.values())]
    ratio_kinds = [k for k in kinds if k != "gloo"] if "gloo" in kinds else []
    head = (["size", "N"] + [f"{k} ms" for k in kinds] + [f"{k} / gloo" for k in ratio_kinds]
            + ["coordinator link busy (ddpwire)", "worker link busy (ddpwire)",
               "star floor ms", "ring floor ms"])
    lines += ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for (size, n), by_kind in sorted(steps.items()):
        row = [f"{size // MiB} MiB", str(n)]
        row += [f"{by_kind[k]['step_span_median'] * 1e3:.0f}" if k in by_kind else "–"
                for k in kinds]
        gloo = by_kind.get("gloo")
        row += [f"{by_kind[k]['step_span_median'] / gloo['step_span_median']:.2f}x"
                if k in by_kind and gloo else "–" for k in ratio_kinds]
        star = by_kind.get("ddpwire")
        row.append(f"{star['coord_link_utilisation']:.0%}" if star else "–")
        # each worker's link carries size each way under the star
        row.append(f"{size * 8 / star['step_span_median'] / worker_rate:.0%}" if star else "–")
        row.append(f"{star_floor(n, size, coord_rate, worker_rate) * 1e3:.0f}")
        row.append(f"{ring_floor(n, size, worker_rate) * 1e3:.0f}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main(argv: List[str]) -> int:
    """Print a table per JSON file named on the command line."""
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(table(p) for p in argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
