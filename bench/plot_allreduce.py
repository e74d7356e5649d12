"""Table and plot of the allreduce benchmark, from pytest-benchmark's JSON.

    python bench/plot_allreduce.py bench/allreduce.json [--png bench/results/allreduce.png]

Prints a Markdown table (for bench/results/notebook.md) and the issue's targets at
64 MiB, met or missed, and writes the plot of time per step against size.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from typing import Dict, Tuple

MiB = 1 << 20
GiB = 1 << 30
TARGET_MIB = 64


def load(path: str) -> Tuple[Dict[Tuple[str, int, int], dict], dict]:
    """(kind, workers, size_bytes) -> extra_info, and the run's machine info."""
    with open(path) as f:
        data = json.load(f)
    rows = {}
    for bench in data["benchmarks"]:
        info = dict(bench["extra_info"])
        if "kind" not in info:
            continue
        info["benchmark_median"] = bench["stats"]["median"]
        rows[(info["kind"], info["workers"], info["size_bytes"])] = info
    return rows, data.get("machine_info", {})


def cores(machine: dict) -> int:
    """The benchmark machine's CPU count, as pytest-benchmark recorded it."""
    return int((machine.get("cpu") or {}).get("count") or 1)


def default_kind(n: int, machine: dict) -> str:
    """The stream loop Coordinator picks by default for n workers on that
    machine at the target size (socket_threads=None: threads when there is a
    core per worker plus one, for vectors of 1 MiB or more)."""
    return "ddpwire-threads" if cores(machine) > n else "ddpwire"


def step_time(info: dict) -> float:
    # first worker's start to last worker's end, median over the timed steps
    return info["step_span_median"]


