"""The collectives ddpwire composes (reduce, gather, scatter, all-to-all,
the coalesced forms), run on gloo and on ddpwire in one process, for
tests/test_torch_composed.py.

    python tests/composed_script.py OUT

Its environment is tests/side_by_side.py's. For each backend it runs every
case on the same inputs and saves what it got to OUT.<backend>.rank<r>.pt:
the tensors, whether an async work's future held the outputs, and the type
and text of each error. ddpwire then fails its group on purpose (ranks
that disagree) to show what a failed composed op leaves behind.
"""
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceCoalescedOptions, GatherOptions,
                                        ReduceOptions, ReduceScatterOptions, ScatterOptions)

from side_by_side import KEEP as _KEEP, DTYPES_NAMES, data, each_backend

DTYPES = [getattr(torch, name) for name in DTYPES_NAMES]
OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
       "product": dist.ReduceOp.PRODUCT}


def holds(value, expected):
    """Whether a future's value is ``expected``'s tensors themselves."""
    if isinstance(expected, torch.Tensor):
        return isinstance(value, torch.Tensor) and value.data_ptr() == expected.data_ptr()
    return (isinstance(value, list) and len(value) == len(expected)
            and all(holds(v, e) for v, e in zip(value, expected)))


def finish(work, future_of):
    """Wait for an async work; whether its future holds ``future_of``
    (None where the work has no future: gloo's coalesced reduce-scatter)."""
    _KEEP.append(work)
    assert work.wait()
    try:
        future = work.get_future()
    except RuntimeError:
        return None
    return holds(future.wait(), future_of)


def failed(exc):
    return ("error", type(exc).__name__, (str(exc).splitlines() or [""])[0])


