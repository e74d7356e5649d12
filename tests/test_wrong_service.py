"""A wrong address that reaches another service (issue 41): a worker pointed
at an SSH, HTTP, TLS, SMTP or Redis port says which service answered
(NotACoordinator), never "frame too large"; one that accepts and stays
silent is given up at the join's deadline, saying so; a coordinator logs a
stranger (curl, an SSH client, a TLS ClientHello) in one line naming its
protocol, and goes on waiting for its workers."""
from __future__ import annotations

import importlib.util
import logging
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, List

import pytest

import ddpwire
from ddpwire import Coordinator, NotACoordinator, Worker, encode_frame
from ddpwire.wire import auth
from ddpwire.wire.extensions import Extension, RefusalReason
from ddpwire.session.join import _could_begin_a_frame

from session_helpers import recv_frame
from test_join_hostile import connect, garbage_before_a_worker, peer_closed, worker

ADDR = ("127.0.0.1", 0)

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="the worker command needs torch")


class FakeServer:
    """A listener on 127.0.0.1 whose every connection is handled by
    ``behave(conn)`` on a thread of its own; the connections stay open
    until :meth:`close` (a silent server must not close them)."""

    def __init__(self, behave: Callable[[socket.socket], None]) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.addr = self.listener.getsockname()[:2]
        self.behave = behave
        self.conns: List[socket.socket] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self.behave(conn)
        except OSError:
            pass

    def close(self) -> None:
        self.stop.set()
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() (Linux)
        except OSError:
            pass
        self.listener.close()
        self.thread.join(5)
        for c in self.conns:
            c.close()

    def __enter__(self) -> "FakeServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- servers that are not coordinators ----

def ssh_server(conn: socket.socket) -> None:
    """An SSH server speaks first: its banner, on accept."""
    conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
    conn.recv(4096)
    conn.sendall(b"Invalid SSH identification string.\r\n")


def http_server(conn: socket.socket) -> None:
    """An HTTP server waits for a request: the worker's JoinRequest is one
    it cannot parse, and it says so."""
    conn.recv(4096)
    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\n"
                 b"Content-Length: 11\r\nConnection: close\r\n\r\nBad Request")


def tls_server(conn: socket.socket) -> None:
    """A TLS server takes the JoinRequest for a broken record: a fatal alert."""
    conn.recv(4096)
    conn.sendall(bytes([0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x32]))


def smtp_server(conn: socket.socket) -> None:
    conn.sendall(b"220 mail.example.com ESMTP Postfix\r\n")
    conn.recv(4096)


def redis_server(conn: socket.socket) -> None:
    conn.recv(4096)
    conn.sendall(b"-ERR Protocol error: invalid multibulk length\r\n")


def binary_server(conn: socket.socket) -> None:
    """Bytes of no protocol known, whose length prefix is 64 KiB + 1."""
    conn.recv(4096)
    conn.sendall(b"\x00\x01\x00\x01\x07\x08\x09")


def silent_server(conn: socket.socket) -> None:
    """Accepts, reads the JoinRequest, never answers."""
    conn.recv(4096)


@pytest.mark.parametrize("behave, service, shown", [
    (ssh_server, "SSH", "'SSH-2.0-OpenSSH_9.6'"),
    (http_server, "HTTP", "'HTTP/1.1 400 Bad Request'"),
    (tls_server, "TLS", "15 03 03 00 02 02 32"),
    (smtp_server, "SMTP", "'220 mail.example.com ESMTP Postfix'"),
    (redis_server, "Redis", "'-ERR Protocol error: invalid multibulk length'"),
], ids=["ssh", "http", "tls", "smtp", "redis"])
def test_a_worker_at_another_service_says_which(behave, service, shown):
    with FakeServer(behave) as srv:
        with pytest.raises(NotACoordinator) as info:
            Worker.connect(srv.addr, timeout=10)
    host, port = srv.addr
    exc = info.value
    assert isinstance(exc, ddpwire.ProtocolError) and not isinstance(exc, ddpwire.FrameTooLarge)
    assert exc.service == service and exc.address == f"{host}:{port}"
    assert str(exc) == (f"{host}:{port} is not a ddpwire coordinator "
                        f"(it answered like {service}: {shown})")
    assert "frame too large" not in str(exc)


def test_bytes_of_no_known_protocol_are_shown_short_and_printable():
    with FakeServer(binary_server) as srv:
        with pytest.raises(NotACoordinator) as info:
            Worker.connect(srv.addr, timeout=10)
    assert info.value.service is None
    assert str(info.value).endswith("(it sent bytes that are not a ddpwire frame: "
                                    "00 01 00 01 07 08 09)")
    text = NotACoordinator("h:1", b"\x01" * 64).args[0]
    assert text.isprintable() and len(text) < 130 and text.endswith("01 01 ...)")
    text = NotACoordinator("h:1", b"x" * 64).args[0]
    assert text.isprintable() and "'" + "x" * 60 + "...'" in text


