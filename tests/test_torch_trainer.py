"""The data-parallel trainer against an in-process fake cluster: flat and per-block steps."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from fake_cluster import FakeCluster, coordinator_average, run_workers  # noqa: E402

from ddpwire.wire.errors import GradientMismatch, NonFiniteGradient  # noqa: E402
from ddpwire.torch import (  # noqa: E402
    DataParallelTrainer,
    DigitsMLP,
    GradientBuffer,
    Segment,
    TinyTransformer,
    classification_batch,
    digits_split,
    evaluate,
    token_sequences,
)

DIGITS_TRAIN, DIGITS_HELD = digits_split(seed=0)
TOKENS = token_sequences(96, seq_len=8, vocab=12, seed=0)


def digits_trainer(worker, samples_per_step=256, **kwargs):
    model = DigitsMLP(hidden=32, seed=7)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    return DataParallelTrainer(worker, model, opt, DIGITS_TRAIN, samples_per_step=samples_per_step, seed=1, **kwargs)


def tiny_transformer(seed=5):
    return TinyTransformer(vocab=12, dim=16, n_blocks=3, n_heads=2, ffn=32, max_len=8, seed=seed)


def token_trainer(worker, per_block, samples_per_step=32, model=None, **kwargs):
    model = model if model is not None else tiny_transformer()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return DataParallelTrainer(
        worker, model, opt, TOKENS, samples_per_step=samples_per_step, seed=2, per_block=per_block, **kwargs
    )


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_bit_identical(models):
    first = weights(models[0])
    for other in models[1:]:
        for a, b in zip(first, weights(other)):
            assert torch.equal(a, b)


def train_all(cluster, make, steps=None):
    """Build and run one trainer per fake worker, each in its own thread; return (trainers, results)."""

    def body(worker):
        trainer = make(worker)
        return trainer, trainer.train(steps)

    out = run_workers(cluster.workers, body)
    return [t for t, _ in out], [r for _, r in out]


# ----- flat mode -----


@pytest.mark.parametrize("n", [2, 3])
def test_flat_weights_bit_identical_and_grads_are_the_coordinator_average(n):
    cluster = FakeCluster(n, total_samples=256, steps=6)
    init = weights(DigitsMLP(hidden=32, seed=7))
    trainers, results = train_all(cluster, digits_trainer)
    models = [t.model for t in trainers]
    assert_bit_identical(models)
    assert any(not torch.equal(a, b) for a, b in zip(init, weights(models[0])))
    assert [len(r) for r in results] == [6] * n
    # every worker applied exactly the coordinator's average of what the workers sent in the last round
    sent = [m["gradients"] for m in cluster.rounds[-1].messages]
    expected = coordinator_average(sent)
    for t in trainers:
        np.testing.assert_array_equal(GradientBuffer(t.model).gather(), expected)
    assert not np.array_equal(sent[0], sent[1])  # the shards really differed
    for step in range(6):
        per_worker = [r[step] for r in results]
        assert len({r.global_loss for r in per_worker}) == 1
        assert sum(r.total for r in per_worker) == 256
        weighted = sum(r.loss * r.total for r in per_worker) / 256
        assert math.isclose(per_worker[0].global_loss, weighted, rel_tol=1e-5)
    assert results[0][-1].global_loss < results[0][0].global_loss


def test_flat_matches_single_process_large_batch_sgd():
    """Two workers averaging equal shards give the same update as one process on the whole batch."""
    cluster = FakeCluster(2, total_samples=200, steps=4)
    trainers, _ = train_all(cluster, lambda w: digits_trainer(w, samples_per_step=200))

    model = DigitsMLP(hidden=32, seed=7)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    sampler = trainers[0].sampler
    for step in range(4):
        model.zero_grad()
        loss, _, _ = classification_batch(model, *DIGITS_TRAIN.rows(sampler.indices(step, 0, 200)))
        loss.backward()
        opt.step()
    for a, b in zip(weights(model), weights(trainers[0].model)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_flat_training_learns_the_digits():
    cluster = FakeCluster(2, total_samples=len(DIGITS_TRAIN), steps=30)
    trainers, _ = train_all(cluster, lambda w: digits_trainer(w, samples_per_step=len(DIGITS_TRAIN)))
    loss, accuracy = evaluate(trainers[0].model, DIGITS_HELD)
    assert accuracy > 0.9, (loss, accuracy)


def test_empty_shards_send_zeros_and_stay_in_step():
    # total_samples 2 over 3 workers: workers 0 and 1 get empty shards
    cluster = FakeCluster(3, total_samples=2, steps=3)
    trainers, results = train_all(cluster, lambda w: digits_trainer(w, samples_per_step=2))
    assert_bit_identical([t.model for t in trainers])
    assert [r[0].total for r in results] == [0, 0, 2]
    assert not cluster.rounds[0].messages[0]["gradients"].any()
    assert cluster.rounds[0].messages[2]["gradients"].any()


def test_step_returns_none_after_shutdown():
    cluster = FakeCluster(1, total_samples=64, steps=2)
    trainer = digits_trainer(cluster.workers[0], samples_per_step=64)
    assert len(trainer.train()) == 2
    assert trainer.step() is None


def test_average_for_the_wrong_step_is_refused():
    cluster = FakeCluster(1, total_samples=64, steps=2)
    worker = cluster.workers[0]
    real = worker.receive_averaged

    def shifted(out=None):
        avg = real(out=out)
        return avg._replace(step=avg.step + 1)

    worker.receive_averaged = shifted
    trainer = digits_trainer(worker, samples_per_step=64)
    with pytest.raises(GradientMismatch, match="step mismatch: expected 0, got 1"):
        trainer.step()


@pytest.mark.parametrize("per_block", [False, True])
def test_non_finite_gradient_halts_every_worker(per_block):
    cluster = FakeCluster(2, total_samples=16, steps=2)

    def poisoned(model, x, y):
        loss, correct, total = classification_batch(model, x, y)
        return loss * float("nan"), correct, total

    def make(worker):
        batch_fn = poisoned if worker.worker_id == 1 else classification_batch
        return token_trainer(worker, per_block, samples_per_step=16, batch_fn=batch_fn)

    with pytest.raises(NonFiniteGradient):
        train_all(cluster, make)


# ----- per-block mode -----


def sends(cluster, worker_id, step):
    return [(t, kind, idx) for t, w, kind, (s, idx) in cluster.events if w == worker_id and s == step and kind.startswith("send")]


@pytest.mark.parametrize("n", [2, 3])
def test_per_block_bit_identical_and_equal_to_flat(n):
    steps = 4
    flat_cluster = FakeCluster(n, total_samples=32, steps=steps)
    flat, _ = train_all(flat_cluster, lambda w: token_trainer(w, per_block=False))
    block_cluster = FakeCluster(n, total_samples=32, steps=steps)
    blocks, results = train_all(block_cluster, lambda w: token_trainer(w, per_block=True))

    assert_bit_identical([t.model for t in blocks])
    for a, b in zip(weights(flat[0].model), weights(blocks[0].model)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(a, b) for a, b in zip(weights(tiny_transformer()), weights(blocks[0].model)))
    assert all(r.global_loss is None for rs in results for r in rs)


def test_per_block_sends_first_block_during_backward_in_backward_order():
    cluster = FakeCluster(2, total_samples=32, steps=3)
    trainers, results = train_all(cluster, lambda w: token_trainer(w, per_block=True))
    for wid, worker_results in enumerate(results):
        for r in worker_results:
            sent = sends(cluster, wid, r.step)
            assert [(k, i) for _, k, i in sent] == [("send_block", 2), ("send_block", 1), ("send_block", 0)] + [
                ("send_non_block", c) for c in (0, 1, 2)
            ]
            backward_end = r.timings.backward_end
            # every block went out from inside backward; the non-block parts after it
            assert all(t < backward_end for t, k, _ in sent if k == "send_block")
            assert all(t > backward_end for t, k, _ in sent if k == "send_non_block")
            assert r.timings.first_send_start <= sent[0][0]  # stamped by the trainer just before the call
            assert r.timings.first_send_lead_s > 0
            assert r.timings.send_s > 0 and r.timings.backward_s > 0
            assert r.timings.hidden_comm_s > 0 and 0 <= r.timings.averages_in_backward <= 3


def test_per_block_receives_on_a_background_thread_while_sending():
    """The averages of a step are received by a thread other than the one that sends."""
    cluster = FakeCluster(2, total_samples=32, steps=1)
    import threading

    seen = {"send": set(), "receive": set()}
    for worker in cluster.workers:
        for name, role in (("send_block_gradient", "send"), ("receive_averaged_block", "receive")):
            real = getattr(worker, name)

            def wrapped(*args, _real=real, _role=role, **kwargs):
                seen[_role].add(threading.get_ident())
                return _real(*args, **kwargs)

            setattr(worker, name, wrapped)
    train_all(cluster, lambda w: token_trainer(w, per_block=True))
    assert seen["send"] and seen["receive"] and not (seen["send"] & seen["receive"])


def test_block_with_unused_parameter_goes_after_backward_in_the_same_order():
    def make(worker):
        model = tiny_transformer()
        model.blocks[2].spare = nn.Parameter(torch.zeros(3))  # never used by forward: its hook never fires
        layout = list(model.gradient_layout())
        i = next(k for k, seg in enumerate(layout) if seg.name == "block.2")
        comps = list(layout[i].components)
        comps[6] = type(comps[6])("down", comps[6].params + (model.blocks[2].spare,))
        layout[i] = Segment("block.2", tuple(comps))
        return token_trainer(worker, per_block=True, model=model, layout=layout)

    cluster = FakeCluster(2, total_samples=32, steps=2)
    trainers, results = train_all(cluster, make)
    assert_bit_identical([t.model for t in trainers])
    for wid, worker_results in enumerate(results):
        for r in worker_results:
            sent = sends(cluster, wid, r.step)
            assert [i for _, k, i in sent if k == "send_block"] == [2, 1, 0]
            assert sent[0][0] > r.timings.backward_end  # block 2 could only be flushed, and blocks 1, 0 waited for it
    assert cluster.rounds[0].messages[0]["component_sizes"][6] == 16 * 32 + 3


def test_per_block_empty_shards():
    cluster = FakeCluster(3, total_samples=2, steps=2)
    trainers, results = train_all(cluster, lambda w: token_trainer(w, per_block=True, samples_per_step=2))
    assert_bit_identical([t.model for t in trainers])
    assert [r[0].total for r in results] == [0, 0, 2 * 8]


def test_per_block_layout_must_name_blocks_and_protocol_parts():
    cluster = FakeCluster(1, total_samples=8, steps=1)
    model = tiny_transformer()
    layout = list(model.gradient_layout())
    layout[0] = Segment("tok_embed", layout[0].components)
    with pytest.raises(ValueError, match="tok_embed"):
        token_trainer(cluster.workers[0], per_block=True, model=model, layout=layout)
    with pytest.raises(ValueError, match="gradient_layout"):
        DataParallelTrainer(cluster.workers[0], DigitsMLP(), torch.optim.SGD(DigitsMLP().parameters(), lr=0.1),
                            DIGITS_TRAIN, per_block=True)


@pytest.mark.parametrize("model_name", ["digits", "transformer"])
def test_a_mixed_speed_pair_with_balance_matches_one_process_on_the_whole_batch(model_name):
    """Real sockets, shards by speed: one worker held back 0.5 ms a sample
    trains a smaller shard, and the weighted average keeps the update of one
    process on the whole batch (for the transformer, `total` counts tokens)."""
    import threading
    import time

    from ddpwire import Coordinator, Worker
    from ddpwire.cli.serve import serve

    steps, total = 6, (200 if model_name == "digits" else 32)
    make = (lambda w, **kw: digits_trainer(w, samples_per_step=total, **kw)) if model_name == "digits" \
        else (lambda w, **kw: token_trainer(w, False, samples_per_step=total, **kw))
    coord = Coordinator(("127.0.0.1", 0), 2, timeout=30, join_timeout=30, balance=True)
    trainers, errors = {}, []

    def run(slow):
        def batch_fn(model, x, y):
            time.sleep(slow * len(x))
            return classification_batch(model, x, y)
        try:
            with Worker.connect(coord.local_addr, timeout=30) as w:
                trainer = make(w, batch_fn=batch_fn)
                trainers[w.worker_id] = trainer
                trainer.train()
        except BaseException as exc:  # handed to the test
            errors.append(exc)

    threads = []
    for i, slow in enumerate([0.0, 5e-4 if model_name == "digits" else 3e-3]):
        threads.append(threading.Thread(target=run, args=(slow,), daemon=True))
        threads[-1].start()
        coord.wait_for_workers(count=i + 1)
    reports = serve(coord, steps=steps, total_samples=total)
    for t in threads:
        t.join(60)
    coord.close()
    assert not errors, errors
    assert reports[-1].workers[0].samples > 0.6 * total, [r.workers for r in reports]
    assert_bit_identical([trainers[0].model, trainers[1].model])

    one = make(None)
    for step in range(steps):
        one.model.zero_grad()
        loss, _, _ = classification_batch(one.model, *one.dataset.rows(one.sampler.indices(step, 0, total)))
        loss.backward()
        one.optimizer.step()
    for a, b in zip(weights(one.model), weights(trainers[0].model)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ----- local steps (DiLoCo) -----


def local_trainer(worker, sync_every, outer=None, inner_lr=0.2, momentum=0.0):
    model = DigitsMLP(hidden=32, seed=7)
    opt = torch.optim.SGD(model.parameters(), lr=inner_lr, momentum=momentum)
    outer_opt = outer(model) if outer is not None else None
    return DataParallelTrainer(worker, model, opt, DIGITS_TRAIN, samples_per_step=256, seed=1,
                               sync_every=sync_every, outer_optimizer=outer_opt)


@pytest.mark.parametrize("n", [2, 3])
def test_local_rounds_end_with_identical_parameters_and_outer_state(n):
    cluster = FakeCluster(n, total_samples=256, steps=4)
    trainers, results = train_all(cluster, lambda w: local_trainer(w, 4, momentum=0.9))
    assert_bit_identical([t.model for t in trainers])
    states = [t.outer_optimizer.state_dict()["state"] for t in trainers]
    for other in states[1:]:
        for i in states[0]:
            assert torch.equal(states[0][i]["momentum_buffer"], other[i]["momentum_buffer"])
    assert [len(r) for r in results] == [4] * n
    assert sum(r.total for r in results[0]) > 0
    assert results[0][-1].global_loss < results[0][0].global_loss


def test_one_inner_sgd_step_and_an_outer_sgd_of_lr_1_is_the_synchronous_step():
    plain = FakeCluster(2, total_samples=256, steps=3)
    sync, _ = train_all(plain, lambda w: local_trainer(w, 1, inner_lr=0.2))
    local = FakeCluster(2, total_samples=256, steps=3)
    rounds, _ = train_all(local, lambda w: local_trainer(
        w, 1, outer=lambda m: torch.optim.SGD(m.parameters(), lr=1.0), inner_lr=0.2))
    for a, b in zip(weights(sync[0].model), weights(rounds[0].model)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_local_steps_need_flat_steps():
    with pytest.raises(ValueError, match="flat steps"):
        DataParallelTrainer(None, tiny_transformer(), torch.optim.SGD(tiny_transformer().parameters(), lr=0.1),
                            TOKENS, per_block=True, sync_every=2)
    with pytest.raises(ValueError, match="sync_every"):
        local_trainer(None, 0)


def test_local_rounds_compose_with_shards_by_speed_and_an_elastic_session():
    """Rounds of local steps (sync_every=4) on an elastic, balanced session:
    a worker held back gets a smaller shard of each round; one that leaves
    mid-run has its round redone by the others (their inner steps and inner
    optimizer put back first); one that joins later takes the round's start,
    the outer state and all, and every worker ends with the same weights."""
    import threading
    import time

    from ddpwire import Coordinator, Worker
    from ddpwire.cli.serve import serve

    # rounds enough for the held-back worker to be measured at a size three
    # times (after the leave and the join) before its share moves
    total, rounds = 256, 14  # a round's samples: local_trainer's samples_per_step
    coord = Coordinator(("127.0.0.1", 0), 3, timeout=30, join_timeout=30, balance=True,
                        elastic=True, samples_per_step=total)
    trainers, errors, threads = {}, [], []

    def run(name, slow, leave_at=None):
        def batch_fn(model, x, y):
            time.sleep(slow * len(x))
            return classification_batch(model, x, y)
        try:
            with Worker.connect(coord.local_addr, timeout=30, samples_per_step=total) as w:
                trainer = local_trainer(w, 4, momentum=0.9)
                trainer.batch_fn = batch_fn
                if leave_at is not None:
                    rows = trainer.sampler.indices

                    def indices(step, start, end):
                        if step == leave_at:
                            w.close()  # gone mid-round
                        return rows(step, start, end)
                    trainer.sampler.indices = indices
                trainers[name] = trainer
                trainer.train()
        except BaseException as exc:  # handed to the test
            errors.append(exc)

    for i, (name, slow, leave) in enumerate([("fast", 0.0, None), ("slow", 2e-4, None),
                                             ("leaves", 0.0, 3)]):
        threads.append(threading.Thread(target=run, args=(name, slow, leave), daemon=True))
        threads[-1].start()
        coord.wait_for_workers(count=i + 1)

    def on_step(report):
        if report.step == 4:
            threads.append(threading.Thread(target=run, args=("joins", 0.0), daemon=True))
            threads[-1].start()
            coord.wait_for_workers(count=3, timeout=30)
    reports = serve(coord, steps=rounds, total_samples=total, on_step=on_step)
    for t in threads:
        t.join(60)
    coord.close()
    from ddpwire import DdpwireError
    gone = [e for e in errors if isinstance(e, DdpwireError)]
    assert len(errors) == len(gone) == 1, errors  # the one that left: its own calls fail
    assert [(e.step, e.joined) for e in coord.membership] == [(3, False), (5, True)]
    live = [trainers[name] for name in ("fast", "slow", "joins")]
    assert all(t.next_step == rounds for t in live)
    assert_bit_identical([t.model for t in live])
    for a, b in zip(live[0].outer_optimizer.state_dict()["state"].values(),
                    live[2].outer_optimizer.state_dict()["state"].values()):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])
    # the held-back worker's shares of the rounds shrank once timed
    share = {w.worker_id: w.samples for w in reports[-1].workers}
    fast, slow = (trainers[n].worker.worker_id for n in ("fast", "slow"))
    assert share[slow] < share[fast], share
