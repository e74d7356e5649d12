"""One side of a ddpwire connection, message by message.

A :class:`Channel` wraps the compiled :class:`~ddpwire._core.Connection` with
what both roles need: a send lock (a background heartbeat must never land in
the middle of a frame), heartbeat frames skipped on receive, and gradient
frames received in two halves so their elements go straight into the
caller's buffer.
"""
from __future__ import annotations

import logging
import math
import select
import socket
import struct
import threading
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple, Type

import numpy as np

from .. import _core
from .._core import encode_frame_parts
from .errors import DdpwireError, GradientMismatch, OptionError, PeerLost, UnexpectedMessage
from .messages import GradientPayload, Heartbeat, StepTiming

from .._core import DEFAULT_MAX_FRAME

log = logging.getLogger("ddpwire.channel")


def check_timeout(name: str, value: float) -> float:
    """A timeout in seconds: finite and positive (NaN would wait forever,
    zero or less would never wait)."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise OptionError(f"{{{name}}} must be a number of seconds, got {OptionError.literal(value)}",
                          **{name: None}) from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise OptionError(f"{{{name}}} must be a finite number of seconds > 0, got "
                          f"{OptionError.literal(value)}", **{name: None})
    return seconds


#: connections a listener keeps handshaking at once (the coordinator's
#: joins, a mesh member's peers owing their PeerHello): past this a new one
#: is closed unread, so a flood of idle clients costs bounded memory
MAX_PENDING = 64
#: heartbeat intervals a peer may stay silent before it is lost, where
#: ``heartbeat_timeout`` is not given: one lost or late heartbeat is no loss
HEARTBEAT_MISSES = 3.0


def heartbeat_limit(heartbeat: Optional[float],
                    heartbeat_timeout: Optional[float]) -> Optional[float]:
    """How long a peer may stay silent before it is lost: ``heartbeat_timeout``
    (checked), else :data:`HEARTBEAT_MISSES` intervals of ``heartbeat``; None
    without heartbeats. Worker and coordinator both take it from here, so
    their defaults cannot drift apart."""
    if heartbeat_timeout is not None:
        return check_timeout("heartbeat_timeout", heartbeat_timeout)
    return HEARTBEAT_MISSES * heartbeat if heartbeat else None


def result_buffer(out: Optional[np.ndarray], count: Optional[int]) -> Optional[np.ndarray]:
    """Where an average of ``count`` float32 elements goes: ``out`` when it
    can take them, a new array when ``out`` is None (None while ``count`` is
    not known yet). Checked before any byte is read, so a wrong ``out`` never
    leaves a frame half received: TypeError for anything but a writable
    C-contiguous float32 array (float64 would take the bytes as other
    numbers), ValueError for the wrong length."""
    if out is None:
        return None if count is None else np.empty(count, dtype=np.float32)
    if (not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.ndim != 1
            or not out.flags.c_contiguous or not out.flags.writeable):
        what = (f"numpy.ndarray of dtype {out.dtype}, shape {out.shape}"
                + ("" if out.flags.writeable else ", read-only")
                if isinstance(out, np.ndarray) else type(out).__name__)
        raise TypeError(f"out: expected a writable 1-D C-contiguous float32 numpy array, "
                        f"got {what}")
    if count is not None and len(out) != count:
        raise ValueError(f"out: has {len(out)} elements, the gradients have {count}")
    return out


#: what a peer may send between the frames a caller waits for, and
#: :meth:`Channel.read_head` skips: signs of life, never answers
SIDE_MESSAGES = (Heartbeat, StepTiming)
#: the most bytes one receive of Channel.discard_gradients takes
_DISCARD_CHUNK = 1 << 20


class Channel:
    """Messages to and from one peer over a connected TCP socket."""

    def __init__(
        self,
        sock: socket.socket,
        *,
        timeout: float,
        peer_name: str,
        lost: Type[PeerLost],
        peer_id: Optional[int] = None,
        max_frame: int = DEFAULT_MAX_FRAME,
        heartbeat_timeout: Optional[float] = None,
    ) -> None:
        self.conn = _core.Connection(sock, peer_id=peer_id, lost=lost, peer_name=peer_name)
        self.timeout = timeout
        self.max_frame = max_frame
        # With heartbeats on, a live peer is never silent for long, so silence
        # is detected sooner than the (long) compute timeout.
        self.heartbeat_timeout = heartbeat_timeout
        self.send_lock = threading.Lock()
        #: time.monotonic() when the last message other than a Heartbeat
        #: was read here (None before the first): on a worker, when the
        #: coordinator last spoke, where its wait for this worker's step began
        self.last_message_at: Optional[float] = None
        #: a send has begun and not completed (send(), a heartbeat, or the
        #: coordinator's sends to every worker at once): true while a frame
        #: goes out, and after an exception cut one short, when the stream
        #: is inside a frame for good and no other frame may follow it
        self.frame_open = False
        #: called with each StepTiming the peer sends (docs/extensions.md,
        #: "Shards by measured speed"); None: the peer sends none, and one is
        #: refused as an unexpected message
        self.on_timing: Optional[Callable[[StepTiming], None]] = None

    @property
    def peer_id(self) -> Optional[int]:
        return self.conn.peer_id

    @peer_id.setter
    def peer_id(self, value: Optional[int]) -> None:
        self.conn.peer_id = value

    @property
    def read_timeout(self) -> float:
        return self.heartbeat_timeout if self.heartbeat_timeout is not None else self.timeout

    def send(self, msg: Any, *, step: Optional[int] = None,
             deadline: Optional[float] = None) -> None:
        """Encode and send one message; a gradient buffer is written from where
        it lies (scatter-gather), never copied into the frame. ``deadline``
        (time.monotonic()) bounds the whole send, not only the peer's silence."""
        parts = encode_frame_parts(msg, max_frame=self.max_frame)
        with self.send_lock:
            self.frame_open = True
            self.conn.send_parts(parts, self.timeout, deadline=deadline, step=step,
                                 what=f"sending {type(msg).__name__}")
            self.frame_open = False

    def send_all(self, msgs: Sequence[Any], *, step: Optional[int] = None) -> None:
        """Encode ``msgs`` (no gradient buffer among them) and send them back
        to back in one write: a step's shard and its scale wake the peer
        once, not once a frame (issue 38: on a busy machine each wake-up
        is a scheduling round on the step's critical path)."""
        parts: List[Any] = []
        for msg in msgs:
            # a message without a bulk field is (head, None, b""): only its head goes
            parts.extend(p for p in encode_frame_parts(msg, max_frame=self.max_frame) if p)
        with self.send_lock:
            self.frame_open = True
            self.conn.send_parts(parts, self.timeout, step=step,
                                 what="sending " + " and ".join(type(m).__name__ for m in msgs))
            self.frame_open = False

    def try_send_heartbeat(self, node_id: str) -> None:
        """Send a Heartbeat unless a frame is being sent (bytes are flowing then)."""
        if not self.send_lock.acquire(blocking=False):
            return
        try:
            msg = Heartbeat(node_id=node_id, timestamp_ms=int(time.time() * 1000))
            self.frame_open = True
            self.conn.send_parts(encode_frame_parts(msg), self.read_timeout, what="sending Heartbeat")
            self.frame_open = False
        finally:
            self.send_lock.release()

    def send_last(self, msg: Any, *, lock_wait: float, timeout: float, what: str) -> bool:
        """Send ``msg`` as the last frame from this side, then shut the
        sending half (the peer reads it, then the end of the stream).
        Only between two frames: a stream left inside one (an exception cut
        a frame short) would take ``msg`` for the rest of it, and so would
        a closed connection's peer; a heartbeat going out is waited for up
        to ``lock_wait`` seconds. Returns whether ``msg`` went out; a send
        that fails raises (DdpwireError, OSError)."""
        if self.conn.fileno() < 0 or not self.send_lock.acquire(timeout=max(0.0, lock_wait)):
            return False
        try:
            if self.frame_open:
                return False
            self.conn.send_parts(encode_frame_parts(msg, max_frame=self.max_frame), timeout,
                                 what=what)
            self.conn.sock.shutdown(socket.SHUT_WR)
            return True
        finally:
            self.send_lock.release()

    def read_head(self, expected: Sequence[type], *, step: Optional[int] = None,
                  what: str = "receiving", deadline: Optional[float] = None) -> Any:
        """The next frame other than a Heartbeat: a whole message, or the
        FrameHead of a gradient message whose elements are still to come.

        Any type outside ``expected`` (and Heartbeat) is refused by its tag,
        before its body is received. It must arrive by ``deadline`` (a
        time.monotonic() value; default ``timeout`` from now): Heartbeats
        show the peer is alive but never extend it, and with heartbeats on, a
        peer silent for ``heartbeat_timeout`` is lost sooner."""
        if deadline is None:
            deadline = time.monotonic() + self.timeout
        while True:
            obj = self.read_frame(expected, step=step, what=what, deadline=deadline)
            if isinstance(obj, Heartbeat) or (isinstance(obj, StepTiming)
                                              and StepTiming not in expected):
                continue
            return obj

    def read_frame(self, expected: Sequence[type], *, deadline: float,
                   step: Optional[int] = None, what: str = "receiving") -> Any:
        """The next frame, a Heartbeat included (read_head without skipping
        them): for a caller that watches several peers at once and counts a
        Heartbeat as a sign of life. It must be complete by ``deadline``.
        A StepTiming, sent ahead of a step's gradients, goes to
        :attr:`on_timing` first and is returned too: such a caller counts
        it as a sign of life, as a Heartbeat (:data:`SIDE_MESSAGES`)."""
        side = (Heartbeat,) if self.on_timing is None else SIDE_MESSAGES
        silence = self.read_timeout
        if self.heartbeat_timeout is None:
            # a deadline past the timeout is a wait that nests another's
            # (ddpwire.plane.deadlines), during which the peer has nothing to say
            silence = max(silence, deadline - time.monotonic())
        obj = _core.read_frame_head(self.conn, silence, self.max_frame,
                                    deadline=deadline, expect=tuple(expected) + side,
                                    step=step, what=what)
        if not isinstance(obj, Heartbeat):
            self.last_message_at = time.monotonic()
        if isinstance(obj, StepTiming) and StepTiming not in expected:
            self.on_timing(obj)  # type: ignore[misc]
        return obj

    def expect(self, expected: Sequence[type], *, step: Optional[int] = None,
               deadline: Optional[float] = None) -> Any:
        """The next whole message, which must be one of ``expected``."""
        names = " or ".join(t.__name__ for t in expected)
        obj = self.read_head(expected, step=step, what=f"waiting for {names}", deadline=deadline)
        if isinstance(obj, tuple(expected)):
            return obj
        raise UnexpectedMessage(names, message_name(obj), worker_id=self.peer_id, step=step)

    def recv_gradients(self, head: "_core.FrameHead", out: Optional[np.ndarray], *,
                       step: Optional[int] = None) -> Tuple[np.ndarray, Any, Optional[int]]:
        """Receive the elements announced by ``head`` into ``out`` (allocated
        when None) and then the fields after them. Returns (gradients, tail,
        the index of the first non-finite element or None), the elements
        checked in the same pass that receives them."""
        count = head.gradient_count
        if out is None:
            out = np.empty(count, dtype=np.float32)
        elif len(out) != count:
            # The elements are still in the socket: the stream is out of step now.
            self.close()
            raise GradientMismatch("gradients length", len(out), count,
                                   worker_id=self.peer_id, step=step)
        bad = self.conn.recv_into(out, self.read_timeout, check_finite=True, step=step,
                                  what=f"receiving {head.message_type}.gradients")
        tail = _core.read_tail(self.conn, head, self.read_timeout, step=step)
        return out, tail, bad

    def discard_gradients(self, head: Optional["_core.FrameHead"], received: int, *,
                          deadline: float, step: int) -> None:
        """Read and drop the rest of the peer's GradientPayload for ``step``:
        its head too when ``head`` is None (not read yet), else the
        ``received`` bytes of the body already read are skipped (what an
        elastic coordinator does with a survivor's gradients for a step it
        calls off). A peer that fails meanwhile raises its ``lost`` error;
        another frame than a GradientPayload is a ProtocolError, refused by
        its tag."""
        if head is None:
            head = self.read_head([GradientPayload], step=step, deadline=deadline,
                                  what="reading the rest of a step called off")
            received = 0
        left = 4 * head.gradient_count + head.tail_len - received
        scratch = memoryview(bytearray(min(max(left, 0), _DISCARD_CHUNK)))
        while left > 0:
            take = min(left, len(scratch))
            self.conn.recv_into(scratch[:take], self.read_timeout, deadline=deadline, step=step,
                                what=f"reading the rest of a GradientPayload (step {step} "
                                     f"called off)")
            left -= take

    def wait_for_frame(self, timeout: float) -> bool:
        """Wait until the peer has started its next frame (True) or has
        closed the connection (False), for at most ``timeout`` seconds
        (then the peer's ``lost`` error): for a server whose peers decide
        when training ends."""
        sock = self.conn.sock
        if self.conn.held():  # opened from a sealed record already: no wait on the socket
            return True
        ready, _, _ = select.select([sock], [], [], check_timeout("timeout", timeout))
        if not ready:
            raise self.conn.lost(f"{self.conn.peer_name} silent for {timeout:g} s",
                                 worker_id=self.peer_id)
        return still_open(sock)

    def close(self) -> None:
        self.conn.close()

    def reset(self) -> None:
        """Close with a reset, dropping what is still queued to send: for a
        peer that reads slowly, which would otherwise read all of it (and
        wait out TCP's zero-window probes) before it learns of the end."""
        try:
            self.conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                      struct.pack("ii", 1, 0))
        except OSError:
            pass  # closed already
        self.conn.close()


