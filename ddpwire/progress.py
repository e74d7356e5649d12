"""A one-line progress bar for the command line (no dependency)."""
from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

from .serve import StepReport

__all__ = ["ProgressBar"]


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

    def update(self, report: StepReport) -> None:
        done = report.step + 1
        self.samples += report.samples
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
            self.stream.write("\r" + line + ("\n" if done == self.total else ""))
        elif done == self.total or done % max(1, self.total // 10) == 0:
            self.stream.write(line + "\n")
        self.stream.flush()

    @property
    def throughput(self) -> float:
        """Samples per second since the bar started."""
        return self.samples / max(time.perf_counter() - self.start, 1e-9)
