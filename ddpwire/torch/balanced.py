"""Per-rank batch sizes by measured speed for DDP, with the full-batch gradient.

PyTorch's DDP gives every rank the same batch, so a step waits for the
slowest machine. Two lines change that, on any backend (ddpwire, gloo,
NCCL)::

    sampler = BalancedBatchSampler(len(dataset), batch_size=256)   # the global batch
    loader = DataLoader(dataset, batch_sampler=sampler)
    ddp.register_comm_hook(sampler, balanced_hook)

Each step the ranks split one global batch of ``batch_size`` samples (a
permutation every rank draws alike) by a fitted model of each rank's step,
a fixed part plus a part per sample (:class:`ddpwire.session.balance.Balancer`, the
rules the coordinator uses; ``balance="auto"``, the default, with the guard's
trials of even and nudged splits, kept where measured steps show them faster). The
hook multiplies each rank's bucket by ``world * c_r / batch_size`` (its
share's weight, in float32) before the bucket is averaged, so the average
is the sample-weighted mean, the gradient of the whole batch: the loss must
be the mean over the rank's batch, as it usually is.

A rank's model is fitted to its compute: from the end of the previous
step's last allreduce to the moment its last bucket is ready (loading,
optimizer step, forward and backward); a step's time for the guard is rank
0's compute plus its wait, which every rank has alike. Its wait, from then to the
end of the step's last allreduce, is the rest of the exchange when it is
the last rank ready (the one that waits least): that part a slow rank pays
at its own speed whatever its batch, and the split is net of it
(:class:`ddpwire.session.balance.Balancer`'s lags). The hook shares every rank's
compute and its previous step's wait with a small allreduce issued after
the last bucket's, so all ranks feed the same figures to the same rules and
agree on every split without a word more. With a DataLoader that
prefetches (``num_workers`` > 0), pass ``lag``: the batches the loader
samples ahead of the step being trained (``num_workers *
prefetch_factor``); the split of a step then follows the timings ``lag``
steps older.

Not for ``no_sync()`` gradient accumulation: the hook counts steps by the
backward passes that reach it.
"""
# no `from __future__ import annotations`: DDP checks the hook's annotations as objects
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Union

import numpy as np
import torch
import torch.distributed as dist

from ..session.balance import Balancer, sample_scale, shard_starts

__all__ = ["BalancedBatchSampler", "balanced_hook"]


