"""The worker's side of the join: reach the coordinator, offer, prove, be admitted.

The coordinator's side is :mod:`ddpwire.session.admission`. Connecting is retried
while the coordinator is not up yet, so workers may start first; the token
handshake proves both ways that each side knows the token
(docs/extensions.md, "Authentication"); a refusal says why.

Once connected, the join has one deadline: the coordinator's first bytes,
its answer and the token handshake all come by it, however the time is
spent among them. A peer whose first bytes cannot begin a coordinator's
frame is another service at a wrong address (NotACoordinator, naming it
where its bytes say: SSH, HTTP, TLS, ...); one that accepts and stays
silent is given up at the deadline, saying so.
"""
from __future__ import annotations

import errno
import logging
import math
import os
import select
import socket
import time
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Tuple

from ..wire import auth, seal
from ..plane import mesh as _mesh
from ..plane import shm as _shm
from ..wire.channel import Channel, check_timeout
from .._core import tag_max_payload
from ..wire.errors import (AuthenticationFailed, CoordinatorLost, JoinRefusedError, JoinTimeout,
                     NotACoordinator, PeerLost, ProtocolError)
from ..wire.extensions import Extension, RefusalReason, encode_flag, encode_u64, samples_mismatch
from ..wire.messages import (
    AuthChallenge, AuthProof, Heartbeat, JoinAccepted, JoinRefused, JoinRequest,
)
from .options import SessionOptions

__all__ = ["Joined", "join"]

# the worker side's one logger, whichever module speaks
log = logging.getLogger("ddpwire.worker")

_RETRYABLE = {errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED,
              errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT}

#: what a coordinator may send first: its answer, or a Heartbeat before it
_FIRST_FRAMES = (JoinAccepted, AuthChallenge, JoinRefused, Heartbeat)
#: the longest first frame a coordinator sends (each of those is a small
#: message: 64 KiB at most, whatever max_frame is), so a length prefix
#: over it is no coordinator's
_FIRST_FRAME_MAX = max(tag_max_payload(t.TAG, 0) for t in _FIRST_FRAMES)
#: a connection made just before the connect deadline still gets this
#: long (or the timeout, if shorter) for the coordinator's answer
_ANSWER_FLOOR = 1.0


def _dial(addr: Tuple[str, int], deadline: float, report_every: float = 5.0) -> socket.socket:
    """Connect, retrying while the coordinator is not up yet, until the deadline;
    says at the first failure and then every ``report_every`` seconds what it
    waits for and how long is left."""
    host, port = addr
    delay = 0.05
    last: Optional[BaseException] = None
    next_report = time.monotonic()
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            why = f": {last.strerror or last}" if isinstance(last, OSError) else ""
            raise JoinTimeout(f"could not reach the coordinator at {host}:{port}{why}")
        try:
            return socket.create_connection((host, port), timeout=min(remaining, 5.0))
        except socket.gaierror as exc:
            raise OSError(errno.EINVAL, f"bad coordinator address {host}:{port}: {exc.strerror}") from None
        except socket.timeout as exc:
            last = exc
        except OSError as exc:
            if exc.errno not in _RETRYABLE:
                raise
            last = exc
        now = time.monotonic()
        if now >= next_report:
            why = last.strerror if isinstance(last, OSError) and last.strerror else "timed out"
            log.info("coordinator at %s:%d not reachable yet (%s); retrying, %d s left",
                     host, port, why, math.ceil(max(0.0, deadline - now)))
            next_report = now + report_every
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 1.0)


def _could_begin_a_frame(head: bytes) -> Optional[bool]:
    """Whether ``head``, the first bytes a peer sent, can begin a
    coordinator's first frame: False as soon as its length prefix is over
    :data:`_FIRST_FRAME_MAX` (a first byte other than zero already says
    16 MiB or more), True once the prefix is in and fits, None while too few
    bytes are in to tell. Only the length decides: every first frame of a
    coordinator fits, so none is taken for another protocol's bytes, and
    bytes that fit are left to the frame reader and its errors."""
    if head[:1] not in (b"", b"\x00"):
        return False
    if len(head) < 4:
        return None
    return int.from_bytes(head[:4], "big") <= _FIRST_FRAME_MAX


