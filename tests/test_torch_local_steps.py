"""Local steps with an outer optimizer (ddpwire.torch.local_steps.DiLoCo)
in two CPU processes: identical parameters and outer state after every
round, on backend ddpwire and on gloo; one SGD step per round with an outer
SGD(lr=1) is synchronous SGD."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from test_torch_backend import LIMIT, ROOT, free_ports  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "local_steps_script.py"
sys.path.insert(0, str(SCRIPT.parent))
import local_steps_script as script  # noqa: E402


def run_ranks(tmp_path, backend, mode, world=2):
    port, = free_ports(1)
    procs = [subprocess.Popen(
        [sys.executable, str(SCRIPT), str(tmp_path / "run"), backend, mode],
        env=dict(os.environ, PYTHONPATH=str(ROOT), RANK=str(r), WORLD_SIZE=str(world),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=LIMIT)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0] * world, "\n".join(outputs)
    return [torch.load(tmp_path / f"run.{mode}.rank{r}.pt") for r in range(world)]


@pytest.mark.parametrize("backend", ["ddpwire", "gloo"])
def test_every_round_ends_with_identical_parameters_and_outer_state(tmp_path, backend):
    ranks = run_ranks(tmp_path, backend, "rounds")
    assert len(ranks[0]) == script.STEPS // 5
    for a, b in zip(*ranks):
        for x, y in zip(a["params"] + a["momentum"], b["params"] + b["momentum"]):
            assert torch.equal(x, y)
        assert a["momentum"], "the outer Nesterov step keeps momentum"
    first, last = ranks[0][0]["params"], ranks[0][-1]["params"]
    assert any(not torch.equal(x, y) for x, y in zip(first, last)), "it did not train"


def test_one_sgd_step_per_round_with_outer_lr_1_is_synchronous_sgd(tmp_path):
    ranks = run_ranks(tmp_path, "ddpwire", "sgd")
    model = script.net(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=script.LR)
    x, y = script.data()
    for k in range(script.STEPS):
        opt.zero_grad()
        lo = k * script.BATCH
        torch.nn.functional.cross_entropy(model(x[lo:lo + script.BATCH]),
                                          y[lo:lo + script.BATCH]).backward()
        opt.step()
    for got, want in zip(ranks[0][-1]["params"], model.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
