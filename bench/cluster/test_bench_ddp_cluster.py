"""A DDP training step over the emulated cluster: backend "ddpwire" against gloo.

Each rank is an unmodified DDP script (bench/ddp_step.py: a 15.7M-parameter
MLP, batch 8, SGD) in a namespace of its own with a hostname of its own and
a tbf-shaped link, so nothing can take two ranks for one host: no shared
memory, every bucket over the links. Kinds: "ddp-gloo" (torch's gloo),
"ddp-ddpwire" (the backend's default, DDP's float32 buckets on the rank
links), "ddp-ddpwire-bf16" (its bf16_wire_hook: bfloat16 on the wire) and,
with DDPWIRE_CLUSTER_DDP_KINDS naming them, "ddp-ddpwire-int8" (its
int8_wire_hook), "ddp-ddpwire-baseline" and
"ddp-ddpwire-bf16-baseline" (the backend of the checkout $DDPWIRE_BASELINE
names), "ddp-ddpwire-sealed" and "ddp-ddpwire-clear" (a token, encryption
on and off), "ddp-ddpwire-sealed-baseline" (sealed, by that checkout) and
"ddp-ddpwire-bf16-free" (a bound: the bf16 step with its 16-bit kernels made free, see
bench/ddp_step.py; its ranks' weights differ), and "fsdp-gloo", "fsdp-ddpwire" and
"fsdp-ddpwire-baseline" (the same model under FSDP2), "bf16model-gloo",
"bf16model-ddpwire" and "bf16model-ddpwire-baseline" (the model in bfloat16), for each N of
DDPWIRE_CLUSTER_WORKERS. Needs root, iproute2 and torch:

    DDPWIRE_CLUSTER_WORKERS=2,4 python -m pytest bench/cluster/test_bench_ddp_cluster.py \\
        --benchmark-json=bench/results/cluster-ddp-1g.json
    python bench/cluster/report_ddp.py bench/results/cluster-ddp-1g.json

A step is from the first rank's start of forward to the last rank's end of
optimizer.step (CLOCK_MONOTONIC stamps); every rank must end with the same
weights (their SHA-256; not the bound), and the ddpwire kinds must have run on the links.
DDPWIRE_CLUSTER_ROUNDS sets the timed steps (default 3, after 2 warm-ups:
DDP builds its buckets during the first).
"""
from __future__ import annotations

import importlib.util
import os
import statistics

import pytest

from ddp_step import DDP_KINDS, DEFAULT_DDP_KINDS, parameter_count

from .conftest import PARAMS
from .nodes import ClusterGroup, procs

WARMUP = 2

# DDPWIRE_CLUSTER_DDP_KINDS picks some of DDP_KINDS ("ddp-ddpwire-baseline"
# runs the backend of the checkout $DDPWIRE_BASELINE names, in the same run)
_KINDS = [k.strip() for k in os.environ.get("DDPWIRE_CLUSTER_DDP_KINDS",
                                            ",".join(DEFAULT_DDP_KINDS)).split(",") if k.strip()]
if any(k not in DDP_KINDS for k in _KINDS):
    raise pytest.UsageError(f"DDPWIRE_CLUSTER_DDP_KINDS must name some of {', '.join(DDP_KINDS)}")
CASES = [pytest.param(kind, n, id=f"N{n}-{kind}") for n in PARAMS.workers for kind in _KINDS]


@pytest.mark.parametrize("kind,n", CASES)
def test_ddp_step(benchmark, cluster_plan, kind, n):
    if importlib.util.find_spec("torch") is None:
        pytest.skip("DDP needs torch")
    benchmark.group = f"DDP N={n}"
    rounds = PARAMS.rounds
    group = ClusterGroup(kind, n, 4 * parameter_count(), WARMUP + rounds, cluster_plan)
    summary = procs.run_rounds(benchmark, group, rounds, WARMUP)
    spans = procs.step_spans(group.step_stamps[WARMUP:])
    ranks = summary["workers"]
    if kind != "ddp-ddpwire-bf16-free":  # a bound: its averages are left undone
        assert len({r["weights_sha256"] for r in ranks}) == 1, "the ranks' weights differ"
    if kind in ("ddp-ddpwire", "ddp-ddpwire-bf16", "ddp-ddpwire-bf16-free", "ddp-ddpwire-sealed",
                "ddp-ddpwire-clear", "ddp-ddpwire-int8", "fsdp-ddpwire", "fsdp-ddpwire-baseline",
                "bf16model-ddpwire", "bf16model-ddpwire-baseline"):
        assert all(r["rank_links"] for r in ranks), "a ddpwire rank did not use the rank links"
    if kind.startswith("ddp-ddpwire"):
        # sealed only where a token is set and encryption left on
        assert all(r.get("sealed", False) == kind.startswith("ddp-ddpwire-sealed")
                   for r in ranks), ranks
    benchmark.extra_info.update(
        kind=kind, workers=n, parameters=parameter_count(), rounds=rounds, warmup=WARMUP,
        step_spans=spans, step_span_median=statistics.median(spans),
        worker_rate_bps=PARAMS.worker_rate, coord_rate_bps=PARAMS.coord_rate,
        step_stamps=group.step_stamps,
        # each rank's CPU seconds per step (all its threads), timed steps only:
        # where every emulated machine shares the same cores, what one kind
        # adds in CPU shows in every kind's step
        step_cpu_s=[r.get("step_cpu_s", [])[WARMUP:] for r in ranks])
    if any(r.get("buckets") for r in ranks):
        benchmark.extra_info["buckets"] = [r["buckets"] for r in ranks]
    if any(r.get("phases") for r in ranks):
        benchmark.extra_info["phases"] = [r["phases"] for r in ranks]