def table(rows: dict) -> str:
    sizes = sorted({size for _, _, size in rows})
    counts = sorted({n for kind, n, _ in rows if kind != "tcp"})
    out = ["| size | N | ddpwire ms/step | gloo ms/step | ddpwire / gloo "
           "| ddpwire-classic ms/step | ddpwire / classic "
           "| ddpwire-threads ms/step | threads / one loop "
           "| coordinator GiB/s (2·N·size / step) | loopback GiB/s | coordinator / loopback "
           "| coordinator head wait / pipelined pass ms "
           "| coordinator peak RSS MiB | 1.5·size + 100 MiB |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for size in sizes:
        tcp = rows.get(("tcp", 1, size))
        loopback = size / step_time(tcp) if tcp else None
        for n in counts:
            dd, gl = rows.get(("ddpwire", n, size)), rows.get(("gloo", n, size))
            cells = [f"{size // MiB} MiB", str(n)]
            cells.append(f"{step_time(dd) * 1e3:.1f}" if dd else "–")
            cells.append(f"{step_time(gl) * 1e3:.1f}" if gl else "–")
            cells.append(f"{step_time(dd) / step_time(gl):.2f}" if dd and gl else "–")
            cl = rows.get(("ddpwire-classic", n, size))
            cells.append(f"{step_time(cl) * 1e3:.1f}" if cl else "–")
            cells.append(f"{step_time(dd) / step_time(cl):.2f}" if dd and cl else "–")
            th = rows.get(("ddpwire-threads", n, size))
            cells.append(f"{step_time(th) * 1e3:.1f}" if th else "–")
            cells.append(f"{step_time(th) / step_time(dd):.2f}" if dd and th else "–")
            rate = 2 * n * size / step_time(dd) if dd else None
            cells.append(f"{rate / GiB:.2f}" if rate else "–")
            cells.append(f"{loopback / GiB:.2f}" if loopback else "–")
            cells.append(f"{rate / loopback:.0%}" if rate and loopback else "–")
            if dd and dd.get("coordinator_pass_times"):
                cells.append(f"{statistics.median(dd['coordinator_head_wait_times']) * 1e3:.1f} / "
                             f"{statistics.median(dd['coordinator_pass_times']) * 1e3:.1f}")
            else:
                cells.append("–")
            rss = dd.get("coordinator_peak_rss") if dd else None
            cells.append(f"{rss / MiB:.0f}" if rss else "–")
            cells.append(f"{(1.5 * size + 100 * MiB) / MiB:.0f}")
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def targets(rows: dict, machine: dict) -> str:
    """The issue's targets at 64 MiB, each marked met or missed, for the
    stream loop a Coordinator would use by default on that machine."""
    size = TARGET_MIB * MiB
    lines = [f"(machine: {cores(machine)} cores; ddpwire = the default loop for N workers: "
             + ", ".join(f"N = {n}: {default_kind(n, machine)}" for n in (2, 3, 4)) + ")"]

    def mark(ok: bool) -> str:
        return "met" if ok else "MISSED"

    for n, limit in ((2, 1.25), (3, 1.0), (4, 1.0)):
        dd, gl = rows.get((default_kind(n, machine), n, size)), rows.get(("gloo", n, size))
        if dd and gl:
            ratio = step_time(dd) / step_time(gl)
            lines.append(f"- N = {n}: ddpwire / gloo = {ratio:.2f} (target <= {limit:.2f}): {mark(ratio <= limit)}")
    tcp = rows.get(("tcp", 1, size))
    for n in (2, 3, 4):
        dd = rows.get((default_kind(n, machine), n, size))
        if dd and tcp:
            share = (2 * n * size / step_time(dd)) / (size / step_time(tcp))
            lines.append(f"- N = {n}: coordinator rate / loopback rate = {share:.0%} (target >= 75%): "
                         f"{mark(share >= 0.75)}")
    dd = rows.get((default_kind(4, machine), 4, size))
    if dd and dd.get("coordinator_peak_rss"):
        rss, budget = dd["coordinator_peak_rss"], 1.5 * size + 100 * MiB
        lines.append(f"- N = 4: coordinator peak RSS {rss / MiB:.0f} MiB (target <= {budget / MiB:.0f} MiB): "
                     f"{mark(rss <= budget)}")
    return "\n".join(lines) if len(lines) > 1 else f"(no {TARGET_MIB} MiB figures in this run)"


def plot(rows: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = defaultdict(list)
    for (kind, n, size), info in rows.items():
        if kind in ("ddpwire", "ddpwire-threads", "gloo"):
            series[(kind, n)].append((size / MiB, step_time(info) * 1e3))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours = {2: "tab:blue", 3: "tab:orange", 4: "tab:green"}
    for (kind, n), points in sorted(series.items()):
        points.sort()
        style = {"ddpwire": ("-", "o"), "ddpwire-threads": (":", "^"), "gloo": ("--", "s")}[kind]
        ax.plot([p[0] for p in points], [p[1] for p in points], linestyle=style[0],
                marker=style[1], color=colours.get(n), label=f"{kind}, N = {n}")
    # a size gloo reached but ddpwire did not is a failed run: say so on the plot
    missing = sorted({size for kind, _, size in rows if kind == "gloo"}
                     - {size for kind, _, size in rows if kind == "ddpwire"})
    if missing:
        names = ", ".join(f"{size // MiB} MiB" for size in missing)
        ax.text(0.98, 0.02, f"no ddpwire figure at {names} (the run failed)",
                transform=ax.transAxes, ha="right", va="bottom", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("gradient size (MiB)")
    ax.set_ylabel("time per step (ms, median)")
    ax.set_title("One allreduce step over loopback: ddpwire vs gloo")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", help="pytest-benchmark JSON (--benchmark-json) of test_bench_allreduce.py")
    parser.add_argument("--png", default="bench/results/allreduce.png", help="where to write the plot")
    args = parser.parse_args(argv)
    rows, machine = load(args.json)
    if not rows:
        print(f"{args.json}: no allreduce benchmark results in it", file=sys.stderr)
        return 1
    print(table(rows))
    print()
    print(f"Targets at {TARGET_MIB} MiB:")
    print(targets(rows, machine))
    plot(rows, args.png)
    print(f"\nplot written to {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
