"""Receive windows for the star: N workers sending to one coordinator at once.

Under the star every worker streams its whole vector into the coordinator's
link at the same moment, the pattern known as incast: N senders, each free
to go at its own link's rate, meet at one port whose buffer they overrun,
and their congestion control then shares the link by losses. On the
emulated 1 Gbit/s cluster that kept the coordinator's link 87-91% busy
with 4 workers. Bounding each connection's receive buffer bounds what each
worker may have in flight, so the N flows together stay short of the
port's buffer and no packet is lost: 95% busy, the link's payload rate
(bench/results/notebook.md, "The star's receive windows").

A window must still cover the path: N windows together at least the
bandwidth-delay product of the coordinator's link, or the link idles. The
delay is measured (the smoothed round trip the kernel keeps for each
connection, sampled during the join); the bandwidth is not known, so the
windows are sized for a link up to :data:`RATE_CEILING`, twice over. A
long path (a round trip of milliseconds) gets windows past what the
kernel's autotuning would give anyway, and is left to it.
"""
from __future__ import annotations

import socket
import struct
from typing import Optional

__all__ = ["CAP", "FLOOR", "RATE_CEILING", "limit_receive", "receive_window", "round_trip"]

#: the fastest coordinator link the automatic windows are sized for, bytes/s
RATE_CEILING = 10e9 / 8
#: the smallest window set: a few dozen full-size segments
FLOOR = 64 << 10
#: windows from this size up are left to the kernel's autotuning (whose
#: default ceiling, net.ipv4.tcp_rmem, is 6 MiB)
CAP = 4 << 20
# struct tcp_info (linux/tcp.h): eight u8 fields, then u32s; tcpi_rtt
# (smoothed, microseconds) is the sixteenth u32
_RTT_OFFSET = 8 + 15 * 4
_TCP_INFO_BYTES = 104


def round_trip(sock: socket.socket) -> Optional[float]:
    """The kernel's smoothed round-trip time of a TCP connection, seconds;
    None where the platform does not say (or has no sample yet)."""
    option = getattr(socket, "TCP_INFO", None)
    if option is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, option, _TCP_INFO_BYTES)
    except OSError:
        return None
    if len(info) < _RTT_OFFSET + 4:
        return None
    rtt_us = struct.unpack_from("=I", info, _RTT_OFFSET)[0]
    return rtt_us / 1e6 if rtt_us else None


def receive_window(rtt: Optional[float], workers: int) -> Optional[int]:
    """Bytes of receive buffer for each of ``workers`` connections whose
    round trip is ``rtt`` seconds: together twice the bandwidth-delay
    product of a :data:`RATE_CEILING` link, at least :data:`FLOOR` each;
    None (autotuning) for one worker, an unknown round trip, or a window
    of :data:`CAP` or more."""
    if workers < 2 or rtt is None or rtt <= 0:
        return None
    window = max(FLOOR, int(2 * RATE_CEILING * rtt / workers))
    return None if window >= CAP else window


def limit_receive(sock: socket.socket, window: int) -> None:
    """Bound what the peer may have in flight towards ``sock`` to about
    ``window`` bytes (SO_RCVBUF; Linux doubles the value for its own
    bookkeeping and advertises about the value asked for)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, window)
