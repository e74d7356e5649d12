"""The outer optimizer of local steps, swept in one process (issue 21):
the same task, model, batches and inner AdamW as bench/cluster/diloco_rank.py,
N replicas simulated side by side (no network: the loss does not depend on
it), synchronous data parallel against DiLoCo at H inner steps for each
outer learning rate and momentum.

    python bench/cluster/diloco_sweep.py --workers 2 4 --sync-every 50 \\
        --lr 0.3 0.5 0.7 1.0 1.4 --momentum 0.0 0.5 0.9 --wire f32 -o bench/results/diloco-sweep.json

Each replica r draws the batches rank r draws in the cluster run (its own
generator, seeded alike); synchronous data parallel is one model stepping
on the mean of the replicas' batch gradients (what DDP computes); DiLoCo
keeps an inner AdamW per replica, and every H steps applies the mean
pseudo-gradient (the round's start minus each replica's parameters) with
SGD (Nesterov when the momentum is not 0) from the round's start, which
every replica then starts the next round from. Held-out loss as in the
cluster run (16,384 positions of held-out files), after the same inner
steps; ``unseen_loss`` on 16,384 positions of the standard library files
after the corpus (which neither the training nor that held-out set
reads), to check a choice made on the held-out loss. ``--wire`` rounds
each replica's pseudo-gradient as DiLoCo(wire=...) does before the mean:
"bf16" (each rounded to bfloat16, the float32 mean rounded once more, the
backend's 16-bit average), "int8" (quantize_int8 and dequantize_mean).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import diloco_rank as task  # noqa: E402
from ddpwire.torch.local_steps import dequantize_mean, quantize_int8  # noqa: E402


def batches(text: torch.Tensor, workers: int, steps: int) -> List[List[Any]]:
    gens = [torch.Generator().manual_seed(task.SEED + 1000 * (r + 1)) for r in range(workers)]
    out = []
    for _ in range(steps):
        out.append([task.windows(torch, text, torch.randint(
            0, len(text) - task.CONTEXT - 1, (task.BATCH,), generator=g)) for g in gens])
    return out


def sync(data, steps: int, held):
    net = task.model(torch)
    opt = torch.optim.AdamW(net.parameters(), lr=task.LR, weight_decay=task.WEIGHT_DECAY)
    for step in range(steps):
        opt.zero_grad()
        loss = sum(torch.nn.functional.cross_entropy(net(x), y) for x, y in data[step])
        (loss / len(data[step])).backward()
        opt.step()
    return net


def unseen_text(limit: int = 1 << 20) -> bytes:
    """The files after the corpus, up to ``limit`` bytes."""
    skip, out = task.CORPUS_BYTES, []
    for path in task.source_files():
        with open(path, "rb") as f:
            data = f.read()
        if skip > 0:
            skip -= len(data)
            continue
        out.append(data)
        if sum(map(len, out)) >= limit:
            break
    return b"".join(out)[:limit]


def mean_on_wire(deltas: List[torch.Tensor], wire: str) -> torch.Tensor:
    """The replicas' pseudo-gradients averaged as DiLoCo(wire=) averages them."""
    if wire == "int8":
        q = [quantize_int8(d) for d in deltas]
        return dequantize_mean([c for c, _ in q], [s for _, s in q], deltas[0].numel())
    if wire == "bf16":
        total = torch.zeros_like(deltas[0])
        for d in deltas:
            total += d.to(torch.bfloat16).float()
        return (total / len(deltas)).to(torch.bfloat16).float()
    total = torch.zeros_like(deltas[0])
    for d in deltas:
        total += d
    return total / len(deltas)


def diloco(data, steps: int, h: int, lr: float, momentum: float, held, wire="f32"):
    workers = len(data[0])
    nets = [task.model(torch) for _ in range(workers)]
    inner = [torch.optim.AdamW(n.parameters(), lr=task.LR, weight_decay=task.WEIGHT_DECAY)
             for n in nets]
    anchor = [p.detach().clone().requires_grad_(True) for p in nets[0].parameters()]
    outer = torch.optim.SGD(anchor, lr=lr, momentum=momentum, nesterov=momentum > 0)
    for step in range(steps):
        for r, (net, opt) in enumerate(zip(nets, inner)):
            x, y = data[step][r]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
        if (step + 1) % h == 0:
            with torch.no_grad():
                deltas = [torch.cat([(a - p).reshape(-1) for a, p in zip(anchor, n.parameters())])
                          for n in nets]
                mean = mean_on_wire(deltas, wire)
                at = 0
                for a in anchor:
                    a.grad = mean[at:at + a.numel()].view_as(a).clone()
                    at += a.numel()
            outer.step()
            with torch.no_grad():
                for n in nets:
                    for p, a in zip(n.parameters(), anchor):
                        p.copy_(a)
    return nets[0]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sync-every", type=int, nargs="+", default=[50])
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--lr", type=float, nargs="+", default=[0.7])
    p.add_argument("--momentum", type=float, nargs="+", default=[0.9])
    p.add_argument("--wire", nargs="+", default=["f32"], choices=["f32", "bf16", "int8"])
    p.add_argument("-o", "--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(1)
    tr, held_bytes, about = task.corpus()
    text = torch.frombuffer(bytearray(tr), dtype=torch.uint8)
    held = torch.frombuffer(bytearray(held_bytes), dtype=torch.uint8)
    unseen = torch.frombuffer(bytearray(unseen_text()), dtype=torch.uint8)

    def losses(net) -> Dict[str, float]:
        return {"held_out_loss": task.held_out_loss(torch, net, held),
                "unseen_loss": task.held_out_loss(torch, net, unseen)}
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip()
    rows: List[Dict[str, Any]] = []
    for n in a.workers:
        data = batches(text, n, a.steps)
        base = losses(sync(data, a.steps, held))
        rows.append({"workers": n, "mode": "sync", **base})
        print(f"N={n} sync {base}", flush=True)
        for h in a.sync_every:
            for wire in a.wire:
                for lr in a.lr:
                    for m in a.momentum:
                        t0 = time.perf_counter()
                        got = losses(diloco(data, a.steps, h, lr, m, held, wire))
                        ratio = got["held_out_loss"] / base["held_out_loss"]
                        unseen_ratio = got["unseen_loss"] / base["unseen_loss"]
                        rows.append({"workers": n, "mode": "diloco", "sync_every": h,
                                     "wire": wire, "outer_lr": lr, "momentum": m, **got,
                                     "to_sync": ratio, "unseen_to_sync": unseen_ratio})
                        print(f"N={n} H={h} {wire} lr={lr} m={m}: {got['held_out_loss']:.4f} "
                              f"({ratio:.3f} of sync; unseen {unseen_ratio:.3f}; "
                              f"{time.perf_counter() - t0:.1f} s)", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"commit": commit, "steps": a.steps, "corpus": about,
                                           "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
