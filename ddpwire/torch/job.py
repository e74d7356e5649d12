"""The ``ddpwire worker`` job: train a demo model with the data-parallel trainer.

Two demo tasks, both shipped with the installed packages (nothing is
downloaded): an MLP on scikit-learn's 8x8 digits (flat steps), and a tiny
transformer on counting sequences (flat or per-block steps).
"""
from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..wire.errors import CoordinatorLost, ShutdownDuringReduce, WorkerDropped
from ..wire.extensions import Extension, decode_u64
from ..plane.mesh import DEFAULT_CONGESTION
from ..session.progress import PaceLog, unit
from ..session.worker import Worker
from .data import ArrayDataset, digits_split, token_sequences
from .device import choose_device
from .models import DigitsMLP, TinyTransformer
from .rank_order import RankOrder
from .._text import counted
from .trainer import DataParallelTrainer, StepResult, evaluate

__all__ = ["WorkerReport", "build_task", "weights_digest", "train_worker"]

log = logging.getLogger(__name__)


@dataclass
class WorkerReport:
    """What a worker tells its launcher when training ends."""

    worker_id: int
    node_id: str
    backend: str
    steps: int
    held_out_loss: float
    held_out_accuracy: float
    weights_sha256: str
    mean_exposed_comm_s: float
    threads: int = 0
    #: the run's length as the coordinator announced it at the join (the
    #: steps extension); 0 when it did not, as a reference coordinator
    run_steps: int = 0
    #: the session's steps done when this worker's run ended (the last
    #: step it applied, plus one): more than ``steps`` for a worker that
    #: joined late, or was dropped and joined again
    reached: int = 0
    #: the coordinator ended the run early: inside a step, or before the
    #: session reached run_steps
    stopped_early: bool = False
    # per step, this worker's shard: mean loss, correct and total samples
    # (the per-block protocol carries no loss, so the demo reads them here)
    train_loss: List[float] = field(default_factory=list)
    train_correct: List[int] = field(default_factory=list)
    train_total: List[int] = field(default_factory=list)
    #: the float32 bytes of every vector this worker averaged (a gradient a
    #: step, or a pseudo-gradient a round): what local steps save, whatever
    #: the topology moves on the wire for each vector
    averaged_bytes: int = 0
    #: inner steps per averaged round (1: every step averaged)
    sync_every: int = 1

    def to_dict(self, per_step: bool = True) -> Dict[str, Any]:
        """The report as JSON-ready values; ``per_step=False`` leaves out the
        per-step lists, for a line that stays short however long the run."""
        d = asdict(self)
        if not per_step:
            for key in ("train_loss", "train_correct", "train_total"):
                del d[key]
        return d


def build_task(model: str, *, seed: int = 0, blocks: int = 4) -> Tuple[nn.Module, ArrayDataset, ArrayDataset]:
    """(model, train set, held-out set) for ``"mlp"`` or ``"transformer"``;
    every worker builds bit-identical initial weights from ``seed``."""
    if model == "mlp":
        train, held = digits_split(seed=seed)
        return DigitsMLP(seed=seed), train, held
    if model == "transformer":
        data = token_sequences(2048, seq_len=16, vocab=16, seed=seed)
        cut = 1792
        train = ArrayDataset(data.features[:cut], data.targets[:cut])
        held = ArrayDataset(data.features[cut:], data.targets[cut:])
        return TinyTransformer(vocab=16, dim=32, n_blocks=blocks, max_len=16, seed=seed), train, held
    raise ValueError(f"unknown model {model!r}: expected 'mlp' or 'transformer'")


def save_weights(model: nn.Module, path: str, steps: int) -> None:
    """``model``'s state_dict to ``path`` through a file beside it renamed
    over it: a run cut short while saving leaves the last file whole."""
    part = f"{path}.part"
    torch.save(model.state_dict(), part)
    os.replace(part, path)
    log.info("saved the model after %s to %s", counted(steps, "step"), path)


