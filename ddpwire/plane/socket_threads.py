"""When a step's socket copies are spread over threads (``socket_threads``).

Copying bytes into and out of the kernel is most of what a large step
costs. One poll loop does all of it on one core; threads let several cores
share it, but starting, waking and joining them costs about a few hundred
microseconds a step (bench/test_bench_socket_threads.py), and where cores
are fewer than busy threads they only take turns. Hence threads only for
vectors of a megabyte or more, and only with cores to run them.
"""
from __future__ import annotations

from typing import Optional

# looked up here at each call, so a test may patch it on this module
from .threads import usable_cores

__all__ = ["MIN_BYTES", "usable_cores", "for_coordinator", "for_worker"]

# smallest vector the defaults put on threads
MIN_BYTES = 1 << 20


def for_coordinator(choice: Optional[bool], workers: int, nbytes: int) -> bool:
    """Whether the coordinator streams a vector of nbytes from ``workers``
    on a receiving and a sending thread per connection: ``choice`` if given,
    else when there is a core per worker plus one."""
    if choice is not None:
        return choice
    return workers > 1 and nbytes >= MIN_BYTES and usable_cores() > workers


def for_worker(choice: Optional[bool], nbytes: int) -> bool:
    """Whether a worker sends its gradients of nbytes from a thread of their
    own while it receives the average: ``choice`` if given, else with two
    cores or more."""
    if choice is not None:
        return choice
    return nbytes >= MIN_BYTES and usable_cores() > 1