def _readable(sock: socket.socket, timeout: float) -> bool:
    """Whether ``sock`` has bytes (or its end, or an error) to read within
    ``timeout`` seconds: poll(), which any descriptor number may use."""
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(max(0.0, timeout) * 1000.0))
    return bool(select.select([sock], [], [], max(0.0, timeout))[0])


def _peek(sock: socket.socket) -> bytes:
    """The bytes waiting on ``sock`` (at most NotACoordinator.HEAD_BYTES),
    left there; b"" at the end of the stream or when none are waiting. Never
    waits (a socket with a timeout would wait for bytes before receiving)."""
    try:
        if not _readable(sock, 0.0):
            return b""
        return sock.recv(NotACoordinator.HEAD_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError, socket.timeout):
        return b""
    except OSError:  # reset: the reader that follows says so
        return b""


def _await_first_bytes(sock: socket.socket, deadline: float, where: str,
                       waited_from: float, timeout: float) -> None:
    """Wait, until ``deadline``, for the first bytes of the peer's answer
    and look at them before the frame reader does: bytes that cannot begin
    a coordinator's frame raise NotACoordinator; none at all by the
    deadline, a CoordinatorLost saying the peer accepted and stayed silent.
    Returns (the bytes left in the socket) when they may be a frame, and at
    the end of the stream (the reader reports it)."""
    while True:
        ready = _readable(sock, deadline - time.monotonic())
        head = _peek(sock) if ready else b""
        if ready and not head:
            return  # the end of the stream, or a reset: the reader says which
        verdict = _could_begin_a_frame(head)
        if verdict is False:
            raise NotACoordinator(where, head)
        if verdict:
            return
        if time.monotonic() >= deadline:
            if head:  # a frame cut short: the reader reports it
                return
            # the user's timeout, unless connecting took a visible part of it
            # (a few milliseconds on a busy machine must not turn 3 s into 2.99)
            waited = max(deadline - waited_from, 0.0)
            shown = timeout if waited >= timeout - max(0.05, 0.05 * timeout) else waited
            raise CoordinatorLost(f"{where} accepted the connection but sent nothing within "
                                  f"{shown:.3g} s: is it a ddpwire coordinator?")
        if head:  # the first bytes of a frame: the rest of its prefix is coming
            time.sleep(min(0.005, max(0.0, deadline - time.monotonic())))


def _await_admission(chan: Channel, token: Optional[bytes], nonce: bytes, share: bytes,
                     where: str, deadline: float) -> Tuple[JoinAccepted, bytes]:
    """The coordinator's answer to our JoinRequest, through the token
    handshake when we have a token (docs/extensions.md, "Authentication"),
    all by ``deadline`` (time.monotonic()), and the coordinator's nonce
    (b"" without a token). ``share``: our seal key share offered (b"":
    none), which both proofs cover. ``where`` (host:port) names the
    coordinator when this worker gives up."""
    theirs = b""
    reply = chan.expect([JoinAccepted, AuthChallenge, JoinRefused], deadline=deadline)
    if isinstance(reply, AuthChallenge):
        if token is None:
            raise _token_needed(where)
        theirs = bytes(reply.nonce)
        expected = auth.coordinator_proof(token, nonce, theirs, share)
        if not auth.proof_matches(expected, bytes(reply.proof)):
            # a peer that does not know the token learns nothing from us
            raise AuthenticationFailed(
                RefusalReason.AUTH_FAILED,
                f"the coordinator at {where} does not know this worker's token (its proof did "
                f"not match): the tokens differ; check {auth.TOKEN_ENV} or --token-file on "
                f"both sides", by_worker=True)
        chan.send(AuthProof(proof=auth.worker_proof(token, nonce, theirs, share)))
        reply = chan.expect([JoinAccepted, JoinRefused], deadline=deadline)
    elif token is not None and isinstance(reply, JoinAccepted):
        # a ddpwire coordinator without a token refuses the offer instead:
        # this is the reference coordinator, or an older ddpwire one
        raise AuthenticationFailed(
            RefusalReason.AUTH_FAILED,
            f"the coordinator at {where} admitted this worker without proving it knows the "
            f"token: it has no token configured (or it is not a ddpwire coordinator), so it "
            f"cannot prove it; start it with the same token, or drop the token from this worker",
            by_worker=True)
    if isinstance(reply, JoinRefused):
        if reply.reason == RefusalReason.AUTH_REQUIRED and token is None:
            raise _token_needed(where)  # said by the coordinator before any challenge
        cls = AuthenticationFailed if reply.reason in (RefusalReason.AUTH_REQUIRED,
                                                       RefusalReason.AUTH_FAILED) else JoinRefusedError
        raise cls(reply.reason, reply.detail)
    return reply, theirs


