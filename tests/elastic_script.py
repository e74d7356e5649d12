"""One worker process of an elastic session, run by tests/test_elastic_processes.py.

    python tests/elastic_script.py HOST PORT OUT [DIE_AT]

Trains the digits MLP with DataParallelTrainer until the coordinator shuts
down, then saves its weights and what it saw to OUT (torch.save). With
DIE_AT the process SIGKILLs itself once it holds its shard of that step,
before its gradient goes out. A worker the coordinator dropped saves the
WorkerDropped it got instead of weights.
"""
import os
import signal
import sys

import torch

from ddpwire import Worker, WorkerDropped
from ddpwire.torch import DataParallelTrainer, DigitsMLP, digits_split

TOTAL = 96  # samples per step


def trainer(worker):
    model = DigitsMLP(hidden=32, seed=7)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    return DataParallelTrainer(worker, model, opt, digits_split(seed=0)[0],
                               samples_per_step=TOTAL, seed=1)


def main():
    host, port, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    die_at = int(sys.argv[4]) if len(sys.argv) > 4 else None
    torch.set_num_threads(1)
    # heartbeats: a stopped process falls silent, a slow one does not
    with Worker.connect((host, port), timeout=30, samples_per_step=TOTAL, heartbeat=0.2,
                        heartbeat_timeout=2.0) as w:
        t = trainer(w)
        indices = t.sampler.indices

        def shard_rows(step, start, end):
            if step == die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return indices(step, start, end)
        t.sampler.indices = shard_rows
        try:
            steps = len(t.train())
        except WorkerDropped as exc:
            torch.save({"dropped": str(exc), "step": exc.step, "worker": w.worker_id}, out)
            return 4
        torch.save({"weights": [p.detach().clone() for p in t.model.parameters()],
                    "steps": steps, "worker": w.worker_id,
                    "redone": [(e.step, e.lost, e.workers) for e in t.membership]}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
