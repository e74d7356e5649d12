"""The ``tc tbf`` command lines that give each link its rate.

tbf is an egress qdisc, so each veth pair gets one on both ends: on the
machine's ``eth0`` it shapes what the machine sends, on the bridge-side port
what it receives.

burst: tokens for 1 ms at the link rate, and never less than 64 KiB. A
burst much smaller than one timer slice's worth of bytes keeps tbf below its
rate (the qdisc sleeps between dequeues); 64 KiB also lets a whole GSO packet
through without tbf splitting it. At 1 Gbit/s that is 125,000 bytes, at
10 Gbit/s 1,250,000.

latency: 10 ms of queue at the link rate (plus the burst), a switch port's
order of buffering: enough that N workers sending to the coordinator at once
fill the link instead of losing packets on every round trip, and short
enough not to hide a slow sender.
"""
from __future__ import annotations

from typing import List

BURST_SECONDS = 0.001
MIN_BURST_BYTES = 64 * 1024
LATENCY_MS = 10


def burst_bytes(rate: int) -> int:
    """tbf's bucket size in bytes for a link of ``rate`` bit/s."""
    return max(int(rate / 8 * BURST_SECONDS), MIN_BURST_BYTES)


def tbf_command(netns: str, dev: str, rate: int) -> List[str]:
    """``tc`` shaping the egress of ``dev`` in ``netns`` to ``rate`` bit/s."""
    return ["tc", "-n", netns, "qdisc", "replace", "dev", dev, "root", "tbf",
            "rate", f"{rate}bit", "burst", str(burst_bytes(rate)),
            "latency", f"{LATENCY_MS}ms"]
