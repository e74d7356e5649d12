"""A plain DDP training script, run unchanged on each backend by the tests.

    python tests/ddp_script.py OUT BACKEND [BACKEND ...]

Rank, world size and rendezvous come from the environment as torchrun sets
them (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), or from DDP_INIT (one
comma-separated init_method per backend: ``env://``, ``tcp://host:port``,
``file://path``) with RANK and WORLD_SIZE. Backend ``gloo+hook`` is gloo with ddpwire's comm hook, its
coordinator at DDP_HOOK_ADDR; ``ddpwire+bf16`` (``+int8``) is ddpwire with its bf16_wire_hook (int8_wire_hook). For each backend it trains a
small model with BatchNorm over several buckets, runs the object and integer
collectives, and saves what it got to OUT.<backend>.rank<r>.pt.
DDP_KILL_AT=<rank>:<step> makes that rank exit abruptly at that step;
DDP_DEVICE=cuda DDP_DEVICE_RANKS=0 trains rank 0 on that device, the rest on CPU.
"""
import faulthandler
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpwire.torch  # noqa: F401  (registers "ddpwire")
from ddpwire.plane.collectives import CollectiveAborted

STEPS = int(os.environ.get("DDP_STEPS", "6"))
# a test that gives up on this rank asks it where every thread stands first
faulthandler.register(signal.SIGUSR1, all_threads=True)
faulthandler.enable()  # a crash prints every thread's stack too


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(20, 64), nn.BatchNorm1d(64), nn.ReLU(),
        nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(),
        nn.Linear(64, 5),
    )


def init(backend: str, run_index: int) -> None:
    timeout = timedelta(seconds=float(os.environ.get("DDP_TIMEOUT", "60")))
    if "DDP_INIT" in os.environ:
        # one rendezvous per run: gloo cannot meet twice on one store in one process
        method = os.environ["DDP_INIT"].split(",")[run_index]
        dist.init_process_group(backend, init_method=method,
                                rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
          torch.uint8, torch.int8, torch.bool]
OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
       "product": dist.ReduceOp.PRODUCT, "avg": dist.ReduceOp.AVG}


def collectives(rank: int, world: int) -> dict:
    """Every op on every dtype, plus the tensor forms of allgather and
    reduce_scatter: the result, or the name of the error raised."""
    got = {}
    gen = torch.Generator().manual_seed(7 + rank)
    for dtype in DTYPES:
        base = torch.randint(0, 4, (6,), generator=gen)
        for name, op in OPS.items():
            t = base.to(dtype, copy=True) if dtype != torch.bool else base > 1
            try:
                dist.all_reduce(t, op=op)
                got[(str(dtype), name)] = t
            except Exception as exc:  # noqa: BLE001 - which ops a backend refuses is compared too
                got[(str(dtype), name)] = type(exc).__name__
        t = base.to(dtype, copy=True) if dtype != torch.bool else base > 1
        dist.broadcast(t, src=world - 1)
        got[(str(dtype), "broadcast")] = t
        out = torch.empty(6 * world, dtype=t.dtype)
        dist.all_gather_into_tensor(out, t)
        got[(str(dtype), "all_gather_into_tensor")] = out
    src = torch.arange(4 * world, dtype=torch.float32) * (rank + 1)
    out = torch.empty(4)
    dist.reduce_scatter_tensor(out, src)
    got[("torch.float32", "reduce_scatter_tensor")] = out
    return got


# torch 2.13's gloo can deadlock when its process group is freed: the freeing
# thread holds the GIL while it joins gloo's work threads, and one of them may
# still be dropping a finished work's tensors, which needs the GIL (seen here:
# ~ProcessGroupGloo joining pt_gloo_runloop blocked in ~AsyncAllreduceWork).
# So nothing that holds a gloo group is ever freed: the models stay here and
# the process ends with os._exit once its results are saved.
_KEEP = []


def run(backend: str, out: str, run_index: int) -> None:
    hook = backend == "gloo+hook"
    # ddpwire's bf16_wire_hook or int8_wire_hook on its own backend
    coded = backend.partition("+")[2] if backend.startswith("ddpwire+") else None
    init("gloo" if hook else "ddpwire" if coded else backend, run_index)
    rank, world = dist.get_rank(), dist.get_world_size()
    kill = os.environ.get("DDP_KILL_AT")
    # DDP_DEVICE=cuda:0 DDP_DEVICE_RANKS=0 puts rank 0 on a GPU, the others on CPU
    on_device = str(rank) in os.environ.get("DDP_DEVICE_RANKS", "").split(",")
    device = torch.device(os.environ.get("DDP_DEVICE", "cpu") if on_device else "cpu")
    net = model()
    # perturb rank != 0 so the initial broadcast matters
    if rank:
        with torch.no_grad():
            for p in net.parameters():
                p.add_(0.5)
    net.to(device)
    ddp = DDP(net, bucket_cap_mb=0.005)  # several buckets even for this small model
    if hook:  # each bucket averaged by a ddpwire coordinator, the group staying gloo
        from ddpwire import Worker
        from ddpwire.session.launch import parse_addr
        from ddpwire.torch.comm_hook import CommHookState, comm_hook

        state = CommHookState(Worker.connect(parse_addr(os.environ["DDP_HOOK_ADDR"]), timeout=30,
                                             token=os.environ.get("DDPWIRE_TOKEN")))
        ddp.register_comm_hook(state, comm_hook)
    if coded:
        from ddpwire.torch import hooks

        ddp.register_comm_hook(None, getattr(hooks, f"{coded}_wire_hook"))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    steps_taken = 0
    try:
        for step in range(STEPS):
            if kill and kill == f"{rank}:{step}":
                os._exit(17)
            if step == 2 and "DDP_MARK" in os.environ:  # tells a test that this rank is training
                open(f"{os.environ['DDP_MARK']}.rank{rank}", "w").close()
            x = torch.randn(16, 20, generator=gen).to(device)
            y = torch.randint(0, 5, (16,), generator=gen).to(device)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            steps_taken += 1
    except CollectiveAborted as exc:
        # docs/ddp.md: what a script catches when a rank is lost, and the
        # optimizer steps it took (none of the step that failed)
        print(f"caught CollectiveAborted (rank {exc.rank}) after {steps_taken} optimizer steps: "
              f"{exc}", flush=True)
        # a normal exit: the group closes (atexit), so rank 0's service
        # tells the other ranks who was lost before it goes
        raise SystemExit(23)
    gathered = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "name": f"r{rank}", "sq": [rank] * rank})
    objs = [f"from {rank}", {"k": rank}] if rank == 1 else [None, None]
    dist.broadcast_object_list(objs, src=1)
    dist.barrier()
    big = torch.tensor([rank * 3 - 4, 2 ** 40 + rank, -rank], dtype=torch.int64)
    dist.all_reduce(big, op=dist.ReduceOp.MAX)
    if hook:
        state.close()
    pg = dist.distributed_c10d._get_default_group()  # ddpwire's group is itself the default
    plane = ("links" if getattr(pg, "rank_links", False) else
             "shm" if getattr(pg, "shared_memory", False) else "service")
    torch.save({"collectives": collectives(rank, world), "plane": plane,
                "state": {k: v.cpu() for k, v in net.state_dict().items()}, "gathered": gathered, "objs": objs, "max": big},
               f"{out}.{backend}.rank{rank}.pt")
    dist.destroy_process_group()
    _KEEP.append(ddp)


if __name__ == "__main__":
    for index, name in enumerate(sys.argv[2:]):
        run(name, sys.argv[1], index)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
