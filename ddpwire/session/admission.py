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
- a handshake that completes when no slot is free (several may complete in
  one pass of the loop) is refused as full right there;
- once every slot is filled, :class:`Refuser` answers later connections on
  a thread of its own: a ddpwire worker gets JoinRefused saying why, anything
  else is closed; the log names the refused address;
- a client of another protocol (curl, an SSH client, a TLS ClientHello, a
  port scanner's probe) is closed unanswered, logged in one line that names
  the protocol its first bytes are, not the frame they do not make.
"""
from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from ..wire import auth, seal
from .._core import FrameReader, encode_frame, tag_max_payload
from .._text import counted
from ..wire.channel import MAX_PENDING, still_open
from ..wire.errors import JoinTimeout, NotACoordinator, ProtocolError
from ..wire.extensions import (Extension, RefusalReason, decode_u64, encode_u64, samples_mismatch,
                         steps_mismatch)
from ..wire.messages import AuthChallenge, AuthProof, JoinAccepted, JoinRefused, JoinRequest
from .sessioninfo import WorkerInfo

__all__ = ["Admitted", "Admission", "Refuser"]

log = logging.getLogger("ddpwire.coordinator")

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
    #: (send, receive) keys of its sealed link (ddpwire.wire.seal), None: in the clear
    keys: Optional[Tuple[bytes, bytes]] = None

    def name(self) -> str:
        """The worker as a user knows it: its node id at its host."""
        return f"{self.join.node_id}@{self.address[0]}"

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
    share: Optional[seal.KeyShare] = None  # our half of its link's key exchange
    refusal: Optional[Tuple[int, str]] = None  # set on a Refuser: why it will be refused
    head: bytes = b""  # its first bytes (NotACoordinator.HEAD_BYTES at most)

    @property
    def name(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"


def _reader_for(tag_type: type, max_frame: int) -> FrameReader:
    """A reader that takes only ``tag_type`` and refuses any longer frame
    than that message's own limit, before allocating."""
    return FrameReader(tag_max_payload(tag_type.TAG, max_frame), allowed_tags=(tag_type.TAG,))


def _stranger(p: _Pending) -> Optional[str]:
    """What a connection whose first bytes are no JoinRequest sent, where
    they are another protocol's ("spoke HTTP") or text ("sent 'hello'"); None
    for binary bytes of no protocol known (the frame error says more)."""
    service = NotACoordinator.service_of(p.head)
    if service is not None:
        return f"spoke {service}"
    if len(p.head) >= 4 and all(32 <= b < 127 or b in (9, 10, 13) for b in p.head[:4]):
        return f"sent {NotACoordinator.shown(p.head)}"
    return None


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


class _Handshakes:
    """Connections not yet admitted, in one selector: accepted up to
    MAX_PENDING, read into each one's bounded FrameReader, ended at their
    deadline. The join and the refuser differ only in what they answer."""

    def __init__(self, listener: socket.socket, handshake_timeout: float, max_frame: int) -> None:
        self.listener = listener
        self.handshake_timeout = handshake_timeout
        self.max_frame = max_frame
        self.pending: Dict[socket.socket, _Pending] = {}

    def accept(self, sel: selectors.BaseSelector,
               refusal: Optional[Tuple[int, str]] = None) -> None:
        """Take every connection waiting on the listener."""
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
                         _reader_for(JoinRequest, self.max_frame), refusal=refusal)
            self.pending[sock] = p
            sel.register(sock, selectors.EVENT_READ, p)

    def read(self, sel: selectors.BaseSelector, p: _Pending) -> list:
        """The messages that the bytes now waiting complete; a connection
        that closed, failed or sent bytes that are not the message expected
        is ended here (and gives no messages)."""
        try:
            data = p.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError as exc:
            self.end(sel, p, f"connection failed: {exc}")
            return []
        if not data:
            if p.coordinator_nonce:
                # a worker checks our proof before it sends its own, and
                # closes without a word when it does not match
                log.warning("worker from %s gave up the handshake after this coordinator's "
                            "AuthChallenge: its token differs from this coordinator's (check "
                            "%s or --token-file on both sides)", p.name, auth.TOKEN_ENV)
                self.drop(sel, p)
            else:
                self.end(sel, p, "disconnected during the handshake")
            return []
        keep = NotACoordinator.HEAD_BYTES - len(p.head)
        if keep > 0:
            p.head += data[:keep]
        try:
            return p.reader.feed(data)
        except ProtocolError as exc:
            stranger = _stranger(p) if p.join is None else None
            if stranger is not None:
                log.warning("a connection from %s %s, not ddpwire: closed", p.name, stranger)
                self.drop(sel, p)
            else:
                self.end(sel, p, str(exc), (RefusalReason.PROTOCOL, str(exc)))
            return []

    def end(self, sel: Optional[selectors.BaseSelector], p: _Pending, why: str,
            refusal: Optional[Tuple[int, str]] = None) -> None:
        """End a handshake, logged by address: a ddpwire worker (one that
        offered an extension block) hears why; anything else is just closed."""
        log.warning("refused a connection from %s: %s", p.name, why)
        refusal = refusal or p.refusal
        if refusal is not None and p.join is not None and p.join.extensions is not None:
            _send_small(p.sock, JoinRefused(reason=int(refusal[0]), detail=refusal[1]))
        self.drop(sel, p)

    def drop(self, sel: Optional[selectors.BaseSelector], p: _Pending) -> None:
        """Forget and close a handshake, saying nothing."""
        self.pending.pop(p.sock, None)
        if sel is not None:
            try:
                sel.unregister(p.sock)
            except (KeyError, ValueError):
                pass
        _close(p.sock)

    def expire(self, sel: selectors.BaseSelector, now: float) -> None:
        for p in [p for p in self.pending.values() if now >= p.deadline]:
            step = "JoinRequest" if p.join is None else "AuthProof"
            self.end(sel, p, f"no complete {step} within {self.handshake_timeout:g} s")

    def next_deadline(self, default: float) -> float:
        return min([default] + [p.deadline for p in self.pending.values()])

    def close_all(self) -> None:
        for p in list(self.pending.values()):
            _close(p.sock)
        self.pending.clear()


