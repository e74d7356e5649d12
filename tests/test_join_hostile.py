"""The join under hostile clients: silent, trickling, garbage and oversized
connections beside real workers; slots freed by workers that leave; surplus
and late workers refused at once; bounded memory before admission."""
from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
import tracemalloc

import pytest

import ddpwire
from ddpwire import Coordinator, Worker, encode_frame
from ddpwire.wire import auth
from ddpwire.plane import mesh as meshmod
from ddpwire.wire.extensions import Extension, RefusalReason, decode_u64

from session_helpers import recv_exact, recv_frame, spawn

ADDR = ("127.0.0.1", 0)


@pytest.fixture(params=["star", "mesh"])
def topology(request) -> str:
    """The surplus-worker tests run on both topologies: a mesh session sends
    every admitted worker a MeshPeers once the slots are filled, the star
    does not."""
    return request.param


def unread_at(port: int) -> int:
    """How many established connections to ``port`` on this host hold bytes
    their server has not read yet, accepted or still in the listen backlog
    (Linux's /proc/net/tcp: rx_queue)."""
    count = 0
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            local, state, queues = fields[1], fields[3], fields[4]
            if int(local.split(":")[1], 16) == port and state == "01" and \
                    int(queues.split(":")[1], 16) > 0:
                count += 1
    return count


def until_unread(coord, n: int) -> None:
    """Return once ``n`` connections to the coordinator hold bytes it has not
    read: while its loop is not running, its next select() then finds them
    all ready in one batch, whatever the scheduling."""
    if not os.path.exists("/proc/net/tcp"):
        pytest.skip("needs Linux's /proc/net/tcp to see what the coordinator has not read")
    port = coord.local_addr[1]
    deadline = time.monotonic() + 30
    while unread_at(port) < n:
        assert time.monotonic() < deadline, f"{unread_at(port)} of {n} connections hold bytes"
        time.sleep(0.01)


def connect(coord) -> socket.socket:
    return socket.create_connection(coord.local_addr, timeout=10)


def worker(coord, **kw):
    return spawn(lambda: Worker.connect(coord.local_addr, 0, "cpu", timeout=10, **kw))


def peer_closed(sock: socket.socket, within: float = 10.0) -> bool:
    """True once the coordinator has closed its end (EOF or reset)."""
    sock.settimeout(within)
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_silent_and_trickling_clients_do_not_hold_up_the_join():
    """Two silent clients and one trickling a JoinRequest connect first; the
    two real workers still join, while the stray clients are still there
    (their handshake_timeout is far longer than the join took)."""
    stop = threading.Event()
    with Coordinator(ADDR, expect_workers=2, handshake_timeout=120, join_timeout=60) as coord:
        silent = [connect(coord), connect(coord)]
        trickler = connect(coord)
        frame = encode_frame(ddpwire.JoinRequest(node_id="slow" * 50, gpu_count=0, backend="cpu"))

        def trickle():
            for b in frame[:-1]:
                if stop.wait(0.05):
                    return
                try:
                    trickler.send(bytes([b]))
                except OSError:
                    return
        t = spawn(trickle)
        time.sleep(0.2)  # the strays are accepted first
        workers = [worker(coord), worker(coord)]
        infos = coord.wait_for_workers()
        joined = [w.join_result() for w in workers]
        assert sorted(i.worker_id for i in infos) == [0, 1]
        assert sorted(w.worker_id for w in joined) == [0, 1]
        # the strays were neither admitted nor dropped: the join never waited on them
        assert t.is_alive()
        for s in silent:
            s.settimeout(0.01)
            with pytest.raises(socket.timeout):
                s.recv(1)
        stop.set()
        t.join_result()
        for w in joined:
            w.close()
    for s in silent + [trickler]:
        s.close()


def test_trickling_cannot_extend_the_handshake_or_the_join():
    """A client that keeps sending one byte at a time is dropped at its
    handshake deadline, and the join ends at its own deadline."""
    stop = threading.Event()
    with Coordinator(ADDR, expect_workers=1, handshake_timeout=0.5) as coord:
        trickler = connect(coord)
        frame = encode_frame(ddpwire.JoinRequest(node_id="x" * 4000, gpu_count=0, backend="cpu"))

        def trickle():
            for i, b in enumerate(frame[:-1]):
                if stop.wait(0.02):
                    return i
                try:
                    trickler.send(bytes([b]))
                except OSError:
                    return i
            return len(frame)
        t = spawn(trickle)
        with pytest.raises(ddpwire.JoinTimeout, match="0 of 1 worker joined within 1.5 s"):
            coord.wait_for_workers(timeout=1.5)
        assert peer_closed(trickler)
        stop.set()
        sent = t.join_result()
        assert sent < len(frame) - 1  # cut off long before it finished
    trickler.close()


