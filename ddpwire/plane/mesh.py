"""The mesh: workers average a flat step among themselves, the coordinator
only decides whether the result may be applied.

The star moves N vectors through the coordinator's link each way; the mesh
moves 2·(N−1)/N of one vector through each worker's link, as a ring does,
in two hops. Worker w owns slice w of the vector (N contiguous element
ranges, near-equal unless the Mesh is given fractions; :mod:`ddpwire.plane.plan`
cuts them, and the coordinator's part, for every worker alike):

1. reduce-scatter: every worker sends slice j of its gradient to worker j
   and receives its own slice from every other; the owner averages it as
   the reference does (float32 sum in worker order, then a true division);
2. each worker sends the coordinator a StepReport (its loss and counts, and
   the first non-finite element found in its slice); the coordinator answers
   every worker the same StepCommit, which either lets the step go on or
   halts it, naming the worker and element at fault;
3. allgather: only after a go-ahead, every worker sends its averaged slice
   to every other, straight into their output buffers.

Each exchange moves its frames' elements in one GIL-free call that runs the
kernels on them as they move (:func:`ddpwire._core.exchange_many`): a
peer's slice is narrowed to 16 bits just ahead of its bytes, the owner's
average is computed range by range as every peer's bytes of that range are
in, and an allgather's 16 bits are widened as they arrive. The kernels are
element-wise, so the bits are those of one pass over the whole slice; the
bytes on the wire are the frames either way.

So every worker ends with the bits the star gives, and no worker holds any
averaged element before the coordinator has seen that the whole vector is
finite. The links between workers are ddpwire-only: each opens with a
PeerHello both ways proving the session's mesh key (sent by the coordinator
in MeshPeers), and slices travel as CollectiveRequest frames (seq = step,
kind reduce_scatter or allgather, root = the sender). A worker's port
handshakes every connection at once, each within :data:`HELLO_TIMEOUT`, so
strangers there are dropped without holding up a peer. docs/extensions.md
has the bytes; docs/sessions.md the timeouts and failures.

When every worker is on one host (the coordinator says so in MeshPeers,
from the host ids in the workers' offers) the same step runs through one
shared segment instead (:class:`ddpwire.plane.shm.SharedPlane`, the torch backend's
plane too): the links open as above and
carry only the segment's set-up; gradients and averages move through
memory, with the same arithmetic per element, reports and go-ahead, and the
same bits.

With a 16-bit codec (compression="bf16" or "fp16" on the coordinator) the
slices travel as 16-bit words: each worker rounds its gradient once, owners
widen, sum in float32 in worker order, divide, and round the average back,
and every worker widens the same 16-bit average.
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import ipaddress
import logging
import secrets
import select
import selectors
import socket
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import _core
from . import codecs as _codecs
from . import plan as _plan
from . import reduce as _reduce
from ..wire import seal
from . import shm as _shm
from .._text import counted
from ..wire.channel import MAX_PENDING, Channel, check_timeout
from ..wire.errors import (GradientMismatch, NonFiniteGradient, NotACoordinator, ProtocolError,
                     ShutdownDuringReduce, UnexpectedMessage, WorkerLost)
from ..wire.extensions import Codec, CollectiveKind, DType, ReduceOp, decode_u16, encode_u16
from ..wire.messages import (
    NO_WORKER, AveragedGradient, CollectiveRequest, GradientPayload, Heartbeat, MeshPeers,
    PeerHello, Shutdown,
)
# the plan's helpers stay importable from here (their home before ddpwire.plane.plan)
from .plan import Plan, coordinator_part, share_value, slice_bounds

__all__ = ["Mesh", "SliceOutcome", "auto_share", "coordinator_part", "format_peers", "listen",
           "parse_peers", "parse_ports", "offer", "peer_host", "peer_port", "share_value",
           "slice_bounds"]

log = logging.getLogger("ddpwire.mesh")

_HELLO_LABEL = b"ddpwire mesh hello v1"
HOST_ID_BYTES = 16  # ddpwire.plane.shm.host_id()
MAX_PEERS_TEXT = 60000  # MeshPeers.peers fits a small frame
#: How long a connection on a worker's mesh port has, from its accept, to
#: send its whole PeerHello (however slowly its bytes come). A peer sends
#: its hello as soon as it has dialed, so only strangers come near it; all
#: connections handshake at once, so none waits on another's allowance.
HELLO_TIMEOUT = 5.0
#: the one frame a connection on the mesh port sends before it is a link
_HELLO_FRAME = len(_core.encode_frame(PeerHello(worker_id=0, proof=bytes(32))))
#: the vector sizes whose scratch a Mesh keeps (a process group's buckets)
SCRATCH_SIZES = 8
#: The congestion control the mesh links ask for (where the kernel lets a
#: socket choose, Linux). Every worker sends N-1 bulk flows at once through
#: its one link and the step ends with the slowest flow, so the links want
#: an algorithm that shares a bottleneck evenly among flows that start
#: together. BBR (v1), some hosts' default, does not: on the emulated 1
#: Gbit/s cluster with 4 workers its flows left each link 87% busy against
#: 93% for cubic (bench/results/notebook.md). None keeps the system's choice.
DEFAULT_CONGESTION: Optional[str] = "cubic"


# ---- join: the offer, the peer table ----

def listen(local_host: str, backlog: int = 64,
           ports: Optional[Tuple[int, int]] = None) -> socket.socket:
    """A listening socket for links from other workers, on the address this
    worker reaches the coordinator from (the one the coordinator will hand
    out), on a port of the kernel's choosing, or the first free one of
    ``ports`` (first, last), for a firewall that opens only those."""
    family = socket.AF_INET6 if ":" in local_host else socket.AF_INET
    candidates = [0] if ports is None else list(range(ports[0], ports[1] + 1))
    for port in candidates:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((local_host, port))
            sock.listen(backlog)
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE and port != candidates[-1]:
                continue
            if exc.errno == errno.EADDRINUSE:
                raise OSError(exc.errno, f"every port of {ports[0]}-{ports[1]} is taken "
                                         f"on {local_host}") from None
            raise
        except BaseException:
            sock.close()
            raise
        return sock
    raise AssertionError("unreachable")  # candidates is never empty


def parse_ports(text: str) -> Tuple[int, int]:
    """A port range "first-last" (or one port) as (first, last)."""
    first, _, last = text.strip().partition("-")
    try:
        lo, hi = int(first), int(last or first)
    except ValueError:
        raise ValueError(f"a port range is FIRST-LAST (say 29600-29700), got {text!r}") from None
    if not 1 <= lo <= hi <= 65535:
        raise ValueError(f"a port range is FIRST-LAST within 1-65535, got {text!r}")
    return lo, hi


def offer(listener: socket.socket, host: Optional[bytes] = None) -> bytes:
    """The mesh entry of a JoinRequest: the u16 port other workers dial,
    then, when given, the 16-byte :func:`ddpwire.plane.shm.host_id` of this
    worker's machine (a worker that may share memory with the others)."""
    value = encode_u16(listener.getsockname()[1])
    if host is not None:
        if len(host) != HOST_ID_BYTES:
            raise ValueError(f"a host id is {HOST_ID_BYTES} bytes, not {len(host)}")
        value += host
    return value


