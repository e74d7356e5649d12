"""Local steps over slow links (issue 21): synchronous DDP against DiLoCo
with H = 10 and H = 50, on backend "ddpwire", over the emulated cluster.

Each rank runs bench/cluster/diloco_rank.py's training (a 400,384-parameter
character-level model of the standard library's source, AdamW, batch 64 per
rank, one torch thread per rank) in a network namespace and with a hostname
of its own, every link shaped with tbf both ways: no shared memory, every
byte over the links. Configurations, for each N of DDPWIRE_CLUSTER_WORKERS:

- "sync": plain DDP (DistributedDataParallel on backend "ddpwire", its
  default float32 buckets), the same AdamW stepping every rank on the
  averaged gradients: every step averaged;
- "H10", "H50": ddpwire.torch.DiLoCo(model, AdamW, sync_every=H), its
  default outer optimizer (Nesterov SGD, lr 0.7, momentum 0.9);
- "H10-m0.5", "H50-m0.5": the same with momentum 0.5, the outer optimizer
  bench/cluster/diloco_sweep.py chose for a run of this length;
- "H50-m0.5-int8": that with the pseudo-gradient in 8 bits
  (DiLoCo(wire="int8")), and "H50-m0.5-bf16" in 16 bits;
- "H10-m0.5-bf16", "H10-m0.5-int8": H = 10 in 16 and 8 bits, ten rounds
  in 100 inner steps, for the cost of an average: each rank times every
  step that averaged (the inner step, the pseudo-gradient's allreduce and
  the outer step), recorded as round_s (rank 0's, each round).

Every configuration runs the same inner steps (DDPWIRE_DILOCO_STEPS,
default 500) on the same per-rank batches. Recorded per case: rank 0's
held-out loss over time (parameters copied every 50 inner steps, right
after an average, evaluated after training), the final held-out loss,
each rank's bytes sent and received on its eth0 (/proc/net/dev of its
namespace) and rank 0's wall-clock time of training. Needs root, iproute2
and torch; skips otherwise. At 100 Mbit/s (about 5 minutes on 2 cores):

    DDPWIRE_CLUSTER_WORKER_RATE=100mbit DDPWIRE_CLUSTER_COORD_RATE=100mbit \\
    DDPWIRE_CLUSTER_WORKERS=2,4 python -m pytest -q bench/cluster/test_bench_diloco.py \\
        --benchmark-json=bench/results/cluster-diloco-100m.json
    python bench/cluster/report_diloco.py bench/results/cluster-diloco-100m.json \\
        --svg bench/results/cluster-diloco-100m.svg

The coordinator's namespace is built (the shared fixture builds it) but not
used: on this backend rank 0 hosts ddpwire's coordinator, on worker 0's
machine.
"""
from __future__ import annotations

import importlib.util
import os
import time

import pytest

from .conftest import PARAMS
from .diloco_rank import BATCH
from ddpwire.plane.codecs import codec_of
from .nodes import NodeProcess

if importlib.util.find_spec("torch") is None:
    pytest.skip("the local-steps benchmark trains a torch model: needs torch",
                allow_module_level=True)

STEPS = int(os.environ.get("DDPWIRE_DILOCO_STEPS") or 500)
EVAL_EVERY = 50
#: (label, mode, sync_every, the outer optimizer's momentum, the pseudo-gradient's wire)
CONFIGS = [("sync", "sync", 1, None, None), ("H10", "diloco", 10, 0.9, None),
           ("H50", "diloco", 50, 0.9, None), ("H10-m0.5", "diloco", 10, 0.5, None),
           ("H50-m0.5", "diloco", 50, 0.5, None), ("H50-m0.5-int8", "diloco", 50, 0.5, "int8"),
           ("H50-m0.5-bf16", "diloco", 50, 0.5, "bf16"),
           ("H10-m0.5-bf16", "diloco", 10, 0.5, "bf16"),
           ("H10-m0.5-int8", "diloco", 10, 0.5, "int8")]
