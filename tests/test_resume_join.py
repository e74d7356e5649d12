"""A restarted coordinator's join (Coordinator(resume=True)): the step the
run goes on from follows the workers admitted and still connected. A worker
that set it and left before the join completed takes it with it: the next
worker admitted sets it again (issue 39, item 8).

Workers run in threads over real sockets on loopback.
"""
from __future__ import annotations

import time
from typing import Optional

import pytest

from ddpwire import Coordinator, Worker

from session_helpers import join_up_to, spawn

T = 12  # samples per step
TOKEN = "resume-join-token"
WAIT = 30.0  # generous: a loaded 2-core machine


def _connect(coord: Coordinator, step: int, token: Optional[str]) -> Worker:
    return Worker.connect(coord.local_addr, 0, "cpu", timeout=WAIT, samples_per_step=T,
                          resume_step=step, token=token)


def _until_joined(coord: Coordinator, count: int) -> None:
    """Wait (the join running in another thread) until the coordinator
    counts ``count`` workers admitted."""
    give_up = time.monotonic() + WAIT
    while coord.worker_count != count:
        assert time.monotonic() < give_up, f"{coord.worker_count} joined, waiting for {count}"
        time.sleep(0.01)


@pytest.mark.parametrize("token", [TOKEN, None], ids=["token", "no-token"])
def test_a_worker_that_set_the_resume_step_and_left_takes_it_with_it(token):
    coord = Coordinator(("127.0.0.1", 0), 2, elastic=True, resume=True, samples_per_step=T,
                        timeout=WAIT, token=token)
    workers = []
    try:
        # a worker at step 7 is admitted first, then leaves before the join completes
        gone = spawn(lambda: _connect(coord, 7, token))
        join_up_to(coord, 1)
        gone.join_result(WAIT).close()
        waiting = spawn(lambda: coord.wait_for_workers(WAIT))
        _until_joined(coord, 0)  # its slot is free again
        # the two left at step 5 are the run now
        fives = [spawn(lambda: _connect(coord, 5, token)) for _ in range(2)]
        workers = [t.join_result(WAIT) for t in fives]
        waiting.join_result(WAIT)
        assert coord.first_step == 5
        assert sorted(w.worker_id for w in workers) == [0, 1]
        assert all(w.joins_at is None for w in workers)  # they keep their own state
        t = spawn(lambda: [w.receive_shard().step for w in workers])
        coord.send_shard_assignments(coord.first_step)
        assert t.join_result(WAIT) == [5, 5]
    finally:
        for w in workers:
            w.close()
        coord.close()


def test_the_resume_step_stays_while_a_worker_admitted_still_holds_it():
    """Of two workers at step 7, one leaves: the other still goes on from
    7, so a worker at 5 is refused and one at 7 completes the join."""
    from ddpwire import JoinRefusedError
    from ddpwire.wire.extensions import RefusalReason
    coord = Coordinator(("127.0.0.1", 0), 3, elastic=True, resume=True, samples_per_step=T,
                        timeout=WAIT, token=TOKEN)
    workers = []
    try:
        stays = spawn(lambda: _connect(coord, 7, TOKEN))
        join_up_to(coord, 1)
        gone = spawn(lambda: _connect(coord, 7, TOKEN))
        join_up_to(coord, 2)
        workers.append(stays.join_result(WAIT))
        gone.join_result(WAIT).close()
        waiting = spawn(lambda: coord.wait_for_workers(WAIT))
        _until_joined(coord, 1)
        with pytest.raises(JoinRefusedError) as refused:
            _connect(coord, 5, TOKEN)
        assert refused.value.reason == RefusalReason.MISMATCH
        assert "the workers admitted from step 7" in str(refused.value)
        workers.append(_connect(coord, 7, TOKEN))
        workers.append(_connect(coord, 7, TOKEN))
        waiting.join_result(WAIT)
        assert coord.first_step == 7
        t = spawn(lambda: [w.receive_shard().step for w in workers])
        coord.send_shard_assignments(coord.first_step)
        assert t.join_result(WAIT) == [7, 7, 7]
    finally:
        for w in workers:
            w.close()
        coord.close()