def peer_port(value: bytes) -> int:
    """The port in a worker's mesh offer (a ProtocolError when malformed or 0)."""
    port = decode_u16(value[:2] if len(value) == 2 + HOST_ID_BYTES else value)
    if port == 0:
        raise ProtocolError("mesh offer: port 0")
    return port


def peer_host(value: bytes) -> Optional[bytes]:
    """The host id in a worker's mesh offer, or None for a 2-byte offer."""
    return bytes(value[2:]) if len(value) == 2 + HOST_ID_BYTES else None


def format_peers(addresses: Sequence[Tuple[str, int]]) -> str:
    """MeshPeers.peers for (host, port) per worker, in worker order."""
    parts = [f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in addresses]
    text = ",".join(parts)
    if len(text) > MAX_PEERS_TEXT:
        raise ValueError(f"the peer table is {len(text)} characters, over {MAX_PEERS_TEXT}")
    return text


def parse_peers(text: str, world: int) -> List[Tuple[str, int]]:
    """The (host, port) list in MeshPeers.peers: exactly ``world`` entries of
    an IP address (IPv6 in brackets) and a port from 1 to 65535."""
    entries = text.split(",") if text else []
    if len(entries) != world:
        raise ProtocolError(f"MeshPeers.peers names {counted(len(entries), 'worker')}, "
                            f"the session has {world}")
    out = []
    for i, entry in enumerate(entries):
        host, sep, port_text = entry.rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        try:
            ipaddress.ip_address(host)
            port = int(port_text)
        except ValueError:
            port = 0
        if not sep or not 0 < port < 65536:
            raise ProtocolError(f"MeshPeers.peers entry {i} is not an address and port: {entry!r}")
        out.append((host, port))
    return out


def hello_proof(key: bytes, sender: int, receiver: int) -> bytes:
    """PeerHello.proof: HMAC-SHA256 of the direction under the mesh key, so a
    hello cannot be turned around or sent to another worker."""
    msg = _HELLO_LABEL + sender.to_bytes(4, "little") + receiver.to_bytes(4, "little")
    return hmac.new(key, msg, hashlib.sha256).digest()


def new_key() -> bytes:
    """A fresh mesh key for MeshPeers."""
    return secrets.token_bytes(32)


def auto_share(workers: int) -> float:
    """The part of the vector the coordinator takes on with equal links.

    During the reduce-scatter each worker's link sends (N-1)/N of its
    workers' part to the other workers plus the coordinator's part x, and
    receives as much back (the coordinator streams its average back within
    the same phase, as the star does); the coordinator's link carries N·x
    each way. The two would finish together at x = 1/(N+1), and the
    allgather then moves only (N-1)/N·(1-x): the step's floor per link
    falls from 2(N-1)/N vector sizes towards (2N-1)/(N+1) (1.5 to 1.4 at
    N = 4). At that balance every link is the bottleneck at once, and the
    coordinator's part, which waits for the slowest of its N flows, is late
    whenever they share a link unevenly: three quarters of it keeps most of
    the gain with slack (on the emulated 1 Gbit/s cluster, 4 workers: 0.15
    of the vector as fast as 0.2 and steadier, 0.25 slower than none; see
    bench/results/notebook.md). At N = 2 the floors are equal, so two workers keep
    the plain mesh."""
    return 0.75 / (workers + 1) if workers >= 3 else 0.0


# ---- the links ----

def check_congestion(name: Optional[str]) -> Optional[str]:
    """``name`` if it can be a congestion control algorithm's name (the
    kernel decides whether it has it), None for the system's choice."""
    if name is None or name == "":
        return None
    if not isinstance(name, str) or not name.isascii() or not name.isprintable() \
            or len(name) > 15 or " " in name:
        raise ValueError(f"tcp_congestion must be an algorithm's name such as 'cubic', "
                         f"got {name!r}")
    return name


def set_congestion(sock: socket.socket, name: Optional[str]) -> bool:
    """Ask the kernel to send ``sock``'s data under congestion control
    ``name``: True when it did. A kernel without that algorithm, one that
    does not allow it to unprivileged sockets, or a platform without the
    option keeps the system's choice (logged, the link works the same)."""
    if name is None:
        return False
    option = getattr(socket, "TCP_CONGESTION", None)
    if option is None:
        log.debug("mesh: this platform cannot choose TCP congestion control; %s not set", name)
        return False
    try:
        sock.setsockopt(socket.IPPROTO_TCP, option, name.encode("ascii"))
    except OSError as exc:
        log.info("mesh: TCP congestion control %s unavailable (%s); the system's is used",
                 name, exc.strerror or exc)
        return False
    return True