ONLY = [c for c in os.environ.get("DDPWIRE_DILOCO_CONFIGS", "").split(",") if c]
#: rank 0's store; a fresh pair of ports per run (the coordinator takes the next)
BASE_PORT = 29700
#: the slowest case (4 ranks, every step averaged) at 100 Mbit/s is a few
#: minutes; far past that, something is wedged
RUN_TIMEOUT = 1200.0
_runs = 0

if STEPS % EVAL_EVERY:
    raise pytest.UsageError(f"DDPWIRE_DILOCO_STEPS must be a multiple of {EVAL_EVERY}")

CASES = [pytest.param(label, mode, h, m, wire, n, id=f"N{n}-{label}")
         for n in PARAMS.workers for label, mode, h, m, wire in CONFIGS
         if not ONLY or label in ONLY]


def run_ranks(plan, n: int, cfg: dict) -> list:
    """Start rank r on worker r's machine, wait for every rank's measurements."""
    global _runs
    port = BASE_PORT + 2 * _runs
    _runs += 1
    procs = []
    try:
        for r in range(n):
            procs.append(NodeProcess(plan.workers[r].netns, f"diloco-rank-{r}", "_diloco_rank",
                                     (cfg, r, n, plan.workers[0].address, port)))
        results = []
        deadline = time.monotonic() + RUN_TIMEOUT
        for proc in procs:
            while not proc.conn.poll(1.0):
                if not proc.is_alive():
                    raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}) "
                                       f"without a result")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{proc.name}: no result after {RUN_TIMEOUT:g} s")
            kind, value = proc.conn.recv()
            if kind == "error":
                raise RuntimeError(f"{proc.name} failed:\n{value}")
            results.append(value)
        for proc in procs:
            proc.join(60)
        return results
    finally:
        for proc in procs:
            proc.terminate()
            proc.join(10)


@pytest.mark.parametrize("label,mode,h,momentum,wire,n", CASES)
def test_diloco(benchmark, cluster_plan, label, mode, h, momentum, wire, n):
    benchmark.group = f"local steps N={n}"
    cfg = {"mode": mode, "sync_every": h, "steps": STEPS, "eval_every": EVAL_EVERY,
           "backend": "ddpwire", "iface": "eth0", "outer_momentum": momentum, "wire": wire}
    out = []
    benchmark.pedantic(lambda: out.append(run_ranks(cluster_plan, n, cfg)), rounds=1,
                       iterations=1)
    ranks = out[0]
    zero = ranks[0]
    assert len({r["weights_sha256"] for r in ranks}) == 1, "the ranks ended with different weights"
    assert all(r["averages"] == STEPS // h for r in ranks)
    assert all(r["net_tx_bytes"] is not None for r in ranks), "no eth0 counters in a namespace"
    params = zero["parameters"]
    benchmark.extra_info.update(
        label=label, mode=mode, sync_every=h, workers=n, steps=STEPS,
        outer_momentum=momentum, wire=wire,
        batch_per_rank=BATCH, parameters=params,
        held_out_loss=zero["held_out_loss"], curve=zero["curve"], wall_s=zero["wall_s"],
        averages=zero["averages"],
        # the averaged vector: every step's gradients (DDP's float32 buckets)
        # or every round's pseudo-gradient, in the codec's bytes a parameter
        # (int8: one, and a float32 scale per 256)
        vector_bytes=zero["averages"] * params * codec_of(wire).size(1 << 20) / (1 << 20),
        round_s=zero["round_s"],
        tx_bytes=[r["net_tx_bytes"] for r in ranks], rx_bytes=[r["net_rx_bytes"] for r in ranks],
        train_loss_last_50=[r["train_loss_last_50"] for r in ranks],
        corpus=zero["corpus"], worker_rate_bps=PARAMS.worker_rate,
        coord_rate_bps=PARAMS.coord_rate)