def _seal(chan: Channel, share: Optional[seal.KeyShare], token: Optional[bytes], nonce: bytes,
          theirs: bytes, granted: Mapping[int, bytes], where: str) -> None:
    """Seal the link from here on when the coordinator granted our share
    (JoinAccepted was its last frame in the clear); say so once when it
    did not."""
    answer = granted.get(Extension.SEAL)
    if share is None:
        if answer is not None:
            raise ProtocolError("the coordinator granted encryption this worker did not offer")
        return
    if answer is None:
        log.warning("the coordinator at %s does not seal links (its encryption is off, or it is "
                    "a ddpwire without it): this session's frames travel in the clear", where)
        return
    assert token is not None
    chan.conn.seal(*seal.join_keys(share, answer, token, nonce, theirs, worker=True))


def _token_needed(where: str) -> AuthenticationFailed:
    """A coordinator with a token, and this worker without one: what to do."""
    return AuthenticationFailed(
        RefusalReason.AUTH_REQUIRED,
        f"the coordinator at {where} requires a token and this worker has none: start it with "
        f"the coordinator's token (the command's --token-file, or {auth.TOKEN_ENV})",
        by_worker=True)


def _check_accepted(accepted: JoinAccepted) -> None:
    if accepted.total_workers == 0:
        raise ProtocolError("JoinAccepted.total_workers is 0")
    if accepted.worker_id >= accepted.total_workers:
        raise ProtocolError(f"JoinAccepted.worker_id {accepted.worker_id} is not below "
                            f"total_workers {accepted.total_workers}")


def _check_samples(granted: Mapping[int, bytes], ours: Optional[int]) -> None:
    why = samples_mismatch(None, granted, ours)
    if why is not None:
        raise JoinRefusedError(RefusalReason.MISMATCH, why)


@dataclass
class Joined:
    """A join that succeeded: the connection, the coordinator's answer, the
    extensions it granted, and the mesh listener when the mesh was granted."""

    chan: Channel
    accepted: JoinAccepted
    granted: Dict[int, bytes]
    listener: Optional[socket.socket]
    node_id: str