def garbage_before_a_worker(data: bytes) -> int:
    """A connection sending ``data``, then a real worker joining: the join
    completes and the garbage connection is closed; its port, to find its
    log lines by."""
    with Coordinator(ADDR, expect_workers=1) as coord:
        garbage = connect(coord)
        garbage.sendall(data)
        w = worker(coord)
        coord.wait_for_workers()
        w.join_result().close()
        assert peer_closed(garbage)
    port = garbage.getsockname()[1]
    garbage.close()
    return port


def test_garbage_clients_are_dropped_and_logged_by_address(caplog):
    caplog.set_level(logging.WARNING, logger="ddpwire.coordinator")
    port = garbage_before_a_worker(b"\x00\x00\x00\x05\xff\x00\x00\x00\x00")  # unknown tag
    refused = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert any(f"127.0.0.1:{port}" in m and "0xff" in m for m in refused), refused
    assert not any("worker 0" in m for m in refused)


@pytest.mark.parametrize("first_frame", [
    # a block gradient declaring 99,999,997 bytes as a client's first frame
    (99_999_997).to_bytes(4, "big") + bytes([0x08]) + b"\x00" * 60,
    # a JoinRequest declaring 99,999,999 bytes
    (99_999_999).to_bytes(4, "big") + bytes([0x01]) + b"\x00" * 3,
    # a Heartbeat declaring 99,999,999 bytes
    (99_999_999).to_bytes(4, "big") + bytes([0x06]) + b"\x00" * 3,
], ids=["block-gradient", "join-request", "heartbeat"])
def test_memory_bombs_before_admission_allocate_nothing_big(first_frame):
    """Nothing is allocated for a frame from a client not yet admitted until
    its tag is the one expected and its length fits that message's limit."""
    with Coordinator(ADDR, expect_workers=1) as coord:
        bomb = connect(coord)
        bomb.sendall(first_frame)
        w = worker(coord)
        tracemalloc.start()
        try:
            coord.wait_for_workers()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        w.join_result().close()
        assert peer_closed(bomb)
    bomb.close()
    assert peak < 1 << 20, peak


def test_admitted_worker_heartbeat_over_its_limit_is_refused_by_its_tag():
    with Coordinator(ADDR, expect_workers=1, timeout=5) as coord:
        from session_helpers import raw_join
        t = spawn(lambda: raw_join(coord.local_addr))
        coord.wait_for_workers()
        raw = t.join_result()
        raw.sendall((99_999_999).to_bytes(4, "big") + bytes([0x06]))
        tracemalloc.start()
        try:
            with pytest.raises(ddpwire.FrameTooLarge) as info:
                coord.collect_and_reduce(0)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        raw.close()
    assert info.value.worker_id == 0 and info.value.step == 0
    assert info.value.limit == 65536
    assert peak < 1 << 20


def test_a_worker_that_leaves_before_the_join_completes_frees_its_slot():
    with Coordinator(ADDR, expect_workers=2) as coord:
        leaving = worker(coord)  # admitted, then leaves
        coord.wait_for_workers(count=1)
        gone = leaving.join_result()
        gone_id = gone.worker_id
        gone.close()
        time.sleep(0.1)
        a, b = worker(coord, node_id="a"), worker(coord, node_id="b")
        infos = coord.wait_for_workers()
        wa, wb = a.join_result(), b.join_result()
        assert {i.node_id for i in infos} == {"a", "b"}
        assert sorted(i.worker_id for i in infos) == [0, 1]
        assert gone_id in (wa.worker_id, wb.worker_id)  # its id was handed on
        # and the session works with them
        coord.set_total_samples(4)
        coord.send_shard_assignments(0)
        for w in (wa, wb):
            assert w.receive_shard() is not None
        wa.close()
        wb.close()


