"""Elastic sessions (Coordinator(elastic=True)): a worker lost mid-step is
dropped, the step is called off on every survivor before any applies any of
it, and the same step is computed again by the others with all its samples.

Workers run in threads over real sockets; each computes the mean of its
shard's rows of a per-step data set, so every step's average must be the
mean over all of the step's rows (the sample-weighted mean of the shards'
means), whoever computed it.
"""
from __future__ import annotations

import socket
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import pytest

import ddpwire
from ddpwire import (Coordinator, GradientPayload, JoinRefused, JoinRequest, MembershipChanged,
                     Worker, WorkerDropped, WorkerLost, encode_frame)
from ddpwire._core import encode_frame_parts
from ddpwire.cli.serve import serve
from ddpwire.wire.extensions import Extension, RefusalReason

from session_helpers import join_up_to, recv_frame, spawn

T = 12  # samples per step


def rows(step: int, n: int) -> np.ndarray:
    return np.random.default_rng(1000 + step).standard_normal((T, n)).astype(np.float32)


def full_mean(step: int, n: int) -> np.ndarray:
    return rows(step, n).mean(axis=0, dtype=np.float64)


Fault = Callable[[Worker, Any, np.ndarray], None]


def train(w: Worker, n: int, fault_at: Optional[int], fault: Optional[Fault]) -> Dict[str, Any]:
    """A worker's run: every step's average it applied, every step it was
    told to compute again."""
    applied: Dict[int, np.ndarray] = {}
    redone: List[MembershipChanged] = []
    while True:
        shard = w.receive_shard()
        if shard is None:
            return {"applied": applied, "redone": redone}
        part = rows(shard.step, n)[shard.shard_start:shard.shard_end]
        count = shard.shard_end - shard.shard_start
        grad = part.mean(axis=0) if count else np.zeros(n, np.float32)
        if fault is not None and shard.step == fault_at:
            fault(w, shard, grad.astype(np.float32))
            return {"applied": applied, "redone": redone, "faulted": True}
        try:
            avg = w.allreduce(shard.step, grad.astype(np.float32), 0.5, 0, count)
        except MembershipChanged as exc:
            redone.append(exc)
            continue
        assert shard.step not in applied, "a step applied twice"
        applied[shard.step] = avg.gradients.copy()


def run(n_workers: int, n: int, steps: int, fault_worker: Optional[int] = None,
        fault_at: Optional[int] = None, fault: Optional[Fault] = None,
        **coord_kwargs: Any):
    coord = Coordinator(("127.0.0.1", 0), n_workers, elastic=True, samples_per_step=T,
                        **{"timeout": 10.0, **coord_kwargs})
    threads = []
    try:
        for i in range(n_workers):
            mine = fault if i == fault_worker else None

            def body(mine=mine):
                w = Worker.connect(coord.local_addr, 0, "cpu", timeout=10.0, samples_per_step=T)
                w.state_source = lambda step: b"state"  # for a late joiner
                try:
                    return train(w, n, fault_at, mine)
                finally:
                    w.close()
            threads.append(spawn(body))
            join_up_to(coord, i + 1)
        coord.wait_for_workers()
        reports = serve(coord, steps=steps, total_samples=T)
        outs = [t.join_result(60) for t in threads]
    finally:
        coord.close()
    return coord, reports, outs


def check_every_sample_once(coord: Coordinator, steps: int, total: int = T) -> None:
    """The shard log: one entry per step, its shards tiling [0, total)."""
    assert [s for s, _ in coord.shard_log] == list(range(steps))
    for step, shards in coord.shard_log:
        covered = sorted(shards.values())
        assert covered[0][0] == 0 and covered[-1][1] == total, (step, shards)
        for (_, end), (start, _) in zip(covered, covered[1:]):
            assert end == start, (step, shards)


