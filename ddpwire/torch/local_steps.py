"""Local steps with an outer optimizer (DiLoCo) for torch users, on any
process group.

Over a slow link (a home uplink, a link between sites) averaging every step
leaves the machines idle most of the time. DiLoCo (Douillard et al., 2023)
trains ``sync_every`` steps locally with the usual (inner) optimizer, then
averages the change of the parameters since the last average (the
pseudo-gradient) and applies it with an outer optimizer, Nesterov momentum
by default::

    model = Net()                                   # no DDP: nothing to sync per step
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    local = DiLoCo(model, inner, sync_every=50)     # on the default process group
    for x, y in loader:                             # each rank its own data
        inner.zero_grad()
        loss_fn(model(x), y).backward()
        local.step()                                # inner step; every 50th, the average

Every rank starts a round from the same parameters and applies the same
averaged pseudo-gradient with the same outer optimizer state, so the ranks
end every round with bit-identical parameters, on any backend whose
allreduce gives every rank the same bits (ddpwire, gloo, NCCL). With
``sync_every=1``, a plain SGD inner optimizer of learning rate ``lr`` and an
outer ``SGD(lr=1)`` this is synchronous data parallel SGD, within float32
rounding.

``wire="bf16"`` (or ``"fp16"``) sends the pseudo-gradient in 16 bits on the
ddpwire backend (half the bytes again; OpenDiLoCo used float16): each
rank's values rounded once, summed in float32, divided, rounded once more,
so each averaged element is within about 2**-8 (bf16) of the float32
average, relative to its size. ``wire="int8"`` sends a byte an element and
a float32 scale per :data:`INT8_BLOCK` (csrc/int8.h), rounded the same two
times, each time within half its block's scale (the block's largest
magnitude over 127): on the ddpwire backend as its flat allreduce over the
rank links, on any other process group as every rank's bytes gathered and
averaged by each rank in rank order, the same bits.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..plane import codecs as _codecs
from ..plane.codecs import INT8_BLOCK

__all__ = ["DiLoCo", "INT8_BLOCK", "nesterov_outer"]


def _ddpwire_group(group: Optional[Any], wire: str) -> Any:
    """The ddpwire backend's process group under ``group``; None for another
    backend's where ``wire`` can travel on it (int8's bytes gathered),
    else a TypeError saying so."""
    from .hooks import _group  # the backend's process group, or a TypeError
    try:
        return _group(group)
    except TypeError:
        if _codecs.codec_of(wire).block:
            return None
        raise TypeError(f"DiLoCo(wire={wire!r}) averages with the ddpwire backend's 16-bit "
                        f"allreduce: init_process_group('ddpwire'), or leave wire=None") \
            from None


def nesterov_outer(params: Any, lr: float = 0.7, momentum: float = 0.9) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer: SGD with Nesterov momentum (the paper's 0.7, 0.9)."""
    return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=True)


class DiLoCo:
    """``model``'s parameters trained ``sync_every`` inner steps at a time
    by ``inner``, then averaged over ``group`` (the default process group
    when None) as a pseudo-gradient applied by ``outer`` (default
    :func:`nesterov_outer`). Call :meth:`step` where ``inner.step()`` was
    called; :meth:`sync` averages at once (at the end of training, say).
    ``wire`` (None: float32, "bf16", "fp16", "int8") is how the
    pseudo-gradient travels (module docstring).
    """

    def __init__(self, model: nn.Module, inner: torch.optim.Optimizer, *, sync_every: int,
                 outer: Optional[torch.optim.Optimizer] = None, group: Optional[Any] = None,
                 wire: Optional[str] = None) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every must be at least 1, got {sync_every}")
        # the flat allreduce's codecs (ddpwire.plane.codecs)
        if wire not in (None, *_codecs.names()):
            choices = ", ".join(repr(n) for n in _codecs.names())
            raise ValueError(f"wire must be None (float32) or one of {choices}, got {wire!r}")
        #: the pseudo-gradient's words on the wire: None (float32), "bf16" or
        #: "fp16" (the ddpwire backend's 16-bit average: half the bytes), or
        #: "int8" (a byte an element and a float32 scale per
        #: :data:`INT8_BLOCK`, on any process group)
        self.wire = wire
        # the ddpwire backend's compressed allreduce (None: float32, or int8
        # gathered on another backend)
        self._coded = None if wire is None else _ddpwire_group(group, wire)
        self.params: List[nn.Parameter] = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no parameters to train")
        self.inner = inner
        self.outer = outer if outer is not None else nesterov_outer(self.params)
        self.sync_every = sync_every
        self.group = group
        #: inner steps since the last average
        self.local_steps = 0
        #: averages done so far
        self.rounds = 0
        self.model = model
        # every rank must start from the same weights and buffers (frozen
        # ones too): the group's first rank's
        self._src = 0 if group is None else dist.get_global_rank(group, 0)
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(t.data, self._src, group=group)
        self._anchor = [p.detach().clone() for p in self.params]

    def step(self, closure: Optional[Callable[[], Any]] = None) -> bool:
        """One inner step; every ``sync_every``-th also averages. Returns
        whether it did."""
        self.inner.step(closure)
        self.local_steps += 1
        if self.local_steps < self.sync_every:
            return False
        self.sync()
        return True

    @torch.no_grad()
    def sync(self) -> None:
        """Average the pseudo-gradients and take the outer step."""
        world = dist.get_world_size(self.group)
        # one flat float32 vector: one allreduce, whatever the model's layout
        delta = torch.cat([(a - p.detach()).reshape(-1).float()
                           for a, p in zip(self._anchor, self.params)])
        if self._coded is not None:
            # rounded once, summed in float32, divided, rounded once more
            self._coded.allreduce_compressed(delta, self.wire).wait()
        elif self.wire is not None:
            # int8 on another backend: the same bits from every rank's bytes
            wire = _codecs.codec_of(self.wire)
            assert wire.kernels is not None
            device = delta.device  # where the group's collectives run (NCCL: the GPU)
            coded = torch.from_numpy(wire.kernels.encode(delta.cpu().numpy())).to(device)
            every = [torch.empty_like(coded) for _ in range(world)]
            dist.all_gather(every, coded, group=self.group)
            delta = torch.from_numpy(wire.average([c.cpu().numpy() for c in every])).to(device)
        else:
            dist.all_reduce(delta, group=self.group)
            delta.div_(world)
        at = 0
        for a, p in zip(self._anchor, self.params):
            n = p.numel()
            p.copy_(a)
            p.grad = delta[at:at + n].view_as(p).to(p.dtype)
            at += n
        self.outer.step()
        for a, p in zip(self._anchor, self.params):
            a.copy_(p.detach())
            p.grad = None
        # buffers (BatchNorm's running statistics) are averaged too, counts
        # taken from the first rank, so every rank holds the same model
        for b in self.model.buffers():
            if b.is_floating_point():
                dist.all_reduce(b.data, group=self.group)
                b.data.div_(world)
            else:
                dist.broadcast(b.data, self._src, group=self.group)
        self.local_steps = 0
        self.rounds += 1

    def state_dict(self) -> dict:
        """The outer optimizer's state, the round counters and the round's
        starting parameters (the inner optimizer and the model keep their own)."""
        return {"outer": self.outer.state_dict(), "local_steps": self.local_steps,
                "rounds": self.rounds, "anchor": [a.clone() for a in self._anchor]}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.outer.load_state_dict(state["outer"])
        self.local_steps = state["local_steps"]
        self.rounds = state["rounds"]
        for a, s in zip(self._anchor, state["anchor"]):
            a.copy_(s)
