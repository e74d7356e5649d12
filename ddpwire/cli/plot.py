"""``ddpwire plot METRICS.jsonl``: a coordinator's ``--metrics`` file drawn
step by step, as an SVG or PNG.

Four panels share the step axis: the loss; the throughput; each worker's
shard; the step time with each worker's compute (solid) and wait (dashed).
A dotted line marks where a worker left or joined an elastic session.
matplotlib is the [plot] extra: it is imported only when a plot is drawn.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

__all__ = ["add_parser", "run_plot", "read_metrics", "draw", "MetricsFileError", "FORMATS"]

#: the output formats, told apart by the file's suffix
FORMATS = ("svg", "png")

INSTALL_HINT = "pip install 'ddpwire[plot]'"


class MetricsFileError(ValueError):
    """A metrics file that cannot be drawn; the message is the one line the user sees."""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``plot`` subcommand to ``ddpwire``'s subparsers ``sub``."""
    p = sub.add_parser(
        "plot", help="draw a --metrics file: loss, throughput, shards, compute and wait",
        description="Draw the JSON lines of a coordinator's --metrics FILE step by step: "
                    "the loss, the throughput (samples/s), each worker's shard, the step time "
                    "with each worker's compute and wait, and a dotted line where a worker "
                    "left or joined (--elastic). Needs matplotlib: pip install 'ddpwire[plot]'.",
        epilog="Exit status: 0 when the plot is written, 1 when the metrics file cannot be "
               "read or drawn or matplotlib is missing, 2 for a bad command line.")
    p.add_argument("metrics", metavar="METRICS.jsonl", help="the coordinator's --metrics file")
    p.add_argument("-o", "--out", default=None, metavar="OUT",
                   help="the plot to write, .svg or .png (default: METRICS with the suffix "
                        ".svg, e.g. run.jsonl -> run.svg)")
    p.add_argument("--title", default=None, help="the figure's title (default: the file's name)")
    p.add_argument("--event", type=int, action="append", default=[], metavar="STEP",
                   help="draw a dashed line before STEP, e.g. where you changed something "
                        "(may repeat)")
    return p


