"""The coordinator's join: every handshake at once, each under its own deadline.

A stray, silent, trickling or hostile client must not hold up the real
workers, so the join is one non-blocking loop over the listening socket and
every connection still handshaking:

- each connection has ``handshake_timeout`` from its accept to finish its
  JoinRequest (and, with a token, its AuthProof); bytes trickling in do not
  extend it, and the join as a whole ends at its own deadline;
- nothing is allocated for a frame before its length prefix passed the limit
  of the one message that may come next (64 KiB for a JoinRequest), so a
  client that has not been admitted costs at most that;
- an admitted worker that disconnects before the join completes frees its
  slot (the next worker admitted takes its id);
- once every slot is filled, :class:`Refuser` answers later connections on
  a thread of its own: a ddpwire worker gets JoinRefused saying why, anything
  else is closed; the log names the refused address.
"""
from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple

from . import auth
from ._core import FrameReader, encode_frame, tag_max_payload
from .errors import DdpwireError, JoinTimeout, ProtocolError
from .extensions import Extension, RefusalReason, decode_u64, encode_u64
from .messages import AuthChallenge, AuthProof, JoinAccepted, JoinRefused, JoinRequest
from .sessioninfo import WorkerInfo

__all__ = ["Admitted", "Admission", "Refuser"]

log = logging.getLogger("ddpwire.coordinator")

# Connections handshaking at once; past this a new one is closed unread, so
# a flood of idle clients costs a bounded amount of memory.
MAX_PENDING = 64
PROGRESS_EVERY = 5.0


@dataclass
class Admitted:
    """A worker that completed its handshake: its socket, JoinRequest and
    the extensions granted to it."""

    sock: socket.socket
    address: Tuple[str, int]
    join: JoinRequest
    granted: Dict[int, bytes]
    worker_id: int = -1

    def info(self) -> WorkerInfo:
        return WorkerInfo(worker_id=self.worker_id, node_id=self.join.node_id,
                          gpu_count=self.join.gpu_count, backend=self.join.backend,
                          address=f"{self.address[0]}:{self.address[1]}",
                          extensions=dict(self.granted))


