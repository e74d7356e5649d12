"""A process group's set-up collectives faked in threads, for
ddpwire.plane.rank_links.form_links: shared by tests/test_torch_links.py and
tests/test_flat_matrix.py. Needs torch (ddpwire.torch imports it)."""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List

import numpy as np

from ddpwire.plane.collectives import Kind


class Group:
    """``world`` ranks' set-up collectives in threads: a broadcast is the
    root's data, an allgather every rank's in rank order (what the service
    answers)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._barrier = threading.Barrier(world, timeout=30)
        self._slots: List[Any] = [None] * world

    def client(self, rank: int) -> Any:
        group = self

        class Client:
            def call(self, kind, dtype, root, data, timeout):
                group._slots[rank] = np.array(data, dtype=np.uint8, copy=True)
                group._barrier.wait()
                got = (group._slots[root].copy() if kind is Kind.BROADCAST
                       else np.concatenate(group._slots))
                group._barrier.wait()
                return got
        return Client()


def form_all(world: int, per_rank: Callable[[int], Dict[str, Any]]) -> list:
    """form_links on ``world`` threads; ``per_rank(rank)`` gives its keyword
    arguments (a timeout of 10 s unless they give one). Returns each rank's RankLinks or None (or its exception)."""
    from ddpwire.plane import rank_links as _links

    group = Group(world)
    got: list = [None] * world

    def run(rank: int) -> None:
        try:
            got[rank] = _links.form_links(group.client(rank), rank, world,
                                          **{"timeout": 10.0, **per_rank(rank)})
        except BaseException as exc:  # handed to the test
            got[rank] = exc
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "form_links hung"
    return got


def loopback(rank: int) -> Dict[str, Any]:
    """form_links arguments of a rank on this host."""
    return dict(listen_host="127.0.0.1", advertise="127.0.0.1")
