"""The table and the plot of the local-steps benchmark's JSON
(bench/cluster/test_bench_diloco.py):

    python bench/cluster/report_diloco.py bench/results/cluster-diloco-100m.json \\
        --svg bench/results/cluster-diloco-100m.svg

One row per configuration and rank count: the held-out loss at the end and
its ratio to synchronous DDP's with the same ranks, the bytes each worker
sent (its eth0 counters, the mean over the ranks) and the averaged vector's
bytes (averages x parameters x the codec's bytes a parameter), rank 0's
wall-clock time of training, with how many times fewer / less than sync,
and the median time of a step that averaged (rank 0's; a DiLoCo round's
inner step, allreduce and outer step, so 8 and 16 bits compare); then,
per rank count, the
issue's goal for H = 50 (within 3% of sync's loss, 40x fewer bytes, 5x less
time). The SVG (written by hand, no plotting library needed) draws rank 0's
held-out loss against wall time, one panel per rank count.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from typing import Dict, List, Sequence, Tuple
from xml.sax.saxutils import escape

ORDER = ("sync", "H10", "H50", "H10-m0.5", "H50-m0.5", "H50-m0.5-int8", "H50-m0.5-bf16",
         "H10-m0.5-bf16", "H10-m0.5-int8")
LABELS = {"sync": "sync (DDP, every step)", "H10": "DiLoCo H=10 (momentum 0.9)",
          "H50": "DiLoCo H=50 (momentum 0.9)", "H10-m0.5": "DiLoCo H=10, momentum 0.5",
          "H50-m0.5": "DiLoCo H=50, momentum 0.5",
          "H50-m0.5-int8": "DiLoCo H=50, momentum 0.5, 8 bits",
          "H50-m0.5-bf16": "DiLoCo H=50, momentum 0.5, bf16",
          "H10-m0.5-bf16": "DiLoCo H=10, momentum 0.5, bf16",
          "H10-m0.5-int8": "DiLoCo H=10, momentum 0.5, 8 bits"}
COLOURS = {"sync": "#000000", "H10": "#1f77b4", "H50": "#d62728", "H10-m0.5": "#17becf",
           "H50-m0.5": "#ff7f0e", "H50-m0.5-int8": "#2ca02c", "H50-m0.5-bf16": "#9467bd",
           "H10-m0.5-bf16": "#8c564b", "H10-m0.5-int8": "#e377c2"}
GOAL_LOSS, GOAL_BYTES, GOAL_TIME = 1.03, 40.0, 5.0


def cases(data: dict) -> Dict[int, Dict[str, dict]]:
    """extra_info by rank count, then by configuration label."""
    by: Dict[int, Dict[str, dict]] = defaultdict(dict)
    for b in data["benchmarks"]:
        info = b["extra_info"]
        by[info["workers"]][info["label"]] = info
    return by


def sent(info: dict) -> float:
    """Bytes a worker sent on its link, the mean over the ranks."""
    return statistics.mean(info["tx_bytes"])


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.1f}x" if b else "–"


def table(path: str) -> str:
    with open(path) as f:
        data = json.load(f)
    by = cases(data)
    commit = data.get("commit_info", {})
    any_info = next(iter(next(iter(by.values())).values()))
    rows = [f"`{path}`: commit {commit.get('id', '?')[:7]}"
            f"{' (dirty)' if commit.get('dirty') else ''}, links "
            f"{any_info['worker_rate_bps'] / 1e6:g} Mbit/s, {any_info['steps']} inner steps of "
            f"{any_info['batch_per_rank']} windows per rank, {any_info['parameters']:,} parameters",
            "",
            "| config | nodes | averages | held-out loss | / sync | sent per worker MB "
            "| fewer than sync | averaged vector MB | wall s | less than sync "
            "| a round's step, median ms |",
            "|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    verdicts = []
    for n in sorted(by):
        sync = by[n].get("sync")
        for label in ORDER:
            info = by[n].get(label)
            if info is None:
                continue
            cells = [LABELS[label], str(n), str(info["averages"]),
                     f"{info['held_out_loss']:.4f}",
                     f"{info['held_out_loss'] / sync['held_out_loss']:.3f}" if sync else "–",
                     f"{sent(info) / 1e6:.2f}",
                     _ratio(sent(sync), sent(info)) if sync else "–",
                     f"{info['vector_bytes'] / 1e6:.2f}",
                     f"{info['wall_s']:.1f}",
                     _ratio(sync["wall_s"], info["wall_s"]) if sync else "–",
                     f"{statistics.median(info['round_s']) * 1e3:.1f}"
                     if info.get("round_s") else "–"]
            rows.append("| " + " | ".join(cells) + " |")
        for label in ("H50", "H50-m0.5", "H50-m0.5-int8"):
            h50 = by[n].get(label)
            if not (sync and h50):
                continue
            loss = h50["held_out_loss"] / sync["held_out_loss"]
            fewer = sent(sync) / sent(h50)
            less = sync["wall_s"] / h50["wall_s"]
            met = [loss <= GOAL_LOSS, fewer >= GOAL_BYTES, less >= GOAL_TIME]
            verdicts.append(
                f"N={n}, {LABELS[label]}: loss {loss:.3f} of sync "
                f"({'met' if met[0] else 'missed'}: "
                f"at most {GOAL_LOSS:g}), {fewer:.1f}x fewer bytes "
                f"({'met' if met[1] else 'missed'}: at least {GOAL_BYTES:g}x), {less:.1f}x less "
                f"wall time ({'met' if met[2] else 'missed'}: at least {GOAL_TIME:g}x)")
    return "\n".join(rows + [""] + verdicts)


# ---- the plot ----

PANEL_W, PANEL_H = 420, 300
LEFT, RIGHT, TOP, GAP, BOTTOM = 60, 20, 50, 50, 50


def ticks(lo: float, hi: float, count: int = 5) -> List[float]:
    """Round values covering [lo, hi]."""
    span = max(hi - lo, 1e-9)
    raw = span / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    out = []
    v = first
    while v < hi + step * 0.999:
        out.append(round(v, 10))
        v += step
    return out


def panel(x0: float, n: int, series: Dict[str, dict]) -> List[str]:
    """One rank count's curves, the plot area's left edge at ``x0``."""
    out = []
    curves: List[Tuple[str, List[Tuple[float, float]]]] = [
        (label, [(c["time_s"], c["held_out_loss"]) for c in series[label]["curve"]])
        for label in ORDER if label in series]
    t_hi = max(t for _, pts in curves for t, _ in pts)
    # the first copy (step 0, before any training) is far above the rest: the
    # axis starts below the lowest loss and stops above the highest after it
    later = [v for _, pts in curves for _, v in pts[1:]] or [v for _, pts in curves for _, v in pts]
    yt = ticks(min(later), max(later))
    xt = ticks(0.0, t_hi)
    x_hi, y_lo, y_hi = xt[-1], yt[0], yt[-1]

    def px(t: float) -> float:
        return x0 + t / x_hi * PANEL_W

    def py(v: float) -> float:
        return TOP + PANEL_H - (v - y_lo) / (y_hi - y_lo) * PANEL_H

    clip = f"clip{n}"
    out.append(f'<clipPath id="{clip}"><rect x="{x0}" y="{TOP}" width="{PANEL_W}" '
               f'height="{PANEL_H}"/></clipPath>')
    out.append(f'<text x="{x0}" y="{TOP - 12}" font-size="14" font-weight="bold">'
               f'{n} machines</text>')
    for v in yt:
        y = py(v)
        out.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x0 + PANEL_W}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{x0 - 6}" y="{y + 4:.1f}" font-size="11" text-anchor="end">{v:g}</text>')
    for t in xt:
        x = px(t)
        out.append(f'<line x1="{x:.1f}" y1="{TOP + PANEL_H}" x2="{x:.1f}" y2="{TOP + PANEL_H + 4}" '
                   f'stroke="#000"/>')
        out.append(f'<text x="{x:.1f}" y="{TOP + PANEL_H + 16}" font-size="11" '
                   f'text-anchor="middle">{t:g}</text>')
    out.append(f'<rect x="{x0}" y="{TOP}" width="{PANEL_W}" height="{PANEL_H}" fill="none" '
               f'stroke="#000"/>')
    out.append(f'<text x="{x0 + PANEL_W / 2}" y="{TOP + PANEL_H + 34}" font-size="12" '
               f'text-anchor="middle">wall-clock time of training (s)</text>')
    ymid = TOP + PANEL_H / 2
    out.append(f'<text x="{x0 - 44}" y="{ymid}" font-size="12" text-anchor="middle" '
               f'transform="rotate(-90 {x0 - 44} {ymid})">held-out loss (nats per byte)</text>')
    for i, (label, pts) in enumerate(curves):
        colour = COLOURS[label]
        line = " ".join(f"{px(t):.1f},{py(v):.1f}" for t, v in pts)
        out.append(f'<polyline points="{line}" fill="none" stroke="{colour}" stroke-width="1.8" '
                   f'clip-path="url(#{clip})"/>')
        for t, v in pts[1:]:
            out.append(f'<circle cx="{px(t):.1f}" cy="{py(v):.1f}" r="2.2" fill="{colour}" '
                       f'clip-path="url(#{clip})"/>')
        lx, ly = x0 + PANEL_W - 170, TOP + 18 + i * 18
        info = series[label]
        out.append(f'<line x1="{lx}" y1="{ly - 4}" x2="{lx + 18}" y2="{ly - 4}" stroke="{colour}" '
                   f'stroke-width="3"/>')
        out.append(f'<text x="{lx + 24}" y="{ly}" font-size="12">'
                   f'{escape(LABELS[label])}: {info["held_out_loss"]:.3f}</text>')
    return out


def render(data: dict) -> str:
    by = cases(data)
    ns = sorted(by)
    width = LEFT + len(ns) * PANEL_W + (len(ns) - 1) * (GAP + LEFT) + RIGHT
    height = TOP + PANEL_H + BOTTOM + 10
    any_info = next(iter(by[ns[0]].values()))
    body = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'font-family="sans-serif">',
            f'<rect width="{width}" height="{height}" fill="#fff"/>',
            f'<text x="{LEFT}" y="18" font-size="13">Held-out loss against wall time, '
            f'{any_info["worker_rate_bps"] / 1e6:g} Mbit/s links, {any_info["steps"]} inner steps '
            f'per rank (rank 0; copies after averages, the first at step 0 above the axis)</text>']
    for i, n in enumerate(ns):
        body += panel(LEFT + i * (PANEL_W + GAP + LEFT), n, by[n])
    body.append("</svg>")
    return "\n".join(body) + "\n"


def main(argv: Sequence[str] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", help="pytest-benchmark JSON of test_bench_diloco.py")
    p.add_argument("--svg", help="write the plot of held-out loss against wall time here")
    a = p.parse_args(argv)
    print(table(a.json))
    if a.svg:
        with open(a.json) as f:
            svg = render(json.load(f))
        with open(a.svg, "w", encoding="utf-8") as f:
            f.write(svg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
