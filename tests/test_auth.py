"""Token authentication at the join, with real sockets: both sides prove the
token, nobody without it takes a slot, a replayed handshake fails, and a fake
coordinator that cannot prove the token learns nothing."""
from __future__ import annotations

import logging
import os
import socket
import time

import numpy as np
import pytest

import ddpwire
from ddpwire import Coordinator, Worker, encode_frame
from ddpwire.wire import auth
from ddpwire.wire.extensions import Extension, RefusalReason

from session_helpers import recv_frame, spawn

ADDR = ("127.0.0.1", 0)
TOKEN = "correct horse battery staple"


def worker(coord, **kw):
    return spawn(lambda: Worker.connect(coord.local_addr, 0, "cpu", timeout=10, **kw))


def logged(caplog, text: str, within: float = 10.0) -> str:
    """The first coordinator log line holding ``text``, waiting for it: the
    coordinator's loop runs on another thread."""
    deadline = time.monotonic() + within
    while True:
        for record in list(caplog.records):
            if text in record.getMessage():
                return record.getMessage()
        assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
        time.sleep(0.01)


def raw_offer(coord, nonce: bytes) -> socket.socket:
    """A bare socket that offers the token handshake with ``nonce``."""
    sock = socket.create_connection(coord.local_addr, timeout=10)
    sock.sendall(encode_frame(ddpwire.JoinRequest(node_id="raw", gpu_count=0, backend="cpu",
                                                  extensions={int(Extension.AUTH): nonce})))
    return sock


def test_workers_with_the_token_join_and_train():
    with Coordinator(ADDR, expect_workers=2, token=TOKEN, topology="star") as coord:
        threads = [worker(coord, token=TOKEN), worker(coord, token=TOKEN.encode())]
        infos = coord.wait_for_workers()
        workers = [t.join_result() for t in threads]
        assert all(Extension.AUTH in i.extensions for i in infos)
        assert all(Extension.AUTH in w.extensions for w in workers)
        coord.set_total_samples(4)
        coord.send_shard_assignments(0)
        runs = [spawn(lambda w=w: (w.receive_shard(),
                                   w.allreduce(0, np.full(5, w.worker_id, np.float32), 1.0, 1, 2)))
                for w in workers]
        result = coord.allreduce(0)
        for r in runs:
            _, avg = r.join_result()
            assert np.array_equal(avg.gradients, np.full(5, 0.5, np.float32))
        assert np.array_equal(result.avg_gradients, np.full(5, 0.5, np.float32))
        for w in workers:
            w.close()


def test_a_worker_without_the_token_is_refused_before_it_takes_a_slot():
    with Coordinator(ADDR, expect_workers=1, token=TOKEN) as coord:
        join = spawn(coord.wait_for_workers)
        with pytest.raises(ddpwire.AuthenticationFailed) as info:
            Worker.connect(coord.local_addr, timeout=10)
        assert info.value.reason == RefusalReason.AUTH_REQUIRED
        # what to do, in the words of the command and of the environment
        assert "requires a token and this worker has none" in str(info.value)
        assert "--token-file" in str(info.value) and "DDPWIRE_TOKEN" in str(info.value)
        good = worker(coord, token=TOKEN)
        infos = join.join_result()
        assert [i.worker_id for i in infos] == [0]
        good.join_result().close()


def test_a_peer_without_an_offer_is_closed_without_an_extension_byte():
    """A reference worker (no extension block) gets no JoinRefused: only a close."""
    with Coordinator(ADDR, expect_workers=1, token=TOKEN) as coord:
        join = spawn(coord.wait_for_workers)
        plain = socket.create_connection(coord.local_addr, timeout=10)
        plain.sendall(encode_frame(ddpwire.JoinRequest(node_id="ref", gpu_count=0, backend="cpu")))
        assert plain.recv(4096) == b""
        plain.close()
        good = worker(coord, token=TOKEN)
        join.join_result()
        good.join_result().close()


