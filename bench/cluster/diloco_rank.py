"""One rank of the local-steps benchmark (bench/cluster/test_bench_diloco.py):
a character-level language model on the Python standard library's own
source, trained either synchronously (plain DDP, every step's gradients
averaged) or with local steps (ddpwire.torch.DiLoCo, H inner steps a round).

The task needs no download: the top-level ``*.py`` files of
``sysconfig.get_paths()["stdlib"]``, sorted by name, read as bytes until
:data:`CORPUS_BYTES`; every :data:`HOLD_OUT_EVERY`-th file is held out
for evaluation (whole files, so the held-out text is code the model never
saw). The model predicts the next byte from the :data:`CONTEXT` before
it: an embedding, two hidden layers, logits over 256 bytes
(:func:`parameter_count` parameters). Inner optimizer AdamW; fixed seeds;
rank r draws its own batches from its own generator, the same in every
configuration, so every configuration is fed the same samples.

Rank 0 keeps a copy of the parameters every ``eval_every`` inner steps
(always right after an average, so it is the model every rank holds) with
its time since the start, and evaluates them all on the held-out text
after training: the evaluation never delays the ranks. Each rank reads its
interface's byte counters (/proc/net/dev, the counters of the namespace it
runs in) before the first step and after the last (after a barrier, so the
last average's bytes have left every socket buffer).

Run by the cluster harness (cluster/node.py, target ``_diloco_rank``), or
by hand on loopback, one process per rank, to try a change::

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29700 \\
        python bench/cluster/diloco_rank.py --mode diloco --sync-every 10 --steps 50 &
    RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29700 \\
        python bench/cluster/diloco_rank.py --mode diloco --sync-every 10 --steps 50
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import traceback
from typing import Any, Dict, List, Optional, Tuple

#: bytes of source read (training and held-out together)
CORPUS_BYTES = 3 << 20
#: every this many-th file (from the 10th) is held out
HOLD_OUT_EVERY = 10
#: held-out positions evaluated (evenly spaced over the held-out text)
EVAL_POSITIONS = 16384
CONTEXT = 16
EMBED = 24
HIDDEN = 384
VOCAB = 256
BATCH = 64
LR = 3e-3
WEIGHT_DECAY = 0.01
SEED = 1234


def parameter_count() -> int:
    """Weights and biases of the model below."""
    return (VOCAB * EMBED + (CONTEXT * EMBED * HIDDEN + HIDDEN)
            + (HIDDEN * HIDDEN + HIDDEN) + (HIDDEN * VOCAB + VOCAB))


def source_files() -> List[str]:
    """The standard library's top-level ``.py`` files, sorted by name."""
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    return [os.path.join(root, name) for name in sorted(os.listdir(root))
            if name.endswith(".py") and os.path.isfile(os.path.join(root, name))]


def corpus(limit: int = CORPUS_BYTES) -> Tuple[bytes, bytes, Dict[str, Any]]:
    """(training text, held-out text, a description: files, sizes, digest)."""
    train, held, names, total = [], [], [], 0
    for i, path in enumerate(source_files()):
        if total >= limit:
            break
        with open(path, "rb") as f:
            data = f.read()[:limit - total]
        total += len(data)
        names.append(os.path.basename(path))
        (held if i % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1 else train).append(data)
    a, b = b"".join(train), b"".join(held)
    digest = hashlib.sha256(a + b"\0" + b).hexdigest()
    return a, b, {"files": len(names), "first": names[0], "last": names[-1],
                  "train_bytes": len(a), "held_out_bytes": len(b), "sha256": digest,
                  "python": sys.version.split()[0]}


def model(torch: Any) -> Any:
    nn = torch.nn
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Embedding(VOCAB, EMBED), nn.Flatten(),
                         nn.Linear(CONTEXT * EMBED, HIDDEN), nn.GELU(),
                         nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
                         nn.Linear(HIDDEN, VOCAB))


def windows(torch: Any, text: Any, starts: Any) -> Tuple[Any, Any]:
    """Inputs (len(starts), CONTEXT) and the byte after each."""
    idx = starts.unsqueeze(1) + torch.arange(CONTEXT)
    return text[idx].long(), text[starts + CONTEXT].long()


def held_out_loss(torch: Any, net: Any, text: Any) -> float:
    """Mean cross-entropy (nats per byte) on the fixed held-out positions."""
    starts = torch.linspace(0, len(text) - CONTEXT - 1, EVAL_POSITIONS).long()
    total = 0.0
    with torch.no_grad():
        for lo in range(0, EVAL_POSITIONS, 4096):
            x, y = windows(torch, text, starts[lo:lo + 4096])
            total += torch.nn.functional.cross_entropy(net(x), y, reduction="sum").item()
    return total / EVAL_POSITIONS


def net_bytes(iface: str) -> Optional[Dict[str, int]]:
    """``iface``'s received and sent bytes in this network namespace, or None."""
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == iface:
                    fields = rest.split()
                    return {"rx": int(fields[0]), "tx": int(fields[8])}
    except OSError:
        pass
    return None


