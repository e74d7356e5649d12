"""A plain DDP training step as a benchmark process body (bench/cluster's
DDP cases, tests/test_cluster_harness.py).

The model is an MLP of 15.7M float32 parameters (1024-4096-2048-1024-1024-10),
trained with SGD on a batch of 8 per rank: an unmodified DDP script whose
only knob is the backend's name ("gloo" or "ddpwire") and, for "ddpwire-bf16"
and "ddpwire-int8", ddpwire's 16-bit or 8-bit bucket hook; the "fsdp-" kinds train the same model under
FSDP2 (torch's fully_shard on every layer) instead of DDP, the "bf16model-"
kinds the same DDP with the model and its input in bfloat16. It speaks bench/allreduce_procs.py's step
protocol: each "step" is one forward, backward (DDP's bucketed allreduces
overlapping it) and optimizer step.

With DDPWIRE_DDP_TRACE=1 every bucket's hook is wrapped to stamp it
(CLOCK_MONOTONIC ns: handed to the hook, its future done) and the stamps come
back in the rank's summary ("buckets": [step, bucket index, elements, issued,
done] each); the wrapping puts a Python hook on gloo's path too, so traced
runs are for finding where a step's time goes, not for the ratios. On the
rank links each bucket's two phases are stamped too ("phases": [phase,
seq, elements, start, end] each, phase "reduce_scatter" or "allgather"),
by wrapping the runner's methods in this process only.

"ddp-ddpwire-bf16-free" is a bound, not a result: the 16-bit buckets with
the rank links' narrowing, averaging and widening made free (those kernels
replaced by nothing in this process), so each rank's bucket comes back as
whatever its buffers held and the ranks' weights differ. Its step is the
shortest that faster 16-bit kernels could give on the same links.
"""
from __future__ import annotations

import hashlib
import os
from datetime import timedelta
from typing import Any, Dict, Optional

from allreduce_procs import _serve, use_baseline

#: the DDP cases: name -> (torch.distributed backend, ddpwire hook or None,
#: whether ddpwire comes from the older checkout $DDPWIRE_BASELINE names)
DDP_KINDS = {"ddp-gloo": ("gloo", None, False), "ddp-ddpwire": ("ddpwire", None, False),
             "ddp-ddpwire-bf16": ("ddpwire", "bf16", False),
             "ddp-ddpwire-int8": ("ddpwire", "int8", False),
             "ddp-ddpwire-baseline": ("ddpwire", None, True),
             "ddp-ddpwire-bf16-free": ("ddpwire", "bf16-free", False),
             "ddp-ddpwire-bf16-baseline": ("ddpwire", "bf16", True)}
#: the environment of a kind's ranks beyond the backend's defaults: with a
#: token every link is sealed (ddpwire.wire.seal), or kept in the clear by choice;
#: "-baseline" sealed by the checkout $DDPWIRE_BASELINE names
DDP_ENV = {"ddp-ddpwire-sealed": {"DDPWIRE_TOKEN": "ddpwire-bench-token"},
           "ddp-ddpwire-sealed-baseline": {"DDPWIRE_TOKEN": "ddpwire-bench-token"},
           "ddp-ddpwire-clear": {"DDPWIRE_TOKEN": "ddpwire-bench-token",
                                 "DDPWIRE_ENCRYPT": "off"}}
DDP_KINDS.update({kind: ("ddpwire", None, kind.endswith("-baseline")) for kind in DDP_ENV})
#: the same model under FSDP2 (fully_shard on every layer): each step
#: all-gathers the parameters and reduce-scatters the gradients
DDP_KINDS.update({"fsdp-gloo": ("gloo", None, False), "fsdp-ddpwire": ("ddpwire", None, False),
                  "fsdp-ddpwire-baseline": ("ddpwire", None, True)})
#: the same model held in bfloat16 under DDP (its buckets bfloat16 tensors)
DDP_KINDS.update({"bf16model-gloo": ("gloo", None, False),
                  "bf16model-ddpwire": ("ddpwire", None, False),
                  "bf16model-ddpwire-baseline": ("ddpwire", None, True)})
#: what a run measures unless told otherwise: the baseline needs a checkout
DEFAULT_DDP_KINDS = ("ddp-gloo", "ddp-ddpwire", "ddp-ddpwire-bf16")
WIDTHS = (1024, 4096, 2048, 1024, 1024, 10)
BATCH = 8
TRACE_ENV = "DDPWIRE_DDP_TRACE"


def parameter_count() -> int:
    """Weights and biases of the benchmark's MLP."""
    return sum(a * b + b for a, b in zip(WIDTHS, WIDTHS[1:]))