def test_a_wrong_token_fails_on_the_worker_first(caplog):
    """The coordinator proves the token first: a worker with another token
    finds out, and sends no proof of its own. Each side says what happened
    and what to check: the worker gave up, the coordinator refused nothing."""
    caplog.set_level(logging.WARNING, logger="ddpwire.coordinator")
    with Coordinator(ADDR, expect_workers=1, token=TOKEN) as coord:
        join = spawn(coord.wait_for_workers)
        host, port = coord.local_addr
        with pytest.raises(ddpwire.AuthenticationFailed) as info:
            Worker.connect(coord.local_addr, timeout=10, token="wrong")
        text = str(info.value)
        assert info.value.reason == RefusalReason.AUTH_FAILED
        assert f"the coordinator at {host}:{port} does not know this worker's token" in text
        assert "the tokens differ" in text and "DDPWIRE_TOKEN" in text and "--token-file" in text
        assert "refused" not in text
        said = logged(caplog, "gave up the handshake")
        assert said.startswith("worker from 127.0.0.1:")
        assert "its token differs from this coordinator's" in said
        assert not any("disconnected during the handshake" in r.getMessage()
                       for r in caplog.records)
        good = worker(coord, token=TOKEN)
        join.join_result()
        good.join_result().close()


def test_a_worker_with_a_token_is_refused_by_a_coordinator_without_one(caplog):
    """A coordinator without a token cannot prove one: it refuses a worker
    that offers one, before it takes a slot, and both sides say which token
    to add or drop."""
    caplog.set_level(logging.INFO, logger="ddpwire.coordinator")
    with Coordinator(ADDR, expect_workers=1) as coord:
        join = spawn(coord.wait_for_workers)
        with pytest.raises(ddpwire.AuthenticationFailed) as info:
            Worker.connect(coord.local_addr, timeout=10, token=TOKEN)
        assert info.value.reason == RefusalReason.AUTH_FAILED
        assert "has no token" in str(info.value)
        assert "start it with the same token" in str(info.value)
        assert "drop the token from the worker" in str(info.value)
        plain = worker(coord)  # the slot is still free
        assert [i.worker_id for i in join.join_result()] == [0]
        plain.join_result().close()
    lines = [r.getMessage() for r in caplog.records]
    refused = [m for m in lines if m.startswith("refused a connection from 127.0.0.1:")]
    assert len(refused) == 1 and "offered a token, and this coordinator has none" in refused[0]
    assert sum(" joined: " in m for m in lines) == 1, lines
    assert not any("before the join completed" in m for m in lines), lines


def test_a_wrong_proof_is_refused_by_the_coordinator():
    with Coordinator(ADDR, expect_workers=1, token=TOKEN) as coord:
        join = spawn(coord.wait_for_workers)
        sock = raw_offer(coord, os.urandom(32))
        challenge = recv_frame(sock)
        assert isinstance(challenge, ddpwire.AuthChallenge)
        sock.sendall(encode_frame(ddpwire.AuthProof(proof=os.urandom(32))))
        refusal = recv_frame(sock)
        assert isinstance(refusal, ddpwire.JoinRefused)
        assert refusal.reason == RefusalReason.AUTH_FAILED
        assert sock.recv(1) == b""
        sock.close()
        good = worker(coord, token=TOKEN)
        assert [i.worker_id for i in join.join_result()] == [0]
        good.join_result().close()


