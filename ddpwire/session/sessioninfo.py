"""What the coordinator knows of each worker that joined."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict

__all__ = ["WorkerInfo"]


@dataclass(frozen=True)
class WorkerInfo:
    """A joined worker: its id (order of admission) and its JoinRequest;
    ``extensions`` is what the coordinator granted it ({type: value})."""

    worker_id: int
    node_id: str
    gpu_count: int
    backend: str
    address: str
    extensions: Dict[int, bytes] = field(default_factory=dict)
