"""The data-parallel trainer over the real Coordinator and Worker on loopback TCP.

Workers run as threads of the test process (torch releases the GIL in its
ops); the coordinator's side runs in the test thread. Every blocking call has
a short timeout, so a protocol bug fails the test instead of hanging it.
"""
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fake_cluster import FakeCluster, run_workers  # noqa: E402
from session_helpers import spawn  # noqa: E402

from ddpwire import Coordinator, Worker  # noqa: E402
from ddpwire.wire.errors import (
    CoordinatorLost, NonFiniteGradient, ShutdownDuringReduce,
)  # noqa: E402
from ddpwire.torch import (  # noqa: E402
    DataParallelTrainer,
    DigitsMLP,
    TinyTransformer,
    classification_batch,
    digits_split,
    token_sequences,
)

TIMEOUT = 20.0  # seconds any one wait on a peer may take; far above a step of these tiny models
DIGITS_TRAIN, _ = digits_split(seed=0)
TOKENS = token_sequences(96, seq_len=8, vocab=12, seed=0)
NON_BLOCK_COMPONENTS = (0, 1, 2)  # lm_head, final_norm, embedding: the order the trainer sends them


def digits_trainer(worker, samples_per_step=256, **kwargs):
    model = DigitsMLP(hidden=32, seed=7)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    return DataParallelTrainer(worker, model, opt, DIGITS_TRAIN, samples_per_step=samples_per_step, seed=1, **kwargs)


def tiny_transformer(seed=5, n_blocks=3):
    return TinyTransformer(vocab=12, dim=16, n_blocks=n_blocks, n_heads=2, ffn=32, max_len=8, seed=seed)


def token_trainer(worker, per_block, samples_per_step=32, **kwargs):
    model = tiny_transformer()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return DataParallelTrainer(
        worker, model, opt, TOKENS, samples_per_step=samples_per_step, seed=2, per_block=per_block, **kwargs
    )


def param_bytes(model):
    return [p.detach().cpu().numpy().tobytes() for p in model.parameters()]


def assert_bit_identical(models):
    first = param_bytes(models[0])
    for other in models[1:]:
        assert param_bytes(other) == first


# ----- the coordinator's side, written out for the tests -----


def serve_flat(coord, steps):
    for step in range(steps):
        coord.send_shard_assignments(step)
        coord.broadcast_averaged(step, coord.collect_and_reduce(step))


def serve_per_block(coord, steps, num_blocks):
    for step in range(steps):
        coord.send_shard_assignments(step)
        for block_idx in reversed(range(num_blocks)):
            coord.broadcast_averaged_block(step, coord.collect_and_reduce_block(step, block_idx))
        for component in NON_BLOCK_COMPONENTS:
            coord.broadcast_averaged_non_block(step, coord.collect_and_reduce_non_block(step, component))


class WorkerThread(threading.Thread):
    """Connects a Worker, builds its trainer with ``make(worker)`` and trains until Shutdown."""

    def __init__(self, addr, make, wrap=None):
        super().__init__(daemon=True)
        self.addr, self.make, self.wrap = addr, make, wrap
        self.trainer = None
        self.results = None
        self.error = None

    def run(self):
        try:
            with Worker.connect(self.addr, timeout=TIMEOUT, connect_timeout=TIMEOUT) as worker:
                if self.wrap is not None:
                    self.wrap(worker)
                self.trainer = self.make(worker)
                self.results = self.trainer.train()
        except BaseException as exc:  # handed to the test thread
            self.error = exc

    def finish(self):
        self.join(2 * TIMEOUT)
        assert not self.is_alive(), "worker thread did not finish"


def run_session(n, total_samples, make, serve, wrap=None):
    """Run a coordinator and n trainer threads on loopback; return (workers sorted by worker_id, serve error).

    After ``serve`` returns (or raises), the workers get Shutdown and are
    joined before the coordinator closes, so what they report comes from the
    protocol, not from a closed socket.
    """
    with Coordinator(("127.0.0.1", 0), expect_workers=n, timeout=TIMEOUT, join_timeout=TIMEOUT) as coord:
        coord.set_total_samples(total_samples)
        threads = [WorkerThread(coord.local_addr, make, wrap) for _ in range(n)]
        for t in threads:
            t.start()
        error = None
        try:
            coord.wait_for_workers()
            serve(coord)
        except Exception as exc:
            error = exc
        coord.shutdown_workers()
        for t in threads:
            t.finish()
    by_id = sorted(threads, key=lambda t: t.trainer.worker.worker_id if t.trainer else n)
    return by_id, error


