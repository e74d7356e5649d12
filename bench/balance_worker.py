"""One worker of the balance benchmark (bench/test_bench_balance.py).

A real forward and backward pass of a small MLP (256 -> 512 -> 512 -> 10,
float32, torch on the CPU, one thread) over exactly its shard of a fixed
synthetic data set, every step; the flattened gradient goes through
``Worker.allreduce`` and the average is applied with plain SGD, so every
worker holds the same weights step after step.

    python bench/balance_worker.py --connect 127.0.0.1:PORT [--cgroup DIR] [--report FILE]

``--cgroup`` names a cgroup v1 directory (e.g.
/sys/fs/cgroup/cpu/ddpwire-bench-slow): this process writes its own pid to
its ``cgroup.procs`` before anything else, torch's import included, so all
of its threads run under that cgroup's CPU quota. ``--report`` writes one
JSON object at the end: the worker id and, each step, its shard, the
seconds it waited for the shard, computed (from the shard's arrival to the
allreduce call), spent in the allreduce (and this process's CPU seconds
there), applying the average, when the allreduce was called and returned
(time.perf_counter: one clock for the processes of a host), and the
global loss.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import emulated_machine  # bench/, beside this script


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--connect", required=True, help="the coordinator's HOST:PORT")
    p.add_argument("--cgroup", help="cgroup v1 cpu directory to run in")
    p.add_argument("--cpus", help="the CPUs to run on, comma-separated (before anything else)")
    p.add_argument("--samples", type=int, default=2048, help="samples per step (the data set)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data and the weights")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--report", help="write a JSON summary here at the end")
    args = p.parse_args(argv)
    # first: the import of torch runs on those CPUs and under the quota too
    emulated_machine.enter(args.cgroup, args.cpus)

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import time

    import numpy as np
    import torch

    from ddpwire import Worker

    torch.set_num_threads(1)
    host, _, port = args.connect.rpartition(":")

    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.samples, 256, generator=gen)
    # labels a linear teacher gives: something to learn, not noise
    teacher = torch.randn(256, 10, generator=gen)
    y = (x @ teacher).argmax(dim=1)
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 10))
    params = list(model.parameters())
    sizes = [q.numel() for q in params]
    length = sum(sizes)
    grads = np.zeros(length, dtype=np.float32)
    flat = torch.from_numpy(grads)  # shares memory with grads
    avg = np.empty(length, dtype=np.float32)
    avg_t = torch.from_numpy(avg)
    loss_fn = torch.nn.CrossEntropyLoss()

    steps = []
    loss_value = None
    with Worker.connect((host, int(port)), timeout=args.timeout,
                        samples_per_step=args.samples, gradient_length=length) as w:
        while True:
            asked = time.perf_counter()
            shard = w.receive_shard()
            if shard is None:
                break
            t0 = time.perf_counter()
            start, end = shard.shard_start, shard.shard_end
            count = end - start
            if count > 0:
                model.zero_grad(set_to_none=False)
                out = model(x[start:end])
                loss = loss_fn(out, y[start:end])  # the shard's mean: ddpwire weights it
                loss.backward()
                with torch.no_grad():
                    at = 0
                    for q, n in zip(params, sizes):
                        flat[at:at + n].copy_(q.grad.reshape(-1))
                        at += n
                correct = int((out.argmax(dim=1) == y[start:end]).sum())
                loss_value = float(loss.detach())
            else:
                grads.fill(0.0)
                correct, loss_value = 0, 0.0
            called, cpu = time.perf_counter(), time.process_time()
            result = w.allreduce(shard.step, grads, loss_value, correct, count, out=avg)
            averaged, cpu = time.perf_counter(), time.process_time() - cpu
            with torch.no_grad():  # SGD with the averaged gradient
                at = 0
                for q, n in zip(params, sizes):
                    q.sub_(avg_t[at:at + n].view_as(q), alpha=args.lr)
                    at += n
            steps.append({"step": shard.step, "shard": count, "compute_s": called - t0,
                          "shard_wait_s": t0 - asked, "allreduce_s": averaged - called,
                          "apply_s": time.perf_counter() - averaged,
                          "allreduce_cpu_s": cpu, "called_at": called, "averaged_at": averaged,
                          "global_loss": float(result.global_loss)})
        worker_id = w.worker_id
    if args.report:
        with open(args.report, "w") as f:
            json.dump({"worker": worker_id, "pid": os.getpid(), "steps": steps}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
