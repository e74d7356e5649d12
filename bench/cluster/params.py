"""What the cluster benchmark runs, read from environment variables.

Kept free of side effects so that tests/test_cluster_harness.py can check
the parsing without root.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Mapping, Optional, Tuple

import allreduce_procs as procs

# bench/allreduce_procs.py's table is the one list of ddpwire kinds; the
# baseline ones run the checkout $DDPWIRE_BASELINE names, in the same run
KINDS = tuple(procs.DDPWIRE_KINDS) + ("gloo",)
# the star and the mesh, plain and compressed, against gloo's ring
DEFAULT_KINDS = ("ddpwire-star", "ddpwire-mesh", "ddpwire-bf16", "gloo")

_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


def parse_rate(text: str) -> int:
    """Bits per second from ``"1gbit"``, ``"500mbit"``, ``"2.5gbit"`` or a plain number.

    tc's own suffixes, lowercase, decimal (1gbit = 10**9 bit/s), so the value
    given here is the value tc is given.
    """
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if not m or m.group(2) not in ("",) + tuple(_UNITS):
        raise ValueError(f"a rate is a number with bit, kbit, mbit or gbit; got {text!r}")
    bits = float(m.group(1)) * _UNITS.get(m.group(2) or "bit", 1)
    if bits < 1e6:
        # tbf below a megabit would make every benchmark step last minutes
        raise ValueError(f"a link rate must be at least 1mbit, got {text!r}")
    return int(bits)


def parse_ints(text: str, least: int, name: str) -> List[int]:
    """A comma-separated list of integers, each at least ``least``."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name} must be numbers like '16,64', got {text!r}") from None
    if not values or min(values) < least:
        raise ValueError(f"{name} must name values of at least {least}, got {text!r}")
    return values


def parse_kinds(text: str) -> Tuple[str, ...]:
    """The measured paths, each one of :data:`KINDS`."""
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if not kinds or unknown:
        raise ValueError(f"DDPWIRE_CLUSTER_KINDS must name some of {', '.join(KINDS)}; "
                         f"got {text!r}")
    return kinds


def parse_congestion(text: str) -> Optional[str]:
    """A congestion control algorithm's name, or None (empty: the host's)."""
    name = text.strip()
    if not name:
        return None
    if not re.fullmatch(r"[a-z0-9_]{1,15}", name):
        raise ValueError(f"DDPWIRE_CLUSTER_TCP must name a congestion control algorithm "
                         f"such as cubic; got {text!r}")
    return name


@dataclass(frozen=True)
class ClusterParams:
    """One benchmark run: the sweep and the links it runs over."""

    sizes_mib: Tuple[int, ...] = (16, 64)
    workers: Tuple[int, ...] = (2, 4)
    coord_rate: int = 10**9
    worker_rate: int = 10**9
    rounds: int = 3
    kinds: Tuple[str, ...] = DEFAULT_KINDS
    #: every machine's default TCP congestion control; None keeps the host's
    congestion: Optional[str] = None

    @property
    def max_workers(self) -> int:
        """How many worker namespaces the largest case needs."""
        return max(self.workers)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "ClusterParams":
        """Read ``DDPWIRE_CLUSTER_*``; anything unset keeps the default above."""
        d = cls()
        return cls(
            sizes_mib=tuple(parse_ints(env.get("DDPWIRE_CLUSTER_SIZES", "16,64"), 1,
                                       "DDPWIRE_CLUSTER_SIZES")),
            workers=tuple(parse_ints(env.get("DDPWIRE_CLUSTER_WORKERS", "2,4"), 1,
                                     "DDPWIRE_CLUSTER_WORKERS")),
            coord_rate=parse_rate(env.get("DDPWIRE_CLUSTER_COORD_RATE", "1gbit")),
            worker_rate=parse_rate(env.get("DDPWIRE_CLUSTER_WORKER_RATE", "1gbit")),
            rounds=parse_ints(env.get("DDPWIRE_CLUSTER_ROUNDS", str(d.rounds)), 1,
                              "DDPWIRE_CLUSTER_ROUNDS")[0],
            kinds=parse_kinds(env.get("DDPWIRE_CLUSTER_KINDS", ",".join(DEFAULT_KINDS))),
            congestion=parse_congestion(env.get("DDPWIRE_CLUSTER_TCP", "")),
        )