def test_late_and_surplus_workers_are_refused_at_once(caplog, topology):
    caplog.set_level(logging.WARNING, logger="ddpwire.coordinator")
    with Coordinator(ADDR, expect_workers=1, timeout=30, topology=topology) as coord:
        first = worker(coord)
        coord.wait_for_workers()
        w0 = first.join_result()
        # a ddpwire worker is told why, long before its 30 s timeout
        with pytest.raises(ddpwire.JoinRefusedError) as info:
            Worker.connect(coord.local_addr, timeout=30)
        assert info.value.reason == RefusalReason.TRAINING
        assert "training has started" in str(info.value)
        # a peer that offered no extension block (the reference) is just closed
        plain = connect(coord)
        plain.sendall(encode_frame(ddpwire.JoinRequest(node_id="ref", gpu_count=0, backend="cpu")))
        plain.settimeout(10)
        assert plain.recv(4096) == b""
        plain.close()
        w0.close()
    refused = [r.getMessage() for r in caplog.records if "refused a connection from 127.0.0.1:" in r.getMessage()]
    assert len(refused) >= 2 and not any("(worker" in m for m in refused)


def test_surplus_worker_mid_handshake_when_the_slots_fill_is_refused_as_full(topology):
    token = "s3cret-token"
    with Coordinator(ADDR, expect_workers=1, token=token, topology=topology) as coord:
        join = spawn(coord.wait_for_workers)
        # a ddpwire peer that offers the token handshake, then stalls
        stalled = connect(coord)
        stalled.sendall(encode_frame(ddpwire.JoinRequest(
            node_id="stall", gpu_count=0, backend="cpu",
            extensions={int(ddpwire.wire.extensions.Extension.AUTH): b"n" * 32})))
        head = recv_exact(stalled, 4)
        challenge = ddpwire.decode_frame(head + recv_exact(stalled, int.from_bytes(head, "big")))
        assert isinstance(challenge, ddpwire.AuthChallenge)
        w = worker(coord, token=token)
        join.join_result()
        w.join_result().close()
        head = recv_exact(stalled, 4)
        refusal = ddpwire.decode_frame(head + recv_exact(stalled, int.from_bytes(head, "big")))
        assert isinstance(refusal, ddpwire.JoinRefused) and refusal.reason == RefusalReason.FULL
    stalled.close()


def test_surplus_join_requests_in_one_batch_are_refused_as_full(topology):
    """Three complete JoinRequests for two slots, all waiting when the
    coordinator's loop first reads: two join, and the third hears at once
    that every slot is taken instead of waiting out its 60 s."""
    with Coordinator(ADDR, expect_workers=2, topology=topology) as coord:
        threads = [spawn(lambda i=i: Worker.connect(coord.local_addr, node_id=f"w{i}", timeout=60))
                   for i in range(3)]
        until_unread(coord, 3)
        infos = coord.wait_for_workers(timeout=30)
        outcomes = []
        for t in threads:
            try:  # join_result's 30 s bound is half the worker's own timeout
                outcomes.append(t.join_result(timeout=30))
            except ddpwire.JoinRefusedError as exc:
                outcomes.append(exc)
        joined = [o for o in outcomes if isinstance(o, Worker)]
        refused = [o for o in outcomes if isinstance(o, ddpwire.JoinRefusedError)]
        assert len(joined) == 2 and len(refused) == 1, outcomes
        assert refused[0].reason == RefusalReason.FULL
        assert "every worker slot is taken" in str(refused[0])
        assert sorted(w.worker_id for w in joined) == sorted(i.worker_id for i in infos) == [0, 1]
        assert coord.mesh == (topology == "mesh")
        for w in joined:
            w.close()


