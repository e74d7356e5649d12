"""A DDP communication hook that averages each bucket through a ddpwire
coordinator, whatever process group DDP itself runs on (gloo, NCCL).

Each bucket travels as a reference BlockGradientPayload (block_idx = the
bucket's index, component_sizes = its gradients' sizes) and comes back as the
AveragedBlockGradient, so any coordinator of the reference protocol can
serve it, the Rust one included; :func:`serve_comm_hook` is ddpwire's. DDP
launches buckets in index order, and so the hook sends them.

    state = CommHookState(Worker.connect((host, port)))
    ddp.register_comm_hook(state, comm_hook)
"""
from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Deque, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from ..session.coordinator import Coordinator
from ..wire.errors import GradientMismatch
from .staging import Staging

__all__ = ["CommHookState", "comm_hook", "serve_comm_hook"]

log = logging.getLogger(__name__)


class CommHookState:
    """What :func:`comm_hook` needs: a joined :class:`~ddpwire.Worker`.

    ``step`` counts DDP iterations (it advances after the last bucket);
    ``num_blocks`` is the bucket count of the previous iteration (0 during
    the first, when DDP has not yet told how many there are).
    """

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.step = 0
        self.num_blocks = 0
        self._staging = Staging()
        self._queue: Deque[Optional[Tuple[Any, ...]]] = collections.deque()
        self._receiving: Deque[Tuple[Any, ...]] = collections.deque()
        self._cond = threading.Condition()
        self.failure: Optional[BaseException] = None
        self._closed = False
        self._threads = [threading.Thread(target=self._send_loop, daemon=True, name="ddpwire-hook-send"),
                         threading.Thread(target=self._receive_loop, daemon=True, name="ddpwire-hook-recv")]
        for t in self._threads:
            t.start()

    def submit(self, bucket: Any) -> torch.futures.Future:
        """Queue one bucket; the future completes with its averaged buffer."""
        buffer = bucket.buffer()
        future: torch.futures.Future = torch.futures.Future()
        sizes = [int(g.numel()) for g in bucket.gradients()] or [int(buffer.numel())]
        wide = buffer if buffer.dtype == torch.float32 else buffer.to(torch.float32)
        data, ready, release = self._staging.outgoing([wide])
        grads = data.view(np.float32)
        entry = (self.step, int(bucket.index()), self.num_blocks, sizes, grads, ready, release,
                 buffer, wide, future)
        if bucket.is_last():
            self.num_blocks = int(bucket.index()) + 1
            self.step += 1
        with self._cond:
            if self.failure is not None:
                release()
                raise self.failure
            self._queue.append(entry)
            self._cond.notify_all()
        return future

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed and self.failure is None:
                    self._cond.wait()
                if not self._queue or self.failure is not None:
                    return
                entry = self._queue.popleft()
                self._receiving.append(entry)
                self._cond.notify_all()
            step, index, num_blocks, sizes, grads, ready, *_ = entry
            try:
                if ready is not None:
                    ready()
                self.worker.send_block_gradient(step, index, num_blocks, grads, sizes)
            except BaseException as exc:  # noqa: BLE001 - every waiting bucket must hear of it
                self._fail(exc)
                return

    def _receive_loop(self) -> None:
        while True:
            with self._cond:
                while not self._receiving and not self._closed and self.failure is None:
                    self._cond.wait()
                if not self._receiving or self.failure is not None:
                    return
                entry = self._receiving[0]
            step, index, _, _, grads, _, release, buffer, wide, future = entry
            try:
                reply = self.worker.receive_averaged_block(out=grads)
                if reply.block_idx != index:
                    raise GradientMismatch("block_idx", index, reply.block_idx, step=step)
                if not (wide.device.type == "cpu" and wide.data_ptr() == grads.ctypes.data):
                    self._staging.incoming([wide], grads.view(np.uint8))
                if wide is not buffer:
                    buffer.copy_(wide)
            except BaseException as exc:  # noqa: BLE001
                self._fail(exc)
                return
            with self._cond:
                self._receiving.popleft()
            release()
            future.set_result(buffer)

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            if self.failure is None:
                self.failure = exc
            waiting = list(self._receiving) + [e for e in self._queue if e is not None]
            self._receiving.clear()
            self._queue.clear()
            self._cond.notify_all()
        for entry in waiting:
            entry[-1].set_exception(self.failure)

    def close(self) -> None:
        """Stop after what is queued and close the worker."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=self.worker_timeout())
        self.worker.close()

    def worker_timeout(self) -> float:
        return float(self.worker.channel.timeout)


def comm_hook(state: CommHookState, bucket: "dist.GradBucket") -> torch.futures.Future:
    """DDP comm hook: average ``bucket`` through ``state``'s coordinator.

    Register with ``ddp.register_comm_hook(state, comm_hook)``. The bucket is
    averaged over the coordinator's workers (one per DDP rank), so it
    replaces DDP's own allreduce; any process group works alongside.
    """
    return state.submit(bucket)


# DDP checks the hook's annotations against the real classes, not strings
comm_hook.__annotations__.update(bucket=dist.GradBucket, state=CommHookState,
                                 **{"return": torch.futures.Future[torch.Tensor]})


def serve_comm_hook(coord: Coordinator) -> int:
    """Average the buckets :func:`comm_hook` sends, on a coordinator whose
    workers have joined, until the workers leave; returns the iterations
    served.

    Blocks come in the order DDP launches them: block_idx 0, 1, … of one
    step, then block 0 of the next; each is averaged by the coordinator's
    own streaming engine (:meth:`Coordinator.allreduce_block`, following
    worker 0's step and block_idx), so every worker's block must agree in
    step, block_idx and sizes (else GradientMismatch naming the worker) and
    the average is the reference's, bit for bit ((x0 + x1) + …) / n.
    """
    first = coord.channel(0)
    step, served = None, 0
    try:
        # worker 0 leaving between blocks ends training; anything else is an error
        while first.wait_for_frame(coord.options.timeout):
            result = coord.allreduce_block(None, None)
            if result.step != step:
                served += step is not None
                step = result.step
    except BaseException:
        # workers waiting for an average that will not come hear it at once
        for w in range(coord.worker_count):
            coord.channel(w).close()
        raise
    return served + (step is not None)