def check_ok(threads, error):
    # a worker's error first: the coordinator's is usually its consequence (the worker left)
    for t in threads:
        if t.error is not None:
            raise t.error
    if error is not None:
        raise error


# ----- flat mode -----


@pytest.mark.parametrize("n", [2, 3])
def test_flat_over_tcp_is_bit_identical_and_matches_the_in_process_average(n):
    steps = 5
    threads, error = run_session(n, 256, digits_trainer, lambda c: serve_flat(c, steps))
    check_ok(threads, error)
    models = [t.trainer.model for t in threads]
    assert_bit_identical(models)
    assert param_bytes(models[0]) != param_bytes(DigitsMLP(hidden=32, seed=7))
    assert [len(t.results) for t in threads] == [steps] * n
    for step in range(steps):
        per_worker = [t.results[step] for t in threads]
        assert len({r.global_loss for r in per_worker}) == 1
        assert sum(r.total for r in per_worker) == 256
    assert threads[0].results[-1].global_loss < threads[0].results[0].global_loss

    # the coordinator averages as the in-process stand-in does (float32 sum in worker order, / n),
    # so the weights after TCP training are the stand-in's, bit for bit
    fake_models = run_workers(FakeCluster(n, 256, steps).workers, lambda w: train_and_keep(digits_trainer(w)))
    assert param_bytes(fake_models[0]) == param_bytes(models[0])


def train_and_keep(trainer):
    trainer.train()
    return trainer.model


# ----- per-block mode -----


def record_sends(worker):
    """Log (perf_counter when the call returned, kind, step, index) of each of this worker's sends."""
    worker.sent = []
    for name, kind in (("send_block_gradient", "block"), ("send_non_block_gradient", "non_block")):
        real = getattr(worker, name)

        def wrapped(step, idx, *args, _real=real, _kind=kind):
            _real(step, idx, *args)
            worker.sent.append((time.perf_counter(), _kind, step, idx))

        setattr(worker, name, wrapped)


