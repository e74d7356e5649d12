"""Markdown tables from the cluster benchmark's pytest-benchmark JSON.

    python bench/cluster/report.py bench/results/cluster-1g.json [bench/results/cluster-10g-coord.json ...]

Per file: the shaping check (raw TCP goodput against the path's rate), then
one table per vector size whose rows are (N, kind): the median step, its
ratio to gloo's float32 step at the same size and N in the same file, how
busy the links the kind loads are (payload bytes over the step time,
against the link rate; TCP/IP and Ethernet headers make ~95.6% the most a
1500-byte MTU allows), the kind's floor at the given rates, and for the
16-bit kinds the error of the average against the float32 one.

The star moves N·size through the coordinator's link each way (and size
through each worker's); the mesh's reduce-scatter and allgather, like
gloo's ring, move 2·(N−1)/N·size through each worker's link each way, in
the wire's element size (half of it for bf16/fp16). A floor is those bytes
at the link rate.
"""
from __future__ import annotations

import json
import sys
from typing import Dict, List, Optional, Tuple

MiB = 1 << 20

# rows in this order; kinds not named here follow, by name, rather than vanish
KIND_ORDER = ("ddpwire", "ddpwire-star", "ddpwire-mesh", "ddpwire-bf16", "ddpwire-fp16",
              "ddpwire-classic", "ddpwire-threads", "ddpwire-auto", "gloo")


def load(path: str) -> Tuple[dict, List[dict]]:
    """The file's commit info and each benchmark's extra_info."""
    with open(path) as f:
        data = json.load(f)
    return data.get("commit_info", {}), [b["extra_info"] for b in data["benchmarks"]]


def kind_order(kinds) -> List[str]:
    """``kinds`` (any iterable, repeats allowed) in report order."""
    seen = set(kinds)
    return [k for k in KIND_ORDER if k in seen] + sorted(seen - set(KIND_ORDER))


def topology(info: dict) -> str:
    """"star", "mesh", "auto" or "ring" (gloo): the topology the coordinator
    chose. Files from before runs recorded it hold only "auto" runs, which
    were the star then."""
    if info["kind"] == "gloo":
        return "ring"
    return info.get("topology") or "auto"


def bytes_per_element(info: dict) -> int:
    """On the wire: 2 for the 16-bit kinds, else 4."""
    return 2 if info.get("compression") else 4


def star_floor(n: int, size: int, coord_rate: int, worker_rate: int) -> float:
    """Seconds a star step needs at least: N·size through the coordinator's link
    and size through each worker's, each way, at the link rates."""
    return max(n * size * 8 / coord_rate, size * 8 / worker_rate)


def ring_floor(n: int, size: int, rate: int) -> float:
    """Seconds a ring allreduce needs at least: 2·(N−1)/N·size through each link each way."""
    return 2 * (n - 1) / n * size * 8 / rate


def mesh_floor(n: int, size: int, coord_rate: int, worker_rate: int, share: float) -> float:
    """Seconds a mesh step whose coordinator averages ``share`` of the vector
    needs at least: the reduce-scatter ends when both the workers' links
    ((N−1)/N of their part and the coordinator's part) and the coordinator's
    (N times its part) are through, the allgather moves (N−1)/N of the
    workers' part. ``share`` 0 is the ring's floor."""
    ours = (n - 1) / n * (1 - share) * size * 8
    scatter = max((ours + share * size * 8) / worker_rate, n * share * size * 8 / coord_rate)
    return scatter + ours / worker_rate


def link_figures(topo: str, elem_bytes: int, n: int, size: int, median: float,
                 coord_rate: int, worker_rate: int, share: float = 0.0) -> Dict[str, float]:
    """Payload bytes each way through the link the topology loads most, and
    that over the step time against the link's rate (the extra_info keys);
    for a mesh with a coordinator share, the coordinator's link's too.

    "auto" (files from before the runs recorded the coordinator's choice)
    counts as the star, which it was then.
    """
    if topo not in ("mesh", "ring"):
        return {"coord_link_bytes_each_way": n * size,
                "coord_link_utilisation": n * size * 8 / median / coord_rate}
    per_worker = int((2 * (n - 1) / n * (1 - share) + share) * size * elem_bytes / 4)
    figures = {"worker_link_bytes_each_way": per_worker,
               "worker_link_utilisation": per_worker * 8 / median / worker_rate}
    if share:
        figures.update(coord_link_bytes_each_way=int(n * share * size),
                       coord_link_utilisation=n * share * size * 8 / median / coord_rate)
    return figures


