"""One worker process of an elastic session, run by tests/test_elastic_processes.py.

    python tests/elastic_script.py HOST PORT OUT [DIE_AT]

Trains the digits MLP with DataParallelTrainer until the coordinator shuts
down, then saves its weights and what it saw to OUT (torch.save). With
DIE_AT the process SIGKILLs itself once it holds its shard of that step,
before its gradient goes out. A worker the coordinator dropped (stopped
past its heartbeat timeout, then resumed) joins again and goes on from the
session's state; one whose coordinator was lost waits for it to be
restarted and goes on from its own.
"""
import os
import signal
import sys

import torch

from ddpwire import CoordinatorLost, Worker, WorkerDropped
from ddpwire.torch import DataParallelTrainer, DigitsMLP, digits_split

TOTAL = 96  # samples per step
# A sanitizer's runtime preloaded (.ci/sanitize) makes every process several
# times slower, the GIL-holding work that the heartbeat thread waits behind
# included: seconds of silence are then a busy worker, not a stopped one.
SLOWER = 4 if any(lib in os.environ.get("LD_PRELOAD", "") for lib in ("libasan", "libtsan")) else 1
#: the silence after which the coordinator drops a worker: a stopped process
#: is silent for good, while on a loaded 2-core machine (another process busy
#: on each core) a live one's heartbeat thread waited up to 2 s for the GIL
#: and the CPU at the first step; the worker gives the coordinator longer
#: (whoever waits on another's wait waits longer)
SILENCE = 5.0 * SLOWER


def trainer(worker):
    model = DigitsMLP(hidden=32, seed=7)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    return DataParallelTrainer(worker, model, opt, digits_split(seed=0)[0],
                               samples_per_step=TOTAL, seed=1)


def main():
    host, port, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    die_at = int(sys.argv[4]) if len(sys.argv) > 4 else None
    torch.set_num_threads(1)
    def connect(resume_step=None):
        # heartbeats: a stopped process falls silent, a slow one does not
        return Worker.connect((host, port), timeout=30, samples_per_step=TOTAL, heartbeat=0.2,
                              heartbeat_timeout=SILENCE + 2.0, resume_step=resume_step)
    w = connect()
    t = trainer(w)
    indices = t.sampler.indices

    def shard_rows(step, start, end):
        if step == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return indices(step, start, end)
    t.sampler.indices = shard_rows
    steps, dropped, joins, resumed = 0, [], [w.joins_at], []
    while True:
        try:
            if t.step() is None:
                break
            steps += 1
            continue
        except WorkerDropped as exc:
            dropped.append((exc.step, str(exc)))
            w.close()
            w = connect()
            joins.append(w.joins_at)
            t.rejoin(w)
        except CoordinatorLost:
            # the coordinator went: wait for its restart (--resume), go on from here
            resumed.append(t.next_step)
            w.close()
            w = connect(resume_step=t.next_step)
            t.rejoin(w)
    torch.save({"weights": [p.detach().clone() for p in t.model.parameters()],
                "steps": steps, "next_step": t.next_step, "worker": w.worker_id, "dropped": dropped, "joins": joins,
                "resumed": resumed,
                "redone": [(e.step, e.lost, e.workers) for e in t.membership]}, out)
    w.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
