"""One rank of a group on backend "ddpwire" exercising its shared-memory
allreduce (tests/test_shm.py starts several).

    python tests/shm_script.py OUT   (RANK, WORLD_SIZE, SHM_INIT set)

Issues, without waiting in between, a mix of float32 allreduces (through
shared memory) and other collectives (through the service), records the
order their futures complete in, and saves every result with the segment's
state to OUT.rank<r>.pt. SHM_KILL_AT=<rank>:<i> makes that rank exit
abruptly (os._exit(17)) before its i-th round; SHM_STALL=<rank> makes that
rank stop (SIGSTOP itself) before its first round.
"""
from __future__ import annotations

import os
import signal
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ddpwire.torch  # noqa: E402
import ddpwire.torch.backend  # noqa: E402


def tensor(rank: int, i: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * i + rank)
    return torch.randn(n, generator=gen) * (rank + 1)


def _ddpwire_group() -> "ddpwire.torch.backend.DdpwireProcessGroup":
    pg = dist.distributed_c10d._get_default_group()
    if isinstance(pg, ddpwire.torch.backend.DdpwireProcessGroup):
        return pg
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device))
        except RuntimeError:
            continue
    raise RuntimeError(f"no ddpwire group in {pg!r}")


def main() -> None:
    out = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = float(os.environ.get("SHM_TIMEOUT", "60"))
    dist.init_process_group("ddpwire", init_method=os.environ["SHM_INIT"], rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout))
    backend = _ddpwire_group()
    plane = backend._shm
    seg = None if plane is None else plane.segment
    record = {"shared_memory": backend.shared_memory,
              "name": None if seg is None else seg.name,
              "linked_after_init": None if seg is None else os.path.exists("/dev/shm" + seg.name)}
    kill = os.environ.get("SHM_KILL_AT", "")
    stall = os.environ.get("SHM_STALL", "")
    sizes = [int(x) for x in os.environ.get("SHM_SIZES", "70000,5,300001").split(",")]
    order, works, results = [], [], []
    try:
        if stall == str(rank):
            os.kill(os.getpid(), signal.SIGSTOP)
        for i in range(int(os.environ.get("SHM_ROUNDS", "3"))):
            if kill == f"{rank}:{i}":
                os._exit(17)
            for j, n in enumerate(sizes):
                op = dist.ReduceOp.AVG if (i + j) % 2 else dist.ReduceOp.SUM
                t = tensor(rank, 10 * i + j, n)
                w = dist.all_reduce(t, op=op, async_op=True)
                w.get_future().then(lambda _, k=len(results): order.append(k))
                works.append(w)
                results.append(t)
                # a service collective between shared-memory ones
                b = torch.full((3,), float(rank)) if rank == i % world else torch.zeros(3)
                w = dist.broadcast(b, src=i % world, async_op=True)
                w.get_future().then(lambda _, k=len(results): order.append(k))
                works.append(w)
                results.append(b)
        for w in works:
            w.wait()
        dist.barrier()
    except Exception as exc:  # noqa: BLE001 - the test reads it
        record["error"] = type(exc).__name__
        record["error_rank"] = getattr(exc, "rank", None)
        record["error_text"] = str(exc)
        traceback.print_exc()
        torch.save(record, f"{out}.rank{rank}.pt")
        sys.stdout.flush()
        os._exit(3)
    record.update(order=order, results=results,
                  shm_collectives=None if plane is None else plane.collectives)
    torch.save(record, f"{out}.rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