def run_cases(rank, world):
    got = {}

    def case(key, run):
        try:
            got[key] = run()
        except Exception as exc:  # noqa: BLE001 - which calls a backend refuses is compared too
            got[key] = failed(exc)

    for i, dtype in enumerate(DTYPES):
        name = str(dtype)
        seed = 1000 * i + rank
        for j, (op_name, op) in enumerate(OPS.items()):
            def reduce(dst=(i + j) % world, asynchronous=bool((i + j) % 2), op=op):
                t = data(dtype, (2, 3), seed + 10 * j)
                before = t.clone()
                work = dist.reduce(t, dst=dst, op=op, async_op=asynchronous)
                future = finish(work, [t]) if asynchronous else None
                return {"in": before, "out": t, "dst": dst, "future": future}
            case(("reduce", name, op_name), reduce)

            def allreduce_coalesced(asynchronous=bool(j % 2), op=op):
                ts = [data(dtype, (3,), seed + 20 * j), data(dtype, (2, 2), seed + 20 * j + 1),
                      data(dtype, (1,), seed + 20 * j + 2)]
                fut = dist.all_reduce_coalesced(ts, op=op, async_op=asynchronous)
                return {"out": ts, "future": holds(fut.wait(), ts) if asynchronous else None}
            case(("allreduce_coalesced", name, op_name), allreduce_coalesced)

        for shape_name, dense in (("1-d", ()), ("hybrid", (2,))):
            def sparse_sum(dense=dense):
                # index 2 twice (not coalesced), the ranks overlapping, the last none
                count = 0 if rank == world - 1 else 3
                indices = torch.tensor([[rank, 2, 2][:count]], dtype=torch.int64)
                t = torch.sparse_coo_tensor(indices, data(dtype, (count, *dense), seed + 77),
                                            (5, *dense))
                dist.all_reduce(t)
                t = t.coalesce()
                return {"out": [t.indices(), t.values()]}
            case((f"sparse allreduce {shape_name}", name, "sum"), sparse_sum)

        asynchronous = bool(i % 2)

        def gather(dst=i % world):
            x = data(dtype, (2, 2), seed)
            outs = [torch.zeros(2, 2, dtype=dtype) for _ in range(world)] if rank == dst else None
            work = dist.gather(x, outs, dst=dst, async_op=asynchronous)
            future = finish(work, outs or []) if asynchronous else None
            return {"out": outs, "future": future}
        case(("gather", name), gather)

        def scatter(src=(i + 1) % world):
            ins = [data(dtype, (3,), 7000 + 10 * i + r) for r in range(world)] if rank == src else None
            out = torch.zeros(3, dtype=dtype)
            work = dist.scatter(out, ins, src=src, async_op=asynchronous)
            future = finish(work, [out]) if asynchronous else None
            return {"out": out, "future": future}
        case(("scatter", name), scatter)

        def all_to_all():
            ins = [data(dtype, (2, 2), seed + 10 * r) for r in range(world)]
            outs = [torch.zeros(2, 2, dtype=dtype) for _ in range(world)]
            work = dist.all_to_all(outs, ins, async_op=asynchronous)
            future = finish(work, outs) if asynchronous else None
            return {"out": outs, "future": future}
        case(("all_to_all", name), all_to_all)

        def all_to_all_single(in_rows, out_rows, in_splits=None, out_splits=None, width=3):
            x = data(dtype, (in_rows, width), seed + 5)
            out = torch.zeros(out_rows, width, dtype=dtype)
            work = dist.all_to_all_single(out, x, out_splits, in_splits, async_op=asynchronous)
            future = finish(work, [out]) if asynchronous else None
            return {"out": out, "future": future}
        case(("all_to_all_single", name), lambda: all_to_all_single(2 * world, 2 * world))
        # rows rank i sends rank j (one pair sends none)
        sends = [[(2 * a + 3 * b) % 4 for b in range(world)] for a in range(world)]
        case(("all_to_all_single splits", name), lambda: all_to_all_single(
            sum(sends[rank]), sum(row[rank] for row in sends), sends[rank],
            [row[rank] for row in sends], width=2))
        even = [1, 2, 0, 3][:world]  # every rank sends rank j even[j] rows
        case(("all_to_all_single input splits", name), lambda: all_to_all_single(
            sum(even), world * even[rank], in_splits=even))
        case(("all_to_all_single output splits", name), lambda: all_to_all_single(
            world * even[rank], sum(even), out_splits=even))

        def allgather_coalesced():
            ins = [data(dtype, (2,), seed + 1), data(dtype, (3, 1), seed + 2)]
            outs = [[torch.zeros(2, dtype=dtype), torch.zeros(3, 1, dtype=dtype)]
                    for _ in range(world)]
            fut = dist.all_gather_coalesced(outs, ins, async_op=asynchronous)
            return {"out": outs, "future": holds(fut.wait(), outs) if asynchronous else None}
        case(("allgather_coalesced", name), allgather_coalesced)

        def all_gather_single_coalesced():
            ins = [data(dtype, (2,), seed + 3), data(dtype, (1, 3), seed + 4)]
            outs = [torch.zeros(2 * world, dtype=dtype), torch.zeros(world, 3, dtype=dtype)]
            with dist._coalescing_manager(async_ops=asynchronous) as cm:
                for o, x in zip(outs, ins):
                    dist.all_gather_into_tensor(o, x)
            if asynchronous:
                cm.wait()
            return {"out": outs}
        case(("all_gather_single_coalesced", name), all_gather_single_coalesced)

        def reduce_scatter_single_coalesced():
            ins = [data(dtype, (2 * world,), seed + 5), data(dtype, (world, 2), seed + 6)]
            outs = [torch.zeros(2, dtype=dtype), torch.zeros(1, 2, dtype=dtype)]
            with dist._coalescing_manager(async_ops=asynchronous) as cm:
                for o, x in zip(outs, ins):
                    dist.reduce_scatter_tensor(o, x, op=dist.ReduceOp.MAX)
            if asynchronous:
                cm.wait()
            return {"out": outs}
        case(("reduce_scatter_single_coalesced", name), reduce_scatter_single_coalesced)

        pg = dist.group.WORLD

        def allgather_into_tensor_coalesced():
            ins = [data(dtype, (3,), seed + 7), data(dtype, (1,), seed + 8)]
            outs = [torch.zeros(3 * world, dtype=dtype), torch.zeros(world, dtype=dtype)]
            work = pg.allgather_into_tensor_coalesced(outs, ins, AllgatherOptions())
            return {"out": outs, "future": finish(work, outs)}
        case(("allgather_into_tensor_coalesced", name), allgather_into_tensor_coalesced)

        def reduce_scatter_tensor_coalesced():
            # gloo splits dim 0: an output of (1, 2) for an input of (world, 2)
            ins = [data(dtype, (world, 2), seed + 9), data(dtype, (world,), seed + 10)]
            outs = [torch.zeros(1, 2, dtype=dtype), torch.zeros(1, dtype=dtype)]
            opts = ReduceScatterOptions()
            opts.reduceOp = dist.ReduceOp.MIN
            work = pg.reduce_scatter_tensor_coalesced(outs, ins, opts)
            return {"out": outs, "future": finish(work, outs)}
        case(("reduce_scatter_tensor_coalesced", name), reduce_scatter_tensor_coalesced)
    return got


