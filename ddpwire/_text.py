"""Wording shared by the messages users read."""
from __future__ import annotations

from typing import Optional

__all__ = ["counted"]


def counted(n: int, noun: str, plural: Optional[str] = None) -> str:
    """``n`` and the noun agreeing with it: "1 worker", "2 workers", "0 workers"."""
    return f"{n} {noun if n == 1 else (plural or noun + 's')}"
