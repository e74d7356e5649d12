"""One rank of a DiLoCo run (ddpwire.torch.local_steps), run by
tests/test_torch_local_steps.py.

    python tests/local_steps_script.py OUT BACKEND MODE

MODE "rounds": AdamW inner steps, 5 per round, the default Nesterov outer
step, 4 rounds; saves every round's parameters and outer state. MODE "sgd":
one SGD step per round and an outer SGD(lr=1), which is synchronous SGD.
Each rank trains on its half of every global batch.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import ddpwire.torch  # noqa: F401  (registers "ddpwire")
from ddpwire.torch.local_steps import DiLoCo

BATCH = 32
STEPS = 20
LR = 0.1


def data():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(BATCH * STEPS, 12, generator=gen)
    return x, (x[:, :3].sum(dim=1) > 0).long()


def net(seed, norm=False):
    torch.manual_seed(seed)
    if norm:  # buffers too: BatchNorm's running statistics and its count
        return nn.Sequential(nn.Linear(12, 24), nn.BatchNorm1d(24), nn.Tanh(), nn.Linear(24, 2))
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 2))


def main():
    out, backend, mode = sys.argv[1:4]
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    # unlike weights: DiLoCo starts every rank from rank 0's
    model = net(seed=rank, norm=mode == "rounds")
    if mode in ("f32", "bf16", "int8"):
        # one round of 5 AdamW steps, the same start on every run: float32 against 16 or 8 bits
        model = net(seed=0)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        local = DiLoCo(model, inner, sync_every=5, wire=None if mode == "f32" else mode)
    elif mode == "sgd":
        inner = torch.optim.SGD(model.parameters(), lr=LR)
        local = DiLoCo(model, inner, sync_every=1, outer=torch.optim.SGD(model.parameters(), lr=1.0))
    else:
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        local = DiLoCo(model, inner, sync_every=5)
    x, y = data()
    half = BATCH // world
    start = [p.detach().clone() for p in model.parameters()]
    rounds = []
    for k in range(5 if mode in ("f32", "bf16", "int8") else STEPS):
        lo = k * BATCH + rank * half
        inner.zero_grad()
        nn.functional.cross_entropy(model(x[lo:lo + half]), y[lo:lo + half]).backward()
        if local.step():
            state = local.outer.state_dict()["state"]
            if mode in ("f32", "bf16", "int8"):
                rounds.append({"anchor": [a.clone() for a in start]})
            rounds.append({"params": [p.detach().clone() for p in model.parameters()],
                           "buffers": [b.clone() for b in model.buffers()],
                           "momentum": [state[i]["momentum_buffer"].clone() for i in sorted(state)
                                        if state[i].get("momentum_buffer") is not None]})
    torch.save(rounds, f"{out}.{mode}.rank{rank}.pt")
    # as in tests/ddp_script.py: torch 2.13's gloo can abort or deadlock when
    # its process group is freed while its work threads finish, so the group
    # is kept and the process ends with os._exit once its results are saved
    keep = dist.distributed_c10d._get_default_group()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0 if keep is not None else 1)


if __name__ == "__main__":
    main()