@dataclass
class _Pending:
    sock: socket.socket
    address: Tuple[str, int]
    deadline: float
    reader: FrameReader
    join: Optional[JoinRequest] = None
    coordinator_nonce: bytes = b""
    refusal: Optional[Tuple[int, str]] = None  # set on a Refuser: why it will be refused

    @property
    def name(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"


def _reader_for(tag_type: type, max_frame: int) -> FrameReader:
    """A reader that takes only ``tag_type`` and refuses any longer frame
    than that message's own limit, before allocating."""
    return FrameReader(tag_max_payload(tag_type.TAG, max_frame), allowed_tags=(tag_type.TAG,))


def _send_small(sock: socket.socket, msg: object) -> bool:
    """Send a handshake frame without blocking. These are tens of bytes on a
    fresh connection: one that cannot take them at once is not worth waiting
    for."""
    frame = encode_frame(msg)
    try:
        return sock.send(frame) == len(frame)
    except OSError:
        return False


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


class Admission:
    """Runs the join for a Coordinator (see the module's docstring)."""

    def __init__(self, listener: socket.socket, *, expect_workers: int, token: Optional[bytes],
                 grants: Mapping[int, bytes], samples: Optional[int], handshake_timeout: float,
                 max_frame: int) -> None:
        self.listener = listener
        self.expect_workers = expect_workers
        self.token = token
        self.grants = dict(grants)
        self.samples = samples
        self.handshake_timeout = handshake_timeout
        self.max_frame = max_frame
        self.slots: List[Optional[Admitted]] = [None] * expect_workers
        self.pending: Dict[socket.socket, _Pending] = {}

    # ---- the loop ----

    def run(self, deadline: float, limit: float, until: int) -> List[Admitted]:
        """Admit workers until ``until`` slots are filled; JoinTimeout at
        ``deadline``. The connections still handshaking then stay in
        ``self.pending`` (for a later call, or a Refuser)."""
        sel = selectors.DefaultSelector()
        self.listener.setblocking(False)
        sel.register(self.listener, selectors.EVENT_READ, None)
        for slot in self.slots:
            if slot is not None:
                sel.register(slot.sock, selectors.EVENT_READ, slot)
        for p in self.pending.values():
            sel.register(p.sock, selectors.EVENT_READ, p)
        next_report = time.monotonic() + PROGRESS_EVERY
        try:
            while self._joined() < until:
                now = time.monotonic()
                if now >= deadline:
                    raise JoinTimeout(f"{self._joined()} of {self.expect_workers} workers joined "
                                      f"within {limit:g} s{self._describe_pending()}")
                if now >= next_report:
                    log.info("waiting for workers: %d of %d joined%s; %.0f s left", self._joined(),
                             self.expect_workers, self._describe_joined(), deadline - now)
                    next_report = now + PROGRESS_EVERY
                wake = min([deadline, next_report] + [p.deadline for p in self.pending.values()])
                for key, _ in sel.select(max(0.0, wake - now)):
                    if key.data is None:
                        self._accept(sel)
                    elif isinstance(key.data, Admitted):
                        self._check_alive(sel, key.data)
                    else:
                        self._on_readable(sel, key.data)
                self._expire(sel, time.monotonic())
            # A worker whose own timeout ran out while others were still
            # joining is gone: find it now, not at step 0.
            for slot in list(self.slots):
                if slot is not None and not _alive(slot.sock):
                    self._free(sel, slot, "disconnected")
            if self._joined() < until:
                return self.run(deadline, limit, until)
        finally:
            sel.close()
        return [s for s in self.slots if s is not None]

    def _joined(self) -> int:
        return sum(s is not None for s in self.slots)

    def _describe_joined(self) -> str:
        joined = [f"worker {s.worker_id} {s.join.node_id}@{s.address[0]}" for s in self.slots if s]
        return f" ({', '.join(joined)})" if joined else ""

    def _describe_pending(self) -> str:
        if not self.pending:
            return ""
        return f"; still handshaking: {', '.join(p.name for p in self.pending.values())}"

    # ---- connections ----

    def _accept(self, sel: selectors.BaseSelector) -> None:
        while True:
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("accept failed: %s", exc)
                return
            sock.setblocking(False)
            if len(self.pending) >= MAX_PENDING:
                log.warning("refused a connection from %s:%s: %d connections already handshaking",
                            addr[0], addr[1], MAX_PENDING)
                _close(sock)
                continue
            p = _Pending(sock, addr[:2], time.monotonic() + self.handshake_timeout,
                         _reader_for(JoinRequest, self.max_frame))
            self.pending[sock] = p
            sel.register(sock, selectors.EVENT_READ, p)

    def _drop(self, sel: selectors.BaseSelector, p: _Pending, why: str,
              refusal: Optional[Tuple[int, str]] = None) -> None:
        """End a handshake: a ddpwire worker (one that offered an extension
        block) hears why; anything else is just closed."""
        log.warning("refused a connection from %s: %s", p.name, why)
        if refusal is not None and p.join is not None and p.join.extensions is not None:
            _send_small(p.sock, JoinRefused(reason=int(refusal[0]), detail=refusal[1]))
        self.pending.pop(p.sock, None)
        sel.unregister(p.sock)
        _close(p.sock)

    def _expire(self, sel: selectors.BaseSelector, now: float) -> None:
        for p in [p for p in self.pending.values() if now >= p.deadline]:
            step = "JoinRequest" if p.join is None else "AuthProof"
            self._drop(sel, p, f"no complete {step} within {self.handshake_timeout:g} s")

    def _on_readable(self, sel: selectors.BaseSelector, p: _Pending) -> None:
        try:
            data = p.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop(sel, p, f"connection failed: {exc}")
            return
        if not data:
            self._drop(sel, p, "disconnected during the handshake")
            return
        try:
            messages = p.reader.feed(data)
        except ProtocolError as exc:
            self._drop(sel, p, str(exc), (RefusalReason.PROTOCOL, str(exc)))
            return
        for msg in messages:
            if p.sock not in self.pending:
                return
            if isinstance(msg, JoinRequest):
                self._on_join(sel, p, msg)
            else:
                self._on_proof(sel, p, msg)

    def _on_join(self, sel: selectors.BaseSelector, p: _Pending, join: JoinRequest) -> None:
        p.join = join
        offered = join.extensions or {}
        why = self._mismatch(offered)
        if why is not None:
            self._drop(sel, p, why, (RefusalReason.MISMATCH, why))
            return
        if self.token is None:
            self._admit(sel, p)
            return
        nonce = offered.get(Extension.AUTH)
        if nonce is None:
            self._drop(sel, p, "no token offered (this coordinator requires one)",
                       (RefusalReason.AUTH_REQUIRED, "this coordinator requires a token"))
            return
        if len(nonce) != auth.NONCE_BYTES:
            self._drop(sel, p, f"auth offer of {len(nonce)} bytes, not {auth.NONCE_BYTES}",
                       (RefusalReason.PROTOCOL, "malformed auth offer"))
            return
        p.coordinator_nonce = auth.new_nonce()
        proof = auth.coordinator_proof(self.token, nonce, p.coordinator_nonce)
        if not _send_small(p.sock, AuthChallenge(nonce=p.coordinator_nonce, proof=proof)):
            self._drop(sel, p, "could not send AuthChallenge")
            return
        p.reader = _reader_for(AuthProof, self.max_frame)

    def _mismatch(self, offered: Mapping[int, bytes]) -> Optional[str]:
        value = offered.get(Extension.SAMPLES)
        if value is None or not self.samples:
            return None
        theirs = decode_u64(value)
        if theirs and theirs != self.samples:
            return f"samples per step differ: coordinator {self.samples}, worker {theirs}"
        return None

    def _on_proof(self, sel: selectors.BaseSelector, p: _Pending, msg: AuthProof) -> None:
        assert self.token is not None and p.join is not None
        expected = auth.worker_proof(self.token, p.join.extensions[Extension.AUTH],
                                     p.coordinator_nonce)
        if not auth.proof_matches(expected, bytes(msg.proof)):
            self._drop(sel, p, "wrong token (its proof did not match)",
                       (RefusalReason.AUTH_FAILED, "authentication failed"))
            return
        self._admit(sel, p)

    def _admit(self, sel: selectors.BaseSelector, p: _Pending) -> None:
        assert p.join is not None
        worker_id = self.slots.index(None)
        offered = p.join.extensions
        granted: Dict[int, bytes] = {}
        if offered is not None:
            for kind, value in self.grants.items():
                if kind in offered:
                    granted[kind] = value
            if self.token is not None:
                granted[Extension.AUTH] = b""
            if Extension.SAMPLES in offered:
                granted[Extension.SAMPLES] = encode_u64(self.samples or 0)
        reply = JoinAccepted(worker_id=worker_id, total_workers=self.expect_workers,
                             extensions=granted if offered is not None else None)
        if not _send_small(p.sock, reply):
            self._drop(sel, p, "could not send JoinAccepted")
            return
        del self.pending[p.sock]
        admitted = Admitted(p.sock, p.address, p.join, granted, worker_id)
        sel.modify(p.sock, selectors.EVENT_READ, admitted)
        self.slots[worker_id] = admitted
        log.info("worker %d joined: %s (%s, %d GPU) from %s", worker_id, p.join.node_id,
                 p.join.backend, p.join.gpu_count, p.name)

    def _check_alive(self, sel: selectors.BaseSelector, a: Admitted) -> None:
        if _alive(a.sock):
            # bytes are waiting (a Heartbeat): it is alive, and the session
            # reads them; stop watching so the loop does not spin on them
            sel.unregister(a.sock)
            return
        self._free(sel, a, "disconnected")

    def _free(self, sel: selectors.BaseSelector, a: Admitted, why: str) -> None:
        log.warning("worker %d (%s@%s:%s) %s before the join completed: its slot is free again",
                    a.worker_id, a.join.node_id, a.address[0], a.address[1], why)
        self.slots[a.worker_id] = None
        try:
            sel.unregister(a.sock)
        except (KeyError, ValueError):
            pass
        _close(a.sock)


def _alive(sock: socket.socket) -> bool:
    """False when the peer has closed (or reset) the connection; True while
    it is open, with or without bytes waiting."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except (BlockingIOError, InterruptedError):
        return True
    except OSError:
        return False


class Refuser:
    """After the join: refuses every connection on a thread of its own, so a
    late or surplus worker learns at once that it cannot join."""

    def __init__(self, listener: socket.socket, pending: Mapping[socket.socket, _Pending], *,
                 detail: str, handshake_timeout: float, max_frame: int) -> None:
        self.listener = listener
        self.detail = detail
        self.handshake_timeout = handshake_timeout
        self.max_frame = max_frame
        self.pending: Dict[socket.socket, _Pending] = dict(pending)
        for p in self.pending.values():
            p.refusal = (RefusalReason.FULL, "every worker slot is taken")
        self._stop = threading.Event()
        # those already past their JoinRequest hear at once
        for p in [p for p in self.pending.values() if p.join is not None]:
            self._refuse(None, p, "every worker slot is taken")
        self._thread = threading.Thread(target=self._run, name="ddpwire-refuser", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread and close what it still holds (not the listener)."""
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        try:
            sel.register(self.listener, selectors.EVENT_READ, None)
            for p in self.pending.values():
                sel.register(p.sock, selectors.EVENT_READ, p)
            while not self._stop.is_set():
                for key, _ in sel.select(0.2):
                    if key.data is None:
                        self._accept(sel)
                    else:
                        self._on_readable(sel, key.data)
                now = time.monotonic()
                for p in [p for p in self.pending.values() if now >= p.deadline]:
                    self._refuse(sel, p, "no JoinRequest within the handshake timeout")
        except (OSError, ValueError) as exc:  # the listener was closed under us
            log.debug("refuser stopped: %s", exc)
        finally:
            for p in list(self.pending.values()):
                _close(p.sock)
            sel.close()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        while True:
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            sock.setblocking(False)
            if len(self.pending) >= MAX_PENDING:
                log.warning("refused a connection from %s:%s: training (%s)", addr[0], addr[1],
                            self.detail)
                _close(sock)
                continue
            p = _Pending(sock, addr[:2], time.monotonic() + self.handshake_timeout,
                         _reader_for(JoinRequest, self.max_frame),
                         refusal=(RefusalReason.TRAINING, self.detail))
            self.pending[sock] = p
            sel.register(sock, selectors.EVENT_READ, p)

    def _on_readable(self, sel: selectors.BaseSelector, p: _Pending) -> None:
        try:
            data = p.sock.recv(4096)
            messages = p.reader.feed(data) if data else []
        except (BlockingIOError, InterruptedError):
            return
        except (OSError, DdpwireError) as exc:
            self._refuse(sel, p, str(exc))
            return
        if not data:
            self._refuse(sel, p, "disconnected")
            return
        for msg in messages:
            if isinstance(msg, JoinRequest):
                p.join = msg
            self._refuse(sel, p, p.refusal[1] if p.refusal else self.detail)
            return

    def _refuse(self, sel: Optional[selectors.BaseSelector], p: _Pending, why: str) -> None:
        log.warning("refused a connection from %s: %s", p.name, why)
        if p.join is not None and p.join.extensions is not None and p.refusal is not None:
            _send_small(p.sock, JoinRefused(reason=int(p.refusal[0]), detail=p.refusal[1]))
        self.pending.pop(p.sock, None)
        if sel is not None:
            try:
                sel.unregister(p.sock)
            except (KeyError, ValueError):
                pass
        _close(p.sock)