def _peer_channel(sock: socket.socket, peer: int, timeout: float, max_frame: int,
                  congestion: Optional[str] = None) -> Channel:
    set_congestion(sock, congestion)
    sock.setblocking(False)
    return Channel(sock, timeout=timeout, lost=WorkerLost, peer_id=peer,
                   peer_name=f"worker {peer} (mesh link)", max_frame=max_frame)


def _seal_link(chan: Channel, key: bytes, me: int, peer: int, sealed: bool) -> None:
    """Seal a link once both PeerHellos have crossed it (with ``sealed``:
    this worker's own link is sealed, so the mesh key came in secret). Its
    keys come from the mesh key, fresh in every MeshPeers, and the pair of
    workers, the lower one (which dialed) the initiator."""
    if not sealed:
        return
    low, high = min(me, peer), max(me, peer)
    context = low.to_bytes(4, "little") + high.to_bytes(4, "little")
    chan.conn.seal(*seal.derive(key, b"", seal.PEER_LABEL, context, initiator=me < peer))


def _connect_links(listener: socket.socket, peers: List[Tuple[str, int]], me: int, key: bytes,
                   timeout: float, max_frame: int, congestion: Optional[str] = None,
                   sealed: bool = False) -> List[Optional[Channel]]:
    """Dial every higher worker, accept every lower one; each link proves the
    key both ways, then is sealed when ``sealed`` (:func:`_seal_link`).
    Strangers on the listening port (silent, garbage, a wrong proof, a
    worker id that is taken or not lower) are handshaken beside the peers,
    each under :data:`HELLO_TIMEOUT`, and dropped by address while the wait
    goes on (:func:`_accept_links`)."""
    world = len(peers)
    deadline = time.monotonic() + timeout
    links: List[Optional[Channel]] = [None] * world
    try:
        for j in range(me + 1, world):
            left = max(0.001, deadline - time.monotonic())
            try:
                sock = socket.create_connection(peers[j], timeout=left)
            except OSError as exc:
                raise WorkerLost(f"cannot reach worker {j} at {peers[j][0]}:{peers[j][1]} "
                                 f"for the mesh: {exc}", worker_id=j) from None
            links[j] = chan = _peer_channel(sock, j, timeout, max_frame, congestion)
            chan.send(PeerHello(worker_id=me, proof=hello_proof(key, me, j)))
        _accept_links(listener, links, me, key, deadline, timeout, max_frame, congestion, sealed)
        for j in range(me + 1, world):
            chan = links[j]
            assert chan is not None
            hello = chan.expect([PeerHello], deadline=deadline)
            if hello.worker_id != j or not hmac.compare_digest(hello.proof,
                                                               hello_proof(key, j, me)):
                raise ProtocolError(f"worker {j}'s mesh link did not prove the session key",
                                    worker_id=j)
            _seal_link(chan, key, me, j, sealed)
    except BaseException:
        for chan in links:
            if chan is not None:
                chan.close()
        raise
    return links


@dataclass
class _Knock:
    """A connection on the mesh port that has not yet proved who it is."""

    sock: socket.socket
    name: str               # its address, for the log
    deadline: float         # its own, for the whole PeerHello
    reader: _core.FrameReader
    head: bytes = b""       # what it sent so far (one PeerHello at most)


def _accept_links(listener: socket.socket, links: List[Optional[Channel]], me: int, key: bytes,
                  deadline: float, timeout: float, max_frame: int,
                  congestion: Optional[str], sealed: bool = False) -> None:
    """Fill links[j] for every worker j below ``me`` from the connections on
    ``listener``, as the coordinator's join does (ddpwire.session.admission): one
    non-blocking loop over the listener and every connection still owing
    its PeerHello, so no connection waits on another's."""
    waiting = set(range(me))
    if not waiting:
        return
    knocks: Dict[socket.socket, _Knock] = {}  # in accept order: the first is the oldest
    listener.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)

    def drop(k: _Knock, why: str) -> None:
        # a stranger is named by its address only: it proved no worker id
        log.warning("mesh: dropped a link from %s: %s", k.name, why)
        del knocks[k.sock]
        sel.unregister(k.sock)
        k.sock.close()

    def accept() -> None:
        while True:
            try:
                sock, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("mesh: accept failed: %s", exc)
                return
            if len(knocks) >= MAX_PENDING:
                # A peer sends its hello as soon as it has dialed, so the
                # connection that has waited longest is the likeliest
                # stranger; closing the newcomer instead would let a flood
                # shut the peers out.
                drop(next(iter(knocks.values())),
                     f"{MAX_PENDING} connections were owing a PeerHello, this one the longest")
            sock.setblocking(False)
            k = _Knock(sock, f"{addr[0]}:{addr[1]}", time.monotonic() + HELLO_TIMEOUT,
                       _core.FrameReader(_core.tag_max_payload(PeerHello.TAG, max_frame),
                                         allowed_tags=(PeerHello.TAG,)))
            knocks[sock] = k
            sel.register(sock, selectors.EVENT_READ, k)

    def hear(k: _Knock) -> None:
        # never past the one frame: a peer's first step may follow our
        # reply on the same socket, and that is the Channel's to read
        try:
            data = k.sock.recv(_HELLO_FRAME - len(k.head))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            drop(k, f"connection failed: {exc}")
            return
        if not data:
            drop(k, "closed before its PeerHello")
            return
        k.head += data
        try:
            done = k.reader.feed(data)
        except ProtocolError as exc:
            service = NotACoordinator.service_of(k.head)
            drop(k, f"spoke {service}, not ddpwire" if service else f"not a PeerHello: {exc}")
            return
        if not done:
            return
        hello = done[0]
        assert isinstance(hello, PeerHello)  # the reader takes no other tag
        j = hello.worker_id
        if j not in waiting:
            drop(k, f"it claimed worker {j}, whose link is not due here")
            return
        if not hmac.compare_digest(hello.proof, hello_proof(key, j, me)):
            drop(k, f"it claimed worker {j} without the session's proof")
            return
        del knocks[k.sock]
        sel.unregister(k.sock)
        chan = _peer_channel(k.sock, j, timeout, max_frame, congestion)
        links[j] = chan
        waiting.discard(j)
        chan.send(PeerHello(worker_id=me, proof=hello_proof(key, me, j)))
        _seal_link(chan, key, me, j, sealed)

    try:
        while waiting:
            now = time.monotonic()
            if now >= deadline:
                missing = min(waiting)
                raise WorkerLost(f"worker {missing} did not open its mesh link within "
                                 f"{timeout:g} s", worker_id=missing)
            for k in [k for k in knocks.values() if now >= k.deadline]:
                drop(k, f"no PeerHello within {HELLO_TIMEOUT:g} s")
            wake = min([deadline] + [k.deadline for k in knocks.values()])
            for ready, _ in sel.select(max(0.0, wake - now)):
                if ready.fileobj is listener:
                    accept()
                elif ready.data.sock in knocks:  # not dropped by this pass's accept
                    hear(ready.data)
                if not waiting:
                    break
    finally:
        for k in list(knocks.values()):
            drop(k, "no PeerHello yet when the wait for the mesh links ended")
        sel.close()


