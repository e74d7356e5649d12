"""Enter an emulated machine (bench/test_bench_balance.py): its CPUs and its
cgroup v1 CPU quota, first thing in a benchmark process, before torch's
import starts any thread, so that every thread inherits both."""
from __future__ import annotations

import os
from typing import Optional


def enter(cgroup: Optional[str] = None, cpus: Optional[str] = None) -> None:
    """Run on ``cpus`` (comma-separated) and under the cgroup directory
    ``cgroup``; either may be None."""
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    if cgroup:
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