def test_surplus_auth_proofs_in_one_batch_are_refused_as_full(topology):
    """The same with a token: three workers past their AuthChallenge send
    their AuthProof while the coordinator's loop is not running; two join,
    the third is refused as full."""
    token = b"s3cret-token"
    with Coordinator(ADDR, expect_workers=2, token=token, topology=topology,
                     handshake_timeout=60) as coord:
        listeners, peers = [], []
        for i in range(3):
            offer = {int(Extension.AUTH): auth.new_nonce()}
            if topology == "mesh":
                listeners.append(meshmod.listen("127.0.0.1"))
                offer[int(Extension.MESH)] = meshmod.offer(listeners[-1])
            sock = socket.create_connection(coord.local_addr, timeout=60)
            sock.sendall(encode_frame(ddpwire.JoinRequest(node_id=f"w{i}", gpu_count=0,
                                                          backend="cpu", extensions=offer)))
            peers.append((sock, offer[int(Extension.AUTH)]))
        # short runs of the loop, each ending in JoinTimeout with nobody
        # admitted, until every peer has its challenge
        challenges = {}
        for _ in range(200):
            if len(challenges) == len(peers):
                break
            with pytest.raises(ddpwire.JoinTimeout):
                coord.wait_for_workers(timeout=0.1)
            waiting = [s for s, _ in peers if s not in challenges]
            for sock in select.select(waiting, [], [], 0)[0]:
                challenges[sock] = recv_frame(sock)
        assert len(challenges) == len(peers)
        for sock, nonce in peers:
            assert isinstance(challenges[sock], ddpwire.AuthChallenge)
            sock.sendall(encode_frame(ddpwire.AuthProof(
                proof=auth.worker_proof(token, nonce, bytes(challenges[sock].nonce)))))
        until_unread(coord, 3)
        infos = coord.wait_for_workers(timeout=30)
        assert sorted(i.worker_id for i in infos) == [0, 1]
        # each answer is there at once: the sockets' 60 s timeout never runs out
        answers = [recv_frame(sock) for sock, _ in peers]
        accepted = [a for a in answers if isinstance(a, ddpwire.JoinAccepted)]
        refused = [a for a in answers if isinstance(a, ddpwire.JoinRefused)]
        assert len(accepted) == 2 and len(refused) == 1, answers
        assert refused[0].reason == RefusalReason.FULL
        assert refused[0].detail == "every worker slot is taken"
        assert coord.mesh == (topology == "mesh")
    for sock, _ in peers:
        sock.close()
    for lsock in listeners:
        lsock.close()


def test_samples_per_step_must_agree():
    with Coordinator(ADDR, expect_workers=1, samples_per_step=256) as coord:
        join = spawn(coord.wait_for_workers)
        with pytest.raises(ddpwire.JoinRefusedError, match="coordinator 256, worker 128") as info:
            Worker.connect(coord.local_addr, timeout=10, samples_per_step=128)
        assert info.value.reason == RefusalReason.MISMATCH
        ok = worker(coord, samples_per_step=256)
        join.join_result()
        w = ok.join_result()
        assert decode_u64(w.extensions[Extension.SAMPLES]) == 256
        w.close()


@pytest.mark.parametrize("coordinator_per_block", [True, False])
def test_the_step_mode_must_agree_with_the_coordinators(caplog, coordinator_per_block):
    """A worker that would send flat steps to a per-block coordinator (or
    the other way) is refused at the join, saying which flag to change,
    instead of failing at step 0 on a message of the wrong type."""
    caplog.set_level(logging.WARNING, logger="ddpwire.coordinator")
    with Coordinator(ADDR, expect_workers=1, per_block=coordinator_per_block) as coord:
        join = spawn(coord.wait_for_workers)
        with pytest.raises(ddpwire.JoinRefusedError) as info:
            Worker.connect(coord.local_addr, timeout=10, per_block=not coordinator_per_block)
        assert info.value.reason == RefusalReason.MISMATCH
        want = ("this coordinator runs per-block steps (--per-block); start the worker with "
                "--per-block" if coordinator_per_block else
                "this coordinator runs flat steps; start the worker without --per-block")
        assert info.value.detail == want
        ok = worker(coord, per_block=coordinator_per_block)
        join.join_result()
        ok.join_result().close()
    refused = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert len(refused) == 1 and want in refused[0]


def test_without_a_mode_of_its_own_the_coordinator_holds_workers_to_the_first_ones():
    with Coordinator(ADDR, expect_workers=2, topology="star") as coord:
        first = worker(coord, per_block=True)
        coord.wait_for_workers(count=1, timeout=30)
        join = spawn(lambda: coord.wait_for_workers(timeout=30))
        with pytest.raises(ddpwire.JoinRefusedError) as info:
            Worker.connect(coord.local_addr, timeout=10, per_block=False)
        assert info.value.reason == RefusalReason.MISMATCH
        assert info.value.detail == ("the workers that joined run per-block steps (--per-block); "
                                     "start this worker with --per-block too")
        second = worker(coord, per_block=True)
        join.join_result()
        for t in (first, second):
            t.join_result().close()


