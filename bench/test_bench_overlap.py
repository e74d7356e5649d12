"""Per-block overlap: a training step in flat mode against per-block mode, in one run.

Two worker processes (one torch thread each) train a small transformer
against a Coordinator in the benchmark process over loopback TCP. What is
timed is the coordinator's whole step: shards out, every gradient message
averaged and broadcast. Flat mode sends one gradient after backward; per-block
mode sends each block from inside backward, so part of the communication hides
behind the compute. The workers report their per-step timings back; the
medians of the timed steps go into ``extra_info``.

    OPENBLAS_NUM_THREADS=1 python -m pytest -q bench/test_bench_overlap.py \
        --benchmark-json=bench-overlap.json
    python bench/report_overlap.py bench-overlap.json
"""
import multiprocessing
import statistics
from dataclasses import asdict

import pytest

torch = pytest.importorskip("torch")

from ddpwire import Coordinator, Worker  # noqa: E402
from ddpwire.torch import DataParallelTrainer, TinyTransformer, token_sequences  # noqa: E402

MODEL = dict(vocab=32, dim=128, n_blocks=6, n_heads=4, ffn=512, max_len=32)
SAMPLES_PER_STEP = 16  # 8 sequences of 32 tokens per worker
WORKERS = 2
WARMUP, ROUNDS = 3, 15
TIMEOUT = 60.0
NON_BLOCK_COMPONENTS = (0, 1, 2)


def worker_main(addr, per_block, pipe):
    """One worker process: train until Shutdown, then send back every step's timings."""
    torch.set_num_threads(1)  # two workers on two cores
    try:
        with Worker.connect(addr, timeout=TIMEOUT, connect_timeout=TIMEOUT) as worker:
            model = TinyTransformer(seed=0, **MODEL)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            data = token_sequences(256, seq_len=MODEL["max_len"], vocab=MODEL["vocab"], seed=0)
            trainer = DataParallelTrainer(
                worker, model, opt, data, samples_per_step=SAMPLES_PER_STEP, seed=1, per_block=per_block
            )
            results = trainer.train()
        pipe.send(("ok", [asdict(r.timings) for r in results]))
    except BaseException as exc:  # reported to the benchmark process
        pipe.send(("error", repr(exc)))


def serve_step(coord, step, per_block):
    coord.send_shard_assignments(step)
    if not per_block:
        coord.broadcast_averaged(step, coord.collect_and_reduce(step))
        return
    for block_idx in reversed(range(MODEL["n_blocks"])):
        coord.broadcast_averaged_block(step, coord.collect_and_reduce_block(step, block_idx))
    for component in NON_BLOCK_COMPONENTS:
        coord.broadcast_averaged_non_block(step, coord.collect_and_reduce_non_block(step, component))


def median(timings, key):
    return statistics.median(t[key] for t in timings)


@pytest.mark.parametrize("mode", ["per-block", "flat"])
def test_step(benchmark, mode):
    per_block = mode == "per-block"
    ctx = multiprocessing.get_context("spawn")  # a clean interpreter: no torch thread pools forked
    with Coordinator(("127.0.0.1", 0), expect_workers=WORKERS, timeout=TIMEOUT, join_timeout=TIMEOUT) as coord:
        coord.set_total_samples(SAMPLES_PER_STEP)
        pipes, procs = [], []
        for _ in range(WORKERS):
            ours, theirs = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=worker_main, args=(coord.local_addr, per_block, theirs), daemon=True)
            proc.start()
            pipes.append(ours)
            procs.append(proc)
        try:
            coord.wait_for_workers()
            steps = iter(range(WARMUP + ROUNDS))
            benchmark.group = "per-block overlap: one training step, 2 workers"
            benchmark.pedantic(lambda: serve_step(coord, next(steps), per_block),
                               rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
            coord.shutdown_workers()
            reports = []
            for pipe in pipes:
                assert pipe.poll(TIMEOUT), "a worker sent no report"
                status, payload = pipe.recv()
                assert status == "ok", payload
                reports.append(payload)
        finally:
            for proc in procs:
                proc.join(TIMEOUT)
                if proc.is_alive():
                    proc.kill()
    assert [len(r) for r in reports] == [WARMUP + ROUNDS] * WORKERS
    timed = [t for report in reports for t in report[WARMUP:]]  # both workers, timed steps only
    params = sum(p.numel() for p in TinyTransformer(seed=0, **MODEL).parameters())
    benchmark.extra_info.update(
        mode=mode,
        gradient_mib=params * 4 / 2**20,
        forward_s=median(timed, "forward_s"),
        backward_s=median(timed, "backward_s"),
        send_s=median(timed, "send_s"),
        exposed_comm_s=median(timed, "exposed_comm_s"),
        hidden_comm_s=median(timed, "hidden_comm_s"),
        optimizer_s=median(timed, "optimizer_s"),
    )
    if per_block:
        # every block went out from inside backward, on every timed step
        assert all(t["first_send_lead_s"] is not None and t["first_send_lead_s"] > 0 for t in timed)
        benchmark.extra_info["first_send_lead_s"] = median(timed, "first_send_lead_s")
        benchmark.extra_info["averages_in_backward"] = median(timed, "averages_in_backward")