def opts(kind, root):
    o = kind()
    o.rootRank = root
    return o


def argument_errors(rank, world):
    """Calls every rank refuses before sending anything: (type, text) each,
    and the group still answers afterwards."""
    pg = dist.group.WORLD
    t = torch.zeros(2)
    other = (rank + 1) % world
    calls = {
        "reduce root out of range": lambda: pg.reduce([t], opts(ReduceOptions, world)),
        "gather root out of range": lambda: pg.gather([], [t], opts(GatherOptions, world)),
        # each rank the root of its own call: each refuses it alone
        "gather output list too short": lambda: pg.gather([[torch.zeros(2)] * (world - 1)], [t],
                                                          opts(GatherOptions, rank)),
        "gather output of the wrong size": lambda: pg.gather([[torch.zeros(3)] * world], [t],
                                                             opts(GatherOptions, rank)),
        "gather outputs off the root": lambda: pg.gather([[torch.zeros(2)] * world], [t],
                                                         opts(GatherOptions, other)),
        "scatter root out of range": lambda: pg.scatter([t], [], opts(ScatterOptions, -1)),
        "scatter input list too long": lambda: pg.scatter([t], [[torch.zeros(2)] * (world + 1)],
                                                          opts(ScatterOptions, rank)),
        "scatter input of the wrong size": lambda: pg.scatter([t], [[torch.zeros(1)] * world],
                                                              opts(ScatterOptions, rank)),
        "scatter inputs off the root": lambda: pg.scatter([t], [[torch.zeros(2)] * world],
                                                          opts(ScatterOptions, other)),
        "all_to_all list too short": lambda: dist.all_to_all([torch.zeros(2)] * (world - 1),
                                                             [torch.zeros(2)] * (world - 1)),
        "all_to_all sizes differ": lambda: dist.all_to_all(
            [torch.zeros(2)] * world, [torch.zeros(2)] * (world - 1) + [torch.zeros(3)]),
        "all_to_all_single split list too short": lambda: dist.all_to_all_single(
            torch.zeros(6), torch.zeros(6), [2, 4], [2] * world),
        "all_to_all_single splits do not add up": lambda: dist.all_to_all_single(
            torch.zeros(6), torch.zeros(6), [2] * world, [1] * world),
        "all_to_all_single rows do not divide": lambda: dist.all_to_all_single(
            torch.zeros(world + 1), torch.zeros(world + 1)),
        "allreduce_coalesced of nothing": lambda: pg.allreduce_coalesced(
            [], AllreduceCoalescedOptions()),
        "allgather_coalesced output lists too few": lambda: dist.all_gather_coalesced(
            [[torch.zeros(2)]] * (world - 1), [torch.zeros(2)]),
        "allgather_coalesced output of the wrong size": lambda: dist.all_gather_coalesced(
            [[torch.zeros(3)]] * world, [torch.zeros(2)]),
        "allgather_into_tensor_coalesced output of the wrong size":
            lambda: pg.allgather_into_tensor_coalesced([torch.zeros(world * 2 + 1)], [torch.zeros(2)],
                                                       AllgatherOptions()),
        "reduce_scatter_tensor_coalesced input of the wrong size":
            lambda: pg.reduce_scatter_tensor_coalesced([torch.zeros(2)], [torch.zeros(2 * world - 1)],
                                                       ReduceScatterOptions()),
    }
    got = {}
    for name, call in calls.items():
        try:
            work = call()
            if work is not None:
                _KEEP.append(work)
                work.wait()
            got[name] = ("no error",)
        except Exception as exc:  # noqa: BLE001 - the error is what is compared
            got[name] = failed(exc)
    after = torch.tensor([float(rank)])
    dist.all_reduce(after)
    got["the group still answers"] = after
    return got