@pytest.mark.parametrize("configured", [False, True], ids=["first-worker", "coordinator"])
def test_the_gradient_length_must_agree(caplog, configured):
    """Workers whose models differ are refused at the join, not at step 0:
    the coordinator's own gradient_length, or else the first worker's,
    sets the length every other worker must offer."""
    caplog.set_level(logging.WARNING, logger="ddpwire.coordinator")
    kw = dict(gradient_length=2405) if configured else {}
    with Coordinator(ADDR, expect_workers=2, **kw) as coord:
        first = worker(coord, gradient_length=2405)
        coord.wait_for_workers(count=1, timeout=30)
        join = spawn(lambda: coord.wait_for_workers(timeout=30))
        with pytest.raises(ddpwire.JoinRefusedError) as info:
            Worker.connect(coord.local_addr, timeout=10, gradient_length=21392)
        assert info.value.reason == RefusalReason.MISMATCH
        want = ("this worker's model has 21392 gradient elements, this coordinator's "
                "gradient_length is 2405: every worker must train the model it was set up for"
                if configured else
                "this worker's model has 21392 gradient elements, the others' 2405: every "
                "worker must train the same model")
        assert info.value.detail == want
        second = worker(coord, gradient_length=2405)
        infos = join.join_result()
        assert sorted(i.worker_id for i in infos) == [0, 1]
        for t in (first, second):
            t.join_result().close()
    refused = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert len(refused) == 1 and want in refused[0]


@pytest.mark.parametrize("kind,value", [
    (Extension.SAMPLES, b"abc"), (Extension.PER_BLOCK, b"\x02"),
    (Extension.GRADIENT_LENGTH, b"\x01\x00")], ids=["samples", "per_block", "gradient_length"])
def test_a_malformed_offer_ends_its_own_handshake_not_the_join(kind, value):
    """A value of the wrong size (or a flag other than 0 or 1) is refused as
    a protocol error; the join goes on (it used to end in ProtocolError)."""
    with Coordinator(ADDR, expect_workers=1) as coord:
        bad = connect(coord)
        bad.sendall(encode_frame(ddpwire.JoinRequest(node_id="bad", gpu_count=0, backend="cpu",
                                                     extensions={int(kind): value})))
        good = worker(coord)
        infos = coord.wait_for_workers(timeout=30)
        good.join_result().close()
        refusal = recv_frame(bad)
        assert isinstance(refusal, ddpwire.JoinRefused)
        assert refusal.reason == RefusalReason.PROTOCOL
        assert all(i.node_id != "bad" for i in infos)
    bad.close()


def test_binding_beyond_loopback_without_a_token_warns(caplog):
    caplog.set_level(logging.WARNING, logger="ddpwire.coordinator")
    with Coordinator(("0.0.0.0", 0), expect_workers=1):
        pass
    assert any("without a token" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with Coordinator(("0.0.0.0", 0), expect_workers=1, token="t"):
        pass
    with Coordinator(ADDR, expect_workers=1):
        pass
    assert not any("without a token" in r.getMessage() for r in caplog.records)


def test_the_join_says_every_few_seconds_who_has_joined_and_how_long_is_left(caplog, monkeypatch):
    from ddpwire.session import admission
    monkeypatch.setattr(admission, "PROGRESS_EVERY", 0.2)
    caplog.set_level(logging.INFO, logger="ddpwire.coordinator")
    with Coordinator(ADDR, expect_workers=2) as coord:
        first = worker(coord, node_id="early")
        with pytest.raises(ddpwire.JoinTimeout, match="1 of 2 workers joined within 1 s"):
            coord.wait_for_workers(timeout=1.0)
        first.join_result().close()
    progress = [r.getMessage() for r in caplog.records if "waiting for workers" in r.getMessage()]
    assert any("1 of 2 joined (worker 0 early@127.0.0.1)" in m and "s left" in m for m in progress)


def test_samples_mismatch_reads_the_same_from_either_side():
    from ddpwire.wire.extensions import Extension, encode_u64, samples_mismatch
    offer = {int(Extension.SAMPLES): encode_u64(128)}
    grant = {int(Extension.SAMPLES): encode_u64(256)}
    want = "samples per step differ: coordinator 256, worker 128"
    assert samples_mismatch(256, offer) == want          # the coordinator, reading the offer
    assert samples_mismatch(None, grant, 128) == want    # a worker, reading the grant
    assert samples_mismatch(256, {int(Extension.SAMPLES): encode_u64(0)}) is None
    assert samples_mismatch(None, {int(Extension.SAMPLES): encode_u64(256)}, 256) is None
    assert samples_mismatch(256, {}) is None
