"""Entry point of one benchmark process inside a cluster namespace.

Run by :mod:`cluster.nodes` as ``ip netns exec NS python node.py FD``: FD is
the child's end of a multiprocessing pipe (a Unix socket pair, which crosses
network namespaces untouched), passed down through ``ip netns exec``. The
first message names one of bench/allreduce_procs.py's process bodies and its
arguments; from then on the body speaks that module's step protocol over the
same pipe, exactly as its spawned processes do on loopback.
"""
from __future__ import annotations

import os
import sys
from multiprocessing.connection import Connection

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import allreduce_procs  # noqa: E402  (needs the path above)
import ddp_step  # noqa: E402
import diloco_rank  # noqa: E402  (this folder: the script's own, first on the path)

# the bodies a cluster run may start, and their modules; anything else is a
# bug in the caller
TARGETS = {name: allreduce_procs for name in ("_ddpwire_coordinator", "_ddpwire_worker",
                                              "_gloo_worker", "_tcp_receiver", "_tcp_sender")}
TARGETS["_ddp_rank"] = ddp_step
TARGETS["_diloco_rank"] = diloco_rank
FIRST_MESSAGE_TIMEOUT = 60.0


def main(argv: list) -> int:
    """Receive the task, run it; the exit status is the body's."""
    conn = Connection(int(argv[1]))
    if not conn.poll(FIRST_MESSAGE_TIMEOUT):
        print("node: no task from the parent", file=sys.stderr)
        return 2
    name, args = conn.recv()
    if name not in TARGETS:
        conn.send(("error", f"node: unknown target {name!r}"))
        return 2
    getattr(TARGETS[name], name)(conn, *args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
