"""``--metrics FILE``: one JSON line per step, as the coordinator saw it.

A file to plot from (``ddpwire plot FILE`` draws the loss, the throughput and
each worker's shard, compute and wait) or to watch with ``tail -f``: each
line is written and flushed when its step ends, so a run cut short keeps
every step it finished.
"""
from __future__ import annotations

import json
from typing import IO, Optional

from .results import StepReport

__all__ = ["MetricsFile"]


class MetricsFile:
    """Appends :meth:`StepReport.as_json` lines to ``path`` (created or emptied)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: Optional[IO[str]] = open(path, "w", encoding="utf-8")

    def write(self, report: StepReport) -> None:
        """One line for ``report``, flushed."""
        if self._file is None:
            raise ValueError(f"metrics file {self.path} is closed")
        self._file.write(json.dumps(report.as_json()) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "MetricsFile":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
