"""A man in the middle for tests of sealed links (tests/test_seal.py): a TCP
relay between two peers that forwards the frames they exchange in the
clear (the join's, or a link's PeerHellos), then cuts each direction into
sealed records (csrc/sealed.c: u32 LE length, ciphertext, 16-byte tag) and
can flip a bit of one, drop, replay, reorder or inject one. Everything
forwarded is kept, to look for plaintext in it."""
from __future__ import annotations

import os
import socket
import threading
from typing import Callable, Dict, List, Optional, Tuple

TAG_BYTES = 16
#: plaintext bytes of a full record: the one a tamper aims at is full, so it
#: is part of a large frame (a gradient), never a small control message
FULL = 64 * 1024

UP, DOWN = "up", "down"  # dialer -> listener, listener -> dialer
#: clear_until's value for a direction that is never sealed
ALL = "all"


def _exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return bytes(out)


class Tamper:
    """What to do to the first full record going ``direction``: "flip" a
    bit of its ciphertext, "drop" it, "replay" it (sent twice), "reorder"
    it (sent after the next), or "inject" a record of random bytes before
    it. ``done`` is set once it has been done."""

    def __init__(self, action: str, direction: str = UP) -> None:
        assert action in ("flip", "drop", "replay", "reorder", "inject"), action
        self.action, self.direction = action, direction
        self.done = threading.Event()
        self._held: Optional[bytes] = None

    def __call__(self, direction: str, record: bytes) -> List[bytes]:
        if direction != self.direction:
            return [record]
        if self._held is not None:  # reorder: the next record, then the held one
            held, self._held = self._held, None
            self.done.set()
            return [record, held]
        if self.done.is_set() or int.from_bytes(record[:4], "little") != FULL:
            return [record]
        if self.action == "reorder":
            self._held = record
            return []
        self.done.set()
        if self.action == "flip":
            bad = bytearray(record)
            bad[4 + 1000] ^= 0x10
            return [bytes(bad)]
        if self.action == "drop":
            return []
        if self.action == "replay":
            return [record, record]
        fake = (200).to_bytes(4, "little") + os.urandom(200 + TAG_BYTES)
        return [fake, record]


class Relay:
    """Listens on loopback; the first connection is relayed to ``target``.
    ``clear_until`` maps a direction to the tag of its last frame in the
    clear (None: none, sealed from the first byte; :data:`ALL`: every
    byte in the clear, forwarded as it comes); ``tamper`` (a
    :class:`Tamper` or any callable (direction, record) -> records) sees
    every sealed record."""

    def __init__(self, target: Tuple[str, int], clear_until: Dict[str, Optional[int]],
                 tamper: Optional[Callable[[str, bytes], List[bytes]]] = None) -> None:
        self.target = target
        self.clear_until = clear_until
        self.tamper = tamper
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.addr: Tuple[str, int] = self.listener.getsockname()[:2]
        #: every byte forwarded, per direction
        self.captured: Dict[str, bytearray] = {UP: bytearray(), DOWN: bytearray()}
        #: sealed records forwarded, per direction
        self.records: Dict[str, int] = {UP: 0, DOWN: 0}
        self._socks: List[socket.socket] = []
        # a socket is closed only by the last thread that uses it (the
        # acceptor, then the last pump): one thread's close() under another's
        # recv() would race for the descriptor; the others shut it down
        self._lock = threading.Lock()
        self._pumps = 0
        self._closing = False
        self._accepting = True
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.listener.settimeout(60)
        try:
            client, _ = self.listener.accept()
        except OSError:
            return
        finally:
            with self._lock:
                self._accepting = False
                self.listener.close()
        server = socket.create_connection(self.target, timeout=60)
        for s in (client, server):
            s.settimeout(None)
        with self._lock:
            self._socks = [client, server]
            self._pumps = 2
            if self._closing:
                self._shut()
        for src, dst, direction in ((client, server, UP), (server, client, DOWN)):
            threading.Thread(target=self._pump, args=(src, dst, direction), daemon=True).start()

    def _send(self, dst: socket.socket, data: bytes, direction: str) -> None:
        self.captured[direction] += data
        dst.sendall(data)

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        try:
            last = self.clear_until.get(direction)
            while last is ALL:
                chunk = src.recv(1 << 16)
                if not chunk:
                    raise EOFError
                self._send(dst, chunk, direction)
            while last is not None:
                head = _exact(src, 4)
                body = _exact(src, int.from_bytes(head, "big"))
                self._send(dst, head + body, direction)
                if body[:1] == bytes([last]):
                    break
            while True:
                head = _exact(src, 4)
                record = head + _exact(src, int.from_bytes(head, "little") + TAG_BYTES)
                self.records[direction] += 1
                for out in (self.tamper(direction, record) if self.tamper else [record]):
                    self._send(dst, out, direction)
        except EOFError:
            # the end of one direction is passed on: the other may go on
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        except OSError:
            with self._lock:
                self._shut()
        with self._lock:
            self._pumps -= 1
            if self._pumps == 0:
                for s in self._socks:
                    s.close()

    def _shut(self) -> None:
        """Both peers hear the end at once (the lock held)."""
        for s in self._socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        """End the relay: the pumps wake, and the last one closes."""
        with self._lock:
            self._closing = True
            self._shut()
            if self._accepting:
                try:
                    # wakes the accept() still waiting: it closes the listener
                    self.listener.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