class BalancedBatchSampler:
    """Each rank's batch of every step: its share of a global batch of
    ``batch_size`` samples from ``dataset_len``, sized by the ranks'
    measured speeds (module docstring). ``drop_last`` as for torch's
    samplers (a last short batch is split too when False); the permutation
    is drawn from ``seed`` and the epoch (:meth:`set_epoch`), as
    DistributedSampler does; ``shuffle=False`` keeps the dataset's order.
    ``group``: the process group (default the
    world); ``rank`` and ``world_size`` default to it, asked when the first
    batch is drawn, so the sampler may be built before the group (as a
    Lightning strategy's ``ddp_comm_state`` is).
    """

    def __init__(self, dataset_len: int, batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = True, lag: int = 0, group: Optional[Any] = None,
                 rank: Optional[int] = None, world_size: Optional[int] = None,
                 balance: Union[bool, str] = "auto") -> None:
        if balance not in (True, False, "auto"):
            raise ValueError(f"balance must be True, False or 'auto', got {balance!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if lag < 0:
            raise ValueError(f"lag must be >= 0, got {lag}")
        self.group = group
        self._rank = rank
        self._world_size = world_size
        self.dataset_len = dataset_len
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.lag = lag
        #: "auto" (the coordinator's default: by speed where that wins), True or False
        self.balance = balance
        self.epoch = 0
        self._balancer: Optional[Balancer] = None
        #: the split of every step sampled so far that is still to be trained
        self.splits: Dict[int, List[int]] = {}
        self._sampled = 0   # steps sampled (the next batch's step)
        self._fed = 0       # steps whose timings the balancer has had
        self._trained = 0   # steps whose last bucket reached the hook
        #: step -> every rank's compute seconds, then every rank's wait in the step before
        self._timings: Dict[int, np.ndarray] = {}
        self._ready_at: Optional[float] = None     # the previous step's last allreduce ended
        self._bucket_at: Optional[float] = None    # this step's last bucket was ready
        self._waited: float = -1.0                 # the previous step's wait (-1: none)
        self._computed: float = -1.0               # rank 0's compute in the step fed last
        self._lock = threading.Lock()

    @property
    def rank(self) -> int:
        """This rank (the group's, asked once)."""
        if self._rank is None:
            self._rank = dist.get_rank(self.group)
        return self._rank

    @property
    def world_size(self) -> int:
        """The ranks sharing each batch (the group's, asked once); a
        ``batch_size`` below it is a ValueError: every rank needs a sample."""
        if self._world_size is None:
            self._world_size = dist.get_world_size(self.group)
            if self.batch_size < self._world_size:
                raise ValueError(f"batch_size {self.batch_size} is smaller than the "
                                 f"{self._world_size} ranks: every rank needs a sample")
        return self._world_size

    @property
    def balancer(self) -> Balancer:
        """The rules every rank applies alike (:class:`ddpwire.session.balance.Balancer`)."""
        if self._balancer is None:
            self._balancer = Balancer(self.world_size, guard=self.balance == "auto")
        return self._balancer

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose permutation :meth:`__iter__` draws next."""
        self.epoch = epoch

    def __len__(self) -> int:
        whole, rest = divmod(self.dataset_len, self.batch_size)
        return whole + (1 if rest and not self.drop_last else 0)

    def __iter__(self) -> Iterator[List[int]]:
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_len, generator=gen).tolist()
        else:
            order = list(range(self.dataset_len))
        for k in range(len(self)):
            batch = order[k * self.batch_size:(k + 1) * self.batch_size]
            split = self._split(len(batch))
            start = shard_starts(split)[self.rank]
            yield batch[start:start + split[self.rank]]

    def _split(self, total: int) -> List[int]:
        """The next step's split, from the timings of every step up to
        ``lag`` before the previous one (all ranks have the same ones)."""
        step = self._sampled
        with self._lock:
            while self._fed < step - self.lag:
                times = self._timings.pop(self._fed, None)
                if times is None:
                    raise RuntimeError(
                        f"BalancedBatchSampler: step {step} is sampled before step {self._fed} "
                        f"was trained: the DataLoader samples ahead; pass lag= (its num_workers * "
                        f"prefetch_factor)")
                world = self.world_size
                for r, seconds in enumerate(times[:world].tolist()):
                    self.balancer.observe(r, self.splits[self._fed][r], seconds)
                waits = times[world:]
                if self._fed > 0 and waits.min() >= 0.0:
                    # the rank that waited least in the step before was the
                    # last one ready: the rest of that step was its own
                    last = int(waits.argmin())
                    self.balancer.ended(last, float(waits[last]))
                    if self._computed >= 0.0:
                        # that step end to end, as rank 0 lived it (every rank
                        # has the same figures, so every rank's guard agrees)
                        self.balancer.stepped(self._fed - 1, self._computed + float(waits[0]))
                self._computed = float(times[0])
                self.splits.pop(self._fed, None)
                self._fed += 1
            if self.balance and total >= self.world_size:
                split = self.balancer.shards(total, step=step)
            else:
                split = [total // self.world_size] * self.world_size
            split[-1] += total - sum(split)
            self.splits[step] = split
        self._sampled += 1
        return split

    # ---- the hook's side ----

    def _scale(self, step: int) -> float:
        split = self.splits.get(step)
        if split is None:
            raise RuntimeError(f"balanced_hook: step {step} was not sampled by this "
                               f"BalancedBatchSampler (is its DataLoader the one trained on?)")
        return sample_scale(split[self.rank], sum(split), self.world_size)

    def _timing(self, now: float) -> torch.Tensor:
        """This rank's compute time, then its wait in the step before, in its
        slots, zeros elsewhere: summed over the ranks they are every rank's
        (-1: not timed, the first step's)."""
        world = self.world_size
        times = torch.zeros(2 * world, dtype=torch.float32)
        times[self.rank] = -1.0 if self._ready_at is None else now - self._ready_at
        times[world + self.rank] = self._waited
        self._bucket_at = now
        return times

    def _trained_step(self, step: int, times: torch.Tensor) -> None:
        with self._lock:
            self._timings[step] = times.numpy().copy()
            self._ready_at = time.perf_counter()
            if self._bucket_at is not None:
                self._waited = self._ready_at - self._bucket_at


def balanced_hook(state: BalancedBatchSampler,
                  bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket weighted by this rank's share of the step
    (register with the sampler as its state, module docstring)."""
    sampler = state
    step = sampler._trained
    buffer = bucket.buffer()
    scale = sampler._scale(step)
    if scale != 1.0:
        buffer.mul_(scale)
    world = sampler.world_size
    fut = dist.all_reduce(buffer, group=sampler.group, async_op=True).get_future()
    averaged = fut.then(lambda f: f.value()[0].div_(world))
    if not bucket.is_last():
        return averaged
    sampler._trained += 1
    times = sampler._timing(time.perf_counter())
    timed = dist.all_reduce(times, group=sampler.group, async_op=True).get_future()

    def done(both: "torch.futures.Future[Any]") -> torch.Tensor:
        grads, summed = both.value()
        sampler._trained_step(step, summed.value()[0])
        return grads.value()

    return torch.futures.collect_all([averaged, timed]).then(done)
