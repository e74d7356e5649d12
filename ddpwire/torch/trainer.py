"""Data-parallel training steps over a ddpwire Worker.

A flat step: take the shard (``None`` means the coordinator shut down), run
forward and backward on those rows (see :mod:`ddpwire.torch.data` for how a
shard maps to rows), send the flat gradient with the shard's mean loss, correct
and total counts while receiving the average straight into the gradient
buffer (``Worker.allreduce`` when the worker has it, else send then receive),
scatter it into ``.grad`` and step the optimizer. Every worker applies the same
averaged gradient to the same weights with the same deterministic optimizer,
so the weights stay bit-identical across workers (on the same kind of device).

A per-block step overlaps communication with backward: a post-accumulate-grad
hook counts each block's parameters, and once a block's gradients are all
accumulated the hook sends that block from the backward thread itself, while
a background thread receives the averages as they come back. Sending from the
hook keeps one sender thread and one receiver thread, as the Worker allows,
and fixes the send order. Blocks are always sent in descending ``block_idx``
order (backward order); a block whose hook cannot fire (an unused parameter,
an empty shard) is sent, with zeros for the missing gradients, after backward
returns, so every worker sends the same sequence. The non-block components
(lm_head, final_norm, embedding, in code order) follow.
Block messages carry no loss, so a per-block step reports no global loss.
"""
from __future__ import annotations

import copy
import io
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .._text import counted
from ..wire.errors import CoordinatorLost, GradientMismatch, MembershipChanged
from ..plane.threads import apply_threads, default_threads, usable_cores, workers_here
from .buffer import NON_BLOCK_COMPONENTS, GradientBuffer, Segment, block_segment
from .data import ArrayDataset, ShardSampler
from .local_steps import nesterov_outer

__all__ = [
    "WorkerLike",
    "BatchFn",
    "classification_batch",
    "StepTimings",
    "StepResult",
    "DataParallelTrainer",
    "evaluate",
]

logger = logging.getLogger(__name__)


class WorkerLike(Protocol):
    """The part of :class:`ddpwire.Worker` the trainer uses. A worker that
    also has ``allreduce(step, gradients, loss, correct, total, out=)``, as
    ddpwire.Worker does, gets it for the flat step instead of the two calls."""

    worker_id: int
    total_workers: int

    def receive_shard(self) -> Optional[Any]: ...
    def send_gradients(self, step: int, gradients: np.ndarray, loss: float, correct: int, total: int) -> None: ...
    def receive_averaged(self, out: Optional[np.ndarray] = None) -> Any: ...
    def send_block_gradient(
        self, step: int, block_idx: int, num_blocks: int, gradients: np.ndarray, component_sizes: Sequence[int]
    ) -> None: ...
    def receive_averaged_block(self, out: Optional[np.ndarray] = None) -> Any: ...
    def send_non_block_gradient(self, step: int, component: int, gradients: np.ndarray) -> None: ...
    def receive_averaged_non_block(self, out: Optional[np.ndarray] = None) -> Any: ...


BatchFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], Tuple[torch.Tensor, int, int]]
"""``(model, features, targets) -> (mean loss, correct, total)``."""


def classification_batch(model: nn.Module, features: torch.Tensor, targets: torch.Tensor) -> Tuple[torch.Tensor, int, int]:
    """Cross-entropy over the last logit dimension; fits both class labels and next-token targets."""
    logits = model(features)
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_targets = targets.reshape(-1)
    loss = F.cross_entropy(flat_logits, flat_targets)
    correct = int((flat_logits.argmax(dim=-1) == flat_targets).sum())
    return loss, correct, int(flat_targets.numel())


@torch.no_grad()
def evaluate(
    model: nn.Module, dataset: ArrayDataset, device: Optional[torch.device] = None, batch_fn: BatchFn = classification_batch
) -> Tuple[float, float]:
    """Mean loss and accuracy of ``model`` on ``dataset`` (one batch; the demo sets are small)."""
    device = device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        loss, correct, total = batch_fn(model, dataset.features.to(device), dataset.targets.to(device))
    finally:
        model.train(was_training)
    return float(loss), correct / max(total, 1)


