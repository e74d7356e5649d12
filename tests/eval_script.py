"""An evaluation loop over a sharded dataset, run on gloo and on ddpwire in
one process, for tests/test_torch_eval.py.

    python tests/eval_script.py OUT

RANK, WORLD_SIZE and DDP_INIT (two comma-separated init_methods, gloo's
then ddpwire's) come from the environment. Each rank evaluates its shard
of a fixed dataset with a small fixed-seed model (predictions and
per-sample losses); rank 0 gathers the predictions and losses
(dist.gather), every rank's metrics dict (dist.gather_object) and the
correct count (dist.reduce, int64 SUM), and every rank gathers a summary
of each rank (dist.all_gather_object). Rank 0 saves what it got for each
backend to OUT.<backend>.pt, with an evaluation of the whole dataset in
this process to check the gathered one against; every rank saves what
all_gather_object gave it to OUT.<backend>.rank<r>.pt.
"""
import faulthandler
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ddpwire.torch

ddpwire.torch.register()  # "ddpwire" (import torch may have already)

faulthandler.register(signal.SIGUSR1, all_threads=True)
faulthandler.enable()

SAMPLES, FEATURES, CLASSES, BATCH = 50, 8, 4, 8
# torch 2.13's gloo can deadlock when a group of its is freed (tests/ddp_script.py):
# nothing that holds one is, and the process ends with os._exit
_KEEP = []


def dataset():
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, FEATURES, generator=gen)
    y = torch.randint(0, CLASSES, (SAMPLES,), generator=gen)
    return TensorDataset(x, y)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, CLASSES)).eval()


@torch.no_grad()
def evaluate(net, loader):
    """Predictions and per-sample losses, in the loader's order."""
    preds, losses = [], []
    for x, y in loader:
        logits = net(x)
        preds.append(logits.argmax(dim=1))
        losses.append(F.cross_entropy(logits, y, reduction="none"))
    return torch.cat(preds), torch.cat(losses)


def run(rank, world):
    data = dataset()
    net = model()
    # every rank the same number of samples (the sampler repeats a few to pad)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
    indices = torch.tensor(list(iter(sampler)), dtype=torch.int64)
    preds, losses = evaluate(net, DataLoader(data, batch_size=BATCH, sampler=sampler))
    labels = data.tensors[1][indices]
    correct = (preds == labels).sum().to(torch.int64)
    metrics = {"rank": rank, "samples": len(indices), "correct": int(correct),
               "loss sum": float(losses.double().sum()), "worst loss": float(losses.max())}

    root = rank == 0
    gathered_preds = [torch.zeros_like(preds) for _ in range(world)] if root else None
    gathered_losses = [torch.zeros_like(losses) for _ in range(world)] if root else None
    gathered_indices = [torch.zeros_like(indices) for _ in range(world)] if root else None
    dist.gather(preds, gathered_preds, dst=0)
    dist.gather(losses, gathered_losses, dst=0)
    dist.gather(indices, gathered_indices, dst=0)
    metrics_of = [None] * world if root else None
    dist.gather_object(metrics, metrics_of, dst=0)
    total_correct = correct.clone()
    dist.reduce(total_correct, dst=0, op=dist.ReduceOp.SUM)
    summaries = [None] * world
    dist.all_gather_object(summaries, (rank, indices.tolist(), metrics["loss sum"]))
    mine = {"summaries": summaries, "correct": correct, "total correct": total_correct}
    if not root:
        return None, mine
    whole_preds, whole_losses = evaluate(net, DataLoader(data, batch_size=BATCH))
    return {"preds": gathered_preds, "losses": gathered_losses, "indices": gathered_indices,
            "metrics": metrics_of, "correct": total_correct, "summaries": summaries,
            "whole": {"preds": whole_preds, "losses": whole_losses,
                      "labels": data.tensors[1]}}, mine


def main():
    out = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for index, backend in enumerate(["gloo", "ddpwire"]):
        # one rendezvous per backend: gloo cannot meet twice on one store in one process
        dist.init_process_group(backend, init_method=os.environ["DDP_INIT"].split(",")[index],
                                rank=rank, world_size=world, timeout=timedelta(seconds=60))
        at_root, mine = run(rank, world)
        if at_root is not None:
            torch.save(at_root, f"{out}.{backend}.pt")
        torch.save(mine, f"{out}.{backend}.rank{rank}.pt")
        _KEEP.append(dist.group.WORLD)
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