def ddpwire_only(rank, world):
    """What gloo cannot show: split sizes that disagree are refused on every
    rank alike, and a failed op leaves its outputs as they were."""
    got = {}
    try:  # each rank sends one row to every rank, but rank 1 expects 2 from rank 0
        expects = [2, 0] + [1] * (world - 2) if rank == 1 else [1] * world
        dist.all_to_all_single(torch.zeros(world), torch.ones(world), expects, [1] * world)
        got["split sizes disagree"] = ("no error",)
    except Exception as exc:  # noqa: BLE001
        got["split sizes disagree"] = failed(exc)
    try:  # rank 1's sparse tensor is longer: every rank names it, nothing else moves
        t = torch.sparse_coo_tensor([[0]], [1.0], (5 if rank == 1 else 4,))
        dist.all_reduce(t)
        got["sparse shapes disagree"] = ("no error",)
    except Exception as exc:  # noqa: BLE001
        got["sparse shapes disagree"] = failed(exc)
    after = torch.tensor([float(rank)])
    dist.all_reduce(after)
    got["the group still answers"] = after
    pg = dist.group.WORLD
    for name, call in {"send": lambda: pg.send([after], rank, 0),
                       "recv": lambda: pg.recv([after], rank, 0),
                       "monitored_barrier": lambda: pg.monitored_barrier()}.items():
        try:
            call()
            got[name] = ("no error",)
        except Exception as exc:  # noqa: BLE001
            got[name] = failed(exc)
    # the ranks disagree (float64 on rank 0, int64 elsewhere): the service
    # fails the group, and every rank's work fails with it; one issued once
    # the group has failed is refused at the call
    t = torch.arange(4, dtype=torch.float64 if rank == 0 else torch.int64) + 10 * rank
    before = t.clone()
    outs = [torch.full((4,), -1, dtype=t.dtype) for _ in range(world)] if rank == 0 else None
    for name, call in (("reduce", lambda: dist.reduce(t, dst=0, async_op=True)),
                       ("gather", lambda: dist.gather(t, outs, dst=0, async_op=True))):
        work = None
        try:
            work = call()
            work.wait()
            got[f"failed {name}"] = ("no error",)
        except Exception as exc:  # noqa: BLE001
            got[f"failed {name}"] = failed(exc)
        if work is not None:
            got[f"failed {name} completed"] = (work.is_completed(), work.is_success(),
                                               work.exception() is not None)
    got["failed reduce left"] = (before, t)
    got["failed gather left"] = outs
    return got


def run(backend, rank, world):
    results = {"cases": run_cases(rank, world), "errors": argument_errors(rank, world)}
    if backend == "ddpwire":
        results["ddpwire"] = ddpwire_only(rank, world)
    return results


if __name__ == "__main__":
    each_backend(run)
