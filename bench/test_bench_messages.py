"""Small messages through the compiled codec (encode_frame, then
decode_frame), this tree beside another checkout in the same run: with
$DDPWIRE_BASELINE naming a built checkout (an older commit), each message is
timed in both, and their frames are checked to be the same bytes first.

    DDPWIRE_BASELINE=/path/to/old/checkout python -m pytest bench/test_bench_messages.py \\
        --benchmark-json=bench/results/messages.json
    python bench/report_messages.py bench/results/messages.json

Each side runs in a spawned process of its own (two ddpwire packages cannot
share one interpreter), both on the same core, and times a batch of BATCH
round trips per call, so the pipe's few microseconds are under 1% of a call,
and alike on both sides.
"""
from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any, Dict, Iterator

import pytest

import allreduce_procs as procs

BATCH = 5000
_ctx = mp.get_context("spawn")


def messages(ddpwire: Any) -> Dict[str, Any]:
    """The messages timed, built with the ddpwire given (any version)."""
    import numpy as np

    return {
        "ShardAssignment": ddpwire.ShardAssignment(42, 100, 200),
        "StepReport": ddpwire.wire.messages.StepReport(7, 1, 1 << 20, 0.25, 90, 128,
                                                       0xFFFFFFFF, 0, 0.0),
        "StepCommit": ddpwire.wire.messages.StepCommit(7, 0.25, 0xFFFFFFFF, 0, 0.0),
        "Heartbeat": ddpwire.Heartbeat("intel-1234", 1733500000000),
        "JoinRequest+ext": ddpwire.JoinRequest("intel-1234", 2, "cpu",
                                               extensions={1: b"", 7: b"\x01\x02"}),
        "GradientPayload 256": ddpwire.GradientPayload(
            7, 1, np.ones(256, np.float32), 0.25, 90, 128),
        "CollectiveRequest 64 B": ddpwire.wire.messages.CollectiveRequest(
            3, 1, 0, 6, 0, 64, np.arange(64, dtype=np.uint8)),
    }


def _serve(conn: Any, path: str) -> None:
    # both sides on the same core, the last: a core's own speed is then no
    # difference between them
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    procs.use_baseline(path)
    import ddpwire

    msgs = messages(ddpwire)
    conn.send({name: ddpwire.encode_frame(m) for name, m in msgs.items()})
    encode, decode = ddpwire.encode_frame, ddpwire.decode_frame
    while True:
        name = conn.recv()
        if name is None:
            return
        msg = msgs[name]
        for _ in range(BATCH):
            decode(encode(msg))
        conn.send(True)


class Side:
    """One checkout's codec in a process of its own."""

    def __init__(self, path: str) -> None:
        self.conn, child = _ctx.Pipe()
        self.proc = _ctx.Process(target=_serve, args=(child, path), daemon=True)
        self.proc.start()
        if not self.conn.poll(60):
            raise RuntimeError(f"the codec process for {path or 'this tree'} did not start")
        self.frames: Dict[str, bytes] = self.conn.recv()

    def batch(self, name: str) -> None:
        self.conn.send(name)
        if not self.conn.poll(60):
            raise RuntimeError(f"{name}: no answer in 60 s")
        self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(10)


SIDES = ["this"] + (["baseline"] if os.environ.get(procs.BASELINE_ENV) else [])


@pytest.fixture(scope="module")
def sides() -> Iterator[Dict[str, Side]]:
    opened = {"this": Side("")}
    if "baseline" in SIDES:
        opened["baseline"] = Side(os.environ[procs.BASELINE_ENV])
        # the same bytes first: a faster codec that writes other frames is no gain
        assert opened["baseline"].frames == opened["this"].frames
    yield opened
    for side in opened.values():
        side.close()


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("name", list(messages(__import__("ddpwire"))))
def test_round_trip(benchmark, sides, name, side):
    benchmark.group = f"{name} x{BATCH}"
    benchmark.extra_info["batch"] = BATCH
    if side == "baseline":
        benchmark.extra_info["baseline"] = procs.baseline_commit(os.environ[procs.BASELINE_ENV])
    benchmark.pedantic(sides[side].batch, args=(name,), rounds=40, warmup_rounds=3)
