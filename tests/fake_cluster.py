"""An in-process stand-in for a coordinator and its workers, for testing the torch side.

``FakeCluster(n, total_samples, steps).workers`` are n objects with the
:class:`ddpwire.Worker` API. They share one condition variable instead of
sockets: the k-th gradient message of every worker forms round k, which is
averaged exactly as the coordinator does (float32 sum in worker-id order, then
division by n; global_loss = sum(loss_i*total_i)/sum(total_i)) once all n have
arrived. Sends never wait for other workers (as a TCP send would not); receives
wait for their round, so one thread may send while another receives. Every
send and receive is logged in ``events`` as ``(time.perf_counter(), worker_id,
kind, (step, block_idx or component))``.
"""
from __future__ import annotations

import threading
import time
from collections import namedtuple
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ddpwire.wire.errors import (
    CoordinatorLost, GradientMismatch, NonFiniteGradient, UnexpectedMessage,
)

ShardAssignment = namedtuple("ShardAssignment", "step shard_start shard_end")
AveragedGradient = namedtuple("AveragedGradient", "step gradients global_loss")
AveragedBlockGradient = namedtuple("AveragedBlockGradient", "step block_idx component_sizes gradients")
AveragedNonBlockGradient = namedtuple("AveragedNonBlockGradient", "step component gradients")


def coordinator_average(gradients: Sequence[np.ndarray]) -> np.ndarray:
    """The coordinator's rule: float32 sum in worker order, then divide by n."""
    acc = np.array(gradients[0], dtype=np.float32, copy=True)
    for g in gradients[1:]:
        acc += g
    acc /= np.float32(len(gradients))
    return acc


class _Round:
    def __init__(self, n: int) -> None:
        self.messages: List[Optional[Dict[str, Any]]] = [None] * n
        self.result: Optional[Dict[str, Any]] = None
        self.error: Optional[BaseException] = None