@dataclass
class StepTimings:
    """Where a step's time went (CPU-side ``time.perf_counter`` clock, seconds).

    ``exposed_comm_s`` is communication the step waited for after backward
    (flat mode: the whole send and receive; ``send_s`` is the same span when
    the worker sends and receives at once). Per-block mode only:
    ``first_send_lead_s`` is how long before the end of backward the first
    block was sent (positive means communication overlapped backward),
    ``hidden_comm_s`` the part of the span from first send to last average
    received that ran during backward, and ``averages_in_backward`` how many
    block averages had already arrived when backward ended.
    """

    forward_s: float = 0.0
    backward_s: float = 0.0
    send_s: float = 0.0
    exposed_comm_s: float = 0.0
    hidden_comm_s: float = 0.0
    optimizer_s: float = 0.0
    first_send_lead_s: Optional[float] = None
    backward_end: float = 0.0
    first_send_start: Optional[float] = None
    averages_in_backward: int = 0


@dataclass
class StepResult:
    """One finished step. ``global_loss`` is ``None`` in per-block mode (block messages carry no loss)."""

    step: int
    loss: float
    global_loss: Optional[float]
    correct: int
    total: int
    timings: StepTimings


def _share_the_cores(worker: Any) -> int:
    """Set torch's threads to this machine's share of the cores, the
    session's workers here counted from the worker's connection to the
    coordinator; the count in use. A worker with no connection to count
    from (a stand-in) leaves torch's setting."""
    channel = getattr(worker, "channel", None)
    if channel is None:
        return apply_threads(0)
    here = workers_here(channel.conn.sock)
    threads = apply_threads(default_threads(here))
    logger.info("torch threads: %d (%d usable cores, %s of this session on this machine)",
                threads, usable_cores(), counted(here, "worker"))
    return threads


