"""What a coordinator's collect step returns, and what a run's step reports."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np

from .._text import counted
from .balance import WorkerTiming
from ..wire.errors import without_frame_progress

__all__ = ["ReduceResult", "BlockReduceResult", "NonBlockReduceResult", "MembershipEvent",
           "MEMBERSHIP_RECORD", "StepReport"]


@dataclass(frozen=True)
class MembershipEvent:
    """A worker that left an elastic session (``Coordinator(elastic=True)``),
    or joined it between two steps."""

    #: the step during which it left
    step: int
    worker_id: int
    #: what the coordinator saw (the lost connection's error text)
    why: str
    #: the workers still in the session afterwards
    workers: int
    #: True when it left while the step's average went out: the step had
    #: been averaged with its samples already, and stands; False when the
    #: step was called off and computed again without it
    committed: bool
    #: True for a worker that joined (late, or back) before ``step``
    joined: bool = False
    #: the worker's node id and host (``node@host``), where known
    name: str = ""

    def as_json(self) -> Dict[str, Any]:
        """The event as one JSON object (in a ``--metrics`` line's membership list)."""
        return {"step": self.step, "worker": self.worker_id, "name": self.name, "why": self.why,
                "workers": self.workers, "committed": self.committed, "joined": self.joined}

    def describe(self) -> str:
        """The event in one line, the same in the coordinator's log and
        under its progress bar."""
        who = f"worker {self.worker_id}" + (f" ({self.name})" if self.name else "")
        going_on = f"going on with {counted(self.workers, 'worker')}"
        if self.joined:
            return f"{who} joined before step {self.step}, with the model's state: {going_on}"
        # the error named the worker already: say it once
        why = without_frame_progress(self.why)
        why = why[len(who) + 1:] if why.startswith(who + " ") else why
        then = ("its step stood (already averaged)" if self.committed
                else f"step {self.step} computed again")
        return f"{who} left during step {self.step} ({why}): {then}, {going_on}"

#: the attribute of a log record that says a MembershipEvent's line: the
#: command's progress bar shows those events itself, and leaves the records out
MEMBERSHIP_RECORD = "ddpwire_membership"


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
    """One finished step as the coordinator saw it (:func:`ddpwire.cli.serve.serve`
    reports them; not the mesh's wire message, :class:`ddpwire.wire.messages.StepReport`).

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
    #: each worker's shard and compute time (:class:`ddpwire.session.balance.WorkerTiming`)
    workers: List[WorkerTiming] = field(default_factory=list)
    #: where the shards stood (ddpwire.session.balance.Shards.state: "off", "equal",
    #: "balanced", "probe" or "held"; None: not known)
    balance: Optional[str] = None
    #: the workers an elastic session lost during this step, or took in before it
    membership: List[MembershipEvent] = field(default_factory=list)

    def _ends(self) -> Optional[List[float]]:
        """When each worker's part came in, from the shards going out (its
        arrival, or its compute where some arrival is not measured), or
        None when some worker's time is unknown."""
        if not self.workers or any(w.compute is None for w in self.workers):
            return None
        if all(w.arrival is not None for w in self.workers):
            return [w.arrival for w in self.workers]  # type: ignore[misc]
        return [w.compute for w in self.workers]  # type: ignore[misc]

    @property
    def waited_for(self) -> Optional[int]:
        """The worker the step waited for (the last whose part came in;
        the longest compute where arrivals are not measured), or None when
        some worker's time is unknown."""
        ends = self._ends()
        if ends is None:
            return None
        return max(zip(ends, self.workers), key=lambda e: (e[0], -e[1].worker_id))[1].worker_id

    @property
    def exchange_time(self) -> Optional[float]:
        """The step's seconds past the compute of the worker it waited for: the
        exchange as every worker waits on it, on the star or the mesh (None
        when some worker's time is unknown)."""
        slowest = self.waited_for
        if slowest is None:
            return None
        compute = next(w.compute for w in self.workers if w.worker_id == slowest)
        return max(0.0, self.step_time - compute)  # type: ignore[operator]

    def waits(self) -> List[Optional[float]]:
        """Each worker's seconds idle waiting for the last one's part."""
        ends = self._ends()
        if ends is None:
            return [None] * len(self.workers)
        return [max(ends) - end for end in ends]

    def as_json(self) -> Dict[str, Any]:
        """The step as one JSON object (a line of ``--metrics``)."""
        return {
            "step": self.step, "loss": self.global_loss, "accuracy": self.accuracy,
            "samples": self.samples, "step_time_s": self.step_time,
            "allreduce_time_s": self.allreduce_time, "exchange_s": self.exchange_time,
            "waited_for": self.waited_for,
            "balance": self.balance,
            "workers": [{"worker": w.worker_id, "name": w.name, "shard": w.samples,
                         "compute_s": w.compute, "fixed_s": w.fixed, "per_sample_s": w.per_sample,
                         "wait_s": wait, "samples_per_s": w.rate, "arrival_s": w.arrival}
                        for w, wait in zip(self.workers, self.waits())],
            "membership": [e.as_json() for e in self.membership],
        }
