"""The coordinator's side of a whole training run, step after step.

Needs no torch: a standalone coordinator runs this loop over any model's
gradients, flat or block by block.
"""
from __future__ import annotations

import time
from typing import Callable, List, Optional, Sequence

from ..session.coordinator import Coordinator
from ..wire.errors import MembershipChanged
from ..wire.messages import NON_BLOCK_COMPONENTS as _COMPONENT_CODES
from ..session.results import StepReport

__all__ = ["StepReport", "serve"]

#: every non-block component, in code order: the order the trainer sends them
NON_BLOCK_COMPONENTS = tuple(sorted(_COMPONENT_CODES.values()))


def serve(
    coord: Coordinator,
    *,
    steps: int,
    total_samples: int,
    per_block: bool = False,
    num_blocks: int = 0,
    non_block_components: Sequence[int] = NON_BLOCK_COMPONENTS,
    on_step: Optional[Callable[[StepReport], None]] = None,
    shutdown: bool = True,
) -> List[StepReport]:
    """Run the steps up to ``steps`` with the joined workers (from
    ``coord.first_step``: 0, or where a resumed run's workers are), then
    send Shutdown.

    Flat mode: shards, one averaged gradient per step. Per-block mode: the
    blocks in backward order (``num_blocks - 1`` down to 0), then the
    non-block components, as the workers' trainer sends them. In an elastic
    session a step called off for a lost worker is planned again among the
    others and redone (its report's ``membership`` names who left, and who
    joined before it).
    """
    if coord.options.per_block is not None and coord.options.per_block != per_block:
        # its workers were admitted for the other mode: every step would fail
        raise ValueError(f"serve(per_block={per_block}) on a coordinator built with "
                         f"per_block={coord.options.per_block}")
    coord.set_total_samples(total_samples)
    reports = []
    step = coord.first_step
    # a step redone counts from its first try: its time and who left include it
    t0, seen = time.perf_counter(), len(coord.membership)
    while step < steps:
        try:
            report = _step(coord, step, total_samples, per_block, num_blocks,
                           non_block_components, t0)
        except MembershipChanged:
            continue  # the same step again, among those left
        # who left during it, and who joined before it (or between it and
        # the last: wait_for_workers in on_step counts for the next one)
        report.membership, seen = coord.membership[seen:], len(coord.membership)
        if coord.shards is not None:
            report.workers = coord.shards.timings()
            report.balance = coord.shards.state
        reports.append(report)
        if on_step is not None:
            on_step(report)
        step += 1
        t0 = time.perf_counter()
    if shutdown:
        coord.shutdown_workers()
    return reports


def _step(coord: Coordinator, step: int, total_samples: int, per_block: bool, num_blocks: int,
          non_block_components: Sequence[int], t0: float) -> StepReport:
    coord.send_shard_assignments(step)
    if per_block:
        allreduce = 0.0
        for block_idx in reversed(range(num_blocks)):
            allreduce += coord.allreduce_block(step, block_idx).reduce_time
        for component in non_block_components:
            allreduce += coord.allreduce_non_block(step, component).reduce_time
        return StepReport(step, None, None, total_samples, allreduce, time.perf_counter() - t0)
    # the average streams back while the gradients arrive (Coordinator.allreduce)
    r = coord.allreduce(step)
    accuracy = r.total_correct / r.total_samples if r.total_samples else None
    return StepReport(step, r.global_loss, accuracy, r.total_samples, r.reduce_time,
                      time.perf_counter() - t0)
