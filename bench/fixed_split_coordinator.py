"""``ddpwire coordinator`` with one fixed split: the oracle a user could not
know, for bench/test_bench_balance_cli.py to sweep.

    python bench/fixed_split_coordinator.py FRACTION coordinator --workers 2 ...

The worker that joined with ``--node-id held`` gets FRACTION of every
step's samples (at least one), the others the rest in equal parts; every
other rule is the coordinator's own (the gradients are weighted by the
shards as with ``--balance on``, so the average is the full batch's).
"""
from __future__ import annotations

import sys
from typing import List, Optional

from ddpwire.session import balance
from ddpwire.cli import main


def fixed_split(fraction: float, names: List[str], total: int) -> List[int]:
    """``fraction`` of ``total`` to the worker named held@..., the rest equally."""
    held = [i for i, name in enumerate(names) if name.startswith("held@")]
    if len(held) != 1:
        raise SystemExit(f"fixed_split_coordinator: one worker must join with --node-id held, "
                         f"got {names}")
    mine = max(1, round(fraction * total))
    others = balance.equal_shards(total - mine, len(names) - 1)
    others.insert(held[0], mine)
    return others


def _patch(fraction: float) -> None:
    plan = balance.Shards.plan

    def fixed_plan(self: balance.Shards, step: int, total: int,
                   now: Optional[float] = None) -> List[int]:
        plan(self, step, total, now)  # the timings and the lags, as always
        self.split = fixed_split(fraction, [self.names[w] for w in self.active], total)
        self._starts = balance.shard_starts(self.split)
        return list(self.split)
    balance.Shards.plan = fixed_plan  # type: ignore[method-assign]


if __name__ == "__main__":
    _patch(float(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
