"""The same cases on gloo, then on ddpwire, in each rank's process: the
scripts' side and the tests' side.

A script runs as ``python SCRIPT OUT [ARGS...]`` with RANK, WORLD_SIZE and
DDP_INIT (gloo's init_method, a comma, ddpwire's: one rendezvous per
backend, as gloo cannot meet twice on one store in one process) in its
environment, and hands :func:`each_backend` a function of (backend, rank,
world) whose result is saved to ``OUT.<backend>.rank<r>.pt``. A test starts
the ranks and loads those results with :func:`run_ranks`.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, NoReturn, Sequence

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("gloo", "ddpwire")
#: every dtype the backend takes (ddpwire/torch/backend.py), each case's
DTYPES_NAMES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8", "int8",
                "bool")
#: torch 2.13's gloo can deadlock when a group of its is freed
#: (tests/ddp_script.py): nothing put here is, and the process ends with
#: os._exit
KEEP: List[Any] = []


def prepare() -> None:
    """The backend registered (import torch may have done it already), and
    a rank's threads dumped on SIGUSR1, which a stuck test sends."""
    import ddpwire.torch

    ddpwire.torch.register()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    faulthandler.enable()


def each_backend(run: Callable[[str, int, int], Any]) -> NoReturn:
    """Run ``run`` on gloo, then on ddpwire, save each result, destroy the
    group it leaves (if any) and end the process."""
    prepare()
    out = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for index, backend in enumerate(BACKENDS):
        dist.init_process_group(backend, init_method=os.environ["DDP_INIT"].split(",")[index],
                                rank=rank, world_size=world, timeout=timedelta(seconds=60))
        torch.save(run(backend, rank, world), f"{out}.{backend}.rank{rank}.pt")
        if dist.is_initialized():
            KEEP.append(dist.group.WORLD)
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def data(dtype: Any, shape: Sequence[int], seed: int, spread: int = 3) -> Any:
    """The same values on both backends: integers within ``spread`` of 0
    (small by default, so that a product stays exact)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 2).to(dtype)
    return torch.randint(-spread, spread + 1, shape, generator=gen).to(dtype)


def start_ranks(script: Path, tmp: Path, world: int, env: Mapping[str, str] = {},
                args: Sequence[str] = ()) -> List[subprocess.Popen]:
    """``world`` ranks of ``script`` writing under ``tmp/run``, with
    ``env`` over this environment (a DDPWIRE_SHM of the caller's dropped,
    so that each test says which path it runs)."""
    init = f"file://{tmp}/store.gloo,file://{tmp}/store.ddpwire"
    base = {k: v for k, v in os.environ.items() if k != "DDPWIRE_SHM"}
    return [subprocess.Popen(
        [sys.executable, str(script), str(tmp / "run"), *args],
        env=dict(base, PYTHONPATH=str(ROOT), RANK=str(r), WORLD_SIZE=str(world),
                 OMP_NUM_THREADS="1", DDP_INIT=init, **env),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]


def run_ranks(script: Path, tmp: Path, world: int,
              env: Mapping[str, str] = {}) -> Dict[str, List[Any]]:
    """{backend: [each rank's result]} of one run of ``script``'s ranks,
    every one of which must exit 0."""
    from test_torch_backend import finish

    codes, outputs = finish(start_ranks(script, tmp, world, env))
    assert codes == [0] * world, "\n".join(outputs)
    return {backend: [torch.load(tmp / f"run.{backend}.rank{r}.pt", weights_only=False)
                      for r in range(world)]
            for backend in BACKENDS}


def identical(ours: Any, theirs: Any, where: Any = ()) -> None:
    """Assert ``ours`` is ``theirs`` bit for bit: dicts key by key, lists
    and tuples item by item, tensors by dtype, shape and bytes (a NaN
    equals itself, -0.0 differs from 0.0), anything else by type and
    repr (a float's every digit)."""
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and list(ours) == list(theirs), (where, ours, theirs)
        for key in theirs:
            identical(ours[key], theirs[key], (where, key))
    elif isinstance(theirs, (list, tuple)):
        assert type(ours) is type(theirs) and len(ours) == len(theirs), (where, ours, theirs)
        for k, (a, b) in enumerate(zip(ours, theirs)):
            identical(a, b, (where, k))
    elif isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor), (where, ours)
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (where, ours, theirs)
        assert torch.equal(_bits(ours), _bits(theirs)), (where, ours, theirs)
    else:
        assert type(ours) is type(theirs) and repr(ours) == repr(theirs), (where, ours, theirs)


def _bits(t: Any) -> Any:
    return t.reshape(-1).contiguous().view(torch.uint8) if t.dtype.is_floating_point else t
