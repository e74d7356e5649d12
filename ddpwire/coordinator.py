"""The coordinator: accepts workers, assigns shards, averages their gradients.

It mirrors the reference coordinator's session (protocol.md, "Session
semantics") with what the reference leaves undefined made into typed errors,
and it receives from every worker at once, averaging the bytes as they
arrive, so memory stays at about one gradient vector whatever the number of
workers.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import socket
import threading
import time
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from . import _core
from . import socket_threads as _socket_threads
from ._core import encode_frame_parts
from .channel import DEFAULT_MAX_FRAME, Channel, message_name
from .errors import (
    DdpwireError,
    GradientMismatch,
    JoinTimeout,
    NonFiniteGradient,
    UnexpectedMessage,
    WorkerLost,
)
from .messages import (
    AveragedBlockGradient,
    AveragedGradient,
    AveragedNonBlockGradient,
    BlockGradientPayload,
    GradientPayload,
    JoinAccepted,
    JoinRequest,
    NonBlockGradientPayload,
    ShardAssignment,
    Shutdown,
)
from .results import BlockReduceResult, NonBlockReduceResult, ReduceResult
from .sessioninfo import WorkerInfo

__all__ = ["Coordinator"]

log = logging.getLogger(__name__)


def _bind(bind: Tuple[str, int], backlog: int) -> socket.socket:
    host, port = bind
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host, port), family=family, backlog=backlog)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise OSError(exc.errno, f"cannot listen on {host}:{port}: address already in use") from None
        if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
            raise OSError(exc.errno, f"cannot listen on {host}:{port}: no such local address") from None
        raise


class Coordinator:
    """Accepts ``expect_workers`` workers and runs the averaging side of training.

    ``timeout`` bounds every wait on a worker: a worker silent that long (or
    gone) raises :class:`~ddpwire.WorkerLost` naming it and the step. With
    ``heartbeat`` (seconds) set, the coordinator sends Heartbeat frames to
    idle workers at that interval, and waits only ``heartbeat_timeout`` on a
    worker that sends none (the reference does not speak heartbeats: leave it
    off when reference workers join).

    Gradients are averaged as they stream in, through a ring of
    ``ring_bytes`` per worker. ``socket_threads`` gives each worker
    connection a receiving and a sending thread while a step streams, so the
    copies in and out of the kernel spread over the cores instead of all
    running on one; None (the default) chooses threads for vectors of a
    megabyte or more when the machine has a core for each worker plus one.
    The result is bit-identical either way.
    """

    def __init__(
        self,
        bind: Tuple[str, int] = ("127.0.0.1", 0),
        expect_workers: int = 1,
        *,
        timeout: float = 120.0,
        join_timeout: float = 300.0,
        max_frame: int = DEFAULT_MAX_FRAME,
        heartbeat: Optional[float] = None,
        heartbeat_timeout: Optional[float] = None,
        ring_bytes: int = 1 << 20,
        socket_threads: Optional[bool] = None,
        node_id: str = "coordinator",
    ) -> None:
        if expect_workers < 1:
            raise ValueError(f"expect_workers must be at least 1, got {expect_workers}")
        self.expect_workers = expect_workers
        self.timeout = timeout
        self.join_timeout = join_timeout
        self.max_frame = max_frame
        self.ring_bytes = ring_bytes
        self.socket_threads = socket_threads
        self.node_id = node_id
        self.heartbeat = heartbeat
        self.heartbeat_timeout = (
            heartbeat_timeout if heartbeat_timeout is not None
            else (3.0 * heartbeat if heartbeat else None))
        self._listener = _bind(bind, backlog=max(16, expect_workers))
        self._channels: List[Channel] = []
        self.workers: List[WorkerInfo] = []
        self.total_samples = 0
        # Vector lengths are fixed by the first step that sees them: a worker
        # whose model differs is caught on its first gradient.
        self._flat_len: Optional[int] = None
        self._block_len: Dict[int, int] = {}
        self._non_block_len: Dict[int, int] = {}
        self._closed = False
        self._stop = threading.Event()
        self._heartbeat_thread: Optional[threading.Thread] = None

    # ---- lifecycle ----

    @property
    def local_addr(self) -> Tuple[str, int]:
        """The (host, port) the coordinator listens on (the real port when bound to 0)."""
        host, port = self._listener.getsockname()[:2]
        return host, port

    @property
    def worker_count(self) -> int:
        """Workers joined so far."""
        return len(self._channels)

    def wait_for_workers(self, timeout: Optional[float] = None) -> List[WorkerInfo]:
        """Accept workers until ``expect_workers`` have joined; worker_id is the
        order of joining. Raises :class:`~ddpwire.JoinTimeout` at the deadline
        (``timeout`` or the constructor's ``join_timeout``)."""
        limit = self.join_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while len(self._channels) < self.expect_workers:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise JoinTimeout(
                    f"{len(self._channels)} of {self.expect_workers} workers joined within {limit:g} s")
            self._listener.settimeout(min(remaining, 1.0))
            try:
                sock, addr = self._listener.accept()
            except socket.timeout:
                continue
            self._handshake(sock, addr, min(remaining, self.timeout))
        if self.heartbeat and self._heartbeat_thread is None:
            self._heartbeat_thread = threading.Thread(
                target=self._send_heartbeats, name="ddpwire-coordinator-heartbeat", daemon=True)
            self._heartbeat_thread.start()
        return list(self.workers)

    def _handshake(self, sock: socket.socket, addr: Tuple, timeout: float) -> None:
        worker_id = len(self._channels)
        chan = Channel(sock, timeout=timeout, peer_name=f"worker at {addr[0]}:{addr[1]}",
                       lost=WorkerLost, peer_id=worker_id, max_frame=self.max_frame)
        try:
            join = chan.expect([JoinRequest])
            chan.send(JoinAccepted(worker_id=worker_id, total_workers=self.expect_workers))
        except DdpwireError as exc:
            # A stray or broken client must not stop the others from joining.
            log.warning("refused a connection from %s:%s: %s", addr[0], addr[1], exc)
            chan.close()
            return
        chan.timeout = self.timeout
        chan.heartbeat_timeout = self.heartbeat_timeout
        chan.conn.peer_name = f"worker {worker_id} ({join.node_id}@{addr[0]})"
        self._channels.append(chan)
        self.workers.append(WorkerInfo(worker_id=worker_id, node_id=join.node_id,
                                       gpu_count=join.gpu_count, backend=join.backend,
                                       address=f"{addr[0]}:{addr[1]}"))
        log.info("worker %d joined: %s (%s, %d GPU) from %s:%s", worker_id, join.node_id,
                 join.backend, join.gpu_count, addr[0], addr[1])

    def _send_heartbeats(self) -> None:
        assert self.heartbeat is not None
        while not self._stop.wait(self.heartbeat):
            for chan in list(self._channels):
                try:
                    chan.try_send_heartbeat(self.node_id)
                except (DdpwireError, OSError) as exc:
                    log.debug("heartbeat to worker %s failed: %s", chan.peer_id, exc)

    def close(self) -> None:
        """Close every connection and the listening socket."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        for chan in self._channels:
            chan.close()
        self._listener.close()

    def __enter__(self) -> "Coordinator":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- shards ----

    def set_total_samples(self, total: int) -> None:
        """The number of samples split between the workers at every step."""
        if total < 0:
            raise ValueError(f"total samples must be >= 0, got {total}")
        self.total_samples = int(total)

    def shard_bounds(self, worker_id: int) -> Tuple[int, int]:
        """[start, end) of the worker's shard: T // n each, the rest to the last."""
        n = len(self._channels)
        shard = self.total_samples // n
        start = worker_id * shard
        end = self.total_samples if worker_id == n - 1 else start + shard
        return start, end

    def send_shard_assignments(self, step: int) -> None:
        """Send every worker its ShardAssignment for ``step``."""
        self._require_workers()
        for chan in self._channels:
            start, end = self.shard_bounds(chan.peer_id)
            chan.send(ShardAssignment(step=step, shard_start=start, shard_end=end), step=step)

    # ---- collect and reduce ----

    def collect_and_reduce(self, step: int, out: Optional[np.ndarray] = None) -> ReduceResult:
        """Receive every worker's GradientPayload for ``step`` and average them.

        ``out`` (float32, the gradient length) receives the average; by
        default a new array is allocated. Raises GradientMismatch,
        UnexpectedMessage, NonFiniteGradient or WorkerLost, naming the worker.
        """
        t0 = time.perf_counter()
        heads = self._collect_heads(GradientPayload, step)
        t1 = time.perf_counter()
        self._check_lengths(heads, step, self._flat_len, "gradients length")
        avg, tails = self._reduce(heads, out, step)
        if self._flat_len is None:
            self._flat_len = len(avg)
        return self._flat_result(step, avg, tails, reduce_time=time.perf_counter() - t1,
                                 wait_time=t1 - t0)

    @staticmethod
    def _flat_result(step: int, avg: np.ndarray, tails: list, *, reduce_time: float,
                     wait_time: float) -> ReduceResult:
        losses = np.array([t[0] for t in tails], dtype=np.float32)
        totals = [t[2] for t in tails]
        total_samples = sum(totals)
        total_correct = sum(t[1] for t in tails)
        # float32 in worker order, as the reference computes it
        weighted = np.float32(0.0)
        for loss, total in zip(losses, totals):
            weighted = np.float32(weighted + loss * np.float32(total))
        global_loss = float(weighted / np.float32(total_samples)) if total_samples else 0.0
        return ReduceResult(step=step, avg_gradients=avg, global_loss=global_loss,
                            total_correct=total_correct, total_samples=total_samples,
                            reduce_time=reduce_time, wait_time=wait_time,
                            worker_losses=[float(x) for x in losses])

    def collect_and_reduce_block(self, step: int, block_idx: int,
                                 out: Optional[np.ndarray] = None) -> BlockReduceResult:
        """Receive every worker's BlockGradientPayload for (step, block_idx) and
        average them; the result carries worker 0's component sizes."""
        t0 = time.perf_counter()
        heads = self._collect_block_heads(step, block_idx)
        t1 = time.perf_counter()
        avg, _ = self._reduce(heads, out, step)
        self._block_len.setdefault(block_idx, len(avg))
        return BlockReduceResult(step=step, block_idx=block_idx, avg_gradients=avg,
                                 component_sizes=list(heads[0].component_sizes),
                                 reduce_time=time.perf_counter() - t1, wait_time=t1 - t0)

    def _collect_block_heads(self, step: int, block_idx: int) -> List["_core.FrameHead"]:
        heads = self._collect_heads(BlockGradientPayload, step)
        for wid, head in enumerate(heads):
            if head.block_idx != block_idx:
                raise GradientMismatch("block_idx", block_idx, head.block_idx, worker_id=wid, step=step)
            if sum(head.component_sizes) != head.gradient_count:
                raise GradientMismatch("sum of component_sizes", head.gradient_count,
                                       sum(head.component_sizes), worker_id=wid, step=step)
            if head.component_sizes != heads[0].component_sizes:
                raise GradientMismatch("component_sizes", heads[0].component_sizes,
                                       head.component_sizes, worker_id=wid, step=step)
        self._check_lengths(heads, step, self._block_len.get(block_idx),
                            f"block {block_idx} gradients length")
        return heads

    def collect_and_reduce_non_block(self, step: int, component: int,
                                     out: Optional[np.ndarray] = None) -> NonBlockReduceResult:
        """Receive every worker's NonBlockGradientPayload for (step, component)
        and average them (0 lm_head, 1 final_norm, 2 embedding)."""
        t0 = time.perf_counter()
        heads = self._collect_non_block_heads(step, component)
        t1 = time.perf_counter()
        avg, _ = self._reduce(heads, out, step)
        self._non_block_len.setdefault(component, len(avg))
        return NonBlockReduceResult(step=step, component=component, avg_gradients=avg,
                                    reduce_time=time.perf_counter() - t1, wait_time=t1 - t0)

    def _collect_non_block_heads(self, step: int, component: int) -> List["_core.FrameHead"]:
        heads = self._collect_heads(NonBlockGradientPayload, step)
        for wid, head in enumerate(heads):
            if head.component != component:
                raise GradientMismatch("component", component, head.component, worker_id=wid, step=step)
        self._check_lengths(heads, step, self._non_block_len.get(component),
                            f"component {component} gradients length")
        return heads

    def _require_workers(self) -> None:
        if len(self._channels) < self.expect_workers:
            raise DdpwireError(
                f"only {len(self._channels)} of {self.expect_workers} workers joined: "
                "call wait_for_workers() first")

    def _collect_heads(self, expected: type, step: int) -> List["_core.FrameHead"]:
        """Every worker's frame head, in worker order; the elements stay in the
        sockets for the streaming reduce."""
        self._require_workers()
        heads = []
        for chan in self._channels:
            head = chan.read_head(step=step, what=f"waiting for {expected.__name__}")
            if not isinstance(head, _core.FrameHead) or head.tag != expected.TAG:
                raise UnexpectedMessage(expected.__name__, message_name(head),
                                        worker_id=chan.peer_id, step=step)
            if head.step != step:
                raise GradientMismatch("step", step, head.step, worker_id=chan.peer_id, step=step)
            if head.worker_id != chan.peer_id:
                raise GradientMismatch("worker_id", chan.peer_id, head.worker_id,
                                       worker_id=chan.peer_id, step=step)
            heads.append(head)
        return heads

    def _check_lengths(self, heads: list, step: int, expected: Optional[int], what: str) -> None:
        want = heads[0].gradient_count if expected is None else expected
        for wid, head in enumerate(heads):
            if head.gradient_count != want:
                raise GradientMismatch(what, want, head.gradient_count, worker_id=wid, step=step)

    @staticmethod
    def _out_for(heads: list, out: Optional[np.ndarray]) -> np.ndarray:
        count = heads[0].gradient_count
        if out is None:
            return np.empty(count, dtype=np.float32)
        if len(out) != count:
            raise ValueError(f"out: has {len(out)} elements, the gradients have {count}")
        return out

    def _reduce(self, heads: list, out: Optional[np.ndarray], step: int) -> Tuple[np.ndarray, list]:
        out = self._out_for(heads, out)
        conns = [chan.conn for chan in self._channels]
        tails, bad = _core.reduce_stream(conns, out, heads[0].tail_len, self.timeout,
                                        ring_bytes=self.ring_bytes,
                                        socket_threads=self._use_socket_threads(heads), step=step)
        self._raise_bad(bad, step)
        return out, [_core.decode_tail(heads[0].tag, t) for t in tails]

    @staticmethod
    def _raise_bad(bad: Optional[list], step: int) -> None:
        if bad is None:
            return
        for wid, (index, value) in enumerate(bad):
            if index >= 0:
                log.error("worker %d sent a non-finite gradient at step %d: halting", wid, step)
                raise NonFiniteGradient(wid, index, value, worker_id=wid, step=step)

    # ---- collect, average and broadcast in one pass ----

    def allreduce(self, step: int, out: Optional[np.ndarray] = None) -> ReduceResult:
        """:meth:`collect_and_reduce` and :meth:`broadcast_averaged` in one
        pipelined pass, with the same result, bit for bit.

        Once every worker's GradientPayload head has been checked, the
        AveragedGradient goes out to all workers while their gradients are
        still arriving: each element range is sent as soon as every worker's
        elements for it are in and averaged (into ``out``), and global_loss
        last, once every worker's loss and counts are in. Workers may send
        their whole frame before reading (send_gradients then
        receive_averaged) or do both at once (:meth:`Worker.allreduce`).

        Averaged bytes already sent cannot be recalled, so a failure after
        the first byte went out ends the session: on a NaN or +/-inf nothing
        more is sent, the incoming frames are drained, every worker
        connection is closed (the workers see CoordinatorLost and never hold
        a complete AveragedGradient, so none applies a partial average) and
        NonFiniteGradient is raised naming the worker and step. A lost worker
        (WorkerLost) closes every connection the same way. Errors found in the
        heads (GradientMismatch, UnexpectedMessage) come before anything is
        sent and leave the connections open, as collect_and_reduce does.

        ``reduce_time`` covers the whole pass after the heads (transfer in,
        average, transfer out); ``wait_time`` the wait for the heads.
        """
        t0 = time.perf_counter()
        heads = self._collect_heads(GradientPayload, step)
        t1 = time.perf_counter()
        self._check_lengths(heads, step, self._flat_len, "gradients length")
        out = self._out_for(heads, out)
        done: List[ReduceResult] = []

        def make_tail(tails: List[bytes]) -> bytes:
            # every worker's loss and counts are in: the result is complete
            # but for its time, and global_loss ends the reply
            decoded = [_core.decode_tail(GradientPayload.TAG, t) for t in tails]
            result = self._flat_result(step, out, decoded, reduce_time=0.0, wait_time=t1 - t0)
            done.append(result)
            return encode_frame_parts(AveragedGradient(step=step, gradients=out,
                                                       global_loss=result.global_loss),
                                      max_frame=self.max_frame)[2]

        head = encode_frame_parts(AveragedGradient(step=step, gradients=out, global_loss=0.0),
                                  max_frame=self.max_frame)[0]
        self._stream(heads, out, head, make_tail, step, "AveragedGradient")
        if self._flat_len is None:
            self._flat_len = len(out)
        result = done[0]
        result.reduce_time = time.perf_counter() - t1
        return result

    def allreduce_block(self, step: int, block_idx: int,
                        out: Optional[np.ndarray] = None) -> BlockReduceResult:
        """:meth:`collect_and_reduce_block` and :meth:`broadcast_averaged_block`
        in one pipelined pass; failures end the session as in :meth:`allreduce`."""
        t0 = time.perf_counter()
        heads = self._collect_block_heads(step, block_idx)
        t1 = time.perf_counter()
        out = self._out_for(heads, out)
        sizes = list(heads[0].component_sizes)
        head = encode_frame_parts(AveragedBlockGradient(step=step, block_idx=block_idx,
                                                        component_sizes=sizes, gradients=out),
                                  max_frame=self.max_frame)[0]
        self._stream(heads, out, head, lambda tails: b"", step, "AveragedBlockGradient")
        self._block_len.setdefault(block_idx, len(out))
        return BlockReduceResult(step=step, block_idx=block_idx, avg_gradients=out,
                                 component_sizes=sizes, reduce_time=time.perf_counter() - t1,
                                 wait_time=t1 - t0)

    def allreduce_non_block(self, step: int, component: int,
                            out: Optional[np.ndarray] = None) -> NonBlockReduceResult:
        """:meth:`collect_and_reduce_non_block` and
        :meth:`broadcast_averaged_non_block` in one pipelined pass; failures
        end the session as in :meth:`allreduce`."""
        t0 = time.perf_counter()
        heads = self._collect_non_block_heads(step, component)
        t1 = time.perf_counter()
        out = self._out_for(heads, out)
        head = encode_frame_parts(AveragedNonBlockGradient(step=step, component=component,
                                                           gradients=out),
                                  max_frame=self.max_frame)[0]
        self._stream(heads, out, head, lambda tails: b"", step, "AveragedNonBlockGradient")
        self._non_block_len.setdefault(component, len(out))
        return NonBlockReduceResult(step=step, component=component, avg_gradients=out,
                                    reduce_time=time.perf_counter() - t1, wait_time=t1 - t0)

    def _stream(self, heads: list, out: np.ndarray, head: bytes, make_tail, step: int,
                reply: str) -> None:
        """Average the elements left in the sockets into ``out`` while sending
        ``head`` + ``out`` + make_tail(tails) to every worker."""
        conns = [chan.conn for chan in self._channels]
        with self._sending_to_all():
            try:
                _, bad = _core.allreduce_stream(conns, out, heads[0].tail_len, head, make_tail,
                                               self.timeout, ring_bytes=self.ring_bytes,
                                               socket_threads=self._use_socket_threads(heads), step=step,
                                               what=f"averaging {heads[0].message_type} into {reply}")
                self._raise_bad(bad, step)
            except BaseException:
                # Some workers hold part of a reply that will never be finished:
                # closing is the only way to tell them at once.
                self._abandon()
                raise

    def _use_socket_threads(self, heads: list) -> bool:
        """Whether the vectors these heads announce stream on threads."""
        return _socket_threads.for_coordinator(self.socket_threads, len(self._channels),
                                               4 * heads[0].gradient_count)

    def _abandon(self) -> None:
        """Close every worker connection: the session cannot go on."""
        for chan in self._channels:
            chan.close()

    # ---- broadcast ----

    def _broadcast(self, msg: object, step: int) -> None:
        self._require_workers()
        parts = encode_frame_parts(msg, max_frame=self.max_frame)
        with self._sending_to_all():
            _core.send_many([c.conn for c in self._channels], parts, self.timeout, step=step,
                           what=f"sending {type(msg).__name__}")

    @contextlib.contextmanager
    def _sending_to_all(self) -> Iterator[None]:
        """Hold every worker's send lock: a heartbeat must not land inside a frame."""
        for chan in self._channels:
            chan.send_lock.acquire()
        try:
            yield
        finally:
            for chan in self._channels:
                chan.send_lock.release()

    def broadcast_averaged(self, step: int, result: ReduceResult) -> None:
        """Send every worker the same AveragedGradient."""
        self._broadcast(AveragedGradient(step=step, gradients=result.avg_gradients,
                                         global_loss=result.global_loss), step)

    def broadcast_averaged_block(self, step: int, result: BlockReduceResult) -> None:
        """Send every worker the same AveragedBlockGradient."""
        self._broadcast(AveragedBlockGradient(step=step, block_idx=result.block_idx,
                                              component_sizes=result.component_sizes,
                                              gradients=result.avg_gradients), step)

    def broadcast_averaged_non_block(self, step: int, result: NonBlockReduceResult) -> None:
        """Send every worker the same AveragedNonBlockGradient."""
        self._broadcast(AveragedNonBlockGradient(step=step, component=result.component,
                                                 gradients=result.avg_gradients), step)

    def shutdown_workers(self) -> None:
        """Send Shutdown to every worker still connected (a lost one is skipped)."""
        for chan in self._channels:
            try:
                chan.send(Shutdown())
            except DdpwireError as exc:
                log.warning("could not send Shutdown to worker %s: %s", chan.peer_id, exc)
