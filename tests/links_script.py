"""One rank of tests/test_torch_links.py's collectives through the backend:
bfloat16 and float16 all_reduce (SUM, AVG), reduce_scatter_tensor (float32,
bfloat16, float16), all_gather_into_tensor and broadcast (float32, bfloat16,
int64),
on random values large enough for the
rank links (or, with DDPWIRE_LINKS_MIN_BYTES set high, through the
service). Saves every result and how many collectives the links ran."""
import os
import sys

import torch
import torch.distributed as dist

import ddpwire.torch  # noqa: F401  (registers "ddpwire")

N = 40_000  # 80 KB in 16 bits: over the links' 64 KiB floor


def main():
    out = sys.argv[1]
    dist.init_process_group("ddpwire")
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(11 + rank)
    got = {}
    for dtype in (torch.bfloat16, torch.float16):
        for name, op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG)):
            t = (torch.randn(N, generator=gen) * 3).to(dtype)
            dist.all_reduce(t, op=op)
            got[(str(dtype), name)] = t
    for dtype, name, op in ((torch.float32, "sum", dist.ReduceOp.SUM),
                            (torch.float32, "avg", dist.ReduceOp.AVG),
                            (torch.bfloat16, "sum", dist.ReduceOp.SUM),
                            (torch.float16, "avg", dist.ReduceOp.AVG)):
        src = (torch.randn(N * world, generator=gen) * 3).to(dtype)
        chunk = torch.empty(N, dtype=dtype)
        dist.reduce_scatter_tensor(chunk, src, op=op)
        got[("reduce_scatter_tensor", str(dtype), name)] = chunk
    # an all-gather moves bytes: any dtype
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        mine = (torch.randn(N, generator=gen) * 1000).to(dtype)
        whole = torch.empty(N * world, dtype=dtype)
        dist.all_gather_into_tensor(whole, mine)
        got[("all_gather_into_tensor", str(dtype))] = whole
    # a broadcast moves bytes too: a scatter from the root, then an all-gather
    for dtype, root in ((torch.float32, 1), (torch.int64, 2), (torch.bfloat16, 0)):
        t = (torch.randn(N, generator=gen) * 1000).to(dtype)
        dist.broadcast(t, src=root)
        got[("broadcast", str(dtype), root)] = t
    pg = dist.distributed_c10d._get_default_group()
    torch.save({"got": got, "links": pg.links_collectives}, f"{out}.rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    os._exit(0)
