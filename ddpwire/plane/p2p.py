"""Point to point for a process group: send, recv and recv from any source.

A message is the bytes of one tensor, its dtype and element count, the rank
that sent it and a tag. Every rank holds a :class:`Mailbox`: messages that
arrive before a receive is posted wait there (keyed by source and tag, in
arrival order, their bytes bounded), and a receive posted before its
message waits there until it comes. Tags match exactly; messages from one
source with one tag are received in the order they were sent.

Messages travel one of two ways (docs/ddp.md, "Point to point"):

- on direct TCP links between the two ranks (:class:`PeerLinks`), opened at
  the group's set-up beside the rank links when those open (shared memory
  off, or ranks on several hosts): each link has a sending thread and a
  receiving thread, and nothing passes through rank 0;
- otherwise through the collectives service on rank 0, as a request of
  kind SEND (docs/extensions.md, "Point to point"), which the service
  relays to the destination as soon as it arrives, outside the collectives'
  numbering (:class:`ServiceRoute`).

Nothing here imports torch: the backend (ddpwire/torch/backend.py) stages
tensors to host bytes and back.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import numpy as np

from .collectives import (DEPARTED_TAG, NUMPY_DTYPES, CollectiveAborted, DType, Kind, Op,
                          split_relayed_seq)
from ..wire.errors import DdpwireError
from ..wire.messages import CollectiveRequest

__all__ = [
    "ANY_SOURCE",
    "MAX_HELD_ENV",
    "MAX_MESSAGE_BYTES",
    "Message",
    "Mailbox",
    "PeerLinks",
    "PointToPointError",
    "PointToPointMismatch",
    "PointToPointOverflow",
    "PointToPointTimeout",
    "ServiceRoute",
    "check_size",
    "check_tag",
    "form_peer_links",
]

log = logging.getLogger("ddpwire.p2p")

#: a receive's source when any rank may have sent the message
ANY_SOURCE: Optional[int] = None
#: the largest tag (tags are 32-bit, non-negative as gloo requires)
MAX_TAG = (1 << 31) - 1
#: the largest message: one frame (the links' and the service's frame limit
#: is 1 GiB), less room for its head
MAX_MESSAGE_BYTES = (1 << 30) - 4096
#: bytes of unclaimed messages a mailbox holds before it fails (environment)
MAX_HELD_ENV = "DDPWIRE_P2P_MAX_BYTES"
DEFAULT_MAX_HELD = 1 << 30
# a link's reading thread waits this long for the next message: as long as
# it likes, the heartbeat silence limit being what notices a silent peer
_IDLE = 10.0 * 365 * 24 * 3600


# ---- errors ----

class PointToPointError(DdpwireError):
    """A point-to-point message that cannot be delivered as asked: ``src``
    and ``dst`` (ranks, None where not known) and ``tag`` say which."""

    def __init__(self, message: str, *, src: Optional[int] = None, dst: Optional[int] = None,
                 tag: Optional[int] = None) -> None:
        super().__init__(message)
        self.src = src
        self.dst = dst
        self.tag = tag


class PointToPointTimeout(PointToPointError, TimeoutError):
    """A send or receive not done within its timeout ("timed out")."""


class PointToPointMismatch(PointToPointError, ValueError):
    """A message whose dtype or size differs from the receiving tensor's:
    nothing is written into the tensor."""


class PointToPointOverflow(PointToPointError, MemoryError):
    """More bytes of unclaimed messages arrived than the mailbox may hold
    (:data:`MAX_HELD_ENV`): the mailbox fails, as messages would be lost."""


def check_size(nbytes: int, what: str) -> None:
    """A ValueError for a message over :data:`MAX_MESSAGE_BYTES`, before
    anything is sent (a frame past the limit would end the connection)."""
    if nbytes > MAX_MESSAGE_BYTES:
        raise ValueError(f"ddpwire {what}: {nbytes} bytes is over the {MAX_MESSAGE_BYTES} bytes "
                         f"one message may hold: send it in parts")


def check_tag(tag: int, what: str) -> int:
    """``tag`` as an int, or a ValueError unless 0 <= tag <= 2**31 - 1."""
    tag = int(tag)
    if not 0 <= tag <= MAX_TAG:
        raise ValueError(f"ddpwire {what}: tag {tag} is not in 0..{MAX_TAG}")
    return tag


# ---- the mailbox ----

@dataclass
class Message:
    """One message received: ``data`` holds ``count`` elements of ``dtype``
    (a wire dtype code) as bytes."""

    src: int
    tag: int
    dtype: int
    count: int
    data: np.ndarray
    order: int = 0

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


#: called once with the message, or with the error that ends the receive
Deliver = Callable[[Optional[Message], Optional[BaseException]], None]


class _Receive:
    __slots__ = ("src", "tag", "deliver")

    def __init__(self, src: Optional[int], tag: int, deliver: Deliver) -> None:
        self.src = src
        self.tag = tag
        self.deliver = deliver

    def matches(self, src: int, tag: int) -> bool:
        return tag == self.tag and (self.src is None or self.src == src)


class Mailbox:
    """Messages to one rank of a group, and its receives still waiting.

    :meth:`put` files an arriving message: the earliest posted receive that
    matches it (same tag, its source or any) gets it, otherwise it waits,
    counted against ``max_held`` bytes. :meth:`post` posts a receive: the
    earliest message waiting that matches is delivered at once, otherwise
    the receive waits. ``deliver`` callbacks run on the thread that made
    the match, outside the mailbox's lock.

    A source that has gone (:meth:`source_gone`) fails the receives that
    wait for it (and those posted later, once its messages are taken) with
    its error; :meth:`fail` fails every receive, now and later.
    """

    def __init__(self, rank: int, world: int, max_held: Optional[int] = None) -> None:
        self.rank = rank
        self.world = world
        if max_held is None:
            max_held = int(os.environ.get(MAX_HELD_ENV) or DEFAULT_MAX_HELD)
        self.max_held = max_held
        self._lock = threading.Lock()
        self._queued: Dict[Tuple[int, int], Deque[Message]] = {}
        self._waiting: List[_Receive] = []
        self._gone: Dict[int, BaseException] = {}
        self._held = 0
        self._arrivals = 0
        self.failure: Optional[BaseException] = None

    @property
    def held(self) -> int:
        """Bytes of the messages waiting for a receive."""
        return self._held

    def waiting(self) -> int:
        """How many receives wait for a message."""
        with self._lock:
            return len(self._waiting)

    def put(self, message: Message) -> None:
        """File ``message``; raises :class:`PointToPointOverflow` (and fails
        the mailbox) when holding it would pass ``max_held`` bytes."""
        overflow: Optional[PointToPointOverflow] = None
        with self._lock:
            if self.failure is not None:
                return  # the receives have failed already: nothing takes it
            for i, receive in enumerate(self._waiting):
                if receive.matches(message.src, message.tag):
                    del self._waiting[i]
                    break
            else:
                receive = None
                if self._held + message.nbytes > self.max_held:
                    overflow = PointToPointOverflow(
                        f"rank {self.rank}: a message of {message.nbytes} bytes from rank "
                        f"{message.src} (tag {message.tag}) would make {self._held + message.nbytes} "
                        f"bytes of unclaimed messages, over the limit of {self.max_held} "
                        f"({MAX_HELD_ENV}): post the receives sooner or raise it",
                        src=message.src, dst=self.rank, tag=message.tag)
                else:
                    message.order = self._arrivals
                    self._arrivals += 1
                    self._held += message.nbytes
                    self._queued.setdefault((message.src, message.tag),
                                            collections.deque()).append(message)
        if overflow is not None:
            self.fail(overflow)
            raise overflow
        if receive is not None:
            _call(receive.deliver, message, None)

    def post(self, src: Optional[int], tag: int, deliver: Deliver) -> None:
        """Post a receive of ``tag`` from ``src`` (None: any source)."""
        error: Optional[BaseException] = None
        with self._lock:
            message = self._take(src, tag)
            if message is None:
                if self.failure is not None:
                    error = self.failure
                elif src is not None and src in self._gone:
                    error = self._gone[src]
                elif src is None and self._gone and len(self._gone) >= self.world - 1:
                    error = next(iter(self._gone.values()))
                else:
                    self._waiting.append(_Receive(src, tag, deliver))
                    return
        _call(deliver, message, error)

    def _take(self, src: Optional[int], tag: int) -> Optional[Message]:
        if src is not None:
            queue = self._queued.get((src, tag))
        else:
            queue = None
            for (s, t), q in self._queued.items():
                if t == tag and q and (queue is None or q[0].order < queue[0].order):
                    queue = q
        if not queue:
            return None
        message = queue.popleft()
        if not queue:
            del self._queued[(message.src, tag)]
        self._held -= message.nbytes
        return message

    def receive(self, src: Optional[int], tag: int, timeout: float) -> Message:
        """Post a receive and wait for it (at most ``timeout`` seconds):
        the message, or its error; :class:`PointToPointTimeout` when none
        came in time (the receive is withdrawn)."""
        box: Dict[str, Any] = {}
        done = threading.Event()

        def deliver(message: Optional[Message], error: Optional[BaseException]) -> None:
            box["message"], box["error"] = message, error
            done.set()

        self.post(src, tag, deliver)
        if not done.wait(timeout):
            self.withdraw(deliver)
            if not done.is_set():
                raise PointToPointTimeout(
                    f"timed out: rank {self.rank} received nothing from "
                    f"{'any rank' if src is None else f'rank {src}'} with tag {tag} within "
                    f"{timeout:g} s", src=src, dst=self.rank, tag=tag)
        if box["error"] is not None:
            raise box["error"]
        return box["message"]

    def withdraw(self, deliver: Deliver) -> bool:
        """Take back the waiting receive posted with ``deliver``; False when
        it is no longer waiting (it got its message or error)."""
        with self._lock:
            for i, receive in enumerate(self._waiting):
                if receive.deliver is deliver:
                    del self._waiting[i]
                    return True
        return False

    def source_gone(self, src: int, error: BaseException) -> None:
        """``src`` sends nothing more: its receives fail with ``error`` once
        its messages already here are taken (an any-source receive only
        when every other rank has gone)."""
        with self._lock:
            if src in self._gone:
                return
            self._gone[src] = error
            all_gone = len(self._gone) >= self.world - 1
            failed = [r for r in self._waiting if r.src == src or (r.src is None and all_gone)]
            self._waiting = [r for r in self._waiting if r not in failed]
        for receive in failed:
            _call(receive.deliver, None, error)

    def fail(self, error: BaseException) -> None:
        """Fail every waiting receive and every later one with ``error``
        (the first error stays the cause); the messages held are dropped."""
        with self._lock:
            if self.failure is None:
                self.failure = error
            error = self.failure
            failed, self._waiting = self._waiting, []
            self._queued.clear()
            self._held = 0
        for receive in failed:
            _call(receive.deliver, None, error)


def _call(deliver: Deliver, message: Optional[Message], error: Optional[BaseException]) -> None:
    try:
        deliver(message, error)
    except BaseException:  # noqa: BLE001 - a failing callback must not stop the transport
        log.exception("point to point: delivering a message failed")


#: called once a send is written out (None) or has failed (its error)
Sent = Callable[[Optional[BaseException]], None]


def _request(dst: int, tag: int, dtype: DType, data: np.ndarray) -> CollectiveRequest:
    itemsize = NUMPY_DTYPES[DType(dtype)].itemsize
    return CollectiveRequest(seq=tag, kind=int(Kind.SEND), op=int(Op.SUM), dtype=int(dtype),
                             root=dst, count=data.nbytes // itemsize, data=data)


# ---- through the service ----

class ServiceRoute:
    """Point to point through the collectives service on rank 0: a send is
    a SEND request (``root`` = destination, ``seq`` = tag) queued in the
    client's order, and the service's relays land in ``mailbox``."""

    direct = False

    def __init__(self, client: Any, mailbox: Mailbox) -> None:
        self._client = client
        self.mailbox = mailbox
        previous = client.on_failure

        def on_failure(error: BaseException) -> None:
            mailbox.fail(error)
            if previous is not None:
                previous(error)

        client.on_failure = on_failure
        if client.failure is not None:
            mailbox.fail(client.failure)
        client.set_on_message(self._arrived)

    def _arrived(self, seq: int, dtype: int, data: np.ndarray) -> None:
        src, tag = split_relayed_seq(seq)
        if tag == DEPARTED_TAG:
            self.mailbox.source_gone(src, CollectiveAborted(
                f"rank {src} left the group: nothing more can come from it", rank=src, seq=None))
            return
        count = data.nbytes // NUMPY_DTYPES[DType(dtype)].itemsize
        try:
            self.mailbox.put(Message(src, tag, dtype, count, data))
        except PointToPointOverflow:
            pass  # the mailbox has failed: every receive says why

    def send(self, dst: int, tag: int, dtype: DType, data: np.ndarray, sent: Sent,
             before_send: Optional[Callable[[], None]] = None) -> None:
        """Queue ``data`` for ``dst``; ``sent`` runs once it is written out."""
        self._client.submit_send(_request(dst, tag, dtype, data), sent, before_send=before_send)

    def close(self) -> None:
        """Nothing of its own to close: the client goes with the group."""
        self.mailbox.fail(_group_closed())


def _group_closed() -> CollectiveAborted:
    """What a send or receive cut short by the group's close fails with."""
    return CollectiveAborted("the process group is closed", rank=None, seq=None)


