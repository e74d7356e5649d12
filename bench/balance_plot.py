"""Shard sizes and step time, step by step, from a coordinator's metrics file
(``ddpwire coordinator --metrics FILE``, or docs/balance-slowdown.jsonl from
bench/test_bench_balance.py), drawn as an SVG written by hand (no plotting
library needed).

    python bench/balance_plot.py docs/balance-slowdown.jsonl -o docs/balance-slowdown.svg \
        --event 30 --names "worker 0 (100% -> 25%)" "worker 1 (50%)"

Top panel: each worker's shard (samples) per step; bottom panel: the step
time in milliseconds. ``--event STEP`` draws a dashed line before that step
(e.g. the step a worker was slowed at).
"""
from __future__ import annotations

import argparse
import json
import math
from typing import List, Optional, Sequence, Tuple
from xml.sax.saxutils import escape

COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
WIDTH, PANEL_H = 760, 240
LEFT, RIGHT, TOP, GAP, BOTTOM = 70, 20, 40, 60, 50


def read(path: str) -> List[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def nice_ticks(hi: float, count: int = 5) -> List[float]:
    """Round tick values from 0 to at least ``hi``."""
    if hi <= 0:
        return [0.0, 1.0]
    raw = hi / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    return [i * step for i in range(int(math.ceil(hi / step)) + 1)]


def _fmt(v: float) -> str:
    return f"{v:g}" if v < 10000 else f"{v:.0f}"


def panel(y0: float, steps: Sequence[int], series: Sequence[Tuple[str, str, Sequence[Optional[float]]]],
          title: str, ylabel: str, event: Optional[int]) -> List[str]:
    """One panel's SVG elements, its plot area starting at ``y0``."""
    out = []
    x_lo, x_hi = min(steps), max(max(steps), min(steps) + 1)
    hi = max((v for _, _, vals in series for v in vals if v is not None), default=1.0)
    ticks = nice_ticks(hi)
    y_hi = ticks[-1]
    w = WIDTH - LEFT - RIGHT

    def px(step: float) -> float:
        return LEFT + (step - x_lo) / (x_hi - x_lo) * w

    def py(v: float) -> float:
        return y0 + PANEL_H - v / y_hi * PANEL_H

    out.append(f'<text x="{LEFT}" y="{y0 - 10}" font-size="14" font-weight="bold">{escape(title)}</text>')
    for t in ticks:
        y = py(t)
        out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + w}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" font-size="11" text-anchor="end">{_fmt(t)}</text>')
    x_step = max(1, int(nice_ticks(x_hi - x_lo, 10)[1]))
    for s in range(x_lo - x_lo % x_step, x_hi + 1, x_step):
        if s < x_lo:
            continue
        x = px(s)
        out.append(f'<line x1="{x:.1f}" y1="{y0 + PANEL_H}" x2="{x:.1f}" y2="{y0 + PANEL_H + 4}" stroke="#000"/>')
        out.append(f'<text x="{x:.1f}" y="{y0 + PANEL_H + 16}" font-size="11" text-anchor="middle">{s}</text>')
    out.append(f'<rect x="{LEFT}" y="{y0}" width="{w}" height="{PANEL_H}" fill="none" stroke="#000"/>')
    out.append(f'<text x="{LEFT + w / 2}" y="{y0 + PANEL_H + 34}" font-size="12" text-anchor="middle">step</text>')
    out.append(f'<text x="16" y="{y0 + PANEL_H / 2}" font-size="12" text-anchor="middle" '
               f'transform="rotate(-90 16 {y0 + PANEL_H / 2})">{escape(ylabel)}</text>')
    if event is not None and x_lo <= event <= x_hi:
        x = px(event - 0.5)
        out.append(f'<line x1="{x:.1f}" y1="{y0}" x2="{x:.1f}" y2="{y0 + PANEL_H}" stroke="#555" '
                   f'stroke-dasharray="5,4"/>')
    for i, (label, colour, vals) in enumerate(series):
        pts = " ".join(f"{px(s):.1f},{py(v):.1f}" for s, v in zip(steps, vals) if v is not None)
        out.append(f'<polyline points="{pts}" fill="none" stroke="{colour}" stroke-width="1.8"/>')
        lx, ly = LEFT + 10 + i * 230, y0 + 16
        out.append(f'<line x1="{lx}" y1="{ly - 4}" x2="{lx + 18}" y2="{ly - 4}" stroke="{colour}" stroke-width="3"/>')
        out.append(f'<text x="{lx + 24}" y="{ly}" font-size="12">{escape(label)}</text>')
    return out


def render(lines: Sequence[dict], names: Sequence[str] = (), event: Optional[int] = None,
           title: str = "") -> str:
    steps = [x["step"] for x in lines]
    n = max(len(x["workers"]) for x in lines)
    shards = []
    for w in range(n):
        label = names[w] if w < len(names) else f"worker {w}"
        vals = [x["workers"][w]["shard"] if w < len(x["workers"]) else None for x in lines]
        shards.append((label, COLOURS[w % len(COLOURS)], vals))
    times = [("step time", "#000", [x["step_time_s"] * 1e3 for x in lines])]
    height = TOP + 2 * PANEL_H + GAP + BOTTOM + 20
    body = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'font-family="sans-serif">',
            f'<rect width="{WIDTH}" height="{height}" fill="#fff"/>']
    body += panel(TOP, steps, shards, title or "shard per worker", "samples", event)
    body += panel(TOP + PANEL_H + GAP + 20, steps, times, "step time", "ms", event)
    body.append("</svg>")
    return "\n".join(body) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("metrics", help="JSON lines, one per step (StepReport.as_json)")
    p.add_argument("-o", "--out", required=True, help="the SVG to write")
    p.add_argument("--event", type=int, help="draw a dashed line before this step")
    p.add_argument("--names", nargs="*", default=[], help="labels of workers 0, 1, ...")
    p.add_argument("--title", default="", help="title of the top panel")
    args = p.parse_args(argv)
    svg = render(read(args.metrics), args.names, args.event, args.title)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(svg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
