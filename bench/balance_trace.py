"""Run bench/balance_worker.py with the calls of one step's exchange timed.

    python bench/balance_trace.py OUT.json bench/balance_worker.py ARGS...

Wraps, before the worker starts, the methods a mesh step over shared
memory goes through (the upload with its StepTiming, the plane's
reduce-scatter and allgather and its barrier waits, the worker's
StepReport-to-StepCommit half, every frame sent and every message read on
a channel) and writes one JSON list at the end: for every call, its name,
its start and end (time.perf_counter: one clock for the processes of a
host) and the calling thread's CPU seconds in it. bench/test_bench_balance.py
runs its workers through this with DDPWIRE_BALANCE_TRACE=1;
bench/report_balance.py lines the calls up against each step's last
arrival. The benchmark also times the coordinator's side in its own
process (:data:`COORDINATOR_TRACED`, :func:`traced_here`).
"""
from __future__ import annotations

import atexit
import contextlib
import json
import runpy
import sys
import time
from typing import Callable, Iterator, List, Sequence, Tuple

#: (class path, method, name in the trace)
TRACED = (
    ("ddpwire.session.shard_inbox.ShardInbox", "upload", "upload"),
    ("ddpwire.plane.shm.SharedPlane", "reduce_scatter", "plane reduce-scatter"),
    ("ddpwire.plane.shm.SharedPlane", "_wait", "plane barrier"),
    ("ddpwire.plane.shm.SharedPlane", "allgather", "plane allgather"),
    ("ddpwire.plane.mesh_step.MeshStep", "receive", "StepCommit and allgather"),
    ("ddpwire.wire.channel.Channel", "send", "send a frame"),
    ("ddpwire.wire.channel.Channel", "expect", "read a message"),
)

#: the coordinator's side, traced in the benchmark's own process
#: (bench/test_bench_balance.py, :func:`traced_here`): its wait for every
#: StepReport, and its go-ahead
COORDINATOR_TRACED = (
    ("ddpwire.session.mesh_control.MeshControl", "_answers", "coordinator: every StepReport"),
    ("ddpwire.session.mesh_control.MeshControl", "commit", "coordinator: StepCommit to all"),
)

EVENTS: List[Tuple[str, float, float, float]] = []


def _wrap(owner: type, method: str, name: str,
          events: List[Tuple[str, float, float, float]] = EVENTS) -> Callable:
    """Time every call of ``owner.method`` into ``events``; returns the
    method as it was."""
    inner = getattr(owner, method)

    def timed(*args, **kwargs):
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            events.append((name, start, time.perf_counter(), time.thread_time() - cpu))

    setattr(owner, method, timed)
    return inner


def targets(traced: Sequence[Tuple[str, str, str]] = TRACED) -> List[Tuple[type, str, str]]:
    """(class, method, name) of every call in ``traced``; AttributeError or
    ImportError naming the one that moved (the tests look them up, so a
    rename in ddpwire cannot leave this script behind)."""
    import importlib
    found = []
    for path, method, name in traced:
        module, _, cls = path.rpartition(".")
        owner = getattr(importlib.import_module(module), cls)
        if not callable(getattr(owner, method)):
            raise AttributeError(f"{path}.{method} is not a method")
        found.append((owner, method, name))
    return found


@contextlib.contextmanager
def traced_here(traced: Sequence[Tuple[str, str, str]] = COORDINATOR_TRACED
                ) -> Iterator[List[Tuple[str, float, float, float]]]:
    """The calls in ``traced`` timed in this process while the block runs,
    into the list it yields; the methods are put back at its end."""
    events: List[Tuple[str, float, float, float]] = []
    saved = [(owner, method, _wrap(owner, method, name, events))
             for owner, method, name in targets(traced)]
    try:
        yield events
    finally:
        for owner, method, inner in reversed(saved):
            setattr(owner, method, inner)


def main() -> None:
    out, script, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    for owner, method, name in targets():
        _wrap(owner, method, name)

    def dump() -> None:
        with open(out, "w") as f:
            json.dump(EVENTS, f)

    atexit.register(dump)  # the worker ends with sys.exit
    sys.argv = [script] + args
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
