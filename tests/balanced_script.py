"""One rank of a DDP run with BalancedBatchSampler and balanced_hook, run
by tests/test_torch_balanced.py.

    python tests/balanced_script.py OUT BACKEND MODE

MODE is "ddp" (a plain loop) or "lightning" (a Lightning Trainer with
use_distributed_sampler=False). Rank and rendezvous come from the
environment as torchrun sets them; BALANCED_SLOW=<rank>:<seconds per
sample> makes that rank's forward slower. Saves the final weights and
every step's split to OUT.rank<r>.pt.
"""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import ddpwire.torch  # noqa: F401  (registers "ddpwire")
from ddpwire.torch.balanced import BalancedBatchSampler, balanced_hook

# As in tests/ddp_script.py: torch 2.13's gloo can abort or deadlock when
# its process group is freed while its work threads finish, so nothing
# holding a group is freed and the process ends with os._exit once saved.
KEEP = []

BATCH = 64
STEPS = 12
LR = 0.1


def dataset():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(BATCH * STEPS, 16, generator=gen)
    return TensorDataset(x, (x[:, :4].sum(dim=1) > 0).long())


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 2))


class Slow(nn.Module):
    """The model, with a rank held back in proportion to its batch."""

    def __init__(self, inner, per_sample):
        super().__init__()
        self.inner = inner
        self.per_sample = per_sample

    def forward(self, x):
        time.sleep(self.per_sample * len(x))
        return self.inner(x)


def slowness(rank):
    spec = os.environ.get("BALANCED_SLOW", "")
    if not spec:
        return 0.0
    who, seconds = spec.split(":")
    return float(seconds) if int(who) == rank else 0.0


def plain(backend, rank):
    dist.init_process_group(backend)
    sampler = BalancedBatchSampler(BATCH * STEPS, BATCH, seed=5)
    loader = DataLoader(dataset(), batch_sampler=sampler)
    model = DDP(Slow(net(), slowness(rank)))
    model.register_comm_hook(sampler, balanced_hook)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    splits = []
    for x, y in loader:
        splits.append(list(sampler.splits[len(splits)]))
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    # never freed (the group it holds with it): see KEEP
    KEEP.append(model)
    return model.module.inner.state_dict(), splits


def lightning(backend, rank):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    # Lightning draws one batch ahead of the step it trains
    sampler = BalancedBatchSampler(BATCH * STEPS, BATCH, seed=5, lag=1)
    splits = []

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Slow(net(), slowness(rank))

        def on_train_start(self):
            # Lightning registers a strategy's ddp_comm_hook on CUDA only: here on any device
            self.trainer.strategy.model.register_comm_hook(sampler, balanced_hook)

        def training_step(self, batch, index):
            splits.append(list(sampler.splits[index]))
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

        def train_dataloader(self):
            return DataLoader(dataset(), batch_sampler=sampler)

    model = Model()
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), num_nodes=1,
                        strategy=DDPStrategy(process_group_backend=backend),
                        use_distributed_sampler=False, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model)
    return model.net.inner.state_dict(), splits


def main():
    out, backend, mode = sys.argv[1:4]
    rank = int(os.environ["RANK"])
    state, splits = (plain if mode == "ddp" else lightning)(backend, rank)
    torch.save({"state": state, "splits": splits}, f"{out}.rank{rank}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # see KEEP: no gloo group is freed on the way out


if __name__ == "__main__":
    main()
