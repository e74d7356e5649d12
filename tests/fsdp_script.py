"""One rank of a small FSDP2 training run (torch.distributed.fsdp.fully_shard)
on CPU, for tests/test_torch_fsdp.py: every layer sharded, so each step
all-gathers the parameters and reduce-scatters the gradients. Saves the
full parameters after training, the loss of each step and how many
collectives ran on ddpwire's rank links."""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import ddpwire.torch  # noqa: F401  (registers "ddpwire")

STEPS = 4


def main():
    out, backend = sys.argv[1:3]
    # "bf16": mixed precision, parameters all-gathered and gradients
    # reduce-scattered in bfloat16 (gloo aborts on that on CPU)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) \
        if sys.argv[3:] == ["bf16"] else MixedPrecisionPolicy()
    dist.init_process_group(backend)
    rank = dist.get_rank()
    torch.manual_seed(0)
    # 300 x 300 float32 is 352 KiB: over the links' 64 KiB floor, and
    # sharded unevenly over 3 ranks (FSDP pads the shards)
    model = torch.nn.Sequential(torch.nn.Linear(32, 300), torch.nn.Tanh(),
                                torch.nn.Linear(300, 300), torch.nn.Tanh(),
                                torch.nn.Linear(300, 5))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(16, 32, generator=gen)
        y = torch.randint(0, 5, (16,), generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    pg = dist.distributed_c10d._get_default_group()
    torch.save({"params": full, "losses": losses,
                "links": getattr(pg, "links_collectives", 0)}, f"{out}.{backend}.rank{rank}.pt")
    dist.destroy_process_group()
    sys.stdout.flush()
    # as tests/ddp_script.py: a gloo group is never freed (torch 2.13 may hang)
    os._exit(0)


if __name__ == "__main__":
    main()