#: why a coordinator with require_encryption refuses a worker in the clear
_NOT_SEALED = ("this coordinator requires encryption (--require-encryption) and this worker "
               "cannot seal its link: give it the token and leave its encryption on")

#: why an elastic session refuses a worker that cannot redo a step
_NOT_ELASTIC = ("this coordinator goes on without a worker it loses (--elastic): every worker "
                "must be able to compute a step again (a ddpwire worker; the reference cannot)")


class Admission:
    """Runs the join for a Coordinator (see the module's docstring)."""

    def __init__(self, listener: socket.socket, *, expect_workers: int, token: Optional[bytes],
                 grants: Mapping[int, bytes], samples: Optional[int], handshake_timeout: float,
                 max_frame: int, per_block: Optional[bool] = None,
                 gradient_length: Optional[int] = None, elastic: bool = False,
                 resume: bool = False, encrypt: bool = False,
                 require_encryption: bool = False) -> None:
        self.listener = listener
        #: seal the link of a worker that offers it (needs the token);
        #: ``require_encryption``: refuse one that does not
        self.encrypt = encrypt and token is not None
        self.require_encryption = require_encryption
        self.elastic = elastic
        #: a restarted coordinator's join: every worker says the step it goes on
        #: from (its elastic entry), the first admitted sets it for the others;
        #: it follows the workers admitted: when the last one holding it leaves
        #: before the join completes, it is None again and the next one sets it
        self.resume = resume
        self.resume_step: Optional[int] = None
        self.expect_workers = expect_workers
        self.token = token
        self.grants = dict(grants)
        self.samples = samples
        self.per_block = per_block
        self.gradient_length = gradient_length
        self.max_frame = max_frame
        self.slots: List[Optional[Admitted]] = [None] * expect_workers
        self.handshakes = _Handshakes(listener, handshake_timeout, max_frame)
        self._late_sel: Optional[selectors.BaseSelector] = None

    # ---- the loop ----

    def run(self, deadline: float, limit: float, until: int) -> List[Admitted]:
        """Admit workers until ``until`` slots are filled; JoinTimeout at
        ``deadline``. The connections still handshaking then stay in
        ``self.handshakes`` (for a later call, or a Refuser)."""
        sel = selectors.DefaultSelector()
        self.listener.setblocking(False)
        sel.register(self.listener, selectors.EVENT_READ, None)
        for slot in self.slots:
            if slot is not None:
                sel.register(slot.sock, selectors.EVENT_READ, slot)
        for p in self.handshakes.pending.values():
            sel.register(p.sock, selectors.EVENT_READ, p)
        next_report = time.monotonic() + PROGRESS_EVERY
        try:
            while self._joined() < until:
                now = time.monotonic()
                if now >= deadline:
                    expected = counted(self.expect_workers, "worker")
                    raise JoinTimeout(f"{self._joined()} of {expected} joined "
                                      f"within {limit:g} s{self._describe_pending()}")
                if now >= next_report:
                    log.info("waiting for workers: %d of %d joined%s; %.0f s left", self._joined(),
                             self.expect_workers, self._describe_joined(), deadline - now)
                    next_report = now + PROGRESS_EVERY
                wake = self.handshakes.next_deadline(min(deadline, next_report))
                self._pump(sel, max(0.0, wake - now))
            # A worker whose own timeout ran out while others were still
            # joining is gone: find it now, not at step 0.
            for slot in list(self.slots):
                if slot is not None and not still_open(slot.sock):
                    self._free(sel, slot, "disconnected")
            if self._joined() < until:
                return self.run(deadline, limit, until)
        finally:
            sel.close()
        return [s for s in self.slots if s is not None]

    def _pump(self, sel: selectors.BaseSelector, wait: float) -> None:
        """One round of the join: accept, read what the handshakes sent,
        watch the admitted, cut off those past their deadline."""
        for key, _ in sel.select(wait):
            if key.data is None:
                self.handshakes.accept(sel)
            elif isinstance(key.data, Admitted):
                self._checkstill_open(sel, key.data)
            else:
                self._on_readable(sel, key.data)
        self.handshakes.expire(sel, time.monotonic())

    def _joined(self) -> int:
        return sum(s is not None for s in self.slots)

    # ---- late joiners (an elastic session, between steps) ----

    def admit_late(self, timeout: float, until: int) -> List[Admitted]:
        """Between two steps of an elastic session: move the handshakes of
        workers joining late on, under the same rules as the first join
        (the token, bounded reads, the handshake deadline, refusals when
        every slot is taken), for at most ``timeout`` seconds, returning
        early once ``until`` slots are filled (0: only what is ready now).
        Returns the workers admitted meanwhile; each is handed over (this
        object no longer watches its socket) and keeps its slot until
        :meth:`release`."""
        if self._late_sel is None:
            self._late_sel = selectors.DefaultSelector()
            self.listener.setblocking(False)
            self._late_sel.register(self.listener, selectors.EVENT_READ, None)
            for p in self.handshakes.pending.values():
                self._late_sel.register(p.sock, selectors.EVENT_READ, p)
        sel = self._late_sel
        before = {s.worker_id for s in self.slots if s is not None}
        new: List[Admitted] = []
        deadline = time.monotonic() + timeout
        while True:
            wake = self.handshakes.next_deadline(deadline)
            # a worker admitted here is handed over below, before it can be watched
            self._pump(sel, max(0.0, wake - time.monotonic()))
            for a in self.slots:
                if a is not None and a.worker_id not in before and a not in new:
                    sel.unregister(a.sock)  # the session reads it from now on
                    new.append(a)
            if self._joined() >= until or time.monotonic() >= deadline:
                return new

    def release(self, worker_id: int) -> None:
        """Free a slot whose worker left the session: a late joiner may take it."""
        self.slots[worker_id] = None

    def close_late(self) -> None:
        """Stop watching for late joiners; those still handshaking are closed."""
        if self._late_sel is not None:
            self._late_sel.close()
            self._late_sel = None
        self.handshakes.close_all()

    def _describe_joined(self) -> str:
        joined = [f"worker {s.worker_id} {s.name()}" for s in self.slots if s]
        return f" ({', '.join(joined)})" if joined else ""

    def _describe_pending(self) -> str:
        pending = self.handshakes.pending
        if not pending:
            return ""
        return f"; still handshaking: {', '.join(p.name for p in pending.values())}"

    # ---- handshakes ----

    def _on_readable(self, sel: selectors.BaseSelector, p: _Pending) -> None:
        for msg in self.handshakes.read(sel, p):
            if p.sock not in self.handshakes.pending:
                return
            if isinstance(msg, JoinRequest):
                self._on_join(sel, p, msg)
            else:
                self._on_proof(sel, p, msg)

    def _on_join(self, sel: selectors.BaseSelector, p: _Pending, join: JoinRequest) -> None:
        p.join = join
        if self._refused_as_full(sel, p):
            return
        offered = join.extensions or {}
        if self._refused_for_offer(sel, p, lambda: samples_mismatch(self.samples, offered)):
            return
        nonce = offered.get(Extension.AUTH)
        if self.token is None:
            if nonce is not None:
                # it would refuse us anyway, for want of a proof; refusing
                # first keeps it out of the slots and says which side to fix
                self.handshakes.end(
                    sel, p, f"it offered a token, and this coordinator has none (start it with "
                            f"the workers' token, --token-file or {auth.TOKEN_ENV}, or drop the "
                            f"token from the worker)",
                    (RefusalReason.AUTH_FAILED,
                     f"this coordinator has no token configured, so it cannot prove it knows "
                     f"the worker's: start it with the same token (--token-file or "
                     f"{auth.TOKEN_ENV}), or drop the token from the worker"))
                return
            self._admit(sel, p)
            return
        if nonce is None:
            self.handshakes.end(sel, p, "no token offered (this coordinator requires one)",
                       (RefusalReason.AUTH_REQUIRED, "this coordinator requires a token"))
            return
        if len(nonce) != auth.NONCE_BYTES:
            self.handshakes.end(sel, p, f"auth offer of {len(nonce)} bytes, not {auth.NONCE_BYTES}",
                       (RefusalReason.PROTOCOL, "malformed auth offer"))
            return
        p.coordinator_nonce = auth.new_nonce()
        proof = auth.coordinator_proof(self.token, nonce, p.coordinator_nonce,
                                       offered.get(Extension.SEAL, b""))
        if not _send_small(p.sock, AuthChallenge(nonce=p.coordinator_nonce, proof=proof)):
            self.handshakes.end(sel, p, "could not send AuthChallenge")
            return
        p.reader = _reader_for(AuthProof, self.max_frame)

    def _on_proof(self, sel: selectors.BaseSelector, p: _Pending, msg: AuthProof) -> None:
        assert self.token is not None and p.join is not None
        expected = auth.worker_proof(self.token, p.join.extensions[Extension.AUTH],
                                     p.coordinator_nonce, p.join.extensions.get(Extension.SEAL, b""))
        if not auth.proof_matches(expected, bytes(msg.proof)):
            self.handshakes.end(sel, p, "wrong token (its proof did not match)",
                       (RefusalReason.AUTH_FAILED, "authentication failed"))
            return
        self._admit(sel, p)

    def _refused_as_full(self, sel: selectors.BaseSelector, p: _Pending) -> bool:
        """Refuse ``p`` when no slot is free. One select() batch may complete
        more handshakes than there are slots left: each is checked here, as
        it completes, so a surplus worker hears at once and the join goes on
        with the others."""
        if None in self.slots:
            return False
        self.handshakes.end(sel, p, "every worker slot is taken",
                            (RefusalReason.FULL, "every worker slot is taken"))
        return True

    def _refused_for_offer(self, sel: selectors.BaseSelector, p: _Pending,
                           check: Callable[[], Optional[str]]) -> bool:
        """Refuse ``p`` when ``check()`` finds a value it offered disagrees
        (reason MISMATCH) or is malformed (PROTOCOL: a client's bad entry
        must end its own handshake, not the join)."""
        try:
            why = check()
        except ProtocolError as exc:
            self.handshakes.end(sel, p, str(exc), (RefusalReason.PROTOCOL, str(exc)))
            return True
        if why is None:
            return False
        self.handshakes.end(sel, p, why, (RefusalReason.MISMATCH, why))
        return True

    def _resume_mismatch(self, value: bytes) -> Optional[str]:
        """Why a worker cannot go on with a resumed run, or None (the first
        one admitted sets the run's step: :meth:`_admit`)."""
        if not value:
            return ("this coordinator picks a run up after a restart (--resume): a worker "
                    "without the run's state cannot join it before it has started")
        step = decode_u64(value)
        if self.resume_step is not None and step != self.resume_step:
            return (f"this worker would go on from step {step}, the workers admitted from step "
                    f"{self.resume_step}: their states differ, the run cannot be resumed with "
                    f"both")
        return None

    def _admit(self, sel: selectors.BaseSelector, p: _Pending) -> None:
        assert p.join is not None
        if self._refused_as_full(sel, p):
            return
        offered = p.join.extensions
        # held to the workers admitted so far, so checked here, after the
        # token: an outsider can neither set the session's values nor learn them
        joined = [s.join.extensions or {} for s in self.slots if s is not None]
        if self._refused_for_offer(sel, p, lambda: steps_mismatch(
                self.per_block, self.gradient_length, offered or {}, joined)):
            return
        if self.elastic and Extension.ELASTIC not in (offered or {}) and \
                self._refused_for_offer(sel, p, lambda: _NOT_ELASTIC):
            return
        if self.resume and self._refused_for_offer(sel, p, lambda: self._resume_mismatch(
                (offered or {}).get(Extension.ELASTIC, b""))):
            return
        share = (offered or {}).get(Extension.SEAL)
        if self.require_encryption and (share is None or Extension.AUTH not in (offered or {})) \
                and self._refused_for_offer(sel, p, lambda: _NOT_SEALED):
            return
        keys: List[Tuple[bytes, bytes]] = []
        if self.encrypt and share is not None and self._refused_for_offer(
                sel, p, lambda: self._seal_keys(p, share, keys)):
            return
        worker_id = self.slots.index(None)
        granted: Dict[int, bytes] = {}
        if offered is not None:
            for kind, value in self.grants.items():
                if kind in offered:
                    granted[kind] = value
            if self.token is not None:
                granted[Extension.AUTH] = b""
            if p.share is not None:
                granted[Extension.SEAL] = p.share.public
            if Extension.SAMPLES in offered:
                granted[Extension.SAMPLES] = encode_u64(self.samples or 0)
            for kind in (Extension.PER_BLOCK, Extension.GRADIENT_LENGTH):
                if kind in offered:
                    granted[kind] = b""
        reply = JoinAccepted(worker_id=worker_id, total_workers=self.expect_workers,
                             extensions=granted if offered is not None else None)
        if not _send_small(p.sock, reply):
            self.handshakes.end(sel, p, "could not send JoinAccepted")
            return
        del self.handshakes.pending[p.sock]
        admitted = Admitted(p.sock, p.address, p.join, granted, worker_id,
                            keys[0] if keys else None)
        sel.modify(p.sock, selectors.EVENT_READ, admitted)
        self.slots[worker_id] = admitted
        if self.resume and self.resume_step is None:
            # set by a worker admitted, not by one refused after the check
            self.resume_step = _resume_step_of(admitted)
        log.info("worker %d joined: %s (%s, %d GPU) from %s%s", worker_id, p.join.node_id,
                 p.join.backend, p.join.gpu_count, p.name, ", its link sealed" if keys else "")
        if offered is None:
            log.info("worker %d speaks the reference protocol (no extensions): its frames "
                     "travel in the clear", worker_id)
        elif self.encrypt and not keys:
            log.warning("worker %d (%s) joined in the clear: it offered no encryption (--encrypt "
                        "off there, or a ddpwire without it); --require-encryption refuses such "
                        "workers", worker_id, p.name)

    def _seal_keys(self, p: _Pending, share: bytes, out: List[Tuple[bytes, bytes]]) -> None:
        """Our half of ``p``'s key exchange and its link's keys, into ``out``
        (ProtocolError for a share that is no key: a refusal, reason PROTOCOL)."""
        assert self.token is not None and p.join is not None
        p.share = seal.KeyShare()
        out.append(seal.join_keys(p.share, share, self.token, p.join.extensions[Extension.AUTH],
                                  p.coordinator_nonce, worker=False))

    def _checkstill_open(self, sel: selectors.BaseSelector, a: Admitted) -> None:
        if still_open(a.sock):
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
        self._follow_resume_step()

    def _follow_resume_step(self) -> None:
        """A resumed run's step is the one its workers admitted go on from:
        once none of them holds it, the next worker admitted sets it."""
        if not self.resume or self.resume_step is None:
            return
        if any(s is not None and _resume_step_of(s) == self.resume_step for s in self.slots):
            return
        log.info("no worker admitted goes on from step %d any more: the next one admitted "
                 "sets the step the run resumes at", self.resume_step)
        self.resume_step = None


