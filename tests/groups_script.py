"""Process groups of the "ddpwire" backend as torch knows them (named, found
by name, subgroups of any ranks in any order, destroyed one by one), run on
gloo and on ddpwire in one process, for tests/test_torch_groups.py.

    python tests/groups_script.py OUT

Its environment is tests/side_by_side.py's, with 3 ranks. For each backend it saves to
OUT.<backend>.rank<r>.pt the groups' names, what torch's lookups by name
gave, and the results of collectives of several groups issued interleaved
on the same inputs; ddpwire then destroys the subgroups one at a time,
showing the others still answer and the destroyed ones refuse.
"""
import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._C._distributed_c10d import _resolve_process_group

from side_by_side import KEEP as _KEEP, each_backend

#: the subgroups every rank creates, in this order: (name in the results, ranks, sorted)
SUBGROUPS = [("a", [2, 0], True), ("b", [0, 1], True), ("c", [1, 2], True), ("d", [2, 0], False)]


def failed(exc):
    return ("error", type(exc).__name__, (str(exc).splitlines() or [""])[0])


def attempt(call):
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - the error is what is compared
        return failed(exc)


def open_fds():
    return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else -1


def ints(seed, n=5):
    return torch.randint(-1000, 1000, (n,), generator=torch.Generator().manual_seed(seed),
                         dtype=torch.int64)


def floats(seed, n=1 << 15):
    """Large enough for the shared-memory and rank-links paths (float32 SUM)."""
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def identity(group):
    """How torch knows ``group``: its name, and what its lookups by name give."""
    name = group.group_name
    return {"name": name,
            "resolved": _resolve_process_group(name) is group,
            "pg_names": dist.distributed_c10d._world.pg_names.get(group) == name,
            "_get_process_group_name": dist.distributed_c10d._get_process_group_name(group) == name,
            "rank": group.rank(), "size": group.size(), "get_rank": dist.get_rank(group),
            "global ranks": dist.get_process_group_ranks(group),
            "backend": dist.get_backend(group),
            # ddpwire's paths for large float32 allreduces, this group's own
            "paths": (getattr(group, "shared_memory", None), getattr(group, "rank_links", None))}


def interleaved(rank, groups, round_):
    """Async collectives on every group this rank is in, issued one group
    after another and waited for in reverse: each rank's program order
    differs (it is in different groups), and gloo gets the same calls."""
    got, pending = {}, []
    for key, group in groups.items():
        seed = 100 * round_ + 10 * rank + ord(key[0])
        s = ints(seed)
        m = ints(seed + 1)
        b = ints(seed + 2) if group.rank() == 0 else torch.zeros(5, dtype=torch.int64)
        g = ints(seed + 3, 3)
        outs = [torch.zeros(3, dtype=torch.int64) for _ in range(group.size())]
        f = floats(seed + 4)
        pending += [dist.all_reduce(s, group=group, async_op=True),
                    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group, async_op=True),
                    # from the group's last rank, named by its global rank
                    dist.broadcast(b, src=dist.get_global_rank(group, group.size() - 1),
                                   group=group, async_op=True),
                    dist.all_gather(outs, g, group=group, async_op=True),
                    dist.all_reduce(f, group=group, async_op=True)]
        got[key] = {"sum": s, "max": m, "broadcast": b, "all_gather": outs, "float sum": f}
    _KEEP.extend(pending)
    for work in reversed(pending):
        work.wait()
    return got


def by_name(groups):
    """torch's functional collectives, which find the group by its name."""
    got = {}
    for key, group in groups.items():
        x = ints(7 + ord(key[0])) * (group.rank() + 1)
        got[key] = attempt(lambda: funcol.all_reduce(x, "sum", group).wait())
    return got


def run(backend, rank, world):
    results = {"fds at start": open_fds()}
    world_pg = dist.group.WORLD
    results["world"] = identity(world_pg)
    groups = {}
    for key, ranks, sort in SUBGROUPS:
        group = dist.new_group(ranks, sort_ranks=sort)
        _KEEP.append(group)
        if group is not dist.GroupMember.NON_GROUP_MEMBER:
            groups[key] = group
    results["members of"] = sorted(groups)
    results["identity"] = {key: identity(group) for key, group in groups.items()}
    results["carrier"] = {key: type(group._get_backend(torch.device("cpu"))).__name__
                          for key, group in {**groups, "world": world_pg}.items()}
    results["round 1"] = interleaved(rank, {"world": world_pg, **groups}, 1)
    results["by name"] = by_name({"world": world_pg, **groups})
    if backend == "ddpwire":
        results["ddpwire"] = destroy_one_by_one(rank, world_pg, groups)
    else:  # what ddpwire's groups give once a is destroyed
        results["round 2"] = interleaved(
            rank, {"world": world_pg, **{k: g for k, g in groups.items() if k != "a"}}, 2)
    return results


def destroy_one_by_one(rank, world_pg, groups):
    """Destroy a (ranks 0 and 2): the default group still answers and so do
    the other subgroups, interleaved; a's collectives refuse, naming it.
    Then b, c, d one at a time, the default group answering after each, and
    last the default group."""
    got = {"repr": {key: repr(group) for key, group in groups.items()}}
    t = torch.zeros(1)
    carrier = world_pg._get_backend(torch.device("cpu"))
    # a collective that reached the carrier (none of ours does) fails
    got["carrier refuses"] = attempt(lambda: carrier.allreduce([t]).wait())
    a = groups.pop("a", None)
    if a is not None:
        name = a.group_name
        got["a name"] = name
        before = open_fds()
    dist.destroy_process_group(a if a is not None else dist.GroupMember.NON_GROUP_MEMBER)
    if a is not None:
        got["fds released"] = before - open_fds()
        got["a closed"] = (a.closed, a.shared_memory, a.rank_links)
        got["a repr"] = repr(a)
        got["a still in pg_names"] = a in dist.distributed_c10d._world.pg_names
        got["a resolved"] = attempt(lambda: _resolve_process_group(name) is a)
        got["a all_reduce"] = attempt(lambda: dist.all_reduce(torch.ones(1), group=a))
        got["a allreduce"] = attempt(lambda: a.allreduce([torch.ones(1)]))
        got["a barrier"] = attempt(lambda: a.barrier())
    got["after a"] = interleaved(rank, {"world": world_pg, **groups}, 2)
    for key in sorted(groups):
        dist.destroy_process_group(groups[key])
        got[f"{key} closed"] = groups[key].closed
        s = torch.tensor([rank + 1])
        dist.all_reduce(s)  # the default group, after each subgroup is gone
        got[f"world after {key}"] = s
    got["world name before"] = world_pg.group_name
    dist.destroy_process_group()
    got["world closed"] = world_pg.closed
    got["world repr"] = repr(world_pg)
    got["world allreduce"] = attempt(lambda: world_pg.allreduce([torch.ones(1)]))
    return got


if __name__ == "__main__":
    each_backend(run)
