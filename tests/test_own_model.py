"""docs/own-model.md's worker script, as the page writes it, trains a model
of the user's own with `ddpwire coordinator` and two workers: the same
weights on both, the cores split between them, the model saved."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddpwire.plane.threads import threads_per_worker

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "own-model.md"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None or not PAGE.exists(),
                                reason="needs torch and the source tree's docs/")


def page_script() -> str:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    assert len(blocks) == 1, "docs/own-model.md shows one worker script"
    return blocks[0]


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_the_pages_worker_script_trains_the_same_model_on_two_workers(tmp_path):
    script = tmp_path / "my_worker.py"
    script.write_text(page_script())
    port = free_port()
    coord = subprocess.Popen([sys.executable, "-m", "ddpwire", "coordinator", "--bind",
                              f"127.0.0.1:{port}", "--workers", "2", "--steps", "200",
                              "--samples", "256", "--timeout", "120"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    env_free = {"PYTHONUNBUFFERED": "1"}
    workers = [subprocess.Popen([sys.executable, str(script), f"127.0.0.1:{port}"], cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**_env_without_omp(), **env_free})
               for _ in range(2)]
    try:
        outs = [p.communicate(timeout=300) for p in workers]
        coord.communicate(timeout=60)
    finally:
        for p in [coord] + workers:
            p.kill()
    for p, (out, err) in zip(workers, outs):
        assert p.returncode == 0, err
        assert "step 150: loss" in out
        assert f"saved its model after 200 steps ({threads_per_worker(2)} torch threads)" in out
    assert coord.returncode == 0
    saved = sorted(tmp_path.glob("model-worker*.pt"))
    assert [f.name for f in saved] == ["model-worker0.pt", "model-worker1.pt"]
    import torch
    first, second = (torch.load(f) for f in saved)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)  # bit-identical weights


def _env_without_omp():
    import os
    # OMP_NUM_THREADS set would leave torch's threads to it: the split is the point here
    return {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
