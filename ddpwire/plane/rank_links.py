"""Rank-to-rank links for a process group: its large allreduces as a ring,
and its reduce-scatters and all-gathers.

Through the collective service every bucket crosses rank 0's link: (N-1)
vectors each way there, where a reduce-scatter and allgather move
2·(N-1)/N of one vector through each rank's link. So after the join every
rank opens a direct link to every other, and float32 SUM/AVG allreduces
(DDP's buckets, in any codec of :mod:`ddpwire.plane.codecs`; bfloat16 and
float16 tensors in their own codec), SUM/AVG reduce-scatters (float32 and
16 bits), all-gathers (of any bytes: FSDP's) and broadcasts (a scatter,
then an all-gather) run on them with
:class:`ddpwire.plane.mesh.Mesh`, the runner the Worker mesh steps with:
the same heads, range cuts and kernels, rank r owning slice r and summing
it in rank order, so every rank gets the bits the service would have
computed.

The set-up travels through the service, over the joins that the token (if
any) authenticated: rank 0 broadcasts a fresh 32-byte key, every rank's
listening address is allgathered, and each link proves the key both ways
(a stranger on a rank's port is dropped, as on the mesh). Every rank then
says whether all its links opened; unless all did, every rank keeps to the
service, with the reason logged, so ranks that cannot reach each other
never hang. Nothing here imports torch.
"""
from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from . import codecs as _codecs
from . import mesh as _mesh
from . import plan as _plan
from .collectives import CollectiveAborted, DType, Kind, Op
from ..wire.channel import Heartbeats
from ..wire.errors import DdpwireError, IntegrityError, integrity_error
from ..wire.extensions import Codec, ReduceOp

__all__ = ["PORTS_ENV", "RankLinks", "form_links", "open_channels"]

log = logging.getLogger("ddpwire.torch.links")

#: "FIRST-LAST": the ports a rank may listen on for its links (a firewall's range)
PORTS_ENV = "DDPWIRE_PORTS"
#: one rank's address record in the set-up's allgather: "host:port", NUL-padded
_ADDRESS_BYTES = 128
#: the longest the links may take to open before the group keeps to the
#: service (they open once every rank has joined, so all dial at once)
LINK_TIMEOUT = 30.0

def ports_from_env() -> Optional[Tuple[int, int]]:
    """The port range :data:`PORTS_ENV` names, or None."""
    text = os.environ.get(PORTS_ENV)
    return _mesh.parse_ports(text) if text else None