def _floor(info: dict, coord_rate: int, worker_rate: int) -> float:
    n, size = info["workers"], info["size_bytes"]
    if topology(info) in ("mesh", "ring"):
        return mesh_floor(n, size, coord_rate, worker_rate, info.get("coordinator_share", 0.0)) \
            * bytes_per_element(info) / 4
    return star_floor(n, size, coord_rate, worker_rate)


def _busy(info: dict, coord_rate: int, worker_rate: int) -> Tuple[Optional[float], float]:
    """(coordinator link, a worker's link) utilisation; None where the kind
    does not use the coordinator's link."""
    n, size, median = info["workers"], info["size_bytes"], info["step_span_median"]
    figures = link_figures(topology(info), bytes_per_element(info), n, size, median,
                           coord_rate, worker_rate, info.get("coordinator_share", 0.0))
    if "worker_link_utilisation" in figures:
        return (figures.get("coord_link_utilisation"),
                info.get("worker_link_utilisation", figures["worker_link_utilisation"]))
    # each worker's link carries its vector each way under the star
    return (info.get("coord_link_utilisation", figures["coord_link_utilisation"]),
            size * 8 / median / worker_rate)


def _rate(bps: int) -> str:
    return f"{bps / 1e9:g} Gbit/s"


def _pct(x: Optional[float]) -> str:
    return "–" if x is None else f"{x:.0%}"


def size_table(size: int, infos: List[dict], coord_rate: int, worker_rate: int) -> List[str]:
    """The markdown lines for one vector size: a row per (N, kind)."""
    head = ["N", "kind", "median ms", "/ gloo", "coordinator link busy", "worker link busy",
            "floor ms", "max abs error", "relative error"]
    lines = [f"**{size // MiB} MiB**" if size >= MiB else f"**{size} B**", "",
             "| " + " | ".join(head) + " |", "|---:|:---|" + "---:|" * (len(head) - 2)]
    order = {k: i for i, k in enumerate(kind_order(i["kind"] for i in infos))}
    by_n: Dict[int, Dict[str, dict]] = {}
    for i in infos:
        by_n.setdefault(i["workers"], {})[i["kind"]] = i
    for n in sorted(by_n):
        gloo = by_n[n].get("gloo")
        for kind in sorted(by_n[n], key=order.__getitem__):
            i = by_n[n][kind]
            median = i["step_span_median"]
            coord_busy, worker_busy = _busy(i, coord_rate, worker_rate)
            ratio = (f"{median / gloo['step_span_median']:.2f}x"
                     if gloo is not None and kind != "gloo" else "–")
            compressed = i.get("compression")
            row = [str(n), kind, f"{median * 1e3:.0f}", ratio, _pct(coord_busy),
                   _pct(worker_busy), f"{_floor(i, coord_rate, worker_rate) * 1e3:.0f}",
                   f"{i['max_abs_error']:.3g}" if compressed else "–",
                   f"{i['relative_error']:.2e}" if compressed else "–"]
            lines.append("| " + " | ".join(row) + " |")
    return lines + [""]


def table(path: str) -> str:
    """The markdown for one JSON file."""
    commit, infos = load(path)
    first = infos[0]
    coord_rate, worker_rate = first["coord_rate_bps"], first["worker_rate_bps"]
    lines = [f"`{path}`: coordinator link {_rate(coord_rate)}, worker links "
             f"{_rate(worker_rate)}"
             f"{', TCP ' + first['tcp_congestion'] if first.get('tcp_congestion') else ''}"
             f", commit {commit.get('id', '?')[:7]}"
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
    by_size: Dict[int, List[dict]] = {}
    for i in infos:
        if i["kind"] != "tcp":
            by_size.setdefault(i["size_bytes"], []).append(i)
    for size in sorted(by_size):
        lines += size_table(size, by_size[size], coord_rate, worker_rate)
    return "\n".join(lines)


def main(argv: List[str]) -> int:
    """Print the tables of each JSON file named on the command line."""
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(table(p) for p in argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
