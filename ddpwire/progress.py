"""A one-line progress bar for the command line (no dependency)."""
from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

from .serve import StepReport

__all__ = ["ProgressBar", "break_line"]

# The bar whose terminal line is unfinished (no newline yet), so that an
# error or "interrupted" can start on a line of its own.
_open_bar: Optional["ProgressBar"] = None


def break_line() -> None:
    """End the progress bar's unfinished terminal line, if there is one."""
    if _open_bar is not None:
        _open_bar.close()


class ProgressBar:
    """Redraws one line per step on a terminal; elsewhere (a log, CI) prints a
    line every tenth of the run so output stays short."""

    def __init__(self, total: int, stream: Optional[TextIO] = None, width: int = 24) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.perf_counter()
        self.samples = 0
        self.last = self.start
        self._line_open = False

    def update(self, report: StepReport) -> None:
        """Count the step's samples and redraw (or print) the line."""
        global _open_bar
        done = report.step + 1
        self.samples += report.samples
        self.last = time.perf_counter()
        filled = int(self.width * done / max(self.total, 1))
        bar = "#" * filled + "." * (self.width - filled)
        parts = [f"step {done:>{len(str(self.total))}}/{self.total} [{bar}]"]
        if report.global_loss is not None:
            parts.append(f"loss {report.global_loss:.4f}")
        if report.accuracy is not None:
            parts.append(f"acc {100 * report.accuracy:5.1f}%")
        parts.append(f"allreduce {1000 * report.allreduce_time:6.2f} ms")
        line = "  ".join(parts)
        if self.tty:
            finished = done == self.total
            self.stream.write("\r" + line + ("\n" if finished else ""))
            self._line_open = not finished
            _open_bar = None if finished else self
        elif done == self.total or done % max(1, self.total // 10) == 0:
            self.stream.write(line + "\n")
        self.stream.flush()

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