class RankLinks:
    """A rank's links to every other rank, and the allreduces that run on
    them, one at a time, in the order every rank issues them (a group's
    collectives are issued in one order on every rank).

    ``fractions`` (one per rank, relative; None: equal) is how much of each
    vector every rank sums, as :class:`ddpwire.plane.mesh.Mesh` takes it: every
    rank must pass the same. A rank with fraction 0 sums nothing and still
    gets the whole result.

    With ``heartbeat`` (seconds) every idle link carries a Heartbeat that
    often, and a peer that sends nothing for ``silence`` seconds is lost,
    named long before the group's ``timeout`` (which still bounds each
    allreduce) where a machine goes quiet.

    After a failure the links are closed and every later call raises the
    first error again, naming the rank at fault.
    """

    def __init__(self, links: list, rank: int, timeout: float,
                 fractions: Optional[Sequence[float]] = None, *,
                 heartbeat: Optional[float] = None, silence: Optional[float] = None) -> None:
        self.rank = rank
        self.world = len(links)
        self.timeout = timeout
        self._links = links
        self.fractions = fractions
        # A rank may compute for the whole group timeout before it joins an
        # allreduce, so only heartbeats tell a silent machine from a busy
        # one: each rank beats on its idle links, and a peer silent for
        # ``silence`` (no byte, heartbeats included) is lost, whatever the
        # deadline says.
        self._read_limit = timeout if silence is None else min(silence, timeout)
        # one runner per wire codec and cut, over the same links: float32 for
        # the default buckets, another codec for a bucket asked to travel in
        # it, equal chunks for a reduce-scatter or all-gather
        self._runners: Dict[Tuple[Codec, Optional[Sequence[float]]], _mesh.Mesh] = {}
        self._seq = 0
        self._lock = threading.Lock()
        self.failure: Optional[CollectiveAborted] = None
        self._beats = Heartbeats(heartbeat, lambda: [c for c in links if c is not None],
                                 f"ddpwire-rank-{rank}-links-heartbeat")
        self._beats.start(f"rank {rank}")

    @property
    def collectives(self) -> int:
        """How many collectives these links have run (begun, failed included)."""
        return self._seq

    @property
    def sealed(self) -> bool:
        """Whether every link is sealed (ddpwire.wire.seal)."""
        return all(chan.conn.sealed for chan in self._links if chan is not None)

    def _runner(self, codec: Codec, fractions: Optional[Sequence[float]]) -> _mesh.Mesh:
        key = (codec, fractions)
        runner = self._runners.get(key)
        if runner is None:
            runner = self._runners[key] = _mesh.Mesh(self._links, self.rank, codec,
                                                     self._read_limit, fractions=fractions)
        return runner

    def allreduce(self, data: np.ndarray, op: Op, compression: Optional[str] = None) -> None:
        """Reduce float32 ``data`` in place across the group: SUM, or AVG (the
        sum divided by the world size). With ``compression`` (a codec of
        :mod:`ddpwire.plane.codecs`: "bf16", "fp16", "int8") each rank's data
        travels encoded and the result comes back encoded, decoded into
        ``data``; with a 16-bit one ``data`` may be its uint16 words (a
        bfloat16 tensor's), sent and written back as they are. A NaN or inf is passed on, as gloo does.
        Raises CollectiveAborted naming the rank whose link failed."""
        def run(runner: _mesh.Mesh, seq: int, deadline: float) -> None:
            runner.reduce_scatter(seq, data, deadline, op=ReduceOp(int(op)))
            runner.allgather(seq, data, deadline)
        self._run(_codecs.codec_of(compression).code, self.fractions, run)

    def reduce_scatter(self, data: np.ndarray, op: Op,
                       compression: Optional[str] = None) -> np.ndarray:
        """Rank r's r-th of the world-size equal chunks of the SUM (or AVG) of
        every rank's float32 ``data`` (a process group's reduce-scatter:
        equal chunks, whatever this group's fractions), summed in rank
        order: float32, or with a 16-bit ``compression`` ("bf16", "fp16")
        its 16-bit words (``data`` float32 or those words). Errors as
        :meth:`allreduce`."""
        out: List[np.ndarray] = []

        def run(runner: _mesh.Mesh, seq: int, deadline: float) -> None:
            runner.reduce_scatter(seq, data, deadline, op=ReduceOp(int(op)))
            out.append(runner.reduced(seq).copy())
        self._run(_codecs.codec_of(compression).code, None, run)
        return out[0]

    def allgather(self, data: np.ndarray) -> np.ndarray:
        """Every rank's float32 ``data`` (equal lengths), in rank order (a
        process group's all-gather). Errors as :meth:`allreduce`."""
        out = np.empty(len(data) * self.world, dtype=np.float32)

        def run(runner: _mesh.Mesh, seq: int, deadline: float) -> None:
            runner.offer(seq, data)
            runner.allgather(seq, out, deadline)
        self._run(Codec.FLOAT32, None, run)
        return out

    def broadcast(self, data: np.ndarray, root: int) -> None:
        """``root``'s float32 ``data`` into every rank's ``data`` (a process
        group's broadcast): the root scatters equal chunks, then every rank
        all-gathers them, so the root's link sends 2·(N-1)/N of the vector
        where the service's sends N-1 of it. Errors as :meth:`allreduce`."""
        def run(runner: _mesh.Mesh, seq: int, deadline: float) -> None:
            runner.scatter(seq, data, root, deadline)
            runner.allgather(seq, data, deadline)
        self._run(Codec.FLOAT32, None, run)

    def _run(self, codec: Codec, fractions: Optional[Sequence[float]],
             collective: Callable[[_mesh.Mesh, int, float], None]) -> None:
        """One collective on the links, ``collective(runner, seq, deadline)``
        with the runner of ``codec`` and ``fractions``: in issue order,
        within the group's timeout, with no Heartbeat inside its frames; a
        failure closes the links and is raised again by every later call."""
        with self._lock:
            if self.failure is not None:
                raise self.failure
            seq = self._seq
            self._seq += 1
            deadline = time.monotonic() + self.timeout
            try:
                runner = self._runner(codec, fractions)
                with self._sending(seq):
                    collective(runner, seq, deadline)
            except BaseException as exc:
                self.failure = _aborted(exc, seq)
                self._close()
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                raise self.failure from exc

    @contextlib.contextmanager
    def _sending(self, seq: int) -> Iterator[None]:
        """Hold every link's send lock for one allreduce: the heartbeat
        thread skips a link whose lock is taken, so no Heartbeat lands
        inside the allreduce's frames (one in flight is waited for)."""
        held: List[threading.Lock] = []
        try:
            for j, chan in enumerate(self._links):
                if chan is None:
                    continue
                if not chan.send_lock.acquire(timeout=self._read_limit):
                    raise CollectiveAborted(f"rank link: a heartbeat to rank {j} did not go out "
                                            f"in {self._read_limit:g} s", rank=j, seq=seq)
                held.append(chan.send_lock)
            yield
        finally:
            for lock in held:
                lock.release()

    def close(self) -> None:
        """Close every link (a rank that leaves: the others see it at once)."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        self._beats.stop()
        for chan in self._links:
            if chan is not None:
                chan.close()
        for runner in self._runners.values():
            runner.close()
        self._beats.stop(self._read_limit)  # the close above wakes one blocked in its send


def _aborted(exc: BaseException, seq: int) -> CollectiveAborted:
    if isinstance(exc, CollectiveAborted):
        return exc
    rank = getattr(exc, "worker_id", None)
    # a tampered record stays an IntegrityError for whoever catches that
    cls = integrity_error(CollectiveAborted) if isinstance(exc, IntegrityError) else \
        CollectiveAborted
    return cls(f"rank link: {exc}", rank=rank, seq=seq)


def _record(host: str, port: int) -> np.ndarray:
    text = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    raw = text.encode()
    if len(raw) > _ADDRESS_BYTES:
        raise ValueError(f"the address {text!r} is over {_ADDRESS_BYTES} bytes")
    out = np.zeros(_ADDRESS_BYTES, dtype=np.uint8)
    out[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return out


def _addresses(gathered: np.ndarray, world: int) -> List[str]:
    return [bytes(gathered[r * _ADDRESS_BYTES:(r + 1) * _ADDRESS_BYTES]).rstrip(b"\0")
            .decode("utf-8", "replace") for r in range(world)]


def form_links(client: object, rank: int, world: int, *, listen_host: str, advertise: str,
               timeout: float, ports: Optional[Tuple[int, int]] = None,
               max_frame: int = 1 << 30,
               fractions: Optional[Sequence[float]] = None,
               heartbeat: Optional[float] = None,
               silence: Optional[float] = None, sealed: bool = False) -> Optional[RankLinks]:
    """Open this rank's links (every rank calls this once, right after the
    join, in the same order as its collectives). ``listen_host`` is the
    address the listener binds, ``advertise`` the one other ranks dial;
    ``ports`` pins the listening port to a range; ``fractions``,
    ``heartbeat`` (seconds between Heartbeats on an idle link) and
    ``silence`` (how long a peer may send nothing) go to :class:`RankLinks`
    (the fractions checked here first, a ValueError before any
    collective); ``sealed`` as for :func:`open_channels`. Returns None, on
    every rank alike, when some rank could
    not open all its links: the group then keeps to the service, and the
    reason is logged."""
    if world < 2:
        return None
    fractions = _plan.check_fractions(fractions, world)
    links = open_channels(client, rank, world, listen_host=listen_host, advertise=advertise,
                          timeout=timeout, ports=ports, max_frame=max_frame, sealed=sealed)
    if links is None:
        return None
    log.info("rank %d: direct links to the %d other ranks carry the large allreduces",
             rank, world - 1)
    return RankLinks(links, rank, timeout, fractions, heartbeat=heartbeat, silence=silence)


def open_channels(client: object, rank: int, world: int, *, listen_host: str, advertise: str,
                  timeout: float, ports: Optional[Tuple[int, int]] = None,
                  max_frame: int = 1 << 30, what: str = "allreduces",
                  sealed: bool = False) -> Optional[list]:
    """One authenticated channel from this rank to every other (None at
    this rank's index), or None on every rank alike when some rank could
    not open all of them (the reason logged). Three collectives through
    ``client``, which every rank runs in the same order: rank 0's fresh key
    (broadcast), every rank's listening address (allgather), every rank's
    verdict (allgather). ``what`` names their traffic in the log. With
    ``sealed`` (this rank's own connection to the group is sealed, so the
    key came in secret) each link is sealed once both hellos crossed it;
    the verdict says so too, and ranks that disagree keep to the service."""
    if world < 2:
        return None
    link_timeout = min(timeout, LINK_TIMEOUT)
    listener: Optional[socket.socket] = None
    links: Optional[list] = None
    why = ""
    try:
        listener = _mesh.listen(listen_host, ports=ports)
        port = listener.getsockname()[1]
    except OSError as exc:
        why = f"rank {rank} cannot listen for its links on {listen_host}: {exc}"
        port = 0
    key = np.frombuffer(secrets.token_bytes(32) if rank == 0 else bytes(32),
                        dtype=np.uint8).copy()
    key = client.call(Kind.BROADCAST, DType.UINT8, 0, key, timeout)  # type: ignore[attr-defined]
    gathered = client.call(Kind.ALLGATHER, DType.UINT8, 0,  # type: ignore[attr-defined]
                           _record(advertise, port), timeout)
    try:
        texts = _addresses(gathered, world)
        silent = [r for r, text in enumerate(texts) if text.endswith(":0")]
        if silent and not why:
            why = f"rank {silent[0]} has no listening port"
        if not why:
            try:
                links = _mesh._connect_links(listener, _mesh.parse_peers(",".join(texts), world),
                                             rank, key.tobytes(), link_timeout, max_frame,
                                             _mesh.check_congestion(_mesh.DEFAULT_CONGESTION),
                                             sealed)
            except (DdpwireError, OSError) as exc:
                why = f"rank {rank}: {exc}"
    finally:
        if listener is not None:
            listener.close()
    verdicts = client.call(Kind.ALLGATHER, DType.UINT8, 0,  # type: ignore[attr-defined]
                           np.array([links is not None, sealed], dtype=np.uint8),
                           timeout).reshape(world, 2)
    mixed = [r for r in range(world) if verdicts[r, 1] != sealed]
    if mixed and links is not None:
        why = (f"rank {mixed[0]}'s connection is {'in the clear' if sealed else 'sealed'}, "
               f"this rank's {'sealed' if sealed else 'in the clear'}")
    if links is not None and verdicts[:, 0].all() and not mixed:
        return links
    if links is not None:
        for chan in links:
            if chan is not None:
                chan.close()
    failed = [r for r in range(world) if not verdicts[r, 0]]
    log.warning("rank %d: the %s go through rank 0 (the links did not open%s%s)", rank, what,
                f" on rank {', '.join(map(str, failed))}" if failed else "",
                f": {why}" if why else "")
    return None
