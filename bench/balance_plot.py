"""Shard sizes and step time, step by step, from a coordinator's metrics file
(``ddpwire coordinator --metrics FILE``, or bench/results/balance-slowdown.jsonl
from bench/test_bench_balance.py): ``ddpwire plot`` (ddpwire/cli/plot.py, the
[plot] extra), with this bench's labels for workers whose metrics carry no
name (files written before they did).

    python bench/balance_plot.py bench/results/balance-slowdown.jsonl -o bench/results/balance-slowdown.svg \
        --event 30 --names "worker 0 (100% -> 25%)" "worker 1 (50%)"

``--event STEP`` draws a dashed line before that step (e.g. the step a
worker was slowed at). For a metrics file of today, ``ddpwire plot FILE
--event STEP`` draws the same.
"""
from __future__ import annotations

import argparse

from ddpwire.cli.plot import draw, read_metrics


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("metrics", help="JSON lines, one per step (StepReport.as_json)")
    p.add_argument("-o", "--out", required=True, help="the plot to write, .svg or .png")
    p.add_argument("--event", type=int, help="draw a dashed line before this step")
    p.add_argument("--names", nargs="*", default=[], help="labels of workers 0, 1, ...")
    p.add_argument("--title", default="", help="the figure's title")
    args = p.parse_args(argv)
    draw(read_metrics(args.metrics), args.out, title=args.title,
         events=[] if args.event is None else [args.event], names=dict(enumerate(args.names)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