class DataParallelTrainer:
    """Run the protocol's training steps for one worker.

    ``model`` must already be on ``device`` (default: its first parameter's) and
    built identically on every worker. ``samples_per_step`` must equal the
    coordinator's ``total_samples`` (default: ``len(dataset)``). With
    ``per_block=True`` the gradients go block by block; ``layout`` (default:
    ``model.gradient_layout()``) must then consist of segments named
    ``block.<i>`` for ``i`` in ``0..N-1`` and any of lm_head, final_norm,
    embedding.

    ``threads``: torch's intra-op threads. None (the default) splits the
    usable cores between the session's workers on this machine, counted at
    the first shard, when every worker has joined, as ``ddpwire worker``
    does (torch's own default where OMP_NUM_THREADS is set): N workers on
    one machine each taking every core run several times slower. 0 leaves
    torch's setting; N sets N.

    Local steps (DiLoCo, for slow links): with ``sync_every=H`` (or an
    ``outer_optimizer``) each protocol step is a round: the worker's shard
    of the round (``samples_per_step`` is the round's, H times the samples
    of one inner step) is split in order into H inner batches, ``optimizer``
    steps on each locally, and the round's pseudo-gradient (its start minus
    where the inner steps led) is averaged by the ordinary flat step, so any
    coordinator (the reference's too) averages it, and applied from the
    round's start by ``outer_optimizer`` (default
    :func:`ddpwire.torch.local_steps.nesterov_outer`). Every worker ends each
    round with the same parameters and outer state.
    """

    def __init__(
        self,
        worker: WorkerLike,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: ArrayDataset,
        *,
        device: Optional[torch.device] = None,
        samples_per_step: Optional[int] = None,
        seed: int = 0,
        per_block: bool = False,
        layout: Optional[Sequence[Segment]] = None,
        batch_fn: BatchFn = classification_batch,
        sync_every: int = 1,
        outer_optimizer: Optional[torch.optim.Optimizer] = None,
        threads: Optional[int] = None,
    ) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every must be at least 1, got {sync_every}")
        if sync_every > 1 and per_block:
            raise ValueError("local steps (sync_every > 1) average one pseudo-gradient a round: "
                             "they need flat steps, not per_block")
        self.model = model
        self.optimizer = optimizer
        self.dataset = dataset
        #: torch's intra-op threads in use (None until the first shard, where
        #: they are split between this machine's workers of the session)
        self.threads: Optional[int] = None if threads is None else apply_threads(threads)
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.sampler = ShardSampler(len(dataset), samples_per_step or len(dataset), seed)
        self.batch_fn = batch_fn
        self.per_block = per_block
        if per_block and layout is None:
            if not hasattr(model, "gradient_layout"):
                raise ValueError("per_block=True needs a layout, or a model with gradient_layout()")
            layout = model.gradient_layout()
        self.buffer = GradientBuffer(model, self.device, layout=layout)
        #: inner steps per averaged round (local steps, DiLoCo; 1: every step averaged)
        self.sync_every = sync_every
        self.outer_optimizer = outer_optimizer
        if outer_optimizer is None and sync_every > 1:
            self.outer_optimizer = nesterov_outer(
                [p for p in model.parameters() if p.requires_grad])
        # the parameters every worker holds at the start of a round
        self._anchor: Optional[List[torch.Tensor]] = None
        #: each step an elastic session called off and this worker computed again
        self.membership: List[MembershipChanged] = []
        self._hooks: List[Any] = []
        self._attach(worker)
        #: the step after the last one this trainer applied
        self.next_step = 0
        if per_block:
            self._plan_blocks()

    # ----- per-block setup -----

    def _plan_blocks(self) -> None:
        names = set(self.buffer.segment_names)
        self.num_blocks = sum(1 for n in names if n.startswith("block."))
        expected = {block_segment(i) for i in range(self.num_blocks)} | set(NON_BLOCK_COMPONENTS)
        stray = names - expected
        if stray:
            raise ValueError(
                f"per-block layout has segments {sorted(stray)}: expected block.0..block.{self.num_blocks - 1} "
                f"and any of {', '.join(NON_BLOCK_COMPONENTS)}"
            )
        self._non_blocks = sorted((code, n) for n, code in NON_BLOCK_COMPONENTS.items() if n in names)
        self._block_sizes = [self.buffer.component_sizes(block_segment(i)) for i in range(self.num_blocks)]
        self._block_param_count = [len(self.buffer.segment_params(block_segment(i))) for i in range(self.num_blocks)]
        self._lock = threading.Lock()
        self._collecting = False
        for i in range(self.num_blocks):
            for p in self.buffer.segment_params(block_segment(i)):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._hook_for(i)))

    def _hook_for(self, block_idx: int) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            if not self._collecting:
                return
            with self._lock:
                self._remaining[block_idx] -= 1
                if self._remaining[block_idx] == 0:
                    self._send_ready_blocks()

        return hook

    def close(self) -> None:
        """Remove the gradient hooks; later per-block steps still work but send every block after backward."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    # ----- steps -----

    def train(self, max_steps: Optional[int] = None) -> List[StepResult]:
        """Run steps until the coordinator shuts down (or ``max_steps``); return their results."""
        results: List[StepResult] = []
        while max_steps is None or len(results) < max_steps:
            result = self.step()
            if result is None:
                break
            results.append(result)
        return results

    def step(self) -> Optional[StepResult]:
        """Run one step; ``None`` when the coordinator sent Shutdown instead of a shard.

        In an elastic session a step called off for a lost worker
        (:class:`~ddpwire.MembershipChanged`) leaves the model, its buffers
        and the optimizers as they were before it, and is computed again on
        the shard that follows; :attr:`membership` keeps each change. So
        does a step the coordinator was lost in (CoordinatorLost, raised):
        join its restart with ``resume_step=`` :attr:`next_step` and
        :meth:`rejoin`."""
        if getattr(self.worker, "joins_at", None) is not None and not self._joined:
            self.load_state_bytes(self.worker.receive_state()[1])
        self._joined = True
        while True:
            shard = self.worker.receive_shard()
            if self.threads is None:
                self.threads = _share_the_cores(self.worker)
            if shard is None:
                logger.info("worker %s: shutdown received", self.worker.worker_id)
                return None
            saved = self._local_state() if getattr(self.worker, "elastic", False) else None
            try:
                result = self._run(shard)
            except MembershipChanged as exc:
                assert saved is not None
                self._restore(saved)
                self.membership.append(exc)  # the worker has logged it
                continue
            except CoordinatorLost:
                if saved is not None:
                    # the step was not applied: a restarted coordinator
                    # (Worker.connect(resume_step=next_step)) has it redone
                    self._restore(saved)
                raise
            self.next_step = shard.step + 1
            return result

    def _run(self, shard: Any) -> StepResult:
        index = self.sampler.indices(shard.step, shard.shard_start, shard.shard_end)
        self.model.train()
        if self.outer_optimizer is not None:
            return self._local_round(shard.step, index)
        # set_to_none=False keeps each .grad allocated, so backward and scatter reuse it every step
        self.model.zero_grad(set_to_none=False)
        if self.per_block:
            result = self._block_step(shard.step, index)
        else:
            result = self._flat_step(shard.step, index)
        t0 = time.perf_counter()
        self.optimizer.step()
        result.timings.optimizer_s = time.perf_counter() - t0
        logger.debug(
            "worker %s step %d: loss %.4f global %s", self.worker.worker_id, result.step, result.loss, result.global_loss
        )
        return result

    def rejoin(self, worker: Any) -> None:
        """Go on with ``worker``, a new connection to an elastic session: one
        this trainer's worker was dropped from (WorkerDropped: it stalled,
        or slept), whose next :meth:`step` takes the session's state first,
        so what this one trained meanwhile is left behind; or a restarted
        coordinator's (``resume_step=``:attr:`next_step`), which goes on from
        this trainer's own state."""
        self._attach(worker)

    def _attach(self, worker: Any) -> None:
        self.worker = worker
        self._joined = False  # a late joiner's state taken (or none to take)
        if getattr(worker, "elastic", False):
            # a worker joining the session late starts from this one's state
            worker.state_source = self.state_bytes

    def state_bytes(self, step: Optional[int] = None) -> bytes:
        """This worker's training state, for a worker joining an elastic
        session late (``Worker.state_source``): the model's weights and
        buffers, the optimizer's state and, with local steps, the outer
        optimizer's and the round's start. Taken between two steps, so
        every worker's is the same; ``step`` (the joiner's, which
        ``Worker.state_source`` passes) does not change it."""
        out = io.BytesIO()
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "outer": None if self.outer_optimizer is None
                    else self.outer_optimizer.state_dict(),
                    "anchor": self._anchor}, out)
        return out.getvalue()

    def load_state_bytes(self, data: bytes) -> None:
        """Continue from :meth:`state_bytes` of another worker (what a late
        joiner's first :meth:`step` does with the state it is handed)."""
        state = torch.load(io.BytesIO(data), map_location=self.device, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.outer_optimizer is not None and state["outer"] is not None:
            self.outer_optimizer.load_state_dict(state["outer"])
        if state["anchor"] is not None:
            self._anchor = [a.to(self.device) for a in state["anchor"]]

    def _local_state(self) -> Tuple[List[torch.Tensor], Optional[Dict[str, Any]]]:
        """What a step changes before its average arrives: the model's
        buffers (batch-norm statistics move in forward) and, for a local
        round, the inner optimizer's state (the parameters go back to the
        round's start by themselves)."""
        buffers = [b.detach().clone() for b in self.model.buffers()]
        inner = copy.deepcopy(self.optimizer.state_dict()) if self.outer_optimizer is not None \
            else None
        return buffers, inner

    def _restore(self, saved: Tuple[List[torch.Tensor], Optional[Dict[str, Any]]]) -> None:
        buffers, inner = saved
        with torch.no_grad():
            for b, keep in zip(self.model.buffers(), buffers):
                b.copy_(keep)
            if self._anchor is not None and self.outer_optimizer is not None:
                for p, a in zip((p for p in self.model.parameters() if p.requires_grad),
                                self._anchor):
                    p.copy_(a)
        if inner is not None:
            self.optimizer.load_state_dict(inner)

    def _forward_backward(self, index: torch.Tensor, timings: StepTimings) -> Tuple[float, int, int]:
        if len(index) == 0:
            # an empty shard (more workers than samples): nothing to learn from, zeros go out
            timings.backward_end = time.perf_counter()
            return 0.0, 0, 0
        features, targets = self.dataset.rows(index)
        t0 = time.perf_counter()
        loss, correct, total = self.batch_fn(self.model, features.to(self.device), targets.to(self.device))
        t1 = time.perf_counter()
        loss.backward()
        timings.backward_end = time.perf_counter()
        timings.forward_s, timings.backward_s = t1 - t0, timings.backward_end - t1
        return loss.item(), correct, total

    def _flat_step(self, step: int, index: torch.Tensor) -> StepResult:
        timings = StepTimings()
        loss, correct, total = self._forward_backward(index, timings)
        gradients = self.buffer.gather() if total else self.buffer.zero()
        global_loss = self._average(step, gradients, loss, correct, total, timings)
        return StepResult(step, loss, global_loss, correct, total, timings)

    def _average(self, step: int, vector: np.ndarray, loss: float, correct: int, total: int,
                 timings: StepTimings) -> float:
        """One flat step of the protocol for ``vector``: its average lands
        in ``.grad`` (through the buffer); returns the global loss."""
        t0 = time.perf_counter()
        allreduce = getattr(self.worker, "allreduce", None)
        if allreduce is not None:
            # send and receive at once: the average may start arriving before the send ends
            avg = allreduce(step, vector, loss, correct, total, out=self.buffer.array)
            timings.send_s = timings.exposed_comm_s = time.perf_counter() - t0
        else:
            self.worker.send_gradients(step, vector, loss, correct, total)
            t1 = time.perf_counter()
            avg = self.worker.receive_averaged(out=self.buffer.array)
            timings.send_s, timings.exposed_comm_s = t1 - t0, time.perf_counter() - t0
        if avg.step != step:
            raise GradientMismatch("step", step, avg.step, worker_id=self.worker.worker_id, step=step)
        self.buffer.scatter(avg.gradients)
        return float(avg.global_loss)

    # ----- local steps (DiLoCo) -----

    def _local_round(self, step: int, index: torch.Tensor) -> StepResult:
        """``sync_every`` inner steps over the round's shard, split in
        order, then the pseudo-gradient (the round's start minus where the
        inner steps led) averaged by one flat step and applied from the
        round's start by the outer optimizer: every worker ends the round
        with the same parameters and outer state."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self._anchor is None:
            self._anchor = [p.detach().clone() for p in params]
        timings = StepTimings()
        loss_sum, correct, total = 0.0, 0, 0
        for part in torch.tensor_split(index, self.sync_every):
            self.model.zero_grad(set_to_none=False)
            loss, c, t = self._forward_backward(part, timings)
            if t:
                self.optimizer.step()
            loss_sum, correct, total = loss_sum + loss * t, correct + c, total + t
        with torch.no_grad():
            for p, a in zip(params, self._anchor):
                p.grad.copy_(a - p)  # type: ignore[union-attr]
        mean_loss = loss_sum / total if total else 0.0
        global_loss = self._average(step, self.buffer.gather(), mean_loss, correct, total,
                                    timings)
        with torch.no_grad():
            for p, a in zip(params, self._anchor):
                p.copy_(a)
        t0 = time.perf_counter()
        assert self.outer_optimizer is not None
        self.outer_optimizer.step()
        timings.optimizer_s = time.perf_counter() - t0
        with torch.no_grad():
            for p, a in zip(params, self._anchor):
                a.copy_(p)
        return StepResult(step, mean_loss, global_loss, correct, total, timings)

    # ----- per-block step -----

    def _send_ready_blocks(self) -> None:
        """Send, in descending order, every block whose gradients are complete (caller holds the lock)."""
        while self._next_block >= 0 and self._remaining[self._next_block] <= 0:
            i = self._next_block
            gradients = self.buffer.gather_segment(block_segment(i))
            t0 = time.perf_counter()
            if self._timings.first_send_start is None:
                self._timings.first_send_start = t0
            self.worker.send_block_gradient(self._step, i, self.num_blocks, gradients, self._block_sizes[i])
            self._timings.send_s += time.perf_counter() - t0
            self._next_block -= 1

    def _receive_all(self, step: int, done: Dict[str, Any]) -> None:
        try:
            for i in reversed(range(self.num_blocks)):
                view = self.buffer.segment_view(block_segment(i))
                avg = self.worker.receive_averaged_block(out=view)
                self._check_received(step, avg.step, "block_idx", i, avg.block_idx, view, avg.gradients)
                done["block_ends"].append(time.perf_counter())
                if list(avg.component_sizes) != self._block_sizes[i]:
                    raise GradientMismatch(
                        "component_sizes", self._block_sizes[i], list(avg.component_sizes),
                        worker_id=self.worker.worker_id, step=step,
                    )
            for code, name in self._non_blocks:
                view = self.buffer.segment_view(name)
                avg = self.worker.receive_averaged_non_block(out=view)
                self._check_received(step, avg.step, "component", code, avg.component, view, avg.gradients)
        except BaseException as exc:  # handed to the training thread, which re-raises it
            done["error"] = exc
        finally:
            done["end"] = time.perf_counter()

    def _check_received(
        self, step: int, got_step: int, field: str, expected: int, got: int, view: np.ndarray, gradients: Any
    ) -> None:
        context = {"worker_id": self.worker.worker_id, "step": step}
        if got_step != step:
            raise GradientMismatch("step", step, got_step, **context)
        if got != expected:
            raise GradientMismatch(field, expected, got, **context)
        if gradients is not None:
            src = GradientBuffer._as_float32(gradients)
            if src.size != view.size:
                raise GradientMismatch("gradients length", view.size, src.size, **context)
            if src.ctypes.data != view.ctypes.data:
                np.copyto(view, src)

    def _block_step(self, step: int, index: torch.Tensor) -> StepResult:
        self._timings = timings = StepTimings()
        self._step = step
        self._remaining = list(self._block_param_count)
        self._next_block = self.num_blocks - 1
        done: Dict[str, Any] = {"block_ends": []}
        receiver = threading.Thread(
            target=self._receive_all, args=(step, done), name=f"ddpwire-recv-{self.worker.worker_id}", daemon=True
        )
        receiver.start()
        self._collecting = True
        try:
            loss, correct, total = self._forward_backward(index, timings)
        finally:
            self._collecting = False
        with self._lock:
            self._remaining = [0] * self.num_blocks  # blocks with an unused parameter go now, zeros filled in
            self._send_ready_blocks()
        for code, name in self._non_blocks:
            gradients = self.buffer.gather_segment(name)
            t0 = time.perf_counter()
            self.worker.send_non_block_gradient(step, code, gradients)
            timings.send_s += time.perf_counter() - t0
        receiver.join()
        if "error" in done:
            raise done["error"]
        timings.exposed_comm_s = max(0.0, done["end"] - timings.backward_end)
        timings.averages_in_backward = sum(1 for t in done["block_ends"] if t < timings.backward_end)
        if timings.first_send_start is not None:
            timings.first_send_lead_s = timings.backward_end - timings.first_send_start
            timings.hidden_comm_s = max(0.0, done["end"] - timings.first_send_start - timings.exposed_comm_s)
        self.buffer.scatter()
        return StepResult(step, loss, None, correct, total, timings)