@pytest.mark.parametrize("n", [2, 3])
def test_per_block_over_tcp_is_bit_identical(n):
    steps, num_blocks = 4, 3
    threads, error = run_session(
        n, 32, lambda w: token_trainer(w, per_block=True), lambda c: serve_per_block(c, steps, num_blocks)
    )
    check_ok(threads, error)
    models = [t.trainer.model for t in threads]
    assert_bit_identical(models)
    assert param_bytes(models[0]) != param_bytes(tiny_transformer())
    assert [len(t.results) for t in threads] == [steps] * n
    assert all(r.global_loss is None for t in threads for r in t.results)

    # the same run in flat mode lands on the same weights (same sums, only split differently)
    flat, error = run_session(n, 32, lambda w: token_trainer(w, per_block=False), lambda c: serve_flat(c, steps))
    check_ok(flat, error)
    for a, b in zip(models[0].parameters(), flat[0].trainer.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_per_block_over_tcp_sends_the_first_block_before_backward_ends():
    steps, num_blocks = 3, 3
    threads, error = run_session(
        2, 32, lambda w: token_trainer(w, per_block=True), lambda c: serve_per_block(c, steps, num_blocks),
        wrap=record_sends,
    )
    check_ok(threads, error)
    for t in threads:
        sent = t.trainer.worker.sent
        for r in t.results:
            this_step = [(at, kind, idx) for at, kind, step, idx in sent if step == r.step]
            assert [(kind, idx) for _, kind, idx in this_step] == [("block", 2), ("block", 1), ("block", 0)] + [
                ("non_block", c) for c in NON_BLOCK_COMPONENTS
            ]
            # the first block was on the wire (its send call had returned) while backward still ran
            first_block_sent = this_step[0][0]
            assert r.timings.first_send_start < first_block_sent < r.timings.backward_end
            assert r.timings.first_send_lead_s > 0
            assert all(at < r.timings.backward_end for at, kind, _ in this_step if kind == "block")
            assert all(at > r.timings.backward_end for at, kind, _ in this_step if kind == "non_block")
            assert r.timings.hidden_comm_s > 0
            assert 0 <= r.timings.averages_in_backward <= num_blocks


# ----- a non-finite gradient halts the session -----


def poisoned(model, x, y):
    loss, correct, total = classification_batch(model, x, y)
    return loss * float("nan"), correct, total


@pytest.mark.parametrize("topology", ["star", "mesh"])
@pytest.mark.parametrize("per_block", [False, True])
@pytest.mark.parametrize("halt", ["shutdown", "close"])
def test_nan_gradient_halts_the_coordinator_and_every_worker(per_block, halt, topology):
    """Worker 1's NaN loss: the coordinator raises NonFiniteGradient naming it and broadcasts nothing.

    With ``halt="shutdown"`` the coordinator then sends Shutdown and every
    worker stops with ShutdownDuringReduce; with ``"close"`` it just closes
    and every worker stops with CoordinatorLost. Either way nobody hangs. On
    the mesh (flat steps) every worker hears the halt itself: NonFiniteGradient
    naming worker 1.
    """
    steps = 3

    def make(worker):
        batch_fn = poisoned if worker.worker_id == 1 else classification_batch
        return token_trainer(worker, per_block, samples_per_step=16, batch_fn=batch_fn)

    def serve(coord):
        if per_block:
            serve_per_block(coord, steps, 3)
        else:
            serve_flat(coord, steps)

    with Coordinator(("127.0.0.1", 0), expect_workers=2, timeout=TIMEOUT, join_timeout=TIMEOUT,
                     topology=topology) as coord:
        coord.set_total_samples(16)
        threads = [WorkerThread(coord.local_addr, make) for _ in range(2)]
        for t in threads:
            t.start()
        coord.wait_for_workers()
        with pytest.raises(NonFiniteGradient) as info:
            serve(coord)
        if halt == "shutdown":
            coord.shutdown_workers()
        else:
            coord.close()
        for t in threads:
            t.finish()
    assert info.value.worker_id == 1 and info.value.step == 0
    assert np.isnan(info.value.value)
    expected = ShutdownDuringReduce if halt == "shutdown" else CoordinatorLost
    if topology == "mesh" and not per_block:
        expected = NonFiniteGradient
    for t in threads:
        assert isinstance(t.error, expected), repr(t.error)
        assert t.error.step == 0
        if expected is NonFiniteGradient:
            assert t.error.worker_id == 1 and np.isnan(t.error.value)
        assert t.results is None  # no step completed: nothing NaN was ever applied
        assert all(torch.isfinite(p).all() for p in t.trainer.model.parameters())


def test_train_worker_is_refused_at_the_join_for_another_step_mode_or_model():
    """train_worker offers its step mode and its model's gradient length:
    a worker of another mode, or with another model, is refused at the
    join with what to change, and the others train on."""
    from ddpwire.wire.errors import JoinRefusedError
    from ddpwire.wire.extensions import RefusalReason
    from ddpwire.cli.serve import serve
    from ddpwire.torch.job import build_task, train_worker

    def length(model):
        return sum(p.numel() for p in build_task(model)[0].parameters())

    with Coordinator(("127.0.0.1", 0), expect_workers=2, per_block=False, timeout=TIMEOUT,
                     samples_per_step=64) as coord:
        def run():
            return train_worker(coord.local_addr, model="mlp", samples_per_step=64,
                                timeout=TIMEOUT)
        first = spawn(run)
        coord.wait_for_workers(count=1, timeout=TIMEOUT)
        join = spawn(lambda: coord.wait_for_workers(timeout=TIMEOUT))
        with pytest.raises(JoinRefusedError) as per_block:
            train_worker(coord.local_addr, model="transformer", per_block=True,
                         samples_per_step=64, timeout=TIMEOUT)
        with pytest.raises(JoinRefusedError) as other_model:
            train_worker(coord.local_addr, model="transformer", samples_per_step=64,
                         timeout=TIMEOUT)
        second = spawn(run)
        join.join_result()
        serve(coord, steps=1, total_samples=64)
        reports = [first.join_result(), second.join_result()]
    assert per_block.value.reason == other_model.value.reason == RefusalReason.MISMATCH
    assert "this coordinator runs flat steps; start the worker without --per-block" in \
        str(per_block.value)
    assert (f"this worker's model has {length('transformer')} gradient elements, the others' "
            f"{length('mlp')}: every worker must train the same model") in str(other_model.value)
    assert [r.steps for r in reports] == [1, 1]