# ---- direct links ----

class _Link:
    """One direct link: a sending thread with its queue, a receiving thread."""

    def __init__(self, owner: "PeerLinks", peer: int, chan: Any) -> None:
        self.owner = owner
        self.peer = peer
        self.chan = chan
        self.cond = threading.Condition()
        self.outbox: Deque[Tuple[CollectiveRequest, Optional[Callable[[], None]], Sent]] = \
            collections.deque()
        self.failure: Optional[BaseException] = None
        self.closing = False
        rank = owner.rank
        self.sender = threading.Thread(target=self._send_loop, daemon=True,
                                       name=f"ddpwire-p2p-send-{rank}-{peer}")
        self.receiver = threading.Thread(target=self._receive_loop, daemon=True,
                                         name=f"ddpwire-p2p-recv-{rank}-{peer}")

    def start(self) -> None:
        self.sender.start()
        self.receiver.start()

    def send(self, req: CollectiveRequest, before_send: Optional[Callable[[], None]],
             sent: Sent) -> None:
        with self.cond:
            if self.failure is not None:
                error: Optional[BaseException] = self.failure
            elif self.closing:
                error = _group_closed()
            else:
                self.outbox.append((req, before_send, sent))
                self.cond.notify_all()
                return
        sent(error)

    def _send_loop(self) -> None:
        while True:
            with self.cond:
                while not self.outbox and not self.closing and self.failure is None:
                    self.cond.wait()
                if self.failure is not None or not self.outbox:
                    return
                req, before_send, sent = self.outbox.popleft()
            try:
                if before_send is not None:
                    before_send()
                self.chan.send(req, deadline=time.monotonic() + self.owner.timeout)
            except BaseException as exc:  # noqa: BLE001 - fails this link, reported to every caller
                error = self._lost(exc)
                sent(error)
                return
            sent(None)

    def _receive_loop(self) -> None:
        owner = self.owner
        while True:
            try:
                msg = self.chan.expect([CollectiveRequest], deadline=time.monotonic() + _IDLE)
                if msg.kind != int(Kind.SEND) or msg.root != owner.rank or msg.seq > MAX_TAG:
                    raise PointToPointError(
                        f"rank {self.peer}'s link carried kind {msg.kind} for rank {msg.root} "
                        f"with tag {msg.seq}: not a message to rank {owner.rank}",
                        src=self.peer, dst=owner.rank)
                data = np.frombuffer(msg.data, dtype=np.uint8)
                owner.mailbox.put(Message(self.peer, int(msg.seq), int(msg.dtype),
                                          int(msg.count), data))
            except PointToPointOverflow:
                return  # the mailbox has failed: every receive says why
            except BaseException as exc:  # noqa: BLE001 - the peer is gone for good
                self._lost(exc)
                return

    def _lost(self, exc: BaseException) -> BaseException:
        """Fail this link (once): its sends and the receives from its peer."""
        with self.cond:
            if self.closing:
                error: BaseException = _group_closed()
                first = False
            else:
                first = self.failure is None
                if first:
                    self.failure = exc if isinstance(exc, CollectiveAborted) else CollectiveAborted(
                        f"rank {self.peer}'s point-to-point link failed: {exc}",
                        rank=self.peer, seq=None)
                error = self.failure
            queued, self.outbox = list(self.outbox), collections.deque()
            self.cond.notify_all()
        if first:
            self.chan.close()
            self.owner.mailbox.source_gone(self.peer, error)
        for _, _, sent in queued:
            sent(error)
        return error

    def close(self, timeout: float) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        if self.sender.ident is not None and self.sender is not threading.current_thread():
            self.sender.join(timeout)  # what is queued goes out first
        self.chan.close()
        if self.receiver.ident is not None and self.receiver is not threading.current_thread():
            self.receiver.join(timeout)
        with self.cond:
            queued, self.outbox = list(self.outbox), collections.deque()
        for _, _, sent in queued:
            sent(_group_closed())