def test_a_replayed_handshake_fails():
    """A recorded JoinRequest and AuthProof, replayed on a new connection, do
    not join: the coordinator's nonce is new, so the old proof is wrong."""
    token = TOKEN.encode()
    nonce = os.urandom(32)
    with Coordinator(ADDR, expect_workers=2, token=TOKEN, topology="star") as coord:
        join = spawn(coord.wait_for_workers)
        first = raw_offer(coord, nonce)
        challenge = recv_frame(first)
        assert auth.proof_matches(auth.coordinator_proof(token, nonce, challenge.nonce),
                                  challenge.proof)
        recorded = encode_frame(ddpwire.AuthProof(
            proof=auth.worker_proof(token, nonce, challenge.nonce)))
        first.sendall(recorded)
        accepted = recv_frame(first)
        assert isinstance(accepted, ddpwire.JoinAccepted) and accepted.worker_id == 0

        replay = raw_offer(coord, nonce)
        second = recv_frame(replay)
        assert isinstance(second, ddpwire.AuthChallenge) and second.nonce != challenge.nonce
        replay.sendall(recorded)
        refusal = recv_frame(replay)
        assert isinstance(refusal, ddpwire.JoinRefused)
        assert refusal.reason == RefusalReason.AUTH_FAILED
        replay.close()
        good = worker(coord, token=TOKEN)
        assert sorted(i.worker_id for i in join.join_result()) == [0, 1]
        good.join_result().close()
        first.close()


def fake_coordinator(answer):
    """A listening socket that reads one JoinRequest, sends answer(request)
    and then records whatever else the worker sends."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def run():
        conn, _ = lsock.accept()
        with conn:
            conn.settimeout(10)
            request = recv_frame(conn)
            conn.sendall(encode_frame(answer(request)))
            rest = b""
            while True:
                data = conn.recv(4096)
                if not data:
                    return request, rest
                rest += data
    return lsock, spawn(run)


def test_a_fake_coordinator_that_cannot_prove_the_token_learns_nothing():
    lsock, t = fake_coordinator(lambda req: ddpwire.AuthChallenge(nonce=os.urandom(32),
                                                                  proof=os.urandom(32)))
    with pytest.raises(ddpwire.AuthenticationFailed, match="does not know this worker's token"):
        Worker.connect(lsock.getsockname(), timeout=10, token=TOKEN)
    request, rest = t.join_result()
    lsock.close()
    assert Extension.AUTH in request.extensions
    assert rest == b""  # no AuthProof went out
    assert TOKEN.encode() not in encode_frame(request)


def test_a_coordinator_that_skips_the_challenge_is_refused_by_a_worker_with_a_token():
    """The reference coordinator (or an older ddpwire one) has no token and
    admits anyone: the worker gives up, and says it did and why."""
    lsock, t = fake_coordinator(lambda req: ddpwire.JoinAccepted(worker_id=0, total_workers=1))
    host, port = lsock.getsockname()
    with pytest.raises(ddpwire.AuthenticationFailed) as info:
        Worker.connect(lsock.getsockname(), timeout=10, token=TOKEN)
    text = str(info.value)
    assert text.startswith(f"the coordinator at {host}:{port} admitted this worker without "
                           f"proving it knows the token: it has no token configured")
    assert "start it with the same token, or drop the token from this worker" in text
    assert "refused" not in text
    t.join_result()
    lsock.close()


def test_without_a_token_a_worker_joins_a_reference_style_coordinator():
    """The reference coordinator ignores the offer and answers a plain
    JoinAccepted: a ddpwire worker without a token joins it."""
    lsock, t = fake_coordinator(lambda req: ddpwire.JoinAccepted(worker_id=0, total_workers=1))
    w = Worker.connect(lsock.getsockname(), timeout=10)
    assert (w.worker_id, w.total_workers, w.extensions) == (0, 1, {})
    w.close()
    t.join_result()
    lsock.close()


def test_tokens_come_from_a_file_or_the_environment(tmp_path):
    path = tmp_path / "token"
    path.write_bytes(b"  from-a-file\n")
    assert auth.load_token(str(path)) == b"from-a-file"
    assert auth.load_token(None, {"DDPWIRE_TOKEN": "from-env"}) == b"from-env"
    assert auth.load_token(None, {}) is None
    (tmp_path / "empty").write_bytes(b"\n")
    with pytest.raises(ValueError, match="empty"):
        auth.load_token(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="empty"):
        Coordinator(ADDR, token="")
