"""An evaluation loop on the "ddpwire" backend gives rank 0 what gloo
gives it, bit for bit, in real processes (tests/eval_script.py): the
predictions and per-sample losses gathered with dist.gather, every rank's
metrics with gather_object, the correct count reduced with dist.reduce
(int64 SUM) and a summary of every rank with all_gather_object; with 2
and 3 ranks, on the default path and with DDPWIRE_SHM=0.
"""
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from test_torch_backend import ROOT, finish  # noqa: E402

pytestmark = pytest.mark.slow

SCRIPT = ROOT / "tests" / "eval_script.py"


def _run(tmp, world, extra):
    out = tmp / "run"
    init = f"file://{tmp}/store.gloo,file://{tmp}/store.ddpwire"
    procs = [subprocess.Popen(
        [sys.executable, str(SCRIPT), str(out)],
        env=dict(os.environ, PYTHONPATH=str(ROOT), RANK=str(r), WORLD_SIZE=str(world),
                 OMP_NUM_THREADS="1", DDP_INIT=init, **extra),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    codes, outputs = finish(procs)
    assert codes == [0] * world, "\n".join(outputs)
    return ({backend: torch.load(f"{out}.{backend}.pt", weights_only=False)
             for backend in ("gloo", "ddpwire")},
            {backend: [torch.load(f"{out}.{backend}.rank{r}.pt", weights_only=False)
                       for r in range(world)] for backend in ("gloo", "ddpwire")})


def _identical(ours, theirs, where=()):
    """Equal bit for bit: tensors by torch.equal (dtype and shape too),
    Python floats by their bits."""
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and list(ours) == list(theirs), (where, ours, theirs)
        for key in theirs:
            _identical(ours[key], theirs[key], (*where, key))
    elif isinstance(theirs, (list, tuple)):
        assert type(ours) is type(theirs) and len(ours) == len(theirs), (where, ours, theirs)
        for k, (a, b) in enumerate(zip(ours, theirs)):
            _identical(a, b, (*where, k))
    elif isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and ours.dtype == theirs.dtype, where
        assert ours.shape == theirs.shape and torch.equal(ours, theirs), (where, ours, theirs)
    else:
        assert type(ours) is type(theirs) and repr(ours) == repr(theirs), (where, ours, theirs)


@pytest.mark.parametrize("path", ["default", "no-shm"])
@pytest.mark.parametrize("world", [2, 3])
def test_an_evaluation_loop_gives_rank_0_gloos_results_bit_for_bit(tmp_path, world, path):
    at_root, per_rank = _run(tmp_path, world, {"DDPWIRE_SHM": "0"} if path == "no-shm" else {})
    gloo, wire = at_root["gloo"], at_root["ddpwire"]
    _identical(wire, gloo)
    for rank in range(world):
        _identical(per_rank["ddpwire"][rank]["summaries"], per_rank["gloo"][rank]["summaries"])
        # every rank's all_gather_object is rank 0's
        _identical(per_rank["ddpwire"][rank]["summaries"], wire["summaries"])
        if rank:  # reduce leaves a non-root rank's tensor as it was (gloo: partial sums)
            _identical(per_rank["ddpwire"][rank]["total correct"], per_rank["ddpwire"][rank]["correct"])

    # and the gathered evaluation is the whole dataset's
    indices = torch.cat(wire["indices"])
    assert sorted(set(indices.tolist())) == list(range(len(wire["whole"]["preds"])))
    preds, losses = torch.cat(wire["preds"]), torch.cat(wire["losses"])
    assert torch.equal(preds, wire["whole"]["preds"][indices])
    torch.testing.assert_close(losses, wire["whole"]["losses"][indices])
    assert [m["rank"] for m in wire["metrics"]] == list(range(world))
    assert sum(m["correct"] for m in wire["metrics"]) == int(wire["correct"])
    # the sampler pads by repeating a few samples: they count again
    labels = wire["whole"]["labels"]
    assert int(wire["correct"]) == int((wire["whole"]["preds"] == labels)[indices].sum())