class PeerLinks:
    """Direct links from one rank to every other for point to point (no
    byte passes through rank 0). A message is a CollectiveRequest of kind
    SEND (``root`` = destination, ``seq`` = tag) on the link between the
    two ranks; each link has its own sending and receiving thread, and a
    receiving thread files what it reads in ``mailbox``.

    ``timeout`` bounds each send; with ``heartbeat`` (seconds) idle links
    carry Heartbeats and a peer silent for ``silence`` seconds is lost,
    failing the receives that wait for it (CollectiveAborted naming it).
    """

    direct = True

    def __init__(self, channels: List[Any], rank: int, mailbox: Mailbox, timeout: float, *,
                 heartbeat: Optional[float] = None, silence: Optional[float] = None) -> None:
        from ..wire.channel import Heartbeats

        self.rank = rank
        self.mailbox = mailbox
        self.timeout = timeout
        self._links: List[Optional[_Link]] = []
        for peer, chan in enumerate(channels):
            if chan is None:
                self._links.append(None)
                continue
            chan.heartbeat_timeout = silence if heartbeat else None
            self._links.append(_Link(self, peer, chan))
        self._beats = Heartbeats(heartbeat, lambda: [c for c in channels if c is not None],
                                 f"ddpwire-rank-{rank}-p2p-heartbeat")
        for link in self._links:
            if link is not None:
                link.start()
        self._beats.start(f"rank {rank}")

    def send(self, dst: int, tag: int, dtype: DType, data: np.ndarray, sent: Sent,
             before_send: Optional[Callable[[], None]] = None) -> None:
        """Queue ``data`` for ``dst`` on its link; ``sent`` runs once it is
        written out, or with the link's error."""
        link = self._links[dst]
        if link is None:
            raise ValueError(f"ddpwire send: rank {dst} is this rank")
        link.send(_request(dst, tag, dtype, data), before_send, sent)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, close every link and fail the receives
        still waiting."""
        self._beats.stop()
        for link in self._links:
            if link is not None:
                link.close(timeout)
        self._beats.stop(timeout)
        self.mailbox.fail(_group_closed())


def form_peer_links(client: Any, rank: int, world: int, mailbox: Mailbox, *, listen_host: str,
                    advertise: str, timeout: float, ports: Optional[Tuple[int, int]] = None,
                    heartbeat: Optional[float] = None,
                    silence: Optional[float] = None, sealed: bool = False) -> Optional[PeerLinks]:
    """Open this rank's point-to-point links (every rank calls it once, at
    the group's set-up, in the same order as its collectives): the same
    key, address exchange, handshake and all-or-nothing verdict as the rank
    links (:func:`ddpwire.plane.rank_links.open_channels`). None, on every rank
    alike, when some rank could not open all its links: point to point
    then goes through the service."""
    from .rank_links import open_channels

    channels = open_channels(client, rank, world, listen_host=listen_host, advertise=advertise,
                             timeout=timeout, ports=ports, what="point-to-point messages",
                             sealed=sealed)
    if channels is None:
        return None
    return PeerLinks(channels, rank, mailbox, timeout, heartbeat=heartbeat, silence=silence)
