"""One torch.distributed allreduce of SIZE MiB of float32 (AVG) on backend
"ddpwire" against "gloo", N ranks on this machine: issue 12's "one host,
64 MiB, 2, 3 and 4 workers" figure for the shared-memory path.

    python bench/torch_allreduce.py [N ...]   (DDPWIRE_BENCH_MIB=64, DDPWIRE_BENCH_ROUNDS=10)

Each round: a barrier, then every rank times its allreduce; the round's
time is the slowest rank's. Prints the medians and the ddpwire / gloo ratio.
Set DDPWIRE_SHM=0 to measure ddpwire's TCP path instead.
"""
from __future__ import annotations

import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch.multiprocessing as mp

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MIB = int(os.environ.get("DDPWIRE_BENCH_MIB", "64"))
ROUNDS = int(os.environ.get("DDPWIRE_BENCH_ROUNDS", "10"))


def rank_main(rank: int, world: int, backend: str, port: int, out: "mp.Queue") -> None:
    import torch
    import torch.distributed as dist
    import ddpwire.torch  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    t = torch.randn(MIB << 18, generator=torch.Generator().manual_seed(rank))
    times = []
    for i in range(ROUNDS + 2):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)  # SUM: gloo has no AVG
        if i >= 2:  # the first rounds allocate and fault the pages in
            times.append(time.perf_counter() - t0)
    out.put((rank, times))
    dist.barrier()
    os._exit(0)  # a gloo group's teardown can deadlock in torch 2.13 (bench/ddp_procs.py)


def run(backend: str, world: int) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, backend, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    per_rank = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    rounds = [max(per_rank[r][i] for r in range(world)) for i in range(ROUNDS)]
    return statistics.median(rounds)


def main() -> None:
    worlds = [int(x) for x in sys.argv[1:]] or [2, 3, 4]
    for world in worlds:
        gloo = run("gloo", world)
        wire = run("ddpwire", world)
        print(f"{world} ranks, {MIB} MiB: gloo {gloo * 1e3:.1f} ms, ddpwire {wire * 1e3:.1f} ms, "
              f"ratio {wire / gloo:.2f}", flush=True)


if __name__ == "__main__":
    main()
