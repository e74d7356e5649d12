"""The figure of the cluster benchmark: median step per kind, with both floors.

    python bench/cluster/plot.py bench/results/cluster.png bench/results/cluster-1g.json [more.json ...]

One panel per JSON file (one set of link rates); in each, a group of bars
per (size, N) and, as marks, the star's and the ring's floor at those rates,
and the mesh's with each coordinator share measured (bench/cluster/report.py
says how they are computed).
"""
from __future__ import annotations

import os
import sys
from typing import List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report  # noqa: E402  (the path above)

def plot(out: str, paths: List[str]) -> None:
    """Write the figure for ``paths`` to ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(paths), figsize=(6.5 * len(paths), 4.5), squeeze=False)
    # one colour per kind across every panel
    every = report.kind_order(i["kind"] for p in paths for i in report.load(p)[1]
                              if i["kind"] != "tcp")
    colour = {k: plt.get_cmap("tab10")(j % 10) for j, k in enumerate(every)}
    for ax, path in zip(axes[0], paths):
        commit, infos = report.load(path)
        infos = [i for i in infos if i["kind"] != "tcp"]
        cases = sorted({(i["size_bytes"], i["workers"]) for i in infos})
        kinds = report.kind_order(i["kind"] for i in infos)
        width = 0.8 / len(kinds)
        for j, kind in enumerate(kinds):
            xs, ys = [], []
            for x, case in enumerate(cases):
                for i in infos:
                    if (i["size_bytes"], i["workers"]) == case and i["kind"] == kind:
                        xs.append(x - 0.4 + width * (j + 0.5))
                        ys.append(i["step_span_median"] * 1e3)
            ax.bar(xs, ys, width, label=kind, color=colour[kind])
        rates = infos[0]["coord_rate_bps"], infos[0]["worker_rate_bps"]
        shared_label = False
        for x, (size, n) in enumerate(cases):
            star = report.star_floor(n, size, *rates) * 1e3
            ring = report.ring_floor(n, size, rates[1]) * 1e3
            ax.hlines(star, x - 0.45, x + 0.45, colors="black", linestyles="-",
                      label="star floor" if x == 0 else None)
            ax.hlines(ring, x - 0.45, x + 0.45, colors="black", linestyles=":",
                      label="ring floor" if x == 0 else None)
            # the mesh with the coordinator's share goes below the ring's floor
            shares = sorted({i.get("coordinator_share", 0.0) for i in infos
                             if (i["size_bytes"], i["workers"]) == (size, n)} - {0.0})
            for share in shares:
                floor = report.mesh_floor(n, size, *rates, share) * 1e3
                ax.hlines(floor, x - 0.45, x + 0.45, colors="grey", linestyles="--",
                          label=None if shared_label else "mesh floor, coordinator's share")
                shared_label = True
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([f"{s >> 20} MiB\nN={n}" for s, n in cases])
        ax.set_ylabel("median step (ms)")
        tcp = infos[0].get("tcp_congestion")
        ax.set_title(f"coordinator {rates[0] / 1e9:g} Gbit/s, workers {rates[1] / 1e9:g} Gbit/s"
                     f"{', TCP ' + tcp if tcp else ''}"
                     f"\n{os.path.basename(path)} @ {commit.get('id', '?')[:7]}", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: List[str]) -> int:
    """``plot.py OUT.png JSON...``"""
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    plot(argv[1], argv[2:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
