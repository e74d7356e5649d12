"""What the coordinator knows of each worker that joined."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["WorkerInfo"]


@dataclass(frozen=True)
class WorkerInfo:
    """A joined worker: its id (order of joining) and its JoinRequest."""

    worker_id: int
    node_id: str
    gpu_count: int
    backend: str
    address: str