def weights_digest(model: nn.Module) -> str:
    """SHA-256 of every parameter's bytes, in order: equal digests mean
    bit-identical weights."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def train_worker(
    addr: Tuple[str, int],
    *,
    model: str = "mlp",
    per_block: bool = False,
    blocks: int = 4,
    samples_per_step: int = 256,
    lr: float = 0.05,
    device: Optional[str] = None,
    node_id: Optional[str] = None,
    timeout: float = 120.0,
    heartbeat: Optional[float] = None,
    seed: int = 0,
    threads: Optional[int] = 0,
    join_turn: Optional[RankOrder] = None,
    token: Optional[bytes] = None,
    encrypt: bool = True,
    mesh: bool = True,
    tcp_congestion: Optional[str] = DEFAULT_CONGESTION,
    on_step: Optional[Callable[[StepResult], None]] = None,
    sync_every: int = 1,
    save: Optional[str] = None,
) -> WorkerReport:
    """Join the coordinator at ``addr`` and train until it shuts training down.

    ``threads``: torch's intra-op threads (0 keeps torch's default; None:
    the usable cores split between the workers of the session on this
    machine, counted once every worker has joined, or torch's default where
    OMP_NUM_THREADS is set).
    ``join_turn``: under torchrun, join only after the previous rank did.
    ``token``: authenticate both ways and, with ``encrypt``, seal every
    link (docs/security.md).
    ``heartbeat``: seconds between heartbeats on an idle connection (None: off).
    ``save``: a file for the model's ``state_dict`` when training ends
    (normally, stopped, or on an error), written whole or not at all.
    ``mesh``, ``tcp_congestion``: as :meth:`Worker.connect`.
    ``on_step``: called with each step's result as it ends.
    ``sync_every``: local steps (DataParallelTrainer); ``samples_per_step``
    is then a round's, and each result a round's.

    A Shutdown where an average was due, or before the run's length that a
    ddpwire coordinator announces at the join, ends training all the same:
    the report then says ``stopped_early``."""
    choice = choose_device(device)
    net, train, held = build_task(model, seed=seed, blocks=blocks)
    net = net.to(choice.device)
    # plain SGD with momentum: deterministic, so equal averages keep equal weights
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    if join_turn is not None:
        join_turn.wait_turn()
    # samples_per_step, the step mode and the model's size go along so that
    # a coordinator running other steps refuses this worker at the join
    # instead of failing at step 0 (the trainer's buffer holds every
    # trainable parameter, in either mode); the steps entry asks how long
    # the run is, so that a Shutdown before its end is told from the end
    # (docs/extensions.md)
    gradient_length = sum(p.numel() for p in net.parameters() if p.requires_grad)

    def connect(resume_step: Optional[int] = None) -> Worker:
        return Worker.connect(addr, gpu_count=choice.gpu_count, backend=choice.backend,
                              node_id=node_id, timeout=timeout, heartbeat=heartbeat, token=token,
                              encrypt=encrypt, samples_per_step=samples_per_step, mesh=mesh,
                              tcp_congestion=tcp_congestion, per_block=per_block,
                              gradient_length=gradient_length, resume_step=resume_step,
                              extensions={Extension.STEPS: b""})

    worker = connect()
    if join_turn is not None:
        join_turn.joined()
    try:
        trainer = DataParallelTrainer(worker, net, optimizer, train, device=choice.device,
                                      samples_per_step=samples_per_step, seed=seed,
                                      per_block=per_block, sync_every=sync_every, threads=threads)
        results: List[StepResult] = []
        granted = worker.extensions.get(Extension.STEPS)
        pace = PaceLog(log, decode_u64(granted) if granted is not None else 0,
                       label=unit(sync_every))
        inside_step = False
        try:
            while True:
                try:
                    result = trainer.step()
                except (WorkerDropped, CoordinatorLost) as exc:
                    if isinstance(exc, WorkerDropped):
                        # stopped or asleep past the timeout: the session went
                        # on without it; join again, from the session's state
                        log.warning("%s: joining again", exc)
                        resume_step = None
                    elif worker.elastic:
                        # an elastic run's coordinator may be restarted
                        # (--resume): wait for it, up to the timeout, and go on
                        log.warning("%s: waiting up to %g s for the coordinator to come back "
                                    "(it goes on with ddpwire coordinator --resume)", exc, timeout)
                        resume_step = trainer.next_step
                    else:
                        raise
                    worker.close()
                    worker = connect(resume_step=resume_step)
                    trainer.rejoin(worker)
                    continue
                if result is None:
                    break
                results.append(result)
                pace.update(result.step, result.total, result.loss if result.global_loss is None
                            else result.global_loss)
                if on_step is not None:
                    on_step(result)
        except ShutdownDuringReduce as exc:
            # a Shutdown in place of an average: the coordinator was stopped
            # (the step is not applied; the weights are those of the last one)
            log.debug("%s", exc)
            inside_step = True
        finally:
            trainer.close()
            if save is not None:
                # whatever ended the run: a step is applied whole or not at
                # all, so the weights are those after the last step applied
                save_weights(net, save, len(results))
        granted = worker.extensions.get(Extension.STEPS)
        run_steps = decode_u64(granted) if granted is not None else 0
        # the session's steps, not this process's: it may have joined late
        reached = results[-1].step + 1 if results else 0
        loss, accuracy = evaluate(net, held, choice.device)
        exposed = [r.timings.exposed_comm_s for r in results]
        report = WorkerReport(
            worker_id=worker.worker_id, node_id=worker.node_id, backend=choice.backend,
            steps=len(results), held_out_loss=loss, held_out_accuracy=accuracy,
            weights_sha256=weights_digest(net),
            mean_exposed_comm_s=sum(exposed) / len(exposed) if exposed else 0.0,
            threads=trainer.threads or 0,
            run_steps=run_steps, reached=reached,
            stopped_early=inside_step or reached < run_steps,
            train_loss=[r.loss for r in results], train_correct=[r.correct for r in results],
            train_total=[r.total for r in results],
            # one flat vector a step (a round): what this worker put on the wire for it
            averaged_bytes=len(results) * 4 * gradient_length, sync_every=sync_every)
    finally:
        worker.close()
    log.info("worker %d done: %s%s, held-out accuracy %.1f%%", report.worker_id,
             counted(report.steps, "step"), " (stopped early)" if report.stopped_early else "",
             100 * accuracy)
    return report
