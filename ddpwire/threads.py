"""How many torch threads a worker process uses: N workers on one machine
each start as many threads as there are cores by default, and then spend
their time competing for the same cores."""
from __future__ import annotations

import os

from typing import Mapping

__all__ = ["usable_cores", "threads_per_worker", "default_threads", "apply_threads"]


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def threads_per_worker(workers_here: int) -> int:
    """The cores divided evenly between ``workers_here`` worker processes, at least one."""
    if workers_here < 1:
        raise ValueError(f"workers_here must be at least 1, got {workers_here}")
    return max(1, usable_cores() // workers_here)


def default_threads(workers_here: int, env: Mapping[str, str] = os.environ) -> int:
    """The thread count when ``--threads`` is not given: 0 (torch's own
    default) where OMP_NUM_THREADS already says, as torchrun sets it, else
    the cores split between ``workers_here`` workers."""
    if env.get("OMP_NUM_THREADS", "").strip():
        return 0
    return threads_per_worker(workers_here)


def apply_threads(threads: int) -> int:
    """Set torch's intra-op threads (0 keeps torch's default); return the count in use."""
    import torch

    if threads < 0:
        raise ValueError(f"--threads must be 0 or more, got {threads}")
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()