class Heartbeats:
    """A Heartbeat on each of ``channels()`` every ``interval`` seconds,
    from a daemon thread named ``name``, from :meth:`start` (which names the
    sender) until :meth:`stop`; an ``interval`` of None (heartbeats off)
    starts nothing. A channel inside a frame is skipped (bytes are flowing
    there), and one whose send fails is only logged: its reader finds out."""

    def __init__(self, interval: Optional[float], channels: Callable[[], Sequence["Channel"]],
                 name: str) -> None:
        self.interval = interval
        self.node_id = ""
        self._channels = channels
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self, node_id: str) -> None:
        """Start beating as ``node_id`` (once; not after :meth:`stop`)."""
        if self.interval and not self._stopped.is_set() and self._thread.ident is None:
            self.node_id = node_id
            self._thread.start()

    def stop(self, wait: Optional[float] = None) -> None:
        """No Heartbeat after this returns, with ``wait`` (seconds) for one
        in flight to end: closing its channel first wakes it."""
        self._stopped.set()
        thread = self._thread
        if wait is not None and thread.ident is not None and thread is not threading.current_thread():
            thread.join(wait)

    def _run(self) -> None:
        assert self.interval
        while not self._stopped.wait(self.interval):
            for chan in list(self._channels()):
                try:
                    chan.try_send_heartbeat(self.node_id)
                except (DdpwireError, OSError) as exc:
                    log.debug("heartbeat on %s failed: %s", chan.conn.peer_name, exc)


def still_open(sock: socket.socket) -> bool:
    """False when the peer has closed (or reset) the connection; True while
    it is open, with or without bytes waiting. Takes nothing from the socket."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except (BlockingIOError, InterruptedError):
        return True
    except OSError:
        return False


def message_name(obj: Any) -> str:
    """The protocol name of a received message or frame head."""
    if isinstance(obj, _core.FrameHead):
        return obj.message_type
    return type(obj).__name__
