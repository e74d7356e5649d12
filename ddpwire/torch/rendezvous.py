"""Bringing a process group's ranks onto one ddpwire coordinator.

Rank 0 hosts the coordinator and the collective service in threads of its
own process, and publishes their address in the group's store (the
torchrun / ``tcp://`` rendezvous every rank already shares). The other ranks
then join one after the other, so the service's order is rank order.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, Tuple

from ..wire.auth import TOKEN_ENV
from ..wire.seal import encrypt_from_env
from ..plane.collectives import CollectiveClient, CollectiveService, local_link
from ..session.coordinator import Coordinator
from ..wire.errors import DdpwireError
from ..wire.extensions import Extension, encode_u16
from ..session.launch import PORT_ENV, is_loopback, parse_addr
from ..session.worker import Worker

__all__ = ["Rendezvous", "join_group", "HOST_ENV", "TOKEN_ENV", "HEARTBEAT_LIMIT"]

log = logging.getLogger(__name__)

#: the address other ranks reach rank 0 at, when the store's host is not it
HOST_ENV = "DDPWIRE_HOST"
#: largest frame either side accepts: an allgather's answer holds every rank's input
MAX_FRAME = 1 << 30
#: longest silence (no byte, heartbeats included) from a live peer, in seconds;
#: the group timeout caps it
HEARTBEAT_LIMIT = 20.0

_ADDR_KEY = "ddpwire/coordinator"

_COLLECTIVES = int(Extension.COLLECTIVES)
# the entry's value is the u16 version; this package speaks version 1
_COLLECTIVES_V1 = encode_u16(1)



@dataclass
class Rendezvous:
    """One rank's connection to the group, and on rank 0 what it hosts."""

    rank: int
    world: int
    client: CollectiveClient
    worker: Optional[Worker] = None
    coordinator: Optional[Coordinator] = None
    service: Optional[CollectiveService] = None
    #: where this rank's links to the other ranks listen, and the address
    #: they dial: rank 0's coordinator address, another rank's own end of
    #: its connection to it
    listen_host: str = "127.0.0.1"
    advertise: str = "127.0.0.1"
    #: this rank's connection to the group is sealed (rank 0: every rank's
    #: is), so the rank links are sealed too (ddpwire.plane.rank_links)
    sealed: bool = False

    def close(self, timeout: float) -> None:
        """Leave the group: the other ranks first, so no answer is cut short."""
        self.client.close(timeout=timeout)
        if self.worker is not None:
            self.worker.close()
        if self.service is not None:
            self.service.wait_for_ranks_to_leave(timeout)
            self.service.stop()
        if self.coordinator is not None:
            self.coordinator.close()


def _store_host(store: Any) -> Optional[str]:
    """The host of the TCPStore under any prefix stores, if there is one."""
    seen = 0
    while store is not None and seen < 16:
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            return host
        store = getattr(store, "underlying_store", None)
        seen += 1
    return None


def _bind_and_advertise(store: Any) -> Tuple[Tuple[str, int], str]:
    host = os.environ.get(HOST_ENV) or _store_host(store) or "127.0.0.1"
    port = int(os.environ.get(PORT_ENV) or 0)
    return ((host if is_loopback(host) else ("::" if ":" in host else "0.0.0.0"), port), host)


def timings(timeout: timedelta) -> Tuple[float, float, float]:
    """(group timeout, heartbeat interval, silence limit) in seconds."""
    seconds = max(timeout.total_seconds(), 1.0)
    silence = min(seconds, HEARTBEAT_LIMIT)
    return seconds, silence / 5.0, silence


def join_group(store: Any, rank: int, world: int, timeout: timedelta) -> Rendezvous:
    """Connect this rank (hosting the coordinator on rank 0); every wait is
    bounded by ``timeout``.

    Rank 0 talks to the service in process (no socket: on loopback that
    halves the bytes its process moves); ranks 1.. join the coordinator
    over TCP in rank order, so worker ``r - 1`` is rank ``r``.
    """
    seconds, heartbeat, silence = timings(timeout)
    token = os.environ.get(TOKEN_ENV) or None
    encrypt = encrypt_from_env()
    offer = {_COLLECTIVES: _COLLECTIVES_V1}
    if rank == 0:
        return _host(store, world, seconds, heartbeat, silence, token, encrypt, offer)
    addr = parse_addr(store.get(_ADDR_KEY).decode())
    store.wait([f"ddpwire/joined/{rank - 1}"], timeout)
    worker = Worker.connect(addr, timeout=seconds, heartbeat=heartbeat, heartbeat_timeout=silence,
                            node_id=f"rank{rank}-{os.getpid()}", token=token, encrypt=encrypt,
                            extensions=offer, max_frame=MAX_FRAME, mesh=False)
    if worker.worker_id != rank - 1:
        worker.close()
        raise DdpwireError(f"joined as worker {worker.worker_id}, expected {rank - 1} for rank {rank}: "
                           "another process joined the coordinator", worker_id=rank)
    if _COLLECTIVES not in worker.extensions:
        worker.close()
        raise DdpwireError(f"the coordinator at {addr[0]}:{addr[1]} did not grant the collectives "
                           "extension (a reference coordinator?)", worker_id=rank)
    store.set(f"ddpwire/joined/{rank}", "1")
    local = worker.channel.conn.sock.getsockname()[0]
    return Rendezvous(rank, world, CollectiveClient(worker.channel, rank, world), worker,
                      listen_host=local, advertise=local, sealed=worker.channel.conn.sealed)


def _host(store: Any, world: int, seconds: float, heartbeat: float, silence: float,
          token: Optional[str], encrypt: bool, offer: dict) -> Rendezvous:
    service_end, client_end = local_link()
    coordinator = None
    channels = [service_end]
    bind, advertised = ("127.0.0.1", 0), "127.0.0.1"
    if world > 1:
        bind, advertised = _bind_and_advertise(store)
        coordinator = Coordinator(bind, world - 1, timeout=seconds, join_timeout=seconds,
                                  heartbeat=heartbeat, heartbeat_timeout=silence,
                                  node_id="ddpwire-rank0", token=token, encrypt=encrypt,
                                  extensions=offer, max_frame=MAX_FRAME, topology="star")
        host = f"[{advertised}]" if ":" in advertised else advertised
        store.set(_ADDR_KEY, f"{host}:{coordinator.local_addr[1]}")
        store.set("ddpwire/joined/0", "1")
        try:
            coordinator.wait_for_workers()
        except BaseException:
            coordinator.close()
            raise
        channels += [coordinator.channel(w) for w in range(world - 1)]
    service = CollectiveService(channels, timeout=seconds).start()
    client = CollectiveClient(client_end, 0, world)
    sealed = coordinator is not None and all(coordinator.channel(w).conn.sealed
                                             for w in range(world - 1))
    return Rendezvous(0, world, client, None, coordinator, service, listen_host=bind[0],
                      advertise=advertised, sealed=sealed)
