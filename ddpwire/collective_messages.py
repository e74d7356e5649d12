"""Stand-in for the collectives messages until the codec (branch issue-9-wire)
lands on main: plain value holders with the fields of docs/extensions.md.
They have no wire encoding; only in-memory tests can use them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(eq=False)
class CollectiveRequest:
    seq: int
    kind: int
    op: int
    dtype: int
    root: int
    count: int
    data: Any


@dataclass(eq=False)
class CollectiveResult:
    seq: int
    kind: int
    dtype: int
    count: int
    data: Any


@dataclass(eq=False)
class CollectiveError:
    seq: int
    worker_id: int
    detail: str
