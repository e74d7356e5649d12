"""Under torchrun, workers join in rank order, so that the coordinator's
worker ids (its order of joining) equal the ranks and each node name says
which id it holds. The turns are taken through the key-value store torchrun
already runs at MASTER_ADDR:MASTER_PORT."""
from __future__ import annotations

import datetime
import logging
import os
from typing import Mapping, Optional

from ..wire.errors import JoinTimeout

__all__ = ["RankOrder"]

log = logging.getLogger(__name__)


class RankOrder:
    """Rank r joins after rank r - 1 has joined: :meth:`wait_turn` before
    connecting, :meth:`joined` after the coordinator accepted."""

    def __init__(self, store, prefix: str, rank: int, timeout: float) -> None:
        self._store = store
        self._prefix = prefix
        self.rank = rank
        self.timeout = timeout

    @classmethod
    def from_environment(cls, rank: int, world_size: int, timeout: float,
                         env: Mapping[str, str] = os.environ) -> Optional["RankOrder"]:
        """Connect to torchrun's store; None (joins in any order) where
        torchrun runs none for its workers, e.g. a hand-set environment."""
        if world_size < 2 or env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
            return None
        from torch.distributed import TCPStore

        try:
            store = TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                             timeout=datetime.timedelta(seconds=timeout))
        except (KeyError, ValueError, RuntimeError) as exc:
            log.warning("torchrun's store is out of reach (%s): workers join in any order", exc)
            return None
        # a restarted run must not see the keys of the attempt before it
        prefix = (f"ddpwire/{env.get('TORCHELASTIC_RUN_ID', 'run')}/"
                  f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/joined/")
        return cls(store, prefix, rank, timeout)

    def wait_turn(self) -> None:
        """Block until the previous rank has joined (rank 0 never waits)."""
        if self.rank == 0:
            return
        try:
            self._store.wait([f"{self._prefix}{self.rank - 1}"], datetime.timedelta(seconds=self.timeout))
        except RuntimeError as exc:  # torch's store timeout
            raise JoinTimeout(f"rank {self.rank - 1} did not join within {self.timeout:g} s, "
                              f"so rank {self.rank} cannot take its turn: {exc}") from None

    def joined(self) -> None:
        """Let the next rank join."""
        self._store.set(f"{self._prefix}{self.rank}", "1")
