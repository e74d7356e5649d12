"""A one-line progress bar for the command line (no dependency)."""
from __future__ import annotations

import logging
import sys
import time
from typing import Callable, List, Optional, TextIO, Tuple

from .results import MEMBERSHIP_RECORD, StepReport

__all__ = ["ProgressBar", "break_line", "duration", "time_left", "unit", "ShownByTheBar",
           "PaceLog", "PACE_S", "worker_rows",
           "worker_summary", "EVERY_S", "REDRAW_S"]

#: seconds between two progress lines off a terminal (a log, CI)
EVERY_S = 2.0
#: seconds between two redraws on a terminal: drawing every step of a fast
#: run would cost more than the step
REDRAW_S = 0.1

# The bar whose terminal line is unfinished (no newline yet), so that an
# error or "interrupted" can start on a line of its own.
_open_bar: Optional["ProgressBar"] = None

#: (step) -> (loss, accuracy) pooled over the workers, or None when unknown
Pooled = Callable[[int], Optional[Tuple[float, float]]]


def duration(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour: a clock's reading, which a
    user compares at a glance with the next line's."""
    whole = max(0, int(round(seconds)))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class ShownByTheBar(logging.Filter):
    """Leaves out the log records of the membership events that the bar
    prints itself (:data:`ddpwire.session.results.MEMBERSHIP_RECORD`), so that a
    worker lost or joined is one line, not two."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, MEMBERSHIP_RECORD, False)


def unit(sync_every: int) -> str:
    """What one averaged step is to the user: a step, or a round of
    ``sync_every`` local steps (DiLoCo)."""
    return "round" if sync_every > 1 else "step"


def time_left(elapsed: float, counted: int, reached: int, total: int) -> Optional[str]:
    """The time left to step ``total`` at the mean pace so far (``counted``
    steps in ``elapsed`` seconds, step ``reached`` the last), as a
    :func:`duration`; None once it is reached or where the length is unknown."""
    if not 0 < reached < total:
        return None
    return duration(elapsed / counted * (total - reached))


def break_line() -> None:
    """End the progress bar's unfinished terminal line, if there is one."""
    if _open_bar is not None:
        _open_bar.close()


class ProgressBar:
    """The progress of a run: on a terminal one line redrawn in place (at
    most every ``redraw`` seconds), elsewhere a line of its own every
    ``every`` seconds; the first and the last step always show. However
    long the run, something shows within a few seconds.

    Each line carries the step (``label``: "round" where one averaged step
    is a round of local steps), the loss and accuracy of that step, the
    throughput since the previous line, the step's allreduce time, the time
    since the start and, until the last step, the time left at the mean
    pace so far. A
    report without loss (per-block steps: block messages carry none) takes
    it from ``pooled`` where given, asked only for the steps that show.
    ``clock`` (seconds) is ``time.perf_counter`` but for tests.
    """

    def __init__(self, total: int, stream: Optional[TextIO] = None, width: int = 24, *,
                 every: float = EVERY_S, redraw: float = REDRAW_S,
                 clock: Callable[[], float] = time.perf_counter,
                 pooled: Optional[Pooled] = None, label: str = "step") -> None:
        self.total = total
        self.label = label
        self.loss: Optional[float] = None  # the last line's
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every = every
        self.redraw = redraw
        self.clock = clock
        self.pooled = pooled
        self.start = clock()
        self.samples = 0
        self.done = 0  # steps reported so far
        self.last = self.start
        self._shown: Optional[float] = None  # when a line last showed
        # throughput is measured over a window that restarts every line off
        # a terminal, every `every` seconds on one (redraws are too close)
        self._window = (self.start, 0)
        self._line_open = False
        self._rows = 0  # worker rows under the bar's terminal line

    def update(self, report: StepReport) -> None:
        """Count the step's samples and, when due, draw (or print) the line."""
        global _open_bar
        done = report.step + 1
        for event in report.membership:
            # each on a line of its own, above the bar
            self.stream.write(("\n" if self._line_open else "") + event.describe() + "\n")
            self._line_open, self._rows = False, 0
        self.done += 1
        self.samples += report.samples
        now = self.clock()
        self.last = now
        finished = done == self.total
        gap = self.redraw if self.tty else self.every
        if not (self._shown is None or finished or now - self._shown >= gap):
            return
        line = self._line(report, done, now)
        self._shown = now
        if not self.tty or now - self._window[0] >= self.every:
            self._window = (now, self.samples)
        rows = worker_rows(report)
        if self.tty:
            # the bar, then a row per worker, redrawn in place: back to the
            # bar's line first, each line cleared as it is rewritten
            up = f"\x1b[{self._rows}F" if self._rows else "\r"
            self.stream.write(up + "\n".join(x + "\x1b[K" for x in [line] + rows)
                              + ("\n" if finished else ""))
            self._rows = 0 if finished else len(rows)
            self._line_open = not finished
            _open_bar = None if finished else self
        else:
            summary = worker_summary(report)
            self.stream.write(line + (f"  | {summary}" if summary else "") + "\n")
        self.stream.flush()

    def _line(self, report: StepReport, done: int, now: float) -> str:
        filled = int(self.width * done / max(self.total, 1))
        bar = "#" * filled + "." * (self.width - filled)
        parts = [f"{self.label} {done:>{len(str(self.total))}}/{self.total} [{bar}]"]
        loss, accuracy = report.global_loss, report.accuracy
        if loss is None and self.pooled is not None:
            pooled = self.pooled(report.step)
            if pooled is not None:
                loss, accuracy = pooled
        if loss is not None:
            self.loss = loss
            parts.append(f"loss {loss:.4f}")
        if accuracy is not None:
            parts.append(f"acc {100 * accuracy:5.1f}%")
        since, samples = self._window
        parts.append(f"{(self.samples - samples) / max(now - since, 1e-9):,.0f} samples/s")
        parts.append(f"allreduce {1000 * report.allreduce_time:6.2f} ms")
        elapsed = now - self.start
        parts.append(f"elapsed {duration(elapsed)}")
        left = time_left(elapsed, self.done, done, self.total)
        if left is not None:
            parts.append(f"left {left}")
        return "  ".join(parts)

    def summary(self) -> str:
        """The run in one line, for its end: steps, time, throughput and
        the last loss shown."""
        loss = "" if self.loss is None else f", last loss {self.loss:.4f}"
        return (f"{self.done:,} {self.label}{'' if self.done == 1 else 's'} in "
                f"{duration(self.last - self.start)}, {self.throughput:,.0f} samples/s{loss}")

    def close(self) -> None:
        """End an unfinished terminal line (a run cut short); else nothing."""
        global _open_bar
        if self._line_open:
            self.stream.write("\n")
            self.stream.flush()
            self._line_open = False
        if _open_bar is self:
            _open_bar = None

    @property
    def throughput(self) -> float:
        """Samples per second from the bar's start to its last step."""
        return self.samples / max(self.last - self.start, 1e-9)


#: seconds between two of a worker's progress lines: a long run shows it
#: is alive in its log without a line per step
PACE_S = 30.0


class PaceLog:
    """A worker's progress in its log: a line every ``every`` seconds with
    its step out of the run's (``total``; 0 where the coordinator did not
    say), the last loss, what it computed per second and the time since it
    joined, and the time left while the run's length is known."""

    def __init__(self, log: logging.Logger, total: int, *, label: str = "step",
                 every: float = PACE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.log, self.total, self.label, self.every, self.clock = log, total, label, every, clock
        self.start = self._shown = clock()
        self.samples = 0
        self.done = 0

    def update(self, step: int, samples: int, loss: Optional[float]) -> None:
        """Count one finished step (``step`` counts from 0) and log when due."""
        self.done += 1
        self.samples += samples
        now = self.clock()
        if now - self._shown < self.every:
            return
        self._shown = now
        elapsed = now - self.start
        done = step + 1
        of = f"/{self.total}" if self.total else ""
        left = time_left(elapsed, self.done, done, self.total)
        self.log.info("%s %d%s%s, %s samples/s on this worker, elapsed %s%s", self.label, done,
                      of, "" if loss is None else f", loss {loss:.4f}",
                      f"{self.samples / max(elapsed, 1e-9):,.0f}", duration(elapsed),
                      "" if left is None else f", left {left}")


def _ms(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f} ms"


def worker_rows(report: StepReport) -> List[str]:
    """The step's per-worker table (empty when no worker reports its
    time): each worker's name, shard, fitted fixed and per-sample time,
    compute and wait, and which worker the step waited for (the last
    whose part came in, never one merely given few samples)."""
    if not any(w.compute is not None for w in report.workers):
        return []
    slowest = report.waited_for
    rows = []
    for w, wait in zip(report.workers, report.waits()):
        per = "-" if w.per_sample is None else f"{1e6 * w.per_sample:.1f} us"
        rows.append(f"  worker {w.worker_id:<3} {w.name:<24} shard {w.samples:>7}  "
                    f"fixed {_ms(w.fixed):>9}  per sample {per:>9}  "
                    f"compute {_ms(w.compute):>9}  wait {_ms(wait):>9}"
                    + ("  <- the step waited for it" if w.worker_id == slowest else ""))
    return rows


def worker_summary(report: StepReport) -> str:
    """The per-worker table on one line, for a log."""
    if not any(w.compute is not None for w in report.workers):
        return ""
    parts = [f"w{w.worker_id}{f' ({w.name})' if w.name else ''} {w.samples} in {_ms(w.compute)}"
             for w in report.workers]
    slowest = report.waited_for
    return ", ".join(parts) + ("" if slowest is None else f"; waited for worker {slowest}")
