"""The allreduce of members that share one host, through shared memory: the
one shared-memory plane of ddpwire, for the torch backend's ranks and the
Worker mesh's workers alike.

Member 0 creates a segment (POSIX shared memory, mode 0600, csrc/shm.h has
the layout and the algorithm) and announces its name and a random nonce to
the group (:func:`share_segment`: through the collectives service for the
backend, :func:`negotiate`; over the mesh links for the Worker mesh), and
every member attaches and checks the nonce. Once every member has answered,
member 0 unlinks the name: from then on the segment lives only as long as
some member maps it, so no member's death, even by SIGKILL, can leave it
behind. If any member cannot attach, or is on another host, every member
stays on TCP. :class:`SharedPlane` then runs every allreduce on it.

``DDPWIRE_SHM=0`` turns it off (on any member: the group then stays on TCP).
Nothing here imports torch.
"""
from __future__ import annotations

import hashlib
import logging
import mmap
import os
import secrets
import socket
import threading
import time
from typing import Any, Callable, Optional, Tuple

import numpy as np

from .. import _core
from ..wire.errors import CollectiveAborted
from ..wire.extensions import CollectiveKind as Kind, DType, ReduceOp as Op
from .plan import slice_bounds

__all__ = ["SHM_ENV", "REGION_BYTES", "Segment", "SharedPlane", "host_id", "enabled",
           "negotiate", "rank_plane", "share_segment"]

log = logging.getLogger("ddpwire.shm")

#: "0" turns shared memory off for the group
SHM_ENV = "DDPWIRE_SHM"
#: bytes of each rank's region (larger allreduces go in pieces): two of DDP's
#: default 25 MiB buckets, so one bucket, whatever parameter closes it, is
#: one piece
REGION_BYTES = 50 << 20
#: overrides REGION_BYTES (tests)
REGION_ENV = "DDPWIRE_SHM_REGION_BYTES"

try:  # the module multiprocessing.shared_memory uses: shm_open(3) on every POSIX system
    import _posixshmem
except ImportError:  # pragma: no cover - Windows
    _posixshmem = None



def enabled() -> bool:
    """False when the user turned shared memory off or the platform lacks it."""
    return os.environ.get(SHM_ENV, "1").strip() != "0" and _posixshmem is not None


def host_id() -> bytes:
    """16 bytes naming this boot of this machine: ranks whose ids differ
    never try to share memory."""
    boot = b""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return hashlib.sha256(boot + b"\0" + socket.gethostname().encode()).digest()[:16]


def region_bytes() -> int:
    value = int(os.environ.get(REGION_ENV) or REGION_BYTES)
    return max(4096, value // 4096 * 4096)


class Segment:
    """One rank's mapping of the shared segment (its layout and algorithm
    are csrc/shm.h's; :class:`SharedPlane` runs allreduces on it)."""

    def __init__(self, name: str, mapping: mmap.mmap, world: int, rank: int, region: int,
                 owner: bool) -> None:
        self.name = name
        self.world = world
        self.rank = rank
        self.region_bytes = region
        self._map = mapping
        self.arena = _core.ShmArena(mapping, world, rank, region)
        self._linked = owner

    @classmethod
    def create(cls, world: int, region: int) -> "Segment":
        """A new segment for ``world`` ranks (this process is rank 0)."""
        if _posixshmem is None:
            raise OSError("no POSIX shared memory here")
        size = _core.shm_size(world, region)
        if size == 0:
            raise ValueError(f"no segment for {world} ranks of {region} bytes")
        sweep_stale()
        # the creator's pid in the name tells a stale segment (creator gone) from a live one
        name = f"/ddpw-{os.getpid():x}-{secrets.token_hex(4)}"
        fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:
                os.ftruncate(fd, size)
                # Reserve the pages now: a full /dev/shm must fail here, not
                # kill a rank with SIGBUS mid-collective.
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, size)
                mapping = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            seg = cls(name, mapping, world, 0, region, True)
        except BaseException:
            _unlink(name)
            raise
        return seg

    @classmethod
    def attach(cls, name: str, world: int, rank: int, region: int, nonce: bytes) -> "Segment":
        """Map the segment rank 0 announced; OSError or ValueError when it
        is not there or not the one announced."""
        if _posixshmem is None:
            raise OSError("no POSIX shared memory here")
        fd = _posixshmem.shm_open(name, os.O_RDWR, 0)
        try:
            size = os.fstat(fd).st_size
            if size != _core.shm_size(world, region):
                raise ValueError(f"segment {name} has {size} bytes, not the size announced")
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        seg = cls(name, mapping, world, rank, region, False)
        if not seg.arena.check(nonce):
            seg.close()
            raise ValueError(f"segment {name} is not the one announced (nonce)")
        return seg

    def init(self, nonce: bytes) -> None:
        self.arena.init(nonce)

    def unlink(self) -> None:
        """Remove the name (rank 0); the mappings stay valid."""
        if self._linked:
            self._linked = False
            _unlink(self.name)

    def abort(self, rank: int) -> None:
        """Call every rank's waits off, blaming ``rank``."""
        try:
            self.arena.abort(rank)
        except ValueError:
            pass  # closed: nothing waits on it

    def close(self) -> None:
        """Unmap (once no call on it runs) and, on rank 0, unlink."""
        self.unlink()
        if self.arena.close():
            try:
                self._map.close()
            except BufferError:
                pass  # still exported: unmapped when the last view goes