def read_metrics(path: str) -> List[Dict[str, Any]]:
    """The steps of a ``--metrics`` file, one dict per non-blank line.

    Raises :class:`MetricsFileError` naming the file (and the line) when it
    cannot be read, holds no step, or has a line that is not a step's JSON.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise MetricsFileError(f"cannot read {path}: {exc.strerror or exc}") from None
    steps = []
    for number, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            step = json.loads(line)
        except ValueError as exc:  # a JSONDecodeError, or bytes that are not UTF-8
            raise MetricsFileError(f"{path} line {number} is not JSON: {exc}") from None
        if not isinstance(step, dict) or not isinstance(step.get("step"), int):
            raise MetricsFileError(f"{path} line {number} is not a step of a --metrics file "
                                   f"(a JSON object with a whole \"step\")")
        steps.append(step)
    if not steps:
        raise MetricsFileError(f"{path} holds no steps (an empty metrics file)")
    return steps


def _number(value: Any) -> float:
    # NaN breaks the line: a step a worker was not in, or a figure not measured
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return math.nan


def _isolated(values: Sequence[float]) -> List[int]:
    # a step with NaN on both sides draws no line: it needs a marker to show
    # (a worker in a single step between leaving and joining, say)
    def known(i: int) -> bool:
        return 0 <= i < len(values) and not math.isnan(values[i])
    return [i for i in range(len(values)) if known(i) and not known(i - 1) and not known(i + 1)]


def _label(worker: int, name: str) -> str:
    return f"worker {worker} ({name})" if name else f"worker {worker}"


def draw(steps: Sequence[Mapping[str, Any]], out: str, *, title: str = "",
         events: Sequence[int] = (), names: Optional[Mapping[int, str]] = None) -> None:
    """Write the plot of ``steps`` (:func:`read_metrics`) to ``out``, its
    format from the suffix (:data:`FORMATS`).

    ``events``: steps to draw a dashed line before; ``names``: labels by
    worker id, in place of those the metrics carry (``node@host``).
    Raises ImportError without matplotlib, OSError when ``out`` cannot be written.
    """
    from matplotlib import rc_context
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    x = [s["step"] for s in steps]
    by_id = [{w["worker"]: w for w in s.get("workers") or ()
              if isinstance(w, dict) and isinstance(w.get("worker"), int)} for s in steps]
    labels: Dict[int, str] = {}
    for entries in by_id:
        for wid, w in entries.items():
            if not labels.get(wid):
                labels[wid] = _label(wid, w.get("name") or "")
    labels.update({wid: label for wid, label in (names or {}).items() if wid in labels})

    def per_worker(ax: Any, wid: int, key: str, scale: float = 1.0, **style: Any) -> None:
        values = [_number(e[wid].get(key)) * scale if wid in e else math.nan for e in by_id]
        ax.plot(x, values, marker=".", markevery=_isolated(values),
                gid=f"series-{key.removesuffix('_s')}-w{wid}", **style)

    # text stays text in an SVG (searchable, small), every step stays a
    # vertex, and ids do not change from run to run (a committed SVG diffs)
    with rc_context({"svg.fonttype": "none", "path.simplify": False, "svg.hashsalt": "ddpwire"}):
        fig = Figure(figsize=(9, 10.5), layout="constrained")
        loss_ax, rate_ax, shard_ax, time_ax = fig.subplots(4, 1, sharex=True)
        fig.suptitle(title)

        loss = [_number(s.get("loss")) for s in steps]
        loss_ax.plot(x, loss, color="black", gid="series-loss")
        loss_ax.set_ylabel("loss")
        if all(math.isnan(v) for v in loss):
            loss_ax.text(0.5, 0.5, "no loss in these steps (per-block steps carry none)",
                         transform=loss_ax.transAxes, ha="center", va="center", color="gray")

        seconds = [_number(s.get("step_time_s")) for s in steps]
        rate = [_number(s.get("samples")) / t if t > 0 else math.nan
                for s, t in zip(steps, seconds)]
        rate_ax.plot(x, rate, color="black", gid="series-throughput")
        rate_ax.set_ylabel("throughput\n(samples/s)")

        time_ax.plot(x, [t * 1e3 for t in seconds], color="black", gid="series-step-time")
        for i, wid in enumerate(sorted(labels)):
            colour = f"C{i % 10}"
            per_worker(shard_ax, wid, "shard", color=colour, label=labels[wid])
            per_worker(time_ax, wid, "compute_s", 1e3, color=colour)
            per_worker(time_ax, wid, "wait_s", 1e3, color=colour, linestyle="--")
        shard_ax.set_ylabel("shard\n(samples)")
        if labels:
            shard_ax.legend(fontsize="small", ncol=min(len(labels), 3))
        time_ax.set_ylabel("time (ms)")
        time_ax.legend(handles=[Line2D([], [], color="black", label="step time"),
                                Line2D([], [], color="gray", label="compute (colour: worker)"),
                                Line2D([], [], color="gray", linestyle="--", label="wait")],
                       fontsize="small", ncol=3)
        time_ax.set_xlabel("step")
        time_ax.xaxis.set_major_locator(MaxNLocator(integer=True))

        axes = (loss_ax, rate_ax, shard_ax, time_ax)
        for ax in (rate_ax, shard_ax, time_ax):
            ax.set_ylim(bottom=0)  # an equal split shows as equal, not as a zoomed wiggle
        for step in events:
            for ax in axes:
                ax.axvline(step - 0.5, color="#555", linestyle="--", linewidth=1)
        for s in steps:
            for e in s.get("membership") or ():
                if not (isinstance(e, dict) and isinstance(e.get("step"), int)
                        and isinstance(e.get("worker"), int)):
                    continue
                # between the last step with the worker and the first without
                # (or the other way round for a join): a committed leave's
                # step was averaged with it
                at = e["step"] + (0.5 if e.get("committed") and not e.get("joined") else -0.5)
                wid = e.get("worker")
                who = labels.get(wid) or _label(wid, e.get("name") or "")
                for ax in axes:
                    ax.axvline(at, color="#555", linestyle=":", linewidth=1.2)
                loss_ax.text(at, 0.98, f" {who} {'joined' if e.get('joined') else 'left'}",
                             transform=loss_ax.get_xaxis_transform(), rotation=90,
                             ha="right", va="top", fontsize="small", color="#555")
        kind = Path(out).suffix.lower().lstrip(".")
        fig.savefig(out, format=kind, **({"metadata": {"Date": None}} if kind == "svg" else {}))


def _default_out(metrics: str) -> str:
    return str(Path(metrics).with_suffix(".svg"))


def run_plot(args: argparse.Namespace) -> int:
    """``ddpwire plot``: draw ``args.metrics`` to ``args.out``; the exit status."""
    out = args.out or _default_out(args.metrics)
    if Path(out).suffix.lower().lstrip(".") not in FORMATS:
        print(f"ddpwire: error: cannot tell the format of {out}: name it .svg or .png",
              file=sys.stderr)
        return 2
    if Path(out).resolve() == Path(args.metrics).resolve():
        print(f"ddpwire: error: {out} is the metrics file itself: pass -o", file=sys.stderr)
        return 2
    try:
        steps = read_metrics(args.metrics)
        draw(steps, out, title=Path(args.metrics).name if args.title is None else args.title,
             events=args.event)
    except MetricsFileError as exc:
        print(f"ddpwire: error: {exc}", file=sys.stderr)
        return 1
    except ImportError as exc:
        absent = isinstance(exc, ModuleNotFoundError) and exc.name == "matplotlib"
        why = "not installed here" if absent else f"which failed to import ({exc})"
        print(f"ddpwire: error: ddpwire plot needs matplotlib, {why}: {INSTALL_HINT}",
              file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"ddpwire: error: cannot write {out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"ddpwire: wrote {out} ({len(steps)} steps)")
    return 0
