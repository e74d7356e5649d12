"""Names and addresses of the emulated cluster.

Every namespace is named ``<prefix>-<role>``: ``-br`` holds the bridge,
``-c`` is the coordinator, ``-w0`` ... the workers. The bridge namespace
holds one veth end per machine (named after the machine's role) enslaved
to the bridge ``br0``; the other end is ``eth0`` inside the machine's
namespace. The addresses (10.213.0.0/24 by default) exist only on those
``eth0``; the root namespace gets neither a link nor a route.
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import List, Optional

PREFIX = "ddpw"
SUBNET = "10.213.0.0/24"
BRIDGE = "br0"
MACHINE_IF = "eth0"
# the coordinator at .1; workers from .10 so the two never collide
_COORD_HOST = 1
_FIRST_WORKER_HOST = 10


@dataclass(frozen=True)
class Machine:
    """One emulated machine: its namespace, its port on the bridge, its address."""

    role: str
    netns: str
    port: str
    address: str
    rate: int


@dataclass(frozen=True)
class Plan:
    """The whole emulated network for one run."""

    prefix: str
    bridge_netns: str
    prefixlen: int
    coordinator: Machine
    workers: List[Machine]
    #: every machine's default TCP congestion control (None: the host's,
    #: which a new namespace starts with)
    congestion: Optional[str] = None

    @property
    def machines(self) -> List[Machine]:
        """The coordinator, then the workers."""
        return [self.coordinator] + list(self.workers)

    @property
    def namespaces(self) -> List[str]:
        """Every namespace the plan creates, the bridge's last (torn down last too)."""
        return [m.netns for m in self.machines] + [self.bridge_netns]


def make_plan(n_workers: int, coord_rate: int, worker_rate: int,
              prefix: str = PREFIX, subnet: str = SUBNET,
              congestion: Optional[str] = None) -> Plan:
    """Names and addresses for a coordinator and ``n_workers`` workers."""
    net = ipaddress.ip_network(subnet)
    if n_workers < 1:
        raise ValueError("at least one worker")
    if _FIRST_WORKER_HOST + n_workers >= net.num_addresses - 1:
        raise ValueError(f"{subnet} has no room for {n_workers} workers")
    if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", prefix):
        # namespace names end up in file names under /run/netns: keep them plain
        raise ValueError(f"prefix must be 1-8 lowercase letters or digits, got {prefix!r}")
    if congestion is not None and not re.fullmatch(r"[a-z0-9_]{1,15}", congestion):
        raise ValueError(f"congestion must be an algorithm's name, got {congestion!r}")

    def machine(role: str, host: int, rate: int) -> Machine:
        return Machine(role=role, netns=f"{prefix}-{role}", port=role,
                       address=str(net.network_address + host), rate=rate)

    return Plan(prefix=prefix, bridge_netns=f"{prefix}-br", prefixlen=net.prefixlen,
                coordinator=machine("c", _COORD_HOST, coord_rate),
                workers=[machine(f"w{i}", _FIRST_WORKER_HOST + i, worker_rate)
                         for i in range(n_workers)],
                congestion=congestion)


def is_ours(netns: str, prefix: str = PREFIX) -> bool:
    """Whether a namespace name is one that a run with ``prefix`` creates.

    Exact shapes only (``-br``, ``-c``, ``-w<k>``), so a crashed run's
    leftovers are removed without touching anyone else's namespaces that
    merely share the prefix.
    """
    return re.fullmatch(rf"{re.escape(prefix)}-(br|c|w[0-9]+)", netns) is not None
