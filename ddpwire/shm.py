"""The allreduce of ranks that share one host, through shared memory.

Rank 0 creates a segment (POSIX shared memory, mode 0600, csrc/shm.h has the
layout and the algorithm), announces its name and a random nonce to the
group through the collectives service, and every rank attaches and checks
the nonce. Once every rank has answered, rank 0 unlinks the name: from then
on the segment lives only as long as some rank maps it, so no rank's death,
even by SIGKILL, can leave it behind. If any rank cannot attach, or is on
another host, every rank stays on TCP.

``DDPWIRE_SHM=0`` turns it off (on any rank: the group then stays on TCP).
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
from typing import Any, Optional

import numpy as np

from . import _core
from .errors import CollectiveAborted
from .extensions import CollectiveKind as Kind, DType, ReduceOp as Op

__all__ = ["SHM_ENV", "REGION_BYTES", "Segment", "host_id", "enabled", "negotiate"]

log = logging.getLogger(__name__)

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
    """One rank's mapping of the shared segment."""

    def __init__(self, name: str, mapping: mmap.mmap, world: int, rank: int, region: int,
                 owner: bool) -> None:
        self.name = name
        self.world = world
        self.rank = rank
        self.region_bytes = region
        self._map = mapping
        self._arena = _core.ShmArena(mapping, world, rank, region)
        self._owner = owner
        self._linked = owner
        self._generation = 0
        self.collectives = 0
        self.failure: Optional[CollectiveAborted] = None
        self._lock = threading.Lock()

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
        if not seg._arena.check(nonce):
            seg.close()
            raise ValueError(f"segment {name} is not the one announced (nonce)")
        return seg

    def init(self, nonce: bytes) -> None:
        self._arena.init(nonce)

    def unlink(self) -> None:
        """Remove the name (rank 0); the mappings stay valid."""
        if self._linked:
            self._linked = False
            _unlink(self.name)

    def abort(self, rank: Optional[int]) -> None:
        """Call every rank's waits off, blaming ``rank`` (rank 0 when None:
        the service's host is where the group ended)."""
        try:
            self._arena.abort(0 if rank is None else rank)
        except ValueError:
            pass  # closed: nothing waits on it

    def allreduce(self, data: Any, op: Op, timeout: float) -> None:
        """Average (AVG) or sum (SUM) the float32 bytes of ``data`` (a
        writable contiguous buffer) with every rank's, in place, in pieces of
        the region size. Raises CollectiveAborted naming the rank at fault."""
        if self.failure is not None:
            raise self.failure
        raw = np.frombuffer(data, dtype=np.uint8)
        step = self.region_bytes
        with self._lock:
            seq = self.collectives
            self.collectives += 1
            for a in range(0, max(raw.nbytes, 1), step):
                status, rank = self._arena.allreduce(raw[a:a + step], int(op),
                                                     self._generation + 1, timeout)
                # generations are 32-bit in the segment, compared wrap-safely
                self._generation = (self._generation + 2) & 0xFFFFFFFF
                if status != _core.SHM_OK:
                    self.failure = _failure(status, rank, seq, timeout)
                    self.abort(rank)
                    raise self.failure

    def close(self) -> None:
        """Unmap (once no allreduce runs) and, on rank 0, unlink."""
        self.unlink()
        if self._arena.close():
            try:
                self._map.close()
            except BufferError:
                pass  # still exported: unmapped when the last view goes


def _failure(status: int, rank: int, seq: int, timeout: float) -> CollectiveAborted:
    if status == _core.SHM_TIMEOUT:
        detail = f"rank {rank} did not reach shared-memory allreduce {seq} within {timeout:g} s"
    elif status == _core.SHM_DISAGREE:
        detail = f"rank {rank} disagrees: another element count or op than rank 0's"
    else:
        detail = f"the group was called off: rank {rank} is gone"
    return CollectiveAborted(detail, rank=rank, seq=seq)


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


def negotiate(client: Any, rank: int, world: int, timeout: float) -> Optional[Segment]:
    """Every rank of the group calls this once, right after joining, in the
    same order as its collectives: a broadcast of rank 0's offer, then an
    allgather of each rank's verdict. Returns the segment when every rank
    attached, else None (everyone stays on TCP)."""
    if world < 2:
        return None
    seg: Optional[Segment] = None
    offer = np.frombuffer(_core.shm_offer_encode(b"", b"", 0, ""), dtype=np.uint8).copy()
    try:
        if rank == 0 and enabled():
            region = region_bytes()
            try:
                seg = Segment.create(world, region)
                nonce = secrets.token_bytes(16)
                seg.init(nonce)
                offer[:] = np.frombuffer(_core.shm_offer_encode(host_id(), nonce, region,
                                                                 seg.name), dtype=np.uint8)
            except (OSError, ValueError) as exc:
                log.info("shared memory unavailable, staying on TCP: %s", exc)
                if seg is not None:
                    seg.close()
                seg = None
        got = client.call(Kind.BROADCAST, DType.UINT8, 0, offer, timeout)
        got_offer = _core.shm_offer_decode(got.tobytes())
        ok = False
        if rank == 0:
            ok = seg is not None
        elif got_offer is not None and enabled() and got_offer[0] == host_id():
            host, nonce, region, name = got_offer
            try:
                seg = Segment.attach(name, world, rank, region, nonce)
                ok = True
            except (OSError, ValueError) as exc:
                log.info("cannot attach rank 0's shared memory, staying on TCP: %s", exc)
        verdicts = client.call(Kind.ALLGATHER, DType.UINT8, 0, np.array([ok], dtype=np.uint8), timeout)
        if seg is not None:
            seg.unlink()  # every rank that could attach has: the name has done its job
        if not verdicts.all():
            if seg is not None:
                seg.close()
            return None
        return seg
    except BaseException:
        if seg is not None:
            seg.close()
        raise
