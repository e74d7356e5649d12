"""One rank of the balance benchmark's DDP runs (bench/test_bench_balance.py).

The same MLP and data as bench/balance_worker.py, trained by a plain DDP
loop on backend "ddpwire": each step a global batch of ``--samples``,
split evenly (``--balance off``, what DistributedSampler gives) or by
measured speed (``--balance on``: ddpwire.torch.BalancedBatchSampler and
balanced_hook).

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=P \\
        python bench/balance_ddp_rank.py --balance on --steps 45 --report r0.json [--cgroup DIR]

``--report`` writes each step's end time (time.perf_counter(), after the
optimizer step) and this rank's batch sizes, as JSON.
"""
from __future__ import annotations

import argparse
import json
import os

import emulated_machine  # bench/, beside this script


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--balance", choices=["on", "off"], required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--samples", type=int, default=2048, help="the global batch")
    p.add_argument("--cgroup", help="cgroup v1 cpu directory to run in")
    p.add_argument("--cpus", help="the CPUs to run on, comma-separated (before anything else)")
    p.add_argument("--report", required=True)
    args = p.parse_args(argv)
    # first: the import of torch runs on those CPUs and under the quota too
    emulated_machine.enter(args.cgroup, args.cpus)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset

    import ddpwire.torch  # noqa: F401  (registers "ddpwire")
    from ddpwire.torch import BalancedBatchSampler, balanced_hook

    torch.set_num_threads(1)
    dist.init_process_group("ddpwire")
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples * args.steps, 256, generator=gen)
    y = (x @ torch.randn(256, 10, generator=gen)).argmax(dim=1)
    data = TensorDataset(x, y)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                    torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                    torch.nn.Linear(512, 10)))
    if args.balance == "on":
        sampler = BalancedBatchSampler(len(data), args.samples, shuffle=False)
        model.register_comm_hook(sampler, balanced_hook)
    else:
        share = args.samples // world
        sampler = [list(range(k * args.samples + rank * share, k * args.samples + (rank + 1) * share))
                   for k in range(args.steps)]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ends, sizes = [], []
    for xb, yb in DataLoader(data, batch_sampler=sampler):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
        ends.append(time.perf_counter())
        sizes.append(len(xb))
    dist.destroy_process_group()
    with open(args.report, "w") as f:
        json.dump({"rank": rank, "ends": ends, "sizes": sizes}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
