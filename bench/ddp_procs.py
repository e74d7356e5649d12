"""Ranks of a DDP job driven step by step from the benchmark process.

    python bench/ddp_procs.py BACKEND   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)

Each rank builds the same ~25M-parameter model, wraps it in DDP on BACKEND
and then, for every "step" line on stdin, runs one training step (forward,
backward with DDP's bucketed allreduce, optimizer step) and answers
"done". "quit" ends it; the parent times each step from its command to the
last rank's answer.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ddpwire.torch  # noqa: E402,F401  (registers "ddpwire")

WIDTH = 2048
DEPTH = 6  # 6 x (2048 x 2048 + 2048) = 25.2M parameters
BATCH = 16


def model() -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers)


def main() -> None:
    torch.set_num_threads(1)  # ranks share the cores: one thread each, both backends alike
    dist.init_process_group(sys.argv[1])
    rank = dist.get_rank()
    ddp = DDP(model())
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(BATCH, WIDTH, generator=gen)
    print("ready", sum(p.numel() for p in ddp.parameters()), flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
        print("done", flush=True)
    dist.destroy_process_group()
    # Freeing a gloo group can deadlock in torch 2.13 (its destructor holds
    # the GIL while joining a gloo thread that needs it; tests/ddp_script.py
    # says more): leave without freeing anything.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
