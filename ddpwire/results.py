"""What a coordinator's collect step returns, and what a run's step reports."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np

__all__ = ["ReduceResult", "BlockReduceResult", "NonBlockReduceResult", "StepReport"]


@dataclass
class ReduceResult:
    """The average of one flat step.

    ``avg_gradients`` is the element-wise float32 sum in worker order divided
    by the number of workers (None in a mesh session, where it stays on the
    workers); ``global_loss`` is sum(loss_i * total_i) /
    sum(total_i) in float32 (0.0 when no samples were counted).
    ``wait_time`` is the seconds spent waiting for every worker's frame to
    start (their compute, seen from the coordinator) and ``reduce_time`` the
    seconds from then to the finished average (the transfer and the sum).
    """

    step: int
    avg_gradients: Optional[np.ndarray]
    global_loss: float
    total_correct: int
    total_samples: int
    reduce_time: float
    wait_time: float = 0.0
    worker_losses: List[float] = field(default_factory=list)


@dataclass
class BlockReduceResult:
    """The average of one transformer block's gradient (v2 per-block mode);
    times as in :class:`ReduceResult`. ``component_sizes`` (worker 0's) is a
    uint32 array."""

    step: int
    block_idx: int
    avg_gradients: np.ndarray
    component_sizes: np.ndarray
    reduce_time: float
    wait_time: float = 0.0


@dataclass
class NonBlockReduceResult:
    """The average of one non-block component (0 lm_head, 1 final_norm, 2 embedding)."""

    step: int
    component: int
    avg_gradients: np.ndarray
    reduce_time: float
    wait_time: float = 0.0


@dataclass
class StepReport:
    """One finished step as the coordinator saw it (:func:`ddpwire.serve.serve`
    reports them; not the mesh's wire message, :class:`ddpwire.messages.StepReport`).

    ``allreduce_time`` is the seconds from the moment every worker's gradient
    had started arriving to the end of the broadcast: the transfer, the
    average and the send back, without the workers' compute. ``global_loss``
    and ``accuracy`` are None in per-block mode (block messages carry no loss).
    """

    step: int
    global_loss: Optional[float]
    accuracy: Optional[float]
    samples: int
    allreduce_time: float
    step_time: float
