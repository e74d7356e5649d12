"""The docs/ddp.md recipes (Lightning Trainer, Lightning Fabric, Accelerate)
on backend "ddpwire", one rank of each, run by tests/test_torch_recipes.py.

    python tests/recipes_script.py OUT RECIPE [RECIPE ...]

Ranks come from the environment as torchrun sets them (MASTER_ADDR, RANK,
WORLD_SIZE, LOCAL_RANK); DDP_PORTS gives one port per recipe, so each
starts a fresh group. Each saves its final weights to OUT.<recipe>.rank<r>.pt.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import ddpwire.torch  # noqa: F401  (registers "ddpwire")

# Lightning's teardown clears these from the environment: keep them for the next recipe
ENV = {k: os.environ[k] for k in ("MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
WORLD = int(ENV["WORLD_SIZE"])


def data(rank, n=64):
    gen = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(n, 8, generator=gen)
    return x, (x.sum(dim=1) > 0).long()


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))


def trainer(rank):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net()

        def training_step(self, batch, _):
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.log("loss", loss, sync_dist=True)  # an allreduce through the backend too
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    x, y = data(rank)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    model = Model()
    fit = L.Trainer(strategy=DDPStrategy(process_group_backend="ddpwire"), accelerator="cpu",
                    devices=WORLD, max_epochs=2, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    use_distributed_sampler=False)
    fit.fit(model, loader)
    assert dist.get_backend() == "ddpwire"
    return model.net


def fabric(rank):
    import lightning as L
    from lightning.fabric.strategies import DDPStrategy

    f = L.Fabric(accelerator="cpu", devices=WORLD,
                 strategy=DDPStrategy(process_group_backend="ddpwire"))
    f.launch()
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = f.setup(model, opt)
    x, y = data(rank)
    for i in range(0, 64, 16):
        opt.zero_grad()
        f.backward(nn.functional.cross_entropy(model(x[i:i + 16]), y[i:i + 16]))
        opt.step()
    assert dist.get_backend() == "ddpwire"
    return model.module


def accelerate(rank):
    from accelerate import Accelerator

    # Accelerate refuses a backend it does not know on CPU: the group comes first
    dist.init_process_group("ddpwire")
    acc = Accelerator(cpu=True)
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    x, y = data(rank)
    for i in range(0, 64, 16):
        opt.zero_grad()
        acc.backward(nn.functional.cross_entropy(model(x[i:i + 16]), y[i:i + 16]))
        opt.step()
    assert dist.get_backend() == "ddpwire"
    return acc.unwrap_model(model)


if __name__ == "__main__":
    out, recipes = sys.argv[1], sys.argv[2:]
    ports = os.environ["DDP_PORTS"].split(",")
    for index, recipe in enumerate(recipes):
        os.environ.update(ENV, MASTER_PORT=ports[index])
        rank = int(ENV["RANK"])
        model = {"trainer": trainer, "fabric": fabric, "accelerate": accelerate}[recipe](rank)
        torch.save(model.state_dict(), f"{out}.{recipe}.rank{rank}.pt")
        dist.barrier()
        dist.destroy_process_group()