def check_averages(outs, steps: int, n: int, survivors) -> None:
    for i in survivors:
        applied = outs[i]["applied"]
        assert sorted(applied) == list(range(steps))
        for step, avg in applied.items():
            np.testing.assert_allclose(avg, full_mean(step, n), rtol=0, atol=2e-6)
    # one average per step, the same bits on every survivor
    for step in range(steps):
        first = outs[survivors[0]]["applied"][step]
        for i in survivors[1:]:
            assert np.array_equal(outs[i]["applied"][step], first)


# ---- the faults ----

def close_before_sending(w: Worker, shard: Any, grad: np.ndarray) -> None:
    w.channel.conn.sock.shutdown(socket.SHUT_RDWR)


def half_a_payload(w: Worker, shard: Any, grad: np.ndarray) -> None:
    head, data, tail = encode_frame_parts(GradientPayload(
        step=shard.step, worker_id=w.worker_id, gradients=grad, loss=0.5, correct=0,
        total=shard.shard_end - shard.shard_start))
    sock = w.channel.conn.sock
    sock.settimeout(10)
    sock.sendall(head)
    sock.sendall(bytes(data)[:len(data) // 2])
    time.sleep(0.2)  # the others are inside their frames too
    sock.shutdown(socket.SHUT_RDWR)


def gone_before_the_average(w: Worker, shard: Any, grad: np.ndarray) -> None:
    """The whole gradient goes out, then the worker is gone: the average
    cannot reach it, and the step stands."""
    head, data, tail = encode_frame_parts(GradientPayload(
        step=shard.step, worker_id=w.worker_id, gradients=grad, loss=0.5, correct=0,
        total=shard.shard_end - shard.shard_start))
    sock = w.channel.conn.sock
    sock.settimeout(10)
    sock.sendall(bytes(head) + bytes(data) + bytes(tail))
    # closed with nothing unread: the coordinator's first bytes draw a reset
    sock.close()


@pytest.mark.parametrize("fault, n", [(close_before_sending, 1000), (half_a_payload, 1 << 20)],
                         ids=["before-its-gradient", "inside-its-gradient"])
def test_a_lost_worker_s_step_is_redone_by_the_others_with_all_its_samples(fault, n):
    steps = 6
    coord, reports, outs = run(3, n, steps, fault_worker=1, fault_at=3, fault=fault)
    assert outs[1].get("faulted")
    assert sorted(outs[1]["applied"]) == [0, 1, 2]  # nothing of step 3 or later
    check_averages(outs, steps, n, [0, 2])
    check_every_sample_once(coord, steps)
    # the step was called off once, on both survivors, and nothing else
    for i in (0, 2):
        assert [(e.step, e.lost, e.workers) for e in outs[i]["redone"]] == [(3, [1], 2)]
    assert [(e.step, e.worker_id, e.workers, e.committed) for e in coord.membership] == \
        [(3, 1, 2, False)]
    assert [e.worker_id for e in reports[3].membership] == [1]
    assert all(not r.membership for r in reports if r.step != 3)
    assert sorted(coord.shard_log[3][1]) == [0, 2]
    assert reports[3].as_json()["membership"][0]["worker"] == 1


def test_a_worker_lost_while_the_average_goes_out_leaves_its_step_standing():
    # an average twice what the socket buffers take at most (tcp_wmem's top is
    # 4 MiB on common kernels, so 4 MiB could all go out before the reset
    # came back, on a loaded machine, and the loss be found a step later)
    steps, n = 5, 2 << 20
    coord, reports, outs = run(3, n, steps, fault_worker=2, fault_at=2,
                               fault=gone_before_the_average)
    check_averages(outs, steps, n, [0, 1])
    check_every_sample_once(coord, steps)
    assert set(coord.shard_log[2][1]) == {0, 1, 2}  # its samples were in step 2's average
    assert set(coord.shard_log[3][1]) == {0, 1}
    assert [(e.step, e.worker_id, e.committed) for e in coord.membership] == [(2, 2, True)]
    assert all(not out["redone"] for out in outs[:2])


def test_below_min_workers_the_session_ends_with_the_lost_worker_named():
    # nobody comes within the join timeout
    coord = Coordinator(("127.0.0.1", 0), 2, elastic=True, min_workers=2, timeout=10.0,
                        samples_per_step=T, join_timeout=0.5)
    try:
        def good():
            w = Worker.connect(coord.local_addr, 0, "cpu", timeout=10.0)
            try:
                shard = w.receive_shard()
                return w.allreduce(shard.step, np.ones(8, np.float32), 0.0, 0, 6)
            finally:
                w.close()

        def bad():
            w = Worker.connect(coord.local_addr, 0, "cpu", timeout=10.0)
            w.receive_shard()
            w.channel.conn.sock.shutdown(socket.SHUT_RDWR)
            w.close()
        threads = [spawn(good)]
        join_up_to(coord, 1)
        threads.append(spawn(bad))
        coord.wait_for_workers()
        coord.send_shard_assignments(0)
        with pytest.raises(WorkerLost, match=r"fewer than min_workers \(2\)") as err:
            coord.allreduce(0)
        assert err.value.worker_id == 1 and err.value.step == 0
        # the first cause stays: every later call says the same
        with pytest.raises(WorkerLost, match="min_workers"):
            coord.send_shard_assignments(1)
        with pytest.raises(ddpwire.DdpwireError):
            threads[0].join_result(30)
    finally:
        coord.close()


def test_a_stalled_worker_is_dropped_and_told_so_when_it_wakes():
    """A worker silent past the timeout (a stopped process, a laptop asleep)
    is dropped; when it wakes it reads that it was dropped (WorkerDropped),
    not a reset, and none of its late gradient is used."""
    n, steps = 64, 4
    woke: Dict[str, Any] = {}

    def stall(w: Worker, shard: Any, grad: np.ndarray) -> None:
        time.sleep(2.0)  # past the coordinator's 1 s
        try:
            w.allreduce(shard.step, grad, 0.5, 0, shard.shard_end - shard.shard_start)
        except BaseException as exc:
            woke["error"] = exc
    coord, reports, outs = run(3, n, steps, fault_worker=0, fault_at=1, fault=stall,
                               timeout=1.0)
    check_averages(outs, steps, n, [1, 2])
    check_every_sample_once(coord, steps)
    err = woke["error"]
    assert isinstance(err, WorkerDropped), repr(err)
    assert err.worker_id == 0 and err.step == 1
    assert "dropped this worker during step 1" in str(err)
    assert [(e.step, e.worker_id) for e in coord.membership] == [(1, 0)]


def test_an_elastic_coordinator_refuses_a_worker_that_cannot_redo_a_step():
    coord = Coordinator(("127.0.0.1", 0), 1, elastic=True, join_timeout=5.0)
    try:
        def join():
            sock = socket.create_connection(coord.local_addr, timeout=5.0)
            try:
                # a ddpwire-style join with an extension block, but no elastic entry
                sock.sendall(encode_frame(JoinRequest(node_id="old", gpu_count=0, backend="cpu",
                                                      extensions={Extension.BALANCE: b""})))
                return recv_frame(sock)
            finally:
                sock.close()
        t = spawn(join)
        with pytest.raises(ddpwire.JoinTimeout):
            coord.wait_for_workers(timeout=1.5)
        reply = t.join_result(10)
        assert isinstance(reply, JoinRefused)
        assert reply.reason == RefusalReason.MISMATCH
        assert "--elastic" in reply.detail
    finally:
        coord.close()


def test_a_worker_granted_elastic_knows_it():
    coord = Coordinator(("127.0.0.1", 0), 1, elastic=True)
    try:
        t = spawn(lambda: Worker.connect(coord.local_addr, 0, "cpu"))
        coord.wait_for_workers()
        w = t.join_result(10)
        assert w.elastic
        w.close()
    finally:
        coord.close()
    plain = Coordinator(("127.0.0.1", 0), 1)
    try:
        t = spawn(lambda: Worker.connect(plain.local_addr, 0, "cpu"))
        plain.wait_for_workers()
        w = t.join_result(10)
        assert not w.elastic
        w.close()
    finally:
        plain.close()


@pytest.mark.parametrize("kwargs, match", [
    (dict(elastic=True, topology="mesh"), "averages on the star"),
    (dict(elastic=True, compression="bf16"), "averages on the star"),
    (dict(elastic=True, per_block=True), "flat steps"),
    (dict(min_workers=1), "it needs elastic=True"),
    (dict(elastic=True, min_workers=3), "from 1 to expect_workers"),
    (dict(elastic=True, min_workers=0), "from 1 to expect_workers"),
])
def test_elastic_arguments_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Coordinator(("127.0.0.1", 0), 2, **kwargs)


def test_an_elastic_session_takes_the_star():
    coord = Coordinator(("127.0.0.1", 0), 2, elastic=True)
    try:
        assert coord.config.topology == "star" and coord.config.elastic
        assert coord.config.min_workers is None  # the session goes on down to one worker
    finally:
        coord.close()


# ---- joining between steps ----

def late_body(addr, n: int, token=None, state_of=None, leave_at=None):
    """A worker in an elastic session that hands ``state_of(step)`` to late
    joiners, leaves (closes) when handed step ``leave_at`` and, joining
    late itself, checks what it was handed."""
    def leave(w, shard, grad):
        w.close()

    def body():
        w = Worker.connect(addr, 0, "cpu", timeout=10.0, samples_per_step=T, token=token)
        try:
            if state_of is not None:
                w.state_source = state_of
            got = None
            if w.joins_at is not None:
                got = w.receive_state()
            out = train(w, n, leave_at, leave if leave_at is not None else None)
            out["joined_with"] = got
            out["joins_at"] = w.joins_at
            return out
        finally:
            w.close()
    return body


def test_a_worker_joining_between_steps_takes_the_state_and_every_later_step():
    n, steps = 256, 8
    big = bytes(range(256)) * (160 * 1024)  # 40 MiB: three ModelState pieces
    coord = Coordinator(("127.0.0.1", 0), 3, elastic=True, samples_per_step=T, timeout=10.0)
    threads = []
    try:
        for i in range(3):
            threads.append(spawn(late_body(coord.local_addr, n, state_of=lambda step: big + bytes([step]),
                                           leave_at=1 if i == 2 else None)))
            join_up_to(coord, i + 1)
        coord.wait_for_workers()

        def on_step(report):
            if report.step == 2:  # one left during step 1: its slot is free
                threads.append(spawn(late_body(coord.local_addr, n)))
                assert len(coord.wait_for_workers(count=3, timeout=20)) == 3
        reports = serve(coord, steps=steps, total_samples=T, on_step=on_step)
        outs = [t.join_result(60) for t in threads]
    finally:
        coord.close()
    late = outs[3]
    assert late["joins_at"] == 3 and late["joined_with"] == (3, big + bytes([3]))
    assert sorted(late["applied"]) == list(range(3, steps))
    for step in range(steps):
        for out in outs:
            if step in out["applied"]:
                np.testing.assert_allclose(out["applied"][step], full_mean(step, n), atol=2e-6)
    for step in range(3, steps):
        assert np.array_equal(outs[0]["applied"][step], late["applied"][step])
    check_every_sample_once(coord, steps)
    assert [set(s) for _, s in coord.shard_log] == \
        [{0, 1, 2}] + [{0, 1}] * 2 + [{0, 1, 2}] * (steps - 3)
    assert [(e.step, e.worker_id, e.joined) for e in coord.membership] == \
        [(1, 2, False), (3, 2, True)]
    assert [e.worker_id for e in reports[3].membership] == [2] and reports[3].membership[0].joined


def test_a_late_joiner_is_held_to_the_token_and_to_the_free_slots():
    from ddpwire import AuthenticationFailed, JoinRefusedError
    token = "elastic-secret"
    n, steps = 32, 8
    coord = Coordinator(("127.0.0.1", 0), 3, elastic=True, samples_per_step=T, timeout=10.0,
                        token=token)
    threads, refused = [], {}
    try:
        for i in range(3):
            threads.append(spawn(late_body(coord.local_addr, n, token=token,
                                           state_of=lambda step: b"s%d" % step,
                                           leave_at=2 if i == 1 else None)))
            join_up_to(coord, i + 1)
        coord.wait_for_workers()

        def try_join(key, tok):
            def run():
                try:
                    w = Worker.connect(coord.local_addr, 0, "cpu", timeout=5.0, token=tok)
                except (JoinRefusedError, ddpwire.PeerLost) as exc:
                    refused[key] = exc
                    return None
                return w
            t = spawn(run)
            deadline = time.monotonic() + 10
            while t.is_alive() and time.monotonic() < deadline:
                # the step boundary's poll, as send_shard_assignments makes it
                coord._members.admit(coord._members.next_step, 0.05, 3)
            return t.join_result(10)

        def on_step(report):
            if report.step == 0:
                # every slot is taken: refused as full, whatever its token
                assert try_join("full", token) is None
            if report.step == 3:
                # worker 1 left in step 2: a free slot, but not for a wrong token
                assert try_join("token", "not-the-token") is None
                assert [e.joined for e in coord.membership] == [False]
        serve(coord, steps=steps, total_samples=T, on_step=on_step)
        for t in threads:
            t.join_result(60)
    finally:
        coord.close()
    assert isinstance(refused["full"], JoinRefusedError)
    assert refused["full"].reason == RefusalReason.FULL
    assert isinstance(refused["token"], AuthenticationFailed)
    check_every_sample_once(coord, steps)
    assert [(e.step, e.worker_id, e.joined) for e in coord.membership] == [(2, 1, False)]


# ---- a restarted coordinator (resume) ----

def test_a_resumed_coordinator_goes_on_from_its_workers_step_and_refuses_one_that_disagrees():
    from ddpwire import JoinRefusedError
    coord = Coordinator(("127.0.0.1", 0), 2, elastic=True, resume=True, samples_per_step=T,
                        timeout=10.0)
    errors = {}
    try:
        def join(key, step):
            def run():
                try:
                    return Worker.connect(coord.local_addr, 0, "cpu", timeout=10.0,
                                          samples_per_step=T, resume_step=step)
                except JoinRefusedError as exc:
                    errors[key] = exc
            return spawn(run)
        first = join("first", 7)
        join_up_to(coord, 1)
        # the join goes on (in a thread) while the two that cannot join are refused
        waiting = spawn(coord.wait_for_workers)
        for t in (join("wrong", 8), join("fresh", None)):
            assert t.join_result(10) is None
        late = join("second", 7)
        waiting.join_result(10)
        assert coord.first_step == 7
        workers = [first.join_result(10), late.join_result(10)]
        assert all(w.joins_at is None for w in workers)  # they keep their own state
        t = spawn(lambda: [w.receive_shard().step for w in workers])
        coord.send_shard_assignments(coord.first_step)
        assert t.join_result(10) == [7, 7]
        for w in workers:
            w.close()
    finally:
        coord.close()
    assert errors["wrong"].reason == RefusalReason.MISMATCH
    assert "go on from step 8, the workers admitted from step 7" in str(errors["wrong"])
    assert errors["fresh"].reason == RefusalReason.MISMATCH
    assert "--resume" in str(errors["fresh"])


def test_resume_needs_elastic_and_a_step_number():
    with pytest.raises(ValueError, match="needs elastic=True"):
        Coordinator(("127.0.0.1", 0), 1, resume=True)
    with pytest.raises(ValueError, match="resume_step must be a step number"):
        Worker.connect(("127.0.0.1", 9), resume_step=-1)


def test_below_min_workers_a_joiner_in_time_lets_the_run_go_on():
    """min_workers=2 of 2: one leaves during step 2, another joins while
    the coordinator waits; step 2 is redone by the two, every sample once."""
    n, steps = 64, 5
    joiner = []

    def leave_and_send_another(w, shard, grad):
        addr = w.channel.conn.sock.getpeername()

        def later():
            time.sleep(0.3)  # once its slot is free
            return late_body(addr, n)()
        joiner.append(spawn(later))
        w.close()
    coord, reports, outs = run(2, n, steps, fault_worker=1, fault_at=2,
                               fault=leave_and_send_another, min_workers=2)
    outs.append(joiner[0].join_result(60))
    check_every_sample_once(coord, steps)
    assert [(e.step, e.worker_id, e.joined) for e in coord.membership] == \
        [(2, 1, False), (2, 1, True)]
    assert outs[2]["joins_at"] == 2 and outs[2]["joined_with"] == (2, b"state")
    assert sorted(outs[2]["applied"]) == [2, 3, 4]
    assert [set(s) for _, s in coord.shard_log] == [{0, 1}] * steps
    for step in range(2, steps):
        assert np.array_equal(outs[0]["applied"][step], outs[2]["applied"][step])
        np.testing.assert_allclose(outs[0]["applied"][step], full_mean(step, n), atol=2e-6)


def test_late_joins_keep_the_join_rules_against_hostile_clients():
    """While an elastic run goes on with a free slot: silent clients and a
    trickler are cut off at their handshake deadline, garbage and a frame
    declaring 99 MB are refused at once, and a real worker still joins."""
    n, steps = 32, 10
    coord = Coordinator(("127.0.0.1", 0), 3, elastic=True, samples_per_step=T, timeout=10.0,
                        handshake_timeout=0.5)
    threads, strays, seen = [], {}, {}

    def closed(sock, within):
        sock.settimeout(within)
        try:
            while True:
                if not sock.recv(4096):
                    return True
        except ConnectionResetError:
            return True
        except socket.timeout:
            return False
    try:
        for i in range(3):
            threads.append(spawn(late_body(coord.local_addr, n, state_of=lambda step: b"s",
                                           leave_at=1 if i == 2 else None)))
            join_up_to(coord, i + 1)
        coord.wait_for_workers()

        def on_step(report):
            if report.step == 2:  # worker 2 left in step 1: a slot is free
                strays["silent"] = [socket.create_connection(coord.local_addr) for _ in range(2)]
                strays["trickler"] = socket.create_connection(coord.local_addr)
                strays["trickler"].sendall(encode_frame(JoinRequest(
                    node_id="slow", gpu_count=0, backend="cpu"))[:5])
                strays["garbage"] = socket.create_connection(coord.local_addr)
                strays["garbage"].sendall(b"\x00\x00\x00\x05\xff\x00\x00\x00\x00")
                strays["bomb"] = socket.create_connection(coord.local_addr)
                strays["bomb"].sendall((99_999_999).to_bytes(4, "big") + bytes([0x01]))
                time.sleep(0.1)
                coord._members.admit(3, 0.2, 3)  # the next boundary's poll, a little longer
                seen["refused at once"] = [closed(strays[k], 0.5) for k in ("garbage", "bomb")]
                time.sleep(0.6)  # past the strays' handshake deadline
            if report.step == 4:
                # the boundaries since then expired them
                seen["cut off"] = [closed(s, 0.5) for s in strays["silent"] + [strays["trickler"]]]
                threads.append(spawn(late_body(coord.local_addr, n)))
                coord.wait_for_workers(count=3, timeout=10)
        serve(coord, steps=steps, total_samples=T, on_step=on_step)
        outs = [t.join_result(60) for t in threads]
    finally:
        coord.close()
        for s in [x for v in strays.values() for x in (v if isinstance(v, list) else [v])]:
            s.close()
    assert seen["refused at once"] == [True, True]
    assert seen["cut off"] == [True, True, True]
    assert outs[3]["joins_at"] == 5 and sorted(outs[3]["applied"]) == list(range(5, steps))
    assert [(e.step, e.worker_id, e.joined) for e in coord.membership] == \
        [(1, 2, False), (5, 2, True)]
    check_every_sample_once(coord, steps)