def train(cfg: Dict[str, Any], rank: int, world: int) -> Dict[str, Any]:
    """One rank's run of ``cfg``: mode ("sync" or "diloco"), sync_every,
    steps, eval_every, backend, iface, and for DiLoCo the outer optimizer's
    momentum (outer_momentum, default 0.9, the paper's) and the wire (None:
    float32). Returns its measurements."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpwire.torch  # noqa: F401  (registers "ddpwire")
    from ddpwire.torch import DiLoCo
    from ddpwire.torch.local_steps import nesterov_outer

    # several ranks share this host's cores: more intra-op threads would contend
    torch.set_num_threads(1)
    mode, steps, h = cfg["mode"], cfg["steps"], cfg.get("sync_every", 1)
    every = cfg["eval_every"]
    if mode == "diloco" and (every % h or steps % h):
        raise ValueError(f"eval_every ({every}) and steps ({steps}) must be multiples of "
                         f"sync_every ({h}): the copies are of averaged models")
    tr, held, about = corpus()
    text = torch.frombuffer(bytearray(tr), dtype=torch.uint8)
    dist.init_process_group(cfg.get("backend", "ddpwire"))
    assert dist.get_rank() == rank and dist.get_world_size() == world
    net = model(torch)
    if mode == "sync":
        ddp = DDP(net)
        opt = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        forward, local = ddp, None
    elif mode == "diloco":
        opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        outer = nesterov_outer(net.parameters(), momentum=cfg.get("outer_momentum") or 0.9)
        local = DiLoCo(net, opt, sync_every=h, outer=outer, wire=cfg.get("wire"))
        forward = net
    else:
        raise ValueError(f"mode is 'sync' or 'diloco', got {mode!r}")
    gen = torch.Generator().manual_seed(SEED + 1000 * (rank + 1))
    # every rank ready before the clock starts (a tiny allreduce as the barrier)
    dist.all_reduce(torch.zeros(1))
    before = net_bytes(cfg["iface"])
    t0 = time.monotonic()
    snaps: List[Tuple[int, float, Dict[str, Any]]] = []

    def snapshot(step: int) -> None:
        if rank == 0:
            snaps.append((step, time.monotonic() - t0,
                          {k: v.detach().clone() for k, v in net.state_dict().items()}))

    snapshot(0)
    losses, averages = [], 0
    rounds_s: List[float] = []
    for step in range(1, steps + 1):
        x, y = windows(torch, text, torch.randint(0, len(text) - CONTEXT - 1, (BATCH,),
                                                  generator=gen))
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(forward(x), y)
        loss.backward()
        if local is None:
            opt.step()
            averages += 1
        else:
            began = time.monotonic()
            if local.step():
                averages += 1
                # the inner step and the round's average (the pseudo-gradient's
                # allreduce and the outer step)
                rounds_s.append(time.monotonic() - began)
        losses.append(loss.item())
        if step % every == 0:
            snapshot(step)
    wall = time.monotonic() - t0
    # the last average's bytes may still sit in this rank's socket buffers when
    # its own result is complete: once every rank has passed this barrier,
    # every rank has received them, so they have left every interface
    dist.all_reduce(torch.zeros(1))
    after = net_bytes(cfg["iface"])
    digest = hashlib.sha256()
    for p in net.parameters():
        digest.update(p.detach().numpy().tobytes())
    dist.destroy_process_group()
    out: Dict[str, Any] = {
        "rank": rank, "wall_s": wall, "averages": averages, "round_s": rounds_s,
        "weights_sha256": digest.hexdigest(),
        "train_loss_last_50": sum(losses[-50:]) / len(losses[-50:]),
        "net_rx_bytes": after["rx"] - before["rx"] if before and after else None,
        "net_tx_bytes": after["tx"] - before["tx"] if before and after else None,
    }
    if rank == 0:
        held_t = torch.frombuffer(bytearray(held), dtype=torch.uint8)
        ev = model(torch)
        curve = []
        for step, t, state in snaps:
            ev.load_state_dict(state)
            curve.append({"step": step, "time_s": t,
                          "held_out_loss": held_out_loss(torch, ev, held_t)})
        out.update(curve=curve, held_out_loss=curve[-1]["held_out_loss"], corpus=about,
                   parameters=sum(p.numel() for p in net.parameters()))
    return out


def _diloco_rank(conn: Any, cfg: Dict[str, Any], rank: int, world: int, addr: str,
                 port: int) -> None:
    """The harness's process body: train, send ("result", measurements)."""
    try:
        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world))
        conn.send(("result", train(cfg, rank, world)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("sync", "diloco"), default="diloco")
    p.add_argument("--sync-every", type=int, default=10)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--backend", default="ddpwire")
    p.add_argument("--iface", default="lo")
    a = p.parse_args(argv)
    cfg = {"mode": a.mode, "sync_every": a.sync_every if a.mode == "diloco" else 1,
           "steps": a.steps, "eval_every": a.eval_every, "backend": a.backend, "iface": a.iface}
    print(json.dumps(train(cfg, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