def _resume_step_of(a: Admitted) -> Optional[int]:
    """The step an admitted worker said it goes on from (None: it said none)."""
    value = (a.join.extensions or {}).get(Extension.ELASTIC, b"")
    return decode_u64(value) if value else None


class Refuser:
    """After the join: refuses every connection on a thread of its own, so a
    late or surplus worker learns at once that it cannot join."""

    def __init__(self, handshakes: _Handshakes, *, detail: str) -> None:
        self.handshakes = handshakes
        self.refusal = (RefusalReason.TRAINING, detail)
        # those still handshaking when the slots filled: there is no slot left
        for p in list(handshakes.pending.values()):
            p.refusal = (RefusalReason.FULL, "every worker slot is taken")
            if p.join is not None:  # past its JoinRequest: it hears at once
                handshakes.end(None, p, "every worker slot is taken")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddpwire-refuser", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread, closing what it still holds (not the listener)."""
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        hs = self.handshakes
        sel = selectors.DefaultSelector()
        try:
            sel.register(hs.listener, selectors.EVENT_READ, None)
            for p in hs.pending.values():
                sel.register(p.sock, selectors.EVENT_READ, p)
            while not self._stop.is_set():
                for key, _ in sel.select(0.2):
                    if key.data is None:
                        hs.accept(sel, refusal=self.refusal)
                        continue
                    p = key.data
                    for msg in hs.read(sel, p):
                        if isinstance(msg, JoinRequest):
                            p.join = msg
                        hs.end(sel, p, p.refusal[1] if p.refusal else self.refusal[1])
                        break
                hs.expire(sel, time.monotonic())
        except (OSError, ValueError) as exc:  # the listener was closed under us
            log.debug("refuser stopped: %s", exc)
        finally:
            hs.close_all()
            sel.close()