def join(addr: Tuple[str, int], opts: SessionOptions, *, gpu_count: int, backend: str,
         node_id: Optional[str], connect_timeout: Optional[float],
         extensions: Optional[Mapping[int, bytes]], mesh: bool,
         resume_step: Optional[int]) -> Joined:
    """Join the coordinator at ``addr`` (Worker.connect's arguments)."""
    connect_limit = opts.timeout if connect_timeout is None else check_timeout(
        "connect_timeout", connect_timeout)
    if resume_step is not None and (isinstance(resume_step, bool) or
                                    not isinstance(resume_step, int) or resume_step < 0):
        raise ValueError(f"resume_step must be a step number (an int >= 0), got {resume_step!r}")
    node_id = default_node_id() if node_id is None else node_id
    secret: Optional[bytes] = opts.token  # type: ignore[assignment]
    offer: Dict[int, bytes] = dict(extensions or {})
    # a ddpwire coordinator grants it to learn each step's compute time
    # (its progress shows them) and, when it balances, to size the shards
    offer.setdefault(Extension.BALANCE, b"")
    # every step this worker runs can be computed again: an elastic
    # coordinator calls off a step it lost a worker in (MembershipChanged)
    offer.setdefault(Extension.ELASTIC, b"" if resume_step is None else encode_u64(resume_step))
    if opts.samples_per_step:
        offer[Extension.SAMPLES] = encode_u64(opts.samples_per_step)
    if opts.per_block is not None:
        offer[Extension.PER_BLOCK] = encode_flag(opts.per_block)
    if opts.gradient_length is not None:
        offer[Extension.GRADIENT_LENGTH] = encode_u64(opts.gradient_length)
    nonce = auth.new_nonce() if secret is not None else b""
    if secret is not None:
        offer[Extension.AUTH] = nonce
    sealing = secret is not None and opts.encrypt
    if sealing:
        seal.load_libcrypto()  # EncryptionUnavailable says what to do, before dialing
    started = time.monotonic()
    dial_until = started + connect_limit
    # the whole join: connecting (retried until dial_until), then the
    # answer, never more than the timeout after the connection is made
    join_until = started + max(connect_limit, opts.timeout)
    where = f"{addr[0]}:{addr[1]}"
    while True:
        sock = _dial(addr, dial_until)
        connected = time.monotonic()
        answer_until = max(min(join_until, connected + opts.timeout),
                           connected + min(opts.timeout, _ANSWER_FLOOR))
        chan = Channel(sock, timeout=opts.timeout, peer_name=f"coordinator {where}",
                       lost=CoordinatorLost, max_frame=opts.max_frame)
        listener: Optional[socket.socket] = None
        # a key share serves one connection
        share = seal.KeyShare() if sealing else None
        if share is not None:
            offer[Extension.SEAL] = share.public
        try:
            if mesh:
                listener = _mesh.listen(sock.getsockname()[0])
                offer[Extension.MESH] = _mesh.offer(
                    listener, _shm.host_id() if _shm.enabled() else None)
            # Always a block, empty when there is nothing to offer: the
            # reference coordinator ignores it, and a ddpwire one then knows
            # it may tell this worker why it is refused.
            try:
                chan.send(JoinRequest(node_id=node_id, gpu_count=gpu_count, backend=backend,
                                      extensions=offer))
            except PeerLost as exc:
                # a service that spoke first and hung up (a banner) says which
                head = _peek(sock)
                if head and _could_begin_a_frame(head) is False:
                    raise NotACoordinator(where, head) from exc
                raise
            _await_first_bytes(sock, answer_until, where, connected, opts.timeout)
            accepted, theirs = _await_admission(chan, secret, nonce,
                                                share.public if share else b"", where,
                                                answer_until)
            _check_accepted(accepted)
            granted = dict(accepted.extensions or {})
            _seal(chan, share, secret, nonce, theirs, granted, where)
            _check_samples(granted, opts.samples_per_step)
            if listener is not None and Extension.MESH not in granted:
                listener.close()
                listener = None
            break
        except BaseException as exc:
            if listener is not None:
                listener.close()
            chan.close()
            # a coordinator being restarted: the dying one's listener may
            # still take the connection, and then close it unanswered
            if resume_step is not None and isinstance(exc, CoordinatorLost) and \
                    time.monotonic() < dial_until:
                log.info("the coordinator closed the join unanswered; trying again")
                time.sleep(0.1)
                continue
            raise
    chan.heartbeat_timeout = opts.heartbeat_timeout
    log.info("joined %s:%s as worker %d of %d", addr[0], addr[1],
             accepted.worker_id, accepted.total_workers)
    return Joined(chan, accepted, granted, listener, node_id)


def default_node_id() -> str:
    """A worker's node_id when none is given: host and process."""
    return f"{socket.gethostname()}-{os.getpid()}"
