"""An evaluation loop over a sharded dataset, run on gloo and on ddpwire in
one process, for tests/test_torch_eval.py.

    python tests/eval_script.py OUT

Its environment is tests/side_by_side.py's. Each rank evaluates its shard
of a fixed dataset with a small fixed-seed model (predictions and
per-sample losses); rank 0 gathers the predictions and losses
(dist.gather), every rank's metrics dict (dist.gather_object) and the
correct count (dist.reduce, int64 SUM), and every rank gathers a summary
of each rank (dist.all_gather_object). Each rank saves to
OUT.<backend>.rank<r>.pt what all_gather_object gave it ("mine") and, on
rank 0, what it gathered ("at root"), with an evaluation of the whole
dataset in this process to check the gathered one against.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from side_by_side import each_backend

SAMPLES, FEATURES, CLASSES, BATCH = 50, 8, 4, 8


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


def run_both(backend, rank, world):
    at_root, mine = run(rank, world)
    return {"at root": at_root, "mine": mine}


if __name__ == "__main__":
    each_backend(run_both)
