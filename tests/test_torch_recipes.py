"""The recipes of docs/ddp.md on backend "ddpwire": a Lightning Trainer with
DDPStrategy(process_group_backend="ddpwire"), Lightning Fabric, and
Accelerate with the group initialised first, each in 2 CPU processes."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")
pytest.importorskip("accelerate")

from test_torch_backend import LIMIT, ROOT, free_ports  # noqa: E402

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parent / "recipes_script.py"
RECIPES = ["trainer", "fabric", "accelerate"]


def test_lightning_trainer_fabric_and_accelerate_train_on_ddpwire(tmp_path):
    world = 2
    ports = free_ports(len(RECIPES) + 1)
    procs = []
    for rank in range(world):
        env = dict(os.environ, PYTHONPATH=str(ROOT), RANK=str(rank), LOCAL_RANK=str(rank),
                   NODE_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   DDP_PORTS=",".join(map(str, ports)), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), str(tmp_path / "run"), *RECIPES],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=LIMIT * 2)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0] * world, "\n".join(outputs)
    torch.manual_seed(0)
    start = torch.nn.Linear(8, 16).weight  # the first layer as the scripts build it
    for recipe in RECIPES:
        states = [torch.load(tmp_path / f"run.{recipe}.rank{r}.pt") for r in range(world)]
        params = [k for k in states[0] if "running" not in k and "num_batches" not in k]
        assert len(params) == 6, (recipe, list(states[0]))
        for name in params:  # DDP kept the ranks in step, bit for bit
            assert torch.equal(states[0][name], states[1][name]), (recipe, name)
            assert torch.isfinite(states[0][name]).all()
        assert not torch.equal(states[0]["0.weight"], start.detach()), f"{recipe} did not train"
