"""Where a worker finds its coordinator: an explicit address, or the
torchrun environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)."""
from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from typing import Mapping, Optional, Tuple

__all__ = ["parse_addr", "is_loopback", "Launch", "from_environment"]

# torchrun's own store listens on MASTER_PORT, so the coordinator takes the
# next port unless DDPWIRE_PORT says otherwise.
PORT_ENV = "DDPWIRE_PORT"


def parse_addr(text: str) -> Tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) to a (host, port) pair."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"bad address {text!r}: expected HOST:PORT, e.g. 127.0.0.1:29400")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, or a name) stays on this machine: a
    loopback address, or "localhost". Other names are not resolved: they
    count as reaching out."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@dataclass(frozen=True)
class Launch:
    """A worker's place in the run: the coordinator's address, and whether
    this process also hosts the coordinator (torchrun's rank 0)."""

    addr: Tuple[str, int]
    rank: Optional[int] = None
    world_size: Optional[int] = None

    @property
    def hosts_coordinator(self) -> bool:
        return self.rank == 0 and self.world_size is not None


def from_environment(connect: Optional[str], env: Mapping[str, str] = os.environ) -> Launch:
    """The explicit ``--connect`` address, else torchrun's environment."""
    if connect:
        return Launch(parse_addr(connect))
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        raise ValueError("no coordinator address: pass --connect HOST:PORT, or run under torchrun "
                         "(MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)")
    try:
        port = int(env.get(PORT_ENV) or int(env["MASTER_PORT"]) + 1)
        rank = int(env.get("RANK", "0"))
        world = int(env.get("WORLD_SIZE", "1"))
    except ValueError as exc:
        raise ValueError(f"bad torchrun environment: {exc}") from None
    return Launch((env["MASTER_ADDR"], port), rank, world)