class FakeCluster:
    """n fake workers sharing one averaging "coordinator"."""

    def __init__(self, n: int, total_samples: int, steps: int, timeout: float = 60.0) -> None:
        self.n = n
        self.total_samples = total_samples
        self.steps = steps
        self.timeout = timeout
        self.cond = threading.Condition()
        self.rounds: List[_Round] = []
        self.events: List[Tuple[float, int, str, Any]] = []
        self.workers = [FakeWorker(self, i) for i in range(n)]

    def shard(self, worker_id: int, step: int) -> ShardAssignment:
        size = self.total_samples // self.n
        start = worker_id * size
        end = self.total_samples if worker_id == self.n - 1 else start + size
        return ShardAssignment(step, start, end)

    def log(self, worker_id: int, kind: str, detail: Any) -> None:
        with self.cond:
            self.events.append((time.perf_counter(), worker_id, kind, detail))

    def contribute(self, worker_id: int, k: int, message: Dict[str, Any]) -> None:
        with self.cond:
            while len(self.rounds) <= k:
                self.rounds.append(_Round(self.n))
            rnd = self.rounds[k]
            rnd.messages[worker_id] = message
            if all(m is not None for m in rnd.messages):
                try:
                    rnd.result = self._average(rnd.messages)  # type: ignore[arg-type]
                except Exception as exc:  # every receiver of this round sees it
                    rnd.error = exc
                self.cond.notify_all()

    def collect(self, k: int) -> Dict[str, Any]:
        deadline = time.monotonic() + self.timeout
        with self.cond:
            while len(self.rounds) <= k or (self.rounds[k].result is None and self.rounds[k].error is None):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CoordinatorLost(f"fake coordinator: round {k} incomplete after {self.timeout}s")
                self.cond.wait(left)
            rnd = self.rounds[k]
            if rnd.error is not None:
                raise rnd.error
            return rnd.result  # type: ignore[return-value]

    def _average(self, messages: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
        first = messages[0]
        for wid, m in enumerate(messages):
            for field in ("kind", "step", "idx"):
                if m[field] != first[field]:
                    raise GradientMismatch(field, first[field], m[field], worker_id=wid, step=first["step"])
            if m["gradients"].size != first["gradients"].size:
                raise GradientMismatch("gradients length", first["gradients"].size, m["gradients"].size, worker_id=wid)
            bad = np.flatnonzero(~np.isfinite(m["gradients"]))
            if bad.size:
                i = int(bad[0])
                raise NonFiniteGradient(wid, i, float(m["gradients"][i]), worker_id=wid, step=m["step"])
        avg = coordinator_average([m["gradients"] for m in messages])
        weights = sum(m.get("total", 0) for m in messages)
        loss = sum(m.get("loss", 0.0) * m.get("total", 0) for m in messages) / weights if weights else 0.0
        return dict(first, gradients=avg, global_loss=float(np.float32(loss)))


def _copy_in(gradients: Any) -> np.ndarray:
    if isinstance(gradients, np.ndarray):
        assert gradients.dtype == np.float32 and gradients.flags.c_contiguous, "Worker API takes C-contiguous float32"
    return np.frombuffer(gradients, dtype=np.float32).copy()


def _land(avg: np.ndarray, out: Optional[np.ndarray]) -> np.ndarray:
    if out is None:
        return avg.copy()
    target = out if isinstance(out, np.ndarray) else np.frombuffer(out, dtype=np.float32)
    np.copyto(target, avg)  # the Worker writes the bytes into out, allocating nothing
    return out


class FakeWorker:
    """One worker's end of a :class:`FakeCluster`, with the ddpwire.Worker methods."""

    def __init__(self, cluster: FakeCluster, worker_id: int) -> None:
        self.cluster = cluster
        self.worker_id = worker_id
        self.total_workers = cluster.n
        self._next_step = 0
        self._sent = 0
        self._received = 0

    def receive_shard(self) -> Optional[ShardAssignment]:
        if self._next_step >= self.cluster.steps:
            return None
        shard = self.cluster.shard(self.worker_id, self._next_step)
        self._next_step += 1
        return shard

    def _send(self, message: Dict[str, Any]) -> None:
        self.cluster.log(self.worker_id, "send_" + message["kind"], (message["step"], message["idx"]))
        k, self._sent = self._sent, self._sent + 1
        self.cluster.contribute(self.worker_id, k, message)

    def _receive(self, kind: str) -> Dict[str, Any]:
        k, self._received = self._received, self._received + 1
        result = self.cluster.collect(k)
        if result["kind"] != kind:
            raise UnexpectedMessage(kind, result["kind"], worker_id=self.worker_id)
        self.cluster.log(self.worker_id, "receive_" + kind, (result["step"], result["idx"]))
        return result

    def send_gradients(self, step: int, gradients: Any, loss: float, correct: int, total: int) -> None:
        self._send(dict(kind="flat", step=step, idx=None, gradients=_copy_in(gradients), loss=loss, total=total))

    def receive_averaged(self, out: Optional[np.ndarray] = None) -> AveragedGradient:
        r = self._receive("flat")
        return AveragedGradient(r["step"], _land(r["gradients"], out), r["global_loss"])

    def send_block_gradient(
        self, step: int, block_idx: int, num_blocks: int, gradients: Any, component_sizes: Sequence[int]
    ) -> None:
        g = _copy_in(gradients)
        if sum(component_sizes) != g.size:
            raise GradientMismatch("component_sizes total", g.size, sum(component_sizes), worker_id=self.worker_id)
        self._send(dict(kind="block", step=step, idx=block_idx, gradients=g, component_sizes=list(component_sizes)))

    def receive_averaged_block(self, out: Optional[np.ndarray] = None) -> AveragedBlockGradient:
        r = self._receive("block")
        return AveragedBlockGradient(r["step"], r["idx"], r["component_sizes"], _land(r["gradients"], out))

    def send_non_block_gradient(self, step: int, component: int, gradients: Any) -> None:
        self._send(dict(kind="non_block", step=step, idx=component, gradients=_copy_in(gradients)))

    def receive_averaged_non_block(self, out: Optional[np.ndarray] = None) -> AveragedNonBlockGradient:
        r = self._receive("non_block")
        return AveragedNonBlockGradient(r["step"], r["idx"], _land(r["gradients"], out))


def run_workers(workers: Sequence[FakeWorker], fn: Callable[[FakeWorker], Any]) -> List[Any]:
    """Run ``fn(worker)`` for every worker, each in its own thread; re-raise the first failure."""
    results: List[Any] = [None] * len(workers)
    errors: List[BaseException] = []

    def body(i: int) -> None:
        try:
            results[i] = fn(workers[i])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(len(workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
