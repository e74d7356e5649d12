"""One worker process of bench/test_bench_elastic.py (numpy only: it starts
in a fraction of a second).

    python bench/elastic_worker.py HOST PORT ELEMENTS STATE_MIB [late]

Runs flat steps of ELEMENTS float32 elements through ``Worker.allreduce``
until the coordinator shuts down, redoing a step called off
(MembershipChanged). It hands a joiner STATE_MIB MiB of state; with
``late`` it joins late itself and takes that state first, printing
``state <bytes> <seconds>`` (from its JoinAccepted to the state checked).
"""
import sys
import time

import numpy as np

from ddpwire import MembershipChanged, Worker


def main() -> int:
    host, port, n, mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    late = len(sys.argv) > 5 and sys.argv[5] == "late"
    state = np.random.default_rng(7).integers(0, 256, mib << 20, dtype=np.uint8).tobytes()
    grad = np.ones(n, dtype=np.float32)
    out = np.empty(n, dtype=np.float32)
    with Worker.connect((host, port), timeout=60, heartbeat=0.2, heartbeat_timeout=1.0) as w:
        w.state_source = lambda step: state
        if late:
            t0 = time.perf_counter()
            _, got = w.receive_state()
            print(f"state {len(got)} {time.perf_counter() - t0:.6f}", flush=True)
        while True:
            shard = w.receive_shard()
            if shard is None:
                return 0
            try:
                w.allreduce(shard.step, grad, 0.0, 0, shard.shard_end - shard.shard_start,
                            out=out)
            except MembershipChanged:
                continue


if __name__ == "__main__":
    sys.exit(main())
