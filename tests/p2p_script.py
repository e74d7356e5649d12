"""Point to point (send, recv, isend, irecv, recv from any source,
batch_isend_irecv, tags) run on gloo and on ddpwire in one process, for
tests/test_torch_p2p.py.

    python tests/p2p_script.py OUT

Its environment is tests/side_by_side.py's. For each backend it runs every
case on the same inputs and saves what it got to OUT.<backend>.rank<r>.pt,
then on ddpwire alone what gloo cannot show (typed errors, the route).

    python tests/p2p_script.py OUT death

ddpwire only: one rank (P2P_DYING, default the last) exits without a word
while the others wait to receive from it; each saves the error its
receive ended with.
"""
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from side_by_side import KEEP as _KEEP, DTYPES_NAMES, each_backend, prepare
from side_by_side import data as _small

DTYPES = [getattr(torch, name) for name in DTYPES_NAMES]


def data(dtype, shape, seed):
    return _small(dtype, shape, seed, spread=100)


def failed(exc):
    return ("error", type(exc).__name__, str(exc))


def ring_of_dtypes(rank, world):
    """Every dtype once around the ring (isend to the next rank, recv from
    the previous), one tag per dtype."""
    got = {}
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for k, dtype in enumerate(DTYPES):
        x = data(dtype, (3, 5), 100 * rank + k)
        y = torch.empty((3, 5), dtype=dtype)
        req = dist.isend(x, dst=nxt, tag=k)
        dist.recv(y, src=prv, tag=k)
        req.wait()
        got[str(dtype)] = y
    return got


def tags_and_order(rank, world):
    """Rank 0 sends rank 1 tags 5, 7, 5, 5; rank 1 takes tag 7 first, then
    the 5s, which come in the order they were sent."""
    got = {}
    if rank == 0:
        reqs = [dist.isend(torch.full((4,), float(v)), dst=1, tag=t)
                for v, t in ((1, 5), (2, 7), (3, 5), (4, 5))]
        for r in reqs:
            r.wait()
    elif rank == 1:
        for name, t in (("first", 7), ("second", 5), ("third", 5), ("fourth", 5)):
            y = torch.empty(4)
            dist.recv(y, src=0, tag=t)
            got[name] = y
    dist.barrier()
    return got


def any_source(rank, world):
    """Every other rank sends rank 0 its rank; rank 0 receives from any
    source and gets each sender's rank with its message."""
    got = []
    if rank == 0:
        for _ in range(world - 1):
            y = torch.empty(2, dtype=torch.int64)
            src = dist.recv(y, tag=11)
            got.append((src, y.tolist()))
        got.sort()
        # irecv with src=None: the work names its source
        y = torch.empty(2, dtype=torch.int64)
        work = dist.irecv(y, tag=12)
        work.wait()
        got.append(("irecv", work._source_rank(), y.tolist()))
    else:
        dist.send(torch.tensor([rank, 10 * rank]), dst=0, tag=11)
        if rank == world - 1:
            dist.send(torch.tensor([rank, -rank]), dst=0, tag=12)
    dist.barrier()
    return got


def both_orders(rank, world):
    """An irecv posted before its message is sent, and a message sent
    before its irecv is posted (a barrier between)."""
    got = {}
    if rank == 1:
        early = torch.zeros(6, dtype=torch.float64)
        work = dist.irecv(early, src=0, tag=21)
    dist.barrier()  # rank 1's irecv is posted
    if rank == 0:
        first = dist.isend(torch.arange(6, dtype=torch.float64) * 1.5, dst=1, tag=21)
        second = dist.isend(torch.arange(5, dtype=torch.int32) - 7, dst=1, tag=22)
        _KEEP.append((first, second))
    dist.barrier()  # rank 0's isends are issued
    if rank == 1:
        late = torch.zeros(5, dtype=torch.int32)
        late_work = dist.irecv(late, src=0, tag=22)
        work.wait()
        late_work.wait()
        got["irecv first"] = early
        got["send first"] = late
        try:
            fut = late_work.get_future().wait()
            got["future"] = (isinstance(fut, list) and len(fut) == 1
                             and fut[0].data_ptr() == late.data_ptr())
        except RuntimeError:
            got["future"] = None  # gloo's p2p works have none
    if rank == 0:
        first.wait()
        second.wait()
    dist.barrier()
    return got