def test_a_silent_server_is_given_up_at_the_timeout_saying_so():
    with FakeServer(silent_server) as srv:
        with pytest.raises(ddpwire.CoordinatorLost) as info:
            Worker.connect(srv.addr, timeout=1)
    host, port = srv.addr
    assert str(info.value) == (f"{host}:{port} accepted the connection but sent nothing "
                               f"within 1 s: is it a ddpwire coordinator?")


@pytest.mark.parametrize("connecting, shown", [(0.01, "3"), (0.14, "3"), (1.5, "1.5")])
def test_the_silence_is_reported_as_the_timeout_unless_connecting_took_a_visible_part(
        connecting, shown):
    # the answer's window is what the timeout left after connecting: a busy
    # machine's few milliseconds still read as the user's 3 s (the deadline
    # is already past, so nothing waits)
    from ddpwire.session.join import _await_first_bytes

    a, b = socket.socketpair()
    with a, b:
        now = time.monotonic()
        with pytest.raises(ddpwire.CoordinatorLost) as info:
            _await_first_bytes(a, now, "h:1", now - (3.0 - connecting), 3.0)
    assert f"sent nothing within {shown} s:" in str(info.value)


def test_only_a_length_over_every_first_frames_limit_is_another_protocol():
    """The first frame of a coordinator is at most 64 KiB: a length prefix up
    to that is left to the frame reader, whatever follows; one byte more,
    or any first byte but zero, is another protocol's."""
    assert _could_begin_a_frame((65536).to_bytes(4, "big") + b"\x02") is True
    assert _could_begin_a_frame((65537).to_bytes(4, "big")) is False
    assert _could_begin_a_frame(b"\x01") is False
    assert _could_begin_a_frame(b"\x00\x00") is None
    assert _could_begin_a_frame(b"") is None
    for msg in (ddpwire.JoinAccepted(worker_id=0, total_workers=1, extensions={}),
                ddpwire.JoinRefused(reason=1, detail="x" * 60000),
                ddpwire.AuthChallenge(nonce=b"\x00" * 32, proof=b"\x00" * 32),
                ddpwire.Heartbeat(node_id="c", timestamp_ms=2 ** 63)):
        assert _could_begin_a_frame(encode_frame(msg)) is True


def fake_coordinator(answer: Callable[[socket.socket], None]) -> FakeServer:
    def behave(conn: socket.socket) -> None:
        recv_frame(conn)
        answer(conn)
    return FakeServer(behave)


def trickled(frame: bytes) -> Callable[[socket.socket], None]:
    def send(conn: socket.socket) -> None:
        for i in range(len(frame)):
            conn.sendall(frame[i:i + 1])
            time.sleep(0.02)
    return send


def test_a_coordinators_answer_trickling_in_byte_by_byte_is_read_as_ever():
    heartbeat = encode_frame(ddpwire.Heartbeat(node_id="c", timestamp_ms=1))
    accepted = encode_frame(ddpwire.JoinAccepted(worker_id=0, total_workers=1))
    with fake_coordinator(trickled(heartbeat + accepted)) as srv:
        w = Worker.connect(srv.addr, timeout=10, mesh=False)
        assert (w.worker_id, w.total_workers) == (0, 1)
        w.close()
    refused = encode_frame(ddpwire.JoinRefused(reason=RefusalReason.FULL, detail="full"))
    with fake_coordinator(trickled(refused)) as srv:
        with pytest.raises(ddpwire.JoinRefusedError, match="full"):
            Worker.connect(srv.addr, timeout=10, mesh=False)


def test_a_frame_of_the_protocol_is_still_its_own_error():
    """A ddpwire-sized frame with a tag nobody expects is the frame reader's
    error, as before: never taken for another service."""
    with fake_coordinator(lambda c: c.sendall(b"\x00\x00\x00\x05\xee\x01\x02\x03\x04")) as srv:
        with pytest.raises(ddpwire.ProtocolError) as info:
            Worker.connect(srv.addr, timeout=10, mesh=False)
    assert not isinstance(info.value, NotACoordinator)
    assert "0xee" in str(info.value)


def test_the_token_handshake_shares_the_joins_deadline():
    """A coordinator that proves the token and then never answers the
    worker's proof: the wait for its answer is the rest of the join's
    deadline, not a timeout of its own (the error names the deadline)."""
    token = b"t" * 32

    def behave(conn: socket.socket) -> None:
        # the JoinRequest carries the worker's nonce (and its seal key
        # share, which the proof covers): the proof is made with them
        offer = recv_frame(conn).extensions
        nonce = bytes(offer[Extension.AUTH])
        ours = auth.new_nonce()
        conn.sendall(encode_frame(ddpwire.AuthChallenge(
            nonce=ours, proof=auth.coordinator_proof(token, nonce, ours,
                                                     bytes(offer.get(Extension.SEAL, b""))))))
        conn.recv(4096)  # the worker's proof; no answer
    with FakeServer(behave) as srv:
        with pytest.raises(ddpwire.CoordinatorLost, match="past the deadline while waiting for "
                                                          "JoinAccepted or JoinRefused"):
            Worker.connect(srv.addr, timeout=1, token=token, mesh=False)


