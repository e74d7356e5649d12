"""How many threads a process may keep busy: N workers on one machine
each start as many torch threads as there are cores by default, and then
spend their time competing for the same cores.

This module is the one home of "usable cores" (the socket-thread policy,
:mod:`ddpwire.plane.socket_threads`, reads it from here) and of how many workers
of a session share this machine. Nothing here imports torch at import time.
"""
from __future__ import annotations

import os
import socket
import struct
from typing import Mapping, Optional, Tuple

__all__ = ["usable_cores", "threads_per_worker", "default_threads", "apply_threads",
           "connections_to", "workers_here"]

#: the kernel's tables of TCP sockets (Linux), one per address family
TCP_TABLES = {socket.AF_INET: "/proc/net/tcp", socket.AF_INET6: "/proc/net/tcp6"}
_ESTABLISHED = "01"  # the "st" column of those tables


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has
    one: a container's or taskset's limit, not the host's count)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def threads_per_worker(workers_here: int) -> int:
    """The cores divided evenly between ``workers_here`` worker processes, at least one."""
    if workers_here < 1:
        raise ValueError(f"workers_here must be at least 1, got {workers_here}")
    return max(1, usable_cores() // workers_here)


def default_threads(workers_here: int, env: Mapping[str, str] = os.environ) -> int:
    """The thread count when ``--threads`` is not given: 0 (torch's own
    default) where OMP_NUM_THREADS already says, as torchrun sets it, else
    the cores split between ``workers_here`` workers."""
    if env.get("OMP_NUM_THREADS", "").strip():
        return 0
    return threads_per_worker(workers_here)


def apply_threads(threads: int) -> int:
    """Set torch's intra-op threads (0 keeps torch's default); return the count in use."""
    import torch

    if threads < 0:
        raise ValueError(f"--threads must be 0 or more, got {threads}")
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def _table_address(text: str) -> bytes:
    """An address of the kernel's TCP table (hex, each 32-bit word in this
    machine's byte order) as the packed bytes inet_pton gives."""
    words = [int(text[i:i + 8], 16) for i in range(0, len(text), 8)]
    return struct.pack(f"={len(words)}I", *words)


def connections_to(peer: Tuple[str, int], tables: Mapping[int, str] = TCP_TABLES) -> Optional[int]:
    """The established TCP connections from this machine (its network
    namespace) to ``peer`` (host, port), from the kernel's table; None where
    there is no table to read (not Linux, or /proc hidden)."""
    host, port = peer[0], int(peer[1])
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        packed = socket.inet_pton(family, host.split("%", 1)[0])  # a v6 scope is not in the table
    except (OSError, ValueError):
        return None
    try:
        with open(tables[family]) as table:
            next(table, None)  # the header line
            count = 0
            for line in table:
                fields = line.split()
                if len(fields) < 4 or fields[3] != _ESTABLISHED:
                    continue
                address, _, port_hex = fields[2].partition(":")
                if int(port_hex, 16) == port and _table_address(address) == packed:
                    count += 1
            return count
    except (OSError, KeyError, ValueError, struct.error):
        return None


def workers_here(coordinator: socket.socket, env: Mapping[str, str] = os.environ) -> int:
    """How many workers of this session run on this machine, this one included.

    Every worker holds exactly one connection to the coordinator, so once
    the join has completed (the first ShardAssignment or MeshPeers has
    arrived) the connections from this machine to the coordinator's address
    are this session's workers here, whatever the topology and whichever
    coordinator (a reference one too). Where the kernel's table cannot be
    read, torchrun's LOCAL_WORLD_SIZE says, else 1."""
    try:
        counted = connections_to(coordinator.getpeername())
    except OSError:
        counted = None
    if counted:
        return counted
    try:
        return max(1, int(env.get("LOCAL_WORLD_SIZE", "1") or 1))
    except ValueError:
        return 1
