"""DDP communication hooks for the "ddpwire" backend: buckets with 16 or 8
bits on the wire.

torch's own ``bf16_compress_hook`` and ``fp16_compress_hook`` refuse every
backend but NCCL (and XCCL), so CPU and MPS users have nothing like them.
These do the same job on the ddpwire backend, across machines on the rank
links and through the service otherwise, with the same bits either way::

    ddp = DistributedDataParallel(model)          # on init_process_group("ddpwire")
    ddp.register_comm_hook(None, ddpwire.torch.hooks.bf16_wire_hook)

Each bucket is averaged (not summed): every rank's float32 gradients are
rounded once to 16 bits (or to int8, a byte an element and a float32 scale
per 256: ``int8_wire_hook``), summed in float32 in rank order, divided by
the world size and rounded once more, and every rank decodes the same
average, so the parameters stay bit-identical across ranks.
"""
# no `from __future__ import annotations`: DDP checks these annotations as objects
from typing import Any, Optional

import torch
import torch.distributed as dist

from .backend import DdpwireProcessGroup

__all__ = ["bf16_wire_hook", "fp16_wire_hook", "int8_wire_hook"]


def _group(process_group: Optional[Any]) -> DdpwireProcessGroup:
    group = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
    if isinstance(group, DdpwireProcessGroup):
        return group
    for device in ("cpu", "cuda", "mps"):
        try:
            backend = group._get_backend(torch.device(device))
        except (RuntimeError, AttributeError):
            continue
        if isinstance(backend, DdpwireProcessGroup):
            return backend
    raise TypeError(f"the ddpwire compress hooks need a process group on the ddpwire backend, "
                    f"got {group!r}: register them on a DDP model of init_process_group('ddpwire')")


def _compressed(process_group: Optional[Any], bucket: dist.GradBucket,
                codec: str) -> "torch.futures.Future[torch.Tensor]":
    buffer = bucket.buffer()
    fut = _group(process_group).allreduce_compressed(buffer, codec).get_future()
    return fut.then(lambda _: buffer)


def bf16_wire_hook(process_group: Optional[Any],
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with bfloat16 on the wire (``process_group``: the
    DDP model's group, or None for the default one)."""
    return _compressed(process_group, bucket, "bf16")


def fp16_wire_hook(process_group: Optional[Any],
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with IEEE float16 on the wire."""
    return _compressed(process_group, bucket, "fp16")


def int8_wire_hook(process_group: Optional[Any],
                   bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with int8 on the wire: about a quarter of
    float32's bytes, each element within half its block's scale (the
    block's largest magnitude over 127) of itself, rounded twice."""
    return _compressed(process_group, bucket, "int8")