# ---- the command ----

def worker_command(port: int, timeout: str = "3") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddpwire", "worker", "--connect",
                           f"127.0.0.1:{port}", "--timeout", timeout],
                          capture_output=True, text=True, timeout=120)


@needs_torch
@pytest.mark.parametrize("server,says", [
    (ssh_server, "is not a ddpwire coordinator (it answered like SSH: 'SSH-2.0-OpenSSH_9.6')"),
    (silent_server, "accepted the connection but sent nothing within 3 s: is it a ddpwire "
                    "coordinator?"),
], ids=["ssh", "silent"])
def test_the_worker_command_at_another_service_is_one_clear_line(server, says):
    with FakeServer(server) as srv:
        proc = worker_command(srv.addr[1])
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"ddpwire: error: 127.0.0.1:{srv.addr[1]} {says}"
    assert "frame too large" not in proc.stderr


# ---- the coordinator's side ----

STRANGERS = [
    (b"GET / HTTP/1.1\r\nHost: x\r\nUser-Agent: curl/8.5.0\r\nAccept: */*\r\n\r\n", "spoke HTTP"),
    (b"SSH-2.0-x\r\n", "spoke SSH"),
    # a TLS 1.2 ClientHello's first bytes
    (bytes([0x16, 0x03, 0x01, 0x00, 0xF1, 0x01, 0x00, 0x00, 0xED, 0x03, 0x03]) + b"\x00" * 32,
     "spoke TLS"),
    (b"hello\n", "sent 'hello'"),
]


def stranger_lines(caplog) -> List[logging.LogRecord]:
    return [r for r in caplog.records if "not ddpwire" in r.getMessage()]


def test_strangers_are_logged_in_one_line_by_protocol_and_the_join_goes_on(caplog):
    caplog.set_level(logging.INFO, logger="ddpwire.coordinator")
    with Coordinator(ADDR, expect_workers=1) as coord:
        strangers = []
        for data, _ in STRANGERS:
            s = connect(coord)
            s.sendall(data)
            strangers.append(s)
        w = worker(coord)
        infos = coord.wait_for_workers()
        assert [i.worker_id for i in infos] == [0]
        for s in strangers:
            s.settimeout(10)
            assert s.recv(4096) == b""  # closed, unanswered
        w.join_result().close()
    lines = stranger_lines(caplog)
    for s, (_, said) in zip(strangers, STRANGERS):
        port = s.getsockname()[1]
        s.close()
        mine = [r for r in lines if f"127.0.0.1:{port} " in r.getMessage()]
        assert [r.getMessage() for r in mine] == [
            f"a connection from 127.0.0.1:{port} {said}, not ddpwire: closed"]
        assert mine[0].levelno == logging.WARNING and mine[0].exc_info is None
    assert not any("frame too large" in r.getMessage() for r in caplog.records)


def test_a_stranger_after_the_join_is_logged_the_same(caplog):
    caplog.set_level(logging.WARNING, logger="ddpwire.coordinator")
    with Coordinator(ADDR, expect_workers=1) as coord:
        w = worker(coord)
        coord.wait_for_workers()
        joined = w.join_result()
        curl = connect(coord)
        curl.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert peer_closed(curl)
        port = curl.getsockname()[1]
        deadline = time.monotonic() + 10
        while not stranger_lines(caplog) and time.monotonic() < deadline:
            time.sleep(0.01)
        joined.close()
    curl.close()
    assert [r.getMessage() for r in stranger_lines(caplog)] == [
        f"a connection from 127.0.0.1:{port} spoke HTTP, not ddpwire: closed"]


def test_binary_garbage_keeps_its_frame_error(caplog):
    """Bytes of no protocol known are still refused with the frame reader's
    words (tests/test_join_hostile.py checks them): only a protocol named,
    or text, is logged as a stranger."""
    caplog.set_level(logging.WARNING, logger="ddpwire.coordinator")
    port = garbage_before_a_worker(b"\x01\x02\x03\x04\x05")
    assert not stranger_lines(caplog)
    refused = [r.getMessage() for r in caplog.records if f"127.0.0.1:{port}" in r.getMessage()]
    assert refused == [f"refused a connection from 127.0.0.1:{port}: frame too large: "
                       f"16909060 bytes (limit 65536)"]
