"""The sum of a sparse COO tensor over the ranks, as gloo computes it: each
rank's coalesced indices and values gathered to every rank, the ranks'
tensors added in rank order, the coalesced sum written into each rank's
tensor (its shape and dtype kept, its number of entries that of the sum).

Only the gathers travel: two dense all-gathers (indices, values) padded to
the largest rank's entries, after a small one of every rank's shape and
entry count, so that ranks that disagree are named before anything else
moves.
"""
from __future__ import annotations

from typing import Callable, List

import torch

from ..plane.collectives import DType

__all__ = ["MAX_DIMS", "sparse_sum"]

#: the most dimensions a sparse tensor may have here (the shape travels in a fixed record)
MAX_DIMS = 16
# the record: entries, dtype (the wire's code), sparse dims, dense dims,
# then the shape padded with -1
_HEAD = 4

Gather = Callable[[torch.Tensor, torch.Tensor], None]


def sparse_sum(t: torch.Tensor, dtype_code: int, rank: int, world: int, gather: Gather) -> None:
    """Sum the sparse COO tensor ``t`` over the ranks into ``t`` itself.

    ``gather(output, input)`` is an all_gather_into_tensor of dense flat
    tensors that returns once done; ``dtype_code`` is ``t``'s dtype as
    the wire names it. A ValueError names the first rank whose dtype, shape
    or layout differs from rank 0's."""
    if t.dim() > MAX_DIMS:
        raise NotImplementedError(f"ddpwire allreduce: a sparse tensor of {t.dim()} dimensions "
                                  f"(at most {MAX_DIMS})")
    mine = t.coalesce()
    records = _gather_records(mine, dtype_code, world, gather)
    for r in range(world):
        if records[r][1:] != records[0][1:]:
            raise ValueError(f"ddpwire allreduce: rank {r}'s sparse tensor is "
                             f"{_describe(records[r])}, rank 0's {_describe(records[0])}")
    counts = [rec[0] for rec in records]
    most = max(counts)
    if most == 0:
        t.copy_(mine)  # nothing anywhere: the sum is empty
        return
    sparse_dim, dense_shape = mine.sparse_dim(), tuple(mine.shape[mine.sparse_dim():])
    indices = torch.zeros(sparse_dim, most, dtype=torch.int64)
    indices[:, :counts[rank]] = mine.indices().cpu()
    values = torch.zeros((most, *dense_shape), dtype=mine.dtype)
    values[:counts[rank]] = mine.values().cpu()
    all_indices = torch.empty(world * indices.numel(), dtype=torch.int64)
    all_values = torch.empty(world * values.numel(), dtype=values.dtype)
    gather(all_indices, indices.reshape(-1))
    gather(all_values, values.reshape(-1))
    total = None
    for r, (idx, val) in enumerate(zip(all_indices.view(world, sparse_dim, most),
                                      all_values.view(world, most, *dense_shape))):
        part = torch.sparse_coo_tensor(idx[:, :counts[r]], val[:counts[r]], mine.shape,
                                       is_coalesced=True)
        total = part if total is None else total + part
    t.copy_(total.coalesce().to(t.device))


def _gather_records(mine: torch.Tensor, dtype_code: int, world: int,
                    gather: Gather) -> List[List[int]]:
    shape = list(mine.shape) + [-1] * (MAX_DIMS - mine.dim())
    record = torch.tensor([mine._nnz(), dtype_code, mine.sparse_dim(), mine.dense_dim(), *shape],
                          dtype=torch.int64)
    out = torch.empty(world * record.numel(), dtype=torch.int64)
    gather(out, record)
    return [row.tolist() for row in out.view(world, record.numel())]


def _describe(record: List[int]) -> str:
    dtype, sparse_dim, dense_dim = record[1:_HEAD]
    shape = record[_HEAD:_HEAD + sparse_dim + dense_dim]
    return (f"{DType(dtype).name.lower()} of shape {tuple(shape)} ({sparse_dim} sparse and "
            f"{dense_dim} dense dimensions)")