#: how long one barrier wait lasts, when the plane watches its members'
#: connections, before it looks at them: a member that left is named this
#: soon, not at the deadline
LOOK_EVERY = 0.2

#: what a member lost raises: (text, the member at fault, seq) -> the error
Lost = Callable[[str, int, int], BaseException]
#: what a member that disagrees raises: (field, expected, got, member, seq) -> the error
Mismatch = Callable[[str, object, object, int, int], BaseException]


class SharedPlane:
    """Allreduces of float32 vectors through one :class:`Segment`: the one
    shared-memory path, for the torch backend's ranks and the Worker mesh.

    An allreduce is two calls, cut at the segment's barriers so that a
    caller may act between them (the mesh hears the coordinator's verdict
    there): :meth:`reduce_scatter` stages this member's vector (all but its
    own slice, which nobody else reads), waits for every member's, and
    reduces this member's slice in member order (AVG: the reference's
    bits; SUM), reporting its first non-finite element; :meth:`allgather`
    waits for every slice and copies the result out. :meth:`allreduce` is
    both, for a vector of any length, in pieces of the region. The vector
    given to :meth:`reduce_scatter` stays an input until it returns: nothing
    may write it before.

    ``lost`` makes the error of a member that left or did not arrive (a
    CollectiveAborted for a rank, a WorkerLost for a mesh worker), from its
    text, the member at fault and the collective's seq (the mesh's step);
    ``mismatch`` that of a vector that does not fit (a GradientMismatch
    for the mesh), from the field, what was expected, what came, the
    member and the seq. ``member`` is how the texts name one ("rank",
    "worker"), ``timeout`` what they say a wait was bounded by. ``gone``
    (the mesh's links) returns a member whose connection closed, looked at
    every :data:`LOOK_EVERY` while a barrier waits; without it, whatever
    ends the group calls the barriers off (:meth:`abort`). After a failure
    every call raises the first error again.
    """

    def __init__(self, segment: Segment, *, lost: Lost, mismatch: Mismatch, timeout: float,
                 member: str = "rank", gone: Optional[Callable[[], Optional[int]]] = None):
        self.segment = segment
        self.timeout = timeout
        self.member = member
        self._arena = segment.arena
        self._lost = lost
        self._mismatch = mismatch
        self._gone = gone
        self._generation = 0
        self._pending: Optional[Tuple[int, int]] = None  # (seq, count) between the calls
        self._lock = threading.Lock()
        #: allreduces begun (:meth:`allreduce` numbers them)
        self.collectives = 0
        self.failure: Optional[BaseException] = None

    @property
    def region_bytes(self) -> int:
        return self.segment.region_bytes

    def abort(self, blame: Optional[int]) -> None:
        """Call every member's waits off, blaming ``blame`` (member 0 when
        None: where the group ended)."""
        self.segment.abort(0 if blame is None else blame)

    def close(self) -> None:
        if self._pending is not None:
            # an allreduce this member leaves half done: nobody waits for it
            self.abort(self.segment.rank)
        self.segment.close()

    # ---- the two halves ----

    def reduce_scatter(self, seq: int, data: np.ndarray, deadline: float, op: int = Op.AVG, *,
                       into_own: bool = False,
                       bounds: Optional[Tuple[int, int]] = None) -> Optional[Tuple[int, int, float]]:
        """Stage float32 ``data``, wait for every member's, and reduce this
        member's slice with ``op`` into the output (with ``into_own`` into
        ``data``'s own slice too). ``bounds`` is that slice, [start, end),
        from the :class:`ddpwire.plane.plan.Plan` every member computes alike (any
        fractions, an empty slice included); None: equal fractions. Returns
        None, or (member, index, value) of the slice's first non-finite
        element in member order."""
        me, n = self.segment.rank, len(data)
        lo, hi = slice_bounds(n, self.segment.world)[me] if bounds is None else bounds
        self._check()
        try:
            if n * 4 > self.region_bytes:
                raise self._mismatch("vector length (the shared segment holds at most)",
                                     self.region_bytes // 4, n, me, seq)
            self._pending = (seq, n)
            self._arena.stage(data, int(op), lo, hi - lo)
            self._wait(self._generation + 1, seq, deadline, "every vector in place")
            bad = self._arena.agree()
            if bad >= 0:
                raise self._mismatch(f"element count and op ({self.member} 0's)", (n, int(op)),
                                     "another", bad, seq)
            _start, _count, bad_rank, index, value = self._arena.reduce(data, into_own)
        except BaseException as exc:
            self._fail(exc)
            raise
        return None if bad_rank < 0 else (bad_rank, index, value)

    def allgather(self, seq: int, out: np.ndarray, deadline: float, *,
                  skip_own: bool = False) -> np.ndarray:
        """Wait for every member's slice of ``seq``, then copy the result into
        ``out`` (with ``skip_own`` all but this member's own slice, which
        :meth:`reduce_scatter` wrote into it already)."""
        self._check()
        if self._pending != (seq, len(out)):
            raise self._mismatch("(seq, length) of the reduce-scatter before this allgather",
                                 self._pending, (seq, len(out)), self.segment.rank, seq)
        try:
            self._wait(self._generation + 2, seq, deadline, "every slice reduced")
            self._arena.gather(out, skip_own)
        except BaseException as exc:
            self._fail(exc)
            raise
        # generations are 32-bit in the segment, compared wrap-safely
        self._generation = (self._generation + 2) & 0xFFFFFFFF
        self._pending = None
        return out

    def allreduce(self, data: Any, op: int, timeout: float) -> None:
        """SUM or AVG the float32 bytes of ``data`` (a writable contiguous
        buffer) with every member's, in place, in pieces of the region, each
        piece's waits bounded by ``timeout``. A non-finite element is passed
        on, as gloo does."""
        raw = np.frombuffer(data, dtype=np.float32)
        step = self.region_bytes // 4
        with self._lock:
            seq = self.collectives
            self.collectives += 1
            for a in range(0, max(len(raw), 1), step):
                piece = raw[a:a + step]
                deadline = time.monotonic() + timeout
                self.reduce_scatter(seq, piece, deadline, op, into_own=True)
                self.allgather(seq, piece, deadline, skip_own=True)

    # ---- waits and failures ----

    def _check(self) -> None:
        if self.failure is not None:
            raise self.failure

    def _fail(self, exc: BaseException) -> None:
        """Keep the first failure and call the group off, blaming the member
        the error names (this one for anything else)."""
        if self.failure is None:
            self.failure = exc
        blame = getattr(exc, "rank", None)
        if blame is None:
            blame = getattr(exc, "worker_id", None)
        self.abort(self.segment.rank if blame is None else int(blame))

    def _name(self, seq: int) -> str:
        return f"shared-memory allreduce {seq}"

    def _wait(self, generation: int, seq: int, deadline: float, what: str) -> None:
        while True:
            left = deadline - time.monotonic()
            look = min(left, LOOK_EVERY) if self._gone is not None else left
            status, rank = self._arena.barrier(generation, max(0.0, look))
            if status == _core.SHM_OK:
                return
            if status == _core.SHM_ABORTED:
                raise self._lost(f"{self.member} {rank} is gone: the group was called off in "
                                 f"{self._name(seq)} ({what})", rank, seq)
            gone = self._gone() if self._gone is not None else None
            if gone is not None:
                # a member arrives before it closes its connections: one that
                # arrived and left normally is no failure; and one that
                # failed calls the group off (blaming the member it lost)
                # before it closes them: that blame names the cause
                status, rank = self._arena.barrier(generation, 0.0)
                if status == _core.SHM_OK:
                    return
                if status == _core.SHM_ABORTED:
                    continue  # named above, at once
                raise self._lost(f"{self.member} {gone} closed its link in {self._name(seq)} "
                                 f"({what})", gone, seq)
            if time.monotonic() >= deadline:
                raise self._lost(f"timed out: {self.member} {rank} did not reach "
                                 f"{self._name(seq)} ({what}) within the {self.timeout:g} s timeout "
                                 f"of the group", rank, seq)


def sweep_stale(directory: str = "/dev/shm") -> int:
    """Unlink the segments whose creator is gone (its pid is in the name).

    The name is unlinked once every rank has answered; a creator killed in
    the moment before that leaves it behind, and the next group on this
    host removes it here. Returns how many it removed."""
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    removed = 0
    for entry in names:
        parts = entry.split("-")
        if len(parts) != 3 or parts[0] != "ddpw":
            continue
        try:
            pid = int(parts[1], 16)
            os.kill(pid, 0)
            continue  # alive, or not ours to judge (EPERM)
        except ValueError:
            continue
        except ProcessLookupError:
            pass
        except OSError:
            continue
        _unlink("/" + entry)
        removed += 1
    return removed


def _unlink(name: str) -> None:
    try:
        _posixshmem.shm_unlink(name)
    except FileNotFoundError:
        pass


def share_segment(rank: int, world: int, region: Optional[int], *,
                  broadcast: Callable[[bytes], bytes], agree: Callable[[bool], bool],
                  who: str) -> Optional[Segment]:
    """The one negotiation of a segment, whatever carries its messages:
    every member calls it once. Member 0 creates a segment of ``region``
    bytes per member (the torch backend's :func:`region_bytes`, the mesh's
    vector) and ``broadcast`` sends its offer (its host, a fresh nonce, the
    region and the segment's name; an empty offer when it has none), which
    the others receive from ``broadcast(b"")``; each that is on the same
    host attaches, checking the nonce (and ``region``, when it is given);
    ``agree(ok)`` returns whether every member attached. Member 0 then
    unlinks the name: from then on the segment lives only as long as some
    member maps it. Returns the segment when every member attached, else
    None (the group keeps to TCP; ``who`` names the group in the log)."""
    seg: Optional[Segment] = None
    try:
        if rank == 0:
            offer = _core.shm_offer_encode(b"", b"", 0, "")
            if enabled():
                assert region is not None
                try:
                    seg = Segment.create(world, region)
                    nonce = secrets.token_bytes(16)
                    seg.init(nonce)
                    offer = _core.shm_offer_encode(host_id(), nonce, region, seg.name)
                except (OSError, ValueError) as exc:
                    log.warning("%s: no shared segment, staying on TCP: %s", who, exc)
                    if seg is not None:
                        seg.close()
                    seg = None
            broadcast(offer)
        else:
            where = _core.shm_offer_decode(broadcast(b""))
            if where is not None and enabled() and where[0] == host_id():
                _host, nonce, offered, name = where
                try:
                    if region is not None and offered != region:
                        raise ValueError(f"a region of {offered} bytes, not {region}")
                    seg = Segment.attach(name, world, rank, offered, nonce)
                except (OSError, ValueError) as exc:
                    log.warning("%s: member %d cannot attach member 0's shared segment, "
                                "staying on TCP: %s", who, rank, exc)
                    seg = None
        ok = agree(seg is not None)
        if seg is not None:
            seg.unlink()  # every member that could attach has: the name has done its job
        if not ok:
            if seg is not None:
                seg.close()
            return None
        return seg
    except BaseException:
        if seg is not None:
            seg.close()
        raise


def negotiate(client: Any, rank: int, world: int, timeout: float) -> Optional[SharedPlane]:
    """The torch backend's segment, through the collectives service: every
    rank of the group calls this once, right after joining, in the same
    order as its collectives (a broadcast of rank 0's offer, then an
    allgather of each rank's verdict). Returns the plane when every rank
    attached, else None (everyone stays on TCP)."""
    if world < 2:
        return None

    def broadcast(offer: bytes) -> bytes:
        data = np.frombuffer(offer or bytes(_core.SHM_OFFER_LEN), dtype=np.uint8).copy()
        return client.call(Kind.BROADCAST, DType.UINT8, 0, data, timeout).tobytes()

    def agree(ok: bool) -> bool:
        verdicts = client.call(Kind.ALLGATHER, DType.UINT8, 0, np.array([ok], dtype=np.uint8),
                               timeout)
        return bool(verdicts.all())

    seg = share_segment(rank, world, region_bytes() if rank == 0 else None,
                        broadcast=broadcast, agree=agree, who=f"rank {rank}")
    if seg is None:
        return None
    return rank_plane(seg, timeout)


def rank_plane(segment: Segment, timeout: float) -> SharedPlane:
    """The torch backend's plane on ``segment``: its failures are
    CollectiveAborted naming the rank at fault (and the barriers are called
    off by whatever ends the group, :meth:`SharedPlane.abort`)."""
    return SharedPlane(segment, lost=_lost, mismatch=_disagrees, timeout=timeout)


def _lost(detail: str, rank: int, seq: int) -> CollectiveAborted:
    return CollectiveAborted(detail, rank=rank, seq=seq)


def _disagrees(field: str, expected: object, got: object, rank: int,
               seq: int) -> CollectiveAborted:
    return CollectiveAborted(f"rank {rank} disagrees: {field} expected {expected}, got {got}",
                             rank=rank, seq=seq)