@dataclass
class SliceOutcome:
    """What the owner found averaging its slice: the first non-finite
    element (worker, index in the whole vector, value), or bad_worker NO_WORKER."""

    bad_worker: int = NO_WORKER
    bad_index: int = 0
    bad_value: float = 0.0


def _check_share(share: int, coordinator: Optional[Channel], codec: int, shared_memory: int,
                 worker_id: int) -> None:
    # the coordinator's part travels as a GradientPayload: float32, over a link
    if share and (coordinator is None or codec != Codec.FLOAT32 or shared_memory):
        raise ProtocolError("MeshPeers.coordinator_share needs float32 over the links",
                            worker_id=worker_id)


@dataclass
class _CoordinatorLeg:
    """The coordinator's part of a reduce-scatter, on the worker's connection
    to it: a GradientPayload out, its AveragedGradient back, in the same
    calls as the slices between workers (so both finish together)."""

    chan: Channel
    head: bytes             # GradientPayload up to its elements
    data: np.ndarray        # the elements: the last coordinator_part() of the vector
    tail: bytes             # GradientPayload's loss, correct, total
    into: np.ndarray        # the averaged part (held until the StepCommit)
    reply_tail: bytearray   # AveragedGradient.global_loss


class Mesh:
    """A worker's links to every other worker of a mesh session, and the two
    exchanges of a mesh step (reduce-scatter, then allgather).

    ``fractions`` (one per worker, relative; None: equal) says how much of
    each vector every worker averages, cut by :class:`ddpwire.plane.plan.Plan`;
    a worker with fraction 0 owns no element but still sends the others
    their slices and receives the whole average. Every worker must be given
    the same fractions: a cut that differs is a GradientMismatch naming the
    worker, at the heads, before any element moves. Unequal fractions keep
    the steps on the links (see ``shared_memory``)."""

    def __init__(self, links: List[Optional[Channel]], worker_id: int, codec: Codec,
                 timeout: float, shared_memory: bool = False,
                 coordinator: Optional[Channel] = None, coordinator_share: int = 0,
                 fractions: Optional[Sequence[float]] = None) -> None:
        _check_share(coordinator_share, coordinator, codec, shared_memory, worker_id)
        self.fractions = _plan.check_fractions(fractions, len(links))
        self.links = links
        #: the connection to the coordinator, which averages the last
        #: coordinator_part() elements of each step itself (none when 0)
        self.coordinator = coordinator
        self.coordinator_share = coordinator_share
        # set while a GradientPayload to the coordinator is cut short: no
        # other frame may follow it on that connection
        self.coordinator_frame_open = False
        self.worker_id = worker_id
        self.world = len(links)
        self.codec = Codec(codec)
        self.timeout = timeout
        self._wire = wire = _codecs.by_code(self.codec)
        self._dtype, self._half = wire.dtype, wire.half
        self._scratch: Dict[Tuple[str, int, str], np.ndarray] = {}
        self._plans: Dict[int, Plan] = {}  # by vector length, as the scratch
        # the averaged slice between the two exchanges, and its step
        self._own: Optional[np.ndarray] = None
        self._step: Optional[int] = None
        self._part: Optional[np.ndarray] = None  # the coordinator's averaged part
        # The coordinator saw every worker on one host: the first step
        # tries to set up a shared segment, and steps use it once every
        # worker has attached, cut by the same plan as the links.
        self._want_shared = bool(shared_memory) and self.codec == Codec.FLOAT32
        self.plane: Optional[_shm.SharedPlane] = None

    @classmethod
    def connect(cls, listener: socket.socket, table: MeshPeers, worker_id: int, world: int, *,
                timeout: float, max_frame: int,
                congestion: Optional[str] = DEFAULT_CONGESTION,
                coordinator: Optional[Channel] = None,
                fractions: Optional[Sequence[float]] = None) -> "Mesh":
        """Open the links a MeshPeers names (closing ``listener`` afterwards),
        each sending under TCP congestion control ``congestion`` where the
        kernel has it (:data:`DEFAULT_CONGESTION`; None: the system's).
        ``coordinator`` is this worker's connection to the coordinator, which
        carries the coordinator's part of each step when the table gives it one.
        ``fractions``: as for :class:`Mesh` (MeshPeers carries none)."""
        timeout = check_timeout("timeout", timeout)
        try:
            _plan.check_fractions(fractions, world)
        except ValueError:
            listener.close()  # before any link opens
            raise
        if len(table.key) != 32:
            raise ProtocolError("MeshPeers.key must be 32 bytes")
        peers = parse_peers(table.peers, world)
        try:
            _check_share(table.coordinator_share, coordinator, table.codec, table.shared_memory,
                         worker_id)
        except ProtocolError:
            listener.close()  # before any link opens
            raise
        try:
            links = _connect_links(listener, peers, worker_id, table.key, timeout, max_frame,
                                   check_congestion(congestion),
                                   coordinator is not None and coordinator.conn.sealed)
        finally:
            listener.close()
        return cls(links, worker_id, Codec(table.codec), timeout,
                   shared_memory=bool(table.shared_memory), coordinator=coordinator,
                   coordinator_share=table.coordinator_share, fractions=fractions)

    def close(self) -> None:
        """Close every link (and the shared plane)."""
        plane, self.plane = self.plane, None
        if plane is not None:
            plane.close()
        for chan in self.links:
            if chan is not None:
                chan.close()

    def plan_for(self, count: int) -> Plan:
        """The cut of a ``count``-element vector: this mesh's fractions,
        codec and coordinator share (kept for the last few lengths, as the
        scratch is)."""
        plan = self._plans.pop(count, None)
        if plan is None:
            if len(self._plans) >= SCRATCH_SIZES:
                del self._plans[next(iter(self._plans))]  # the least recently used
            plan = Plan(count, self.world, self.fractions, self.codec, self.coordinator_share)
        self._plans[count] = plan
        return plan

    @property
    def _conns(self) -> List[Optional["_core.Connection"]]:
        return [None if c is None else c.conn for c in self.links]

    def _buffer(self, name: str, n: int, dtype: np.dtype) -> np.ndarray:
        """Scratch reused from step to step: one allocation per size, for the
        last :data:`SCRATCH_SIZES` sizes of each use (DDP's buckets come in a
        few sizes, every step: a fresh array each time would fault its pages
        in again)."""
        key = (name, n, np.dtype(dtype).str)
        buf = self._scratch.pop(key, None)
        if buf is None:
            sizes = [k for k in self._scratch if k[0] == name]
            for old in sizes[:max(0, len(sizes) - SCRATCH_SIZES + 1)]:
                del self._scratch[old]  # the least recently used (dicts keep order)
            buf = np.empty(n, dtype=dtype)
        self._scratch[key] = buf
        return buf

    # ---- one exchange: heads first, then the elements range by range ----

    def _exchange(self, step: int, kind: CollectiveKind, sends: Sequence[Optional[np.ndarray]],
                  recvs: Sequence[Optional[np.ndarray]], deadline: float,
                  leg: Optional[_CoordinatorLeg] = None, op: ReduceOp = ReduceOp.AVG,
                  **kernels: object) -> Optional[Tuple[int, int]]:
        """Send sends[j] to worker j while receiving recvs[j] from it, every
        link at once. The heads go first, each checked (step, phase, sender,
        length, dtype), so a worker whose vector differs is named before any
        element is read into a buffer sized for another length. The elements
        follow in one GIL-free call that runs ``kernels`` on them as they
        move (:func:`ddpwire._core.exchange_many`'s narrowing, widening and
        reduce; its report of a non-finite input is returned). ``leg`` adds
        the coordinator's part on the connection to it."""
        me = self.worker_id
        heads_out: List[List[bytes]] = [[] for _ in range(self.world)]
        for j, chan in enumerate(self.links):
            if chan is None:
                continue
            data = sends[j]
            msg = CollectiveRequest(seq=step, kind=int(kind), op=int(op),
                                    dtype=int(self._dtype), root=me, count=len(data), data=data)
            head, _bulk, _tail = _core.encode_frame_parts(msg, max_frame=chan.max_frame)
            heads_out[j] = [head]
        conns = self._conns
        out: List[list] = [[] if c is None else [sends[j]] for j, c in enumerate(conns)]
        into: List[list] = [[] if c is None else [recvs[j]] for j, c in enumerate(conns)]
        if leg is not None:
            conns.append(leg.chan.conn)
            heads_out.append([leg.head])
            out.append([leg.data, leg.tail])
            into.append([leg.into, leg.reply_tail])
            self.coordinator_frame_open = True
        what = f"exchanging {kind.name.lower()} heads"
        _core.exchange_many(conns, heads_out, [[] for _ in conns], self.timeout,
                            deadline=deadline, step=step, what=what)
        for j, chan in enumerate(self.links):
            if chan is None:
                continue
            # a peer still computing may send Heartbeats on an idle link (a
            # process group's links: ddpwire.plane.rank_links); each one read
            # restarts the silence limit, the deadline holds
            while True:
                head = _core.read_frame_head(chan.conn, self.timeout, chan.max_frame,
                                             deadline=deadline,
                                             expect=(CollectiveRequest, Heartbeat),
                                             step=step, what=what, collective_heads=True)
                if not isinstance(head, Heartbeat):
                    break
            self._check_head(head, step, kind, j, len(recvs[j]), op)
        if leg is not None:
            self._check_reply_head(leg, step, deadline)
        # the elements follow their head as raw bytes in the sender's order,
        # as encode_frame_parts would send them
        bad = _core.exchange_many(conns, out, into, self.timeout, deadline=deadline, step=step,
                                  what=f"exchanging {kind.name.lower()} slices",
                                  codec=self._half, **kernels)
        self.coordinator_frame_open = False
        return bad

    def _check_reply_head(self, leg: _CoordinatorLeg, step: int, deadline: float) -> None:
        """The head of the coordinator's AveragedGradient for its part."""
        ctx = dict(worker_id=self.worker_id, step=step)
        head = leg.chan.read_head([AveragedGradient, Shutdown], step=step, deadline=deadline,
                                  what="receiving the coordinator's part of the average")
        if isinstance(head, Shutdown):
            raise ShutdownDuringReduce("coordinator shut down during AllReduce", **ctx)
        if not isinstance(head, _core.FrameHead) or head.tag != AveragedGradient.TAG:
            raise UnexpectedMessage(AveragedGradient.__name__, type(head).__name__, **ctx)
        if head.step != step:
            raise GradientMismatch("step", step, head.step, **ctx)
        if head.gradient_count != len(leg.into):
            raise GradientMismatch("coordinator's part length", len(leg.into),
                                   head.gradient_count, **ctx)
        if head.tail_len != len(leg.reply_tail):
            raise ProtocolError(f"AveragedGradient from the coordinator ends in {head.tail_len} "
                                f"bytes, not {len(leg.reply_tail)}", **ctx)

    def _check_head(self, head: object, step: int, kind: CollectiveKind, j: int,
                    count: int, op: ReduceOp) -> None:
        if not isinstance(head, _core.FrameHead):
            raise ProtocolError(f"worker {j} sent {type(head).__name__} on the mesh link",
                                worker_id=j, step=step)
        ctx = dict(worker_id=j, step=step)
        if head.seq != step:
            raise GradientMismatch("step", step, head.seq, **ctx)
        if head.kind != kind or head.root != j:
            raise ProtocolError(f"worker {j} sent {CollectiveKind(head.kind).name.lower()} "
                                f"from {head.root} where {kind.name.lower()} from {j} was due",
                                **ctx)
        if head.dtype != self._dtype:
            raise GradientMismatch("mesh dtype", self._dtype.name.lower(),
                                   DType(head.dtype).name.lower(), **ctx)
        if head.op != op:
            raise GradientMismatch("reduce op", op.name.lower(), _op_name(head.op), **ctx)
        if head.count != count:
            raise GradientMismatch("mesh slice length (its gradients have another length)",
                                   count, head.count, **ctx)

    # ---- setting up the shared segment (docs/extensions.md) ----

    def _note(self, j: int, step: int, data: bytes) -> None:
        """One message of the set-up on the link to worker j: a broadcast of
        uint8 from this worker, seq = the step."""
        chan = self.links[j]
        assert chan is not None
        body = np.frombuffer(data, dtype=np.uint8)
        chan.send(CollectiveRequest(seq=step, kind=int(CollectiveKind.BROADCAST),
                                    op=int(ReduceOp.SUM), dtype=int(DType.UINT8),
                                    root=self.worker_id, count=len(body), data=body), step=step)

    def _heard(self, j: int, step: int, deadline: float) -> bytes:
        chan = self.links[j]
        assert chan is not None
        msg = chan.expect([CollectiveRequest], step=step, deadline=deadline)
        ctx = dict(worker_id=j, step=step)
        if msg.seq != step:
            raise GradientMismatch("step", step, msg.seq, **ctx)
        if msg.kind != CollectiveKind.BROADCAST or msg.root != j or msg.dtype != DType.UINT8:
            raise ProtocolError(f"worker {j} sent another message than its shared-memory "
                                f"set-up on the mesh link", **ctx)
        return bytes(memoryview(msg.data).cast("B")) if msg.count else b""

    def _share(self, step: int, count: int, deadline: float) -> Optional[_shm.SharedPlane]:
        """The segment of a mesh whose workers share a host, negotiated as
        the torch backend's is (:func:`ddpwire.plane.shm.share_segment`) over the
        links: worker 0 sends its offer (a region of ``count`` float32) to
        every other worker; each answers whether it attached; worker 0 tells
        everyone whether all did. Any refusal keeps the links for the data."""
        me, world = self.worker_id, self.world

        def broadcast(offer: bytes) -> bytes:
            if me != 0:
                return self._heard(0, step, deadline)
            for j in range(1, world):
                self._note(j, step, offer)
            return offer

        def agree(ok: bool) -> bool:
            if me != 0:
                self._note(0, step, b"\x01" if ok else b"\x00")
                return self._heard(0, step, deadline) == b"\x01"
            answers = [self._heard(j, step, deadline) == b"\x01" for j in range(1, world)]
            every = ok and all(answers)
            for j in range(1, world):
                self._note(j, step, b"\x01" if every else b"\x00")
            if ok and not every:
                log.warning("mesh: worker %d could not attach the shared segment; the links "
                            "carry the steps", answers.index(False) + 1)
            return every

        try:
            seg = _shm.share_segment(me, world, max(4, count * 4), broadcast=broadcast,
                                     agree=agree, who="mesh")
        except ValueError as exc:  # a malformed offer
            raise ProtocolError(f"worker 0's shared-memory offer: {exc}", worker_id=0,
                                step=step) from None
        if seg is None:
            return None
        log.info("mesh: worker %d steps through shared memory", me)
        return _shm.SharedPlane(seg, lost=_worker_lost, mismatch=_mesh_mismatch,
                                timeout=self.timeout, member="worker", gone=self._gone)

    def _gone(self) -> Optional[int]:
        """A peer whose link has closed (EOF or reset), if any: a shared
        step's barrier looks here while it waits."""
        socks = {chan.conn.sock: j for j, chan in enumerate(self.links) if chan is not None}
        if not socks:
            return None
        readable, _, _ = select.select(list(socks), [], [], 0)
        for sock in readable:
            try:
                if sock.recv(1, socket.MSG_PEEK) == b"":
                    return socks[sock]
            except BlockingIOError:
                continue
            except OSError:
                return socks[sock]
        return None

    # ---- the step ----

    def reduce_scatter(self, step: int, gradients: np.ndarray, deadline: float,
                       tail: Tuple[float, int, int] = (0.0, 0, 0), *,
                       op: ReduceOp = ReduceOp.AVG) -> SliceOutcome:
        """Phase 1: this worker's slice of the average (``op`` AVG) or of the
        sum (SUM, without a coordinator share: a process group's all_reduce),
        kept until :meth:`allgather`. Non-finite elements are reported, not raised: the
        coordinator decides for the whole vector (a process group passes
        them on, as gloo does). With a coordinator share, the last
        :func:`coordinator_part` elements go to the coordinator in a
        GradientPayload whose tail is ``tail`` (loss, correct, total), and
        their average comes back in the same calls."""
        op = ReduceOp(op)
        if op not in (ReduceOp.AVG, ReduceOp.SUM) or (op is ReduceOp.SUM and
                                                      self.coordinator_share):
            raise ValueError(f"the mesh reduces AVG, and SUM without a coordinator share, "
                             f"not {op.name} ({self.codec.name.lower()})")
        if gradients.dtype != np.float32 and not (self._half and gradients.dtype == np.uint16):
            raise TypeError(f"the mesh reduces float32{' or its uint16 words' if self._half else ''}"
                            f", not {gradients.dtype} ({self.codec.name.lower()})")
        if self._want_shared:
            self._want_shared = False
            self.plane = self._share(step, len(gradients), deadline)
        if self.plane is not None:
            bad = self.plane.reduce_scatter(step, gradients, deadline, op,
                                            bounds=self.plan_for(len(gradients)).slice(
                                                self.worker_id))
            return SliceOutcome() if bad is None else SliceOutcome(*bad)
        n, me = self.world, self.worker_id
        plan = self.plan_for(len(gradients))
        if self._wire.block:
            return self._reduce_scatter_blocks(step, gradients, deadline, plan, op)
        leg = self._leg(step, gradients, tail, plan)
        bounds = plan.bounds
        lo, hi = bounds[me]
        half = self._half
        # 16-bit words given as they are (a bfloat16 tensor's) travel without
        # narrowing; float32 is narrowed just ahead of its bytes
        words = half is not None and gradients.dtype == np.uint16
        wire = gradients if half is None or words else self._buffer("wire", len(gradients),
                                                                     np.dtype(np.uint16))
        mine = hi - lo
        inbox = self._buffer("inbox", mine * max(n - 1, 1), wire.dtype)
        recvs: List[Optional[np.ndarray]] = []
        inputs: List[np.ndarray] = []
        sources: List[Optional[int]] = []
        k = 0
        for j in range(n):
            if j == me:
                recvs.append(None)
                inputs.append(wire[lo:hi])
                sources.append(None)
            else:
                part = inbox[k * mine:(k + 1) * mine]
                k += 1
                recvs.append(part)
                inputs.append(part)
                sources.append(j)
        sends = [None if j == me else wire[a:b] for j, (a, b) in enumerate(bounds)]
        own = self._buffer("own", mine, wire.dtype)
        # each peer's slice is narrowed just ahead of its bytes, and this
        # worker's own slice averaged range by range as every peer's arrives;
        # a worker with fraction 0 owns no element: it only sends (its heads
        # say count 0 to every owner)
        narrow = None if half is None or words else [
            None if j == me or b == a else gradients[a:b] for j, (a, b) in enumerate(bounds)]
        reduce = None if mine == 0 else (inputs, sources, own, op is ReduceOp.AVG,
                                         None if half is None or words else gradients[lo:hi])
        bad = self._exchange(step, CollectiveKind.REDUCE_SCATTER, sends, recvs, deadline, leg,
                             op, narrow_from=narrow, reduce=reduce)
        outcome = SliceOutcome()
        if bad is not None:
            worker, index = bad
            value = inputs[worker][index:index + 1]
            wide = float(value[0]) if half is None else \
                float(_reduce.from_half(value, codec=half)[0])
            outcome = SliceOutcome(worker, lo + index, wide)
        self._own, self._step = own, step
        self._part = None if leg is None else leg.into
        return outcome

    def _byte_bounds(self, plan: Plan) -> List[Tuple[int, int]]:
        """Each slice's bytes in a blocked codec's encoding of the vector
        (its slices start on a block, so each is its blocks' bytes)."""
        size = self._wire.size
        return [(size(a), size(b)) for a, b in plan.bounds]

    def _reduce_scatter_blocks(self, step: int, gradients: np.ndarray, deadline: float,
                               plan: Plan, op: ReduceOp) -> SliceOutcome:
        """Phase 1 in a codec with a scale per block (int8: its
        :class:`~ddpwire.plane.codecs.BlockKernels`), whose values
        cannot be summed as they travel: the vector encoded once, the
        slices exchanged as bytes, then this worker's slice decoded from
        every worker and averaged (or summed) in worker order, and that
        encoded for the allgather (every worker, this one too, decodes those
        bytes)."""
        n, me = self.world, self.worker_id
        kernels = self._wire.kernels
        assert kernels is not None
        wire = self._buffer("wire", self._wire.size(len(gradients)), np.dtype(np.uint8))
        kernels.encode(gradients, wire)
        spans = self._byte_bounds(plan)
        lo, hi = plan.bounds[me]
        a, b = spans[me]
        inbox = self._buffer("inbox", (b - a) * max(n - 1, 1), wire.dtype)
        recvs: List[Optional[np.ndarray]] = []
        inputs: List[np.ndarray] = []
        k = 0
        for j in range(n):
            if j == me:
                recvs.append(None)
                inputs.append(wire[a:b])
            else:
                part = inbox[k * (b - a):(k + 1) * (b - a)]
                k += 1
                recvs.append(part)
                inputs.append(part)
        sends = [None if j == me else wire[x:y] for j, (x, y) in enumerate(spans)]
        self._exchange(step, CollectiveKind.REDUCE_SCATTER, sends, recvs, deadline, op=op)
        own = self._buffer("own", hi - lo, np.dtype(np.float32))
        outcome = SliceOutcome()
        if hi > lo:
            try:
                kernels.mean(inputs, own, divide=op is ReduceOp.AVG)
            except NonFiniteGradient as exc:  # the whole slice is averaged even so
                outcome = SliceOutcome(exc.input, lo + exc.index, exc.value)
        self._own = kernels.encode(own, self._buffer("own bytes", b - a, wire.dtype))
        self._step, self._part = step, None
        return outcome

    def _leg(self, step: int, gradients: np.ndarray, tail: Tuple[float, int, int],
             plan: Plan) -> Optional[_CoordinatorLeg]:
        if not self.coordinator_share:
            return None
        assert self.coordinator is not None and self._half is None
        data = gradients[plan.ours:]
        loss, correct, total = tail
        msg = GradientPayload(step=step, worker_id=self.worker_id, gradients=data, loss=loss,
                              correct=correct, total=total)
        head, _bulk, after = _core.encode_frame_parts(msg, max_frame=self.coordinator.max_frame)
        return _CoordinatorLeg(self.coordinator, head, data, after,
                               self._buffer("coordinator part", len(data), np.dtype(np.float32)),
                               bytearray(4))

    def reduced(self, step: int) -> np.ndarray:
        """This member's slice of what :meth:`reduce_scatter` of ``step``
        computed, taken instead of an allgather (a process group's
        reduce-scatter, over the links): float32, or a 16-bit codec's words.
        It is scratch: valid until the next reduce-scatter."""
        if self._wire.block or self.plane is not None or self.coordinator_share:
            raise ValueError("a reduce-scatter alone is float32 or 16-bit on the links, "
                             "no share")
        return self._take_own(step)

    def offer(self, step: int, own: np.ndarray) -> None:
        """Give :meth:`allgather` of ``step`` this member's slice without a
        reduce-scatter before it (a process group's all-gather: each member's
        own float32 elements, over the links)."""
        if self.codec != Codec.FLOAT32 or self.plane is not None or self.coordinator_share:
            raise ValueError("an all-gather alone is float32 on the links, no share")
        self._own, self._step, self._part = own, step, None

    def scatter(self, step: int, data: np.ndarray, root: int, deadline: float) -> None:
        """The first half of a broadcast from ``root`` (a process group's,
        over the links): the root sends each member its slice of float32
        ``data``, which lands in that member's ``data`` in place and is
        offered to :meth:`allgather` of ``step``, the second half."""
        if self.codec != Codec.FLOAT32 or self.plane is not None or self.coordinator_share:
            raise ValueError("a broadcast is float32 on the links, no share")
        me, bounds = self.worker_id, self.plan_for(len(data)).bounds
        empty = data[:0]
        sends = [empty if me != root or j == me else data[a:b]
                 for j, (a, b) in enumerate(bounds)]
        recvs = [data[bounds[me][0]:bounds[me][1]] if j == root and j != me else empty
                 for j in range(self.world)]
        # only the root's heads carry elements; the others' say count 0
        self._exchange(step, CollectiveKind.BROADCAST, sends, recvs, deadline, op=ReduceOp.SUM)
        self.offer(step, data[bounds[me][0]:bounds[me][1]])

    def _take_own(self, step: int) -> np.ndarray:
        own = self._own
        if own is None or self._step != step:
            raise ProtocolError(f"allgather for step {step} without its reduce-scatter",
                                worker_id=self.worker_id, step=step)
        self._own = self._step = None
        return own

    def allgather(self, step: int, out: np.ndarray, deadline: float) -> np.ndarray:
        """Phase 3, after the coordinator's go-ahead: every slice of the
        average into ``out`` (float32; with a 16-bit codec, or its uint16
        words as they are), this worker's own included."""
        if self.plane is not None:
            return self.plane.allgather(step, out, deadline)
        own = self._take_own(step)
        part, self._part = self._part, None
        n, me = self.world, self.worker_id
        plan = self.plan_for(len(out))
        bounds = plan.bounds
        lo, hi = bounds[me]
        sends = [None if j == me else own for j in range(n)]
        if self._half is not None and out.dtype == np.uint16:
            # 16-bit words wanted as they are: received in place
            recvs = [None if j == me else out[a:b] for j, (a, b) in enumerate(bounds)]
            self._exchange(step, CollectiveKind.ALLGATHER, sends, recvs, deadline)
            out[lo:hi] = own
            return out
        if self._wire.block:
            # every slice's bytes, this worker's own too, decoded at once
            spans = self._byte_bounds(plan)
            coded = self._buffer("gathered", spans[-1][1], own.dtype)
            recvs = [None if j == me else coded[a:b] for j, (a, b) in enumerate(spans)]
            self._exchange(step, CollectiveKind.ALLGATHER, sends, recvs, deadline)
            a, b = spans[me]
            coded[a:b] = own
            kernels = self._wire.kernels
            assert kernels is not None
            return kernels.decode(coded, out)
        if self._half is None:
            # float32 lands where it belongs
            recvs = [None if j == me else out[a:b] for j, (a, b) in enumerate(bounds)]
            self._exchange(step, CollectiveKind.ALLGATHER, sends, recvs, deadline)
            out[lo:hi] = own
            if part is not None:
                out[plan.ours:] = part
            return out
        # 16 bits are widened into ``out`` as they arrive
        full = self._buffer("gathered", len(out), own.dtype)
        recvs = [None if j == me else full[a:b] for j, (a, b) in enumerate(bounds)]
        widen = [None if j == me or b == a else out[a:b] for j, (a, b) in enumerate(bounds)]
        self._exchange(step, CollectiveKind.ALLGATHER, sends, recvs, deadline, widen_into=widen)
        _reduce.from_half(own, out[lo:hi], codec=self._half)
        return out


def _op_name(op: int) -> str:
    try:
        return ReduceOp(op).name.lower()
    except ValueError:
        return f"op {op}"


def _worker_lost(detail: str, worker: int, step: int) -> WorkerLost:
    return WorkerLost(detail, worker_id=worker, step=step)


def _mesh_mismatch(field: str, expected: object, got: object, worker: int,
                   step: int) -> GradientMismatch:
    return GradientMismatch(f"shared-memory {field}", expected, got, worker_id=worker, step=step)