def batch_ring(rank, world):
    """batch_isend_irecv: every rank sends the next rank and receives the
    previous, twice, tags 3 and 4."""
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    outs = [torch.empty(7, dtype=torch.int64), torch.empty(2, 3)]
    ops = [dist.P2POp(dist.isend, torch.arange(7) * (rank + 1), nxt, tag=3),
           dist.P2POp(dist.irecv, outs[0], prv, tag=3),
           dist.P2POp(dist.isend, data(torch.float32, (2, 3), rank), nxt, tag=4),
           dist.P2POp(dist.irecv, outs[1], prv, tag=4)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return outs


def non_contiguous(rank, world):
    """A transposed tensor sent, received into a strided view: the rest of
    the receiving buffer stays as it was."""
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    x = (torch.arange(20, dtype=torch.float32) + 100 * rank).view(4, 5).t()
    buf = torch.full((5, 8), -1.0)
    y = buf[:, ::2]
    assert not x.is_contiguous() and not y.is_contiguous()
    try:
        req = dist.isend(x, dst=nxt, tag=9)
        dist.recv(y, src=prv, tag=9)
        req.wait()
        strided = buf
    except RuntimeError as exc:  # gloo: "input tensor has to be contiguous"
        strided = failed(exc)
    # the same through contiguous copies: what the strided tensors must get
    ref = torch.full((5, 8), -1.0)
    part = torch.empty(5, 4)
    req = dist.isend(x.contiguous(), dst=nxt, tag=10)
    dist.recv(part, src=prv, tag=10)
    req.wait()
    ref[:, ::2] = part
    return {"strided": strided, "through copies": ref}


def pipeline(rank, world, steps=4):
    """Two stages on ranks 0 and 1: stage 0 sends its activations, stage 1
    its loss's gradient for them; each steps its optimizer. The final
    weights and losses."""
    if rank > 1:
        return None
    torch.manual_seed(1234)
    first = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh())
    second = torch.nn.Linear(16, 4)
    stage = first if rank == 0 else second
    opt = torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(99)
    losses = []
    for step in range(steps):
        x = torch.randn(6, 8, generator=gen)
        target = torch.randn(6, 4, generator=gen)
        opt.zero_grad()
        if rank == 0:
            act = stage(x)
            dist.send(act.detach(), dst=1, tag=step)
            grad = torch.empty_like(act)
            dist.recv(grad, src=1, tag=1000 + step)
            act.backward(grad)
        else:
            act = torch.empty(6, 16)
            dist.recv(act, src=0, tag=step)
            act.requires_grad_(True)
            loss = torch.nn.functional.mse_loss(stage(act), target)
            loss.backward()
            dist.send(act.grad, dst=0, tag=1000 + step)
            losses.append(loss.detach())
        opt.step()
    return {"state": {k: v.clone() for k, v in stage.state_dict().items()}, "losses": losses}


def run_cases(rank, world):
    got = {"dtypes": ring_of_dtypes(rank, world), "tags": tags_and_order(rank, world),
           "any source": any_source(rank, world), "both orders": both_orders(rank, world),
           "batch": batch_ring(rank, world), "non-contiguous": non_contiguous(rank, world),
           "pipeline": pipeline(rank, world)}
    try:
        dist.send(torch.zeros(1), dst=rank)
        got["send to self"] = ("no error",)
    except Exception as exc:  # noqa: BLE001 - the error is what is compared
        got["send to self"] = failed(exc)
    dist.barrier()
    return got


def ddpwire_only(rank, world):
    """What gloo cannot show: the route, typed errors for a message of
    another size or dtype, a receive that times out, sends to self
    refused by the group itself."""
    backend = dist.distributed_c10d._get_default_group()  # ddpwire's group is itself the default
    got = {"direct": backend.p2p_direct, "rank links": backend.rank_links}
    for name, call in {"pg.send to self": lambda: backend.send([torch.zeros(1)], rank, 0),
                       "pg.recv from self": lambda: backend.recv([torch.zeros(1)], rank, 0),
                       "negative tag": lambda: backend.send([torch.zeros(1)], (rank + 1) % world,
                                                            -1)}.items():
        try:
            call()
            got[name] = ("no error",)
        except Exception as exc:  # noqa: BLE001
            got[name] = failed(exc)
    if rank == 0:
        dist.send(torch.arange(3, dtype=torch.float32), dst=1, tag=31)
        dist.send(torch.arange(4, dtype=torch.int32), dst=1, tag=32)
        dist.send(torch.tensor([5.0, 6.0]), dst=1, tag=33)
    elif rank == 1:
        for name, tag, y in (("size", 31, torch.full((4,), -1.0)),
                             ("dtype", 32, torch.full((4,), -1.0))):
            try:
                dist.recv(y, src=0, tag=tag)
                got[f"{name} mismatch"] = ("no error",)
            except Exception as exc:  # noqa: BLE001
                got[f"{name} mismatch"] = failed(exc)
            got[f"{name} mismatch left"] = y
        # the mismatch took its message; the next one with its tag is fine
        y = torch.empty(2)
        dist.recv(y, src=0, tag=33)
        got["after the mismatches"] = y
        work = dist.irecv(torch.empty(1), src=0, tag=999)
        try:
            work.wait(timeout=timedelta(seconds=0.5))
            got["timeout"] = ("no error",)
        except Exception as exc:  # noqa: BLE001
            got["timeout"] = failed(exc)
        got["timeout completed"] = work.is_completed()
    dist.barrier()
    after = torch.tensor([float(rank)])
    dist.all_reduce(after)
    got["the group still answers"] = after
    return got


def death(out, rank, world):
    """One rank (P2P_DYING, default the last) leaves without a word while
    every other rank waits to receive from it."""
    dist.init_process_group("ddpwire", init_method=os.environ["DDP_INIT"].split(",")[1],
                            rank=rank, world_size=world, timeout=timedelta(seconds=60))
    dying = int(os.environ.get("P2P_DYING", world - 1))
    works = []
    if rank != dying:
        works.append(("from the dying", dist.irecv(torch.empty(3), src=dying, tag=1)))
    dist.barrier()  # every receive is posted
    if rank == dying:
        os._exit(3)
    got = {}
    for name, work in works:
        try:
            work.wait()
            got[name] = ("no error",)
        except Exception as exc:  # noqa: BLE001
            got[name] = failed(exc)
            got[name + " rank"] = getattr(exc, "rank", None)
    torch.save(got, f"{out}.death.rank{rank}.pt")
    if rank == 0:
        # rank 0 hosts the service: it stays until the others have saved
        for r in range(1, world):
            while r != dying and not os.path.exists(f"{out}.death.rank{r}.pt"):
                time.sleep(0.05)
    sys.stdout.flush()
    os._exit(0)


def run(backend, rank, world):
    results = {"cases": run_cases(rank, world)}
    if backend == "ddpwire":
        results["ddpwire"] = ddpwire_only(rank, world)
    return results


if __name__ == "__main__":
    if sys.argv[2:] == ["death"]:
        prepare()
        death(sys.argv[1], int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    each_backend(run)