def _model() -> Any:
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    layers = []
    for a, b in zip(WIDTHS, WIDTHS[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _stamped(hook: Any, trace: list) -> Any:
    """``hook`` with each bucket's hand-over and completion stamped into ``trace``."""
    import time

    step, seen = [0], set()

    # unannotated: DDP refuses a hook whose annotations are not its own types
    def stamped(state, bucket):  # type: ignore[no-untyped-def]
        index = bucket.index()
        if index in seen:  # every bucket goes once a step: a new step began
            step[0] += 1
            seen.clear()
        seen.add(index)
        entry = [step[0], index, bucket.buffer().numel(), time.monotonic_ns(), None]
        trace.append(entry)

        def done(fut: Any) -> Any:
            entry[4] = time.monotonic_ns()
            return fut.value()
        return hook(state, bucket).then(done)
    return stamped


def _stamp_phases(phases: list) -> None:
    """Wrap :class:`ddpwire.plane.mesh.Mesh`'s two phases, in this process, to
    stamp each one's start and end into ``phases``."""
    import time

    from ddpwire.plane.mesh import Mesh

    def stamped(name: str, method: Any) -> Any:
        def run(self: Any, step: int, data: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.monotonic_ns()
            result = method(self, step, data, *args, **kwargs)
            phases.append([name, step, len(data), start, time.monotonic_ns()])
            return result
        return run
    Mesh.reduce_scatter = stamped("reduce_scatter", Mesh.reduce_scatter)  # type: ignore[method-assign]
    Mesh.allgather = stamped("allgather", Mesh.allgather)  # type: ignore[method-assign]


def _free_half_kernels() -> None:
    """Make the rank links' 16-bit kernels cost nothing, in this process:
    the bytes still travel, and no element is narrowed, averaged or widened
    on the way (but for widening the rank's own slice after the allgather)."""
    from ddpwire.plane.mesh import Mesh

    exchange = Mesh._exchange

    def bare(self: Any, *args: Any, **kernels: Any) -> Any:
        return exchange(self, *args, **({} if self._half is not None else kernels))
    Mesh._exchange = bare  # type: ignore[method-assign]


def _ddp_rank(conn, kind: str, port: int, rank: int, n: int, host: str,
              baseline: Optional[str] = None) -> None:
    backend, hook, _ = DDP_KINDS[kind]

    def setup() -> Dict[str, Any]:
        use_baseline(baseline)
        os.environ.update(DDP_ENV.get(kind, {}))
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        import ddpwire.torch  # noqa: F401  (registers "ddpwire")

        if hook == "bf16-free":
            _free_half_kernels()
        phases: list = []
        if os.environ.get(TRACE_ENV) == "1" and backend == "ddpwire":
            _stamp_phases(phases)
        # n ranks share this machine's cores: more intra-op threads would contend
        torch.set_num_threads(1)
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank,
                                world_size=n, timeout=timedelta(seconds=120))
        if kind.startswith("fsdp"):
            from torch.distributed.fsdp import fully_shard

            ddp = _model()
            for layer in ddp:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer)
            fully_shard(ddp)
        elif kind.startswith("bf16model"):
            ddp = DDP(_model().to(torch.bfloat16))
        else:
            ddp = DDP(_model())
        chosen = None
        if hook in ("bf16", "bf16-free", "int8"):
            from ddpwire.torch import hooks

            chosen = hooks.int8_wire_hook if hook == "int8" else hooks.bf16_wire_hook
        trace: list = []
        if os.environ.get(TRACE_ENV) == "1":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            chosen = _stamped(chosen or allreduce_hook, trace)
        if chosen is not None:
            ddp.register_comm_hook(None, chosen)
        gen = torch.Generator().manual_seed(100 + rank)
        group = dist.distributed_c10d._get_default_group()
        return {"dist": dist, "torch": torch, "ddp": ddp,
                "opt": torch.optim.SGD(ddp.parameters(), lr=0.01),
                "x": torch.randn(BATCH, WIDTHS[0], generator=gen).to(
                    torch.bfloat16 if kind.startswith("bf16model") else torch.float32),
                "y": torch.randint(0, WIDTHS[-1], (BATCH,), generator=gen),
                "links": bool(getattr(group, "rank_links", False)), "trace": trace,
                "sealed": bool(getattr(group, "links_sealed", False)),
                "phases": phases}

    def step(st: Dict[str, Any]) -> None:
        st["opt"].zero_grad()
        st["torch"].nn.functional.cross_entropy(st["ddp"](st["x"]), st["y"]).backward()
        st["opt"].step()

    def finish(st: Dict[str, Any]) -> Dict[str, Any]:
        digest = hashlib.sha256()
        model = getattr(st["ddp"], "module", st["ddp"])  # FSDP: the model itself
        for p in model.parameters():
            # an FSDP parameter is sharded: its whole tensor is an all-gather
            whole = p.full_tensor() if hasattr(p, "full_tensor") else p
            digest.update(whole.detach().float().numpy().tobytes())  # bfloat16: no numpy type
        st["dist"].destroy_process_group()
        # DDP keeps every rank's parameters identical: the test compares digests
        return {"average_ok": True, "weights_sha256": digest.hexdigest(),
                "rank_links": st["links"], "sealed": st["sealed"], "buckets": st["trace"],
                "phases": st["phases"]}

    _serve(conn, setup, step, finish)
