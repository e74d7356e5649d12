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
arrival.
"""
from __future__ import annotations

import atexit
import json
import runpy
import sys
import time
from typing import List, Tuple

#: (class path, method, name in the trace)
TRACED = (
    ("ddpwire.worker.Worker", "_upload", "upload"),
    ("ddpwire.mesh.SharedPlane", "reduce_scatter", "plane reduce-scatter"),
    ("ddpwire.mesh.SharedPlane", "_wait", "plane barrier"),
    ("ddpwire.mesh.SharedPlane", "allgather", "plane allgather"),
    ("ddpwire.worker.Worker", "_mesh_receive", "StepCommit and allgather"),
    ("ddpwire.channel.Channel", "send", "send a frame"),
    ("ddpwire.channel.Channel", "expect", "read a message"),
)

EVENTS: List[Tuple[str, float, float, float]] = []


def _wrap(owner: type, method: str, name: str) -> None:
    inner = getattr(owner, method)

    def timed(*args, **kwargs):
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            EVENTS.append((name, start, time.perf_counter(), time.thread_time() - cpu))

    setattr(owner, method, timed)


def main() -> None:
    out, script, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    import importlib
    for path, method, name in TRACED:
        module, _, cls = path.rpartition(".")
        _wrap(getattr(importlib.import_module(module), cls), method, name)

    def dump() -> None:
        with open(out, "w") as f:
            json.dump(EVENTS, f)

    atexit.register(dump)  # the worker ends with sys.exit
    sys.argv = [script] + args
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
