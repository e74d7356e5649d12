"""Ranks of a torch.distributed job driven step by step from the benchmark
process, and the parent's handle on them (:class:`Ranks`).

    python bench/ddp_procs.py BACKEND [train | allreduce SIZE]
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)

"train" (the default): each rank builds the same ~25M-parameter model,
wraps it in DDP on BACKEND and, for every "step" line on stdin, runs one
training step (forward, backward with DDP's bucketed allreduce, optimizer
step). "allreduce SIZE": every "step" is one ``dist.all_reduce`` (SUM) of
SIZE MiB of float32, or SIZE bytes with a "B" after it ("4B": a scalar).
Each step is answered "done"; "quit" ends it. The parent times each step
from its command to the last rank's answer.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ddpwire.torch  # noqa: E402,F401  (registers "ddpwire")

WIDTH = 2048
DEPTH = 6  # 6 x (2048 x 2048 + 2048) = 25.2M parameters
BATCH = 16


def model() -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers)


def training_step() -> "tuple[int, object]":
    """The DDP job: (parameters, one training step)."""
    rank = dist.get_rank()
    ddp = DDP(model())
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(BATCH, WIDTH, generator=gen)

    def step() -> None:
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
    return sum(p.numel() for p in ddp.parameters()), step


def allreduce_step(size: str) -> "tuple[int, object]":
    """One all_reduce of ``size`` (MiB, or bytes ending in "B") of float32
    per step: (elements, step)."""
    elements = int(size[:-1]) // 4 if size.endswith("B") else int(size) << 18
    t = torch.randn(elements, generator=torch.Generator().manual_seed(dist.get_rank()))
    return t.numel(), lambda: dist.all_reduce(t)


def main() -> None:
    torch.set_num_threads(1)  # ranks share the cores: one thread each, both backends alike
    dist.init_process_group(sys.argv[1])
    job = sys.argv[2] if len(sys.argv) > 2 else "train"
    size, step = allreduce_step(sys.argv[3]) if job == "allreduce" else training_step()
    print("ready", size, flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        step()
        print("done", flush=True)
    dist.destroy_process_group()
    # Freeing a gloo group can deadlock in torch 2.13 (its destructor holds
    # the GIL while joining a gloo thread that needs it; tests/ddp_script.py
    # says more): leave without freeing anything.
    sys.stdout.flush()
    os._exit(0)


BACKENDS = ("gloo", "ddpwire")
#: another built checkout of ddpwire: its ranks are the case "ddpwire-baseline"
BASELINE_ENV = "DDPWIRE_BASELINE"
#: cases that are ddpwire with settings of their own (named in
#: DDPWIRE_BENCH_BACKENDS): "ddpwire-service" keeps every allreduce on the
#: service, as the group does without shared memory or links
VARIANTS = {"ddpwire-service": {"DDPWIRE_SHM_MIN_BYTES": str(1 << 60),
                                "DDPWIRE_LINKS_MIN_BYTES": str(1 << 60)}}


def cases() -> List[Tuple[str, int]]:
    """(backend, world) for each case of a rank benchmark, gloo first per
    world; DDPWIRE_BENCH_RANKS ("2,3,4") picks the worlds and
    DDPWIRE_BENCH_BACKENDS (default "gloo,ddpwire") the cases, among them
    the :data:`VARIANTS`. With $DDPWIRE_BASELINE, "ddpwire-baseline" runs
    that checkout's ranks (its own copy of this script) beside this one's,
    in the same run."""
    worlds = [int(x) for x in os.environ.get("DDPWIRE_BENCH_RANKS", "2,3,4").split(",")
              if x.strip()]
    backends = tuple(x.strip() for x in os.environ.get(
        "DDPWIRE_BENCH_BACKENDS", ",".join(BACKENDS)).split(",") if x.strip())
    for name in backends:
        if name not in BACKENDS and name not in VARIANTS:
            raise ValueError(f"DDPWIRE_BENCH_BACKENDS: unknown case {name!r}")
    backends += ("ddpwire-baseline",) if os.environ.get(BASELINE_ENV) else ()
    return [(backend, n) for n in worlds for backend in backends]


def case_ids() -> List[str]:
    return [f"N{n}-{backend}" for backend, n in cases()]


class Ranks:
    """N rank processes of this script on one backend (the parent's side)."""

    def __init__(self, backend: str, world: int, job: List[str] = ()) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        here = Path(__file__).resolve()
        variant = VARIANTS.get(backend, {})
        if variant:
            backend = "ddpwire"
        if backend == "ddpwire-baseline":
            # the older checkout's script puts its own tree first on sys.path
            here = Path(os.environ[BASELINE_ENV]).resolve() / "bench" / here.name
            backend = "ddpwire"
        root = str(here.parent.parent)
        self.procs = []
        for rank in range(world):
            env = dict(os.environ, **variant, RANK=str(rank), WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                       PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
            self.procs.append(subprocess.Popen([sys.executable, str(here), backend, *job],
                                               env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                               text=True, bufsize=1))
        self.size = [self._answer(p, "ready") for p in self.procs][0]

    @staticmethod
    def _answer(p: subprocess.Popen, word: str) -> str:
        line = p.stdout.readline()
        if not line.startswith(word):
            raise RuntimeError(f"rank answered {line!r}, expected {word!r} (exit {p.poll()})")
        return line.split()[1] if len(line.split()) > 1 else ""

    def step(self) -> None:
        for p in self.procs:
            p.stdin.write("step\n")
        for p in self.procs:
            self._answer(p, "done")

    def close(self) -> None:
        for p in self.procs:
            try:
                p.stdin.write("quit\n")
                p.stdin.close()
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()
