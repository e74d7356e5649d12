"""An evaluation loop on the "ddpwire" backend gives rank 0 what gloo
gives it, bit for bit, in real processes (tests/eval_script.py): the
predictions and per-sample losses gathered with dist.gather, every rank's
metrics with gather_object, the correct count reduced with dist.reduce
(int64 SUM) and a summary of every rank with all_gather_object; with 2
and 3 ranks, on the default path and with DDPWIRE_SHM=0.
"""
import pytest

torch = pytest.importorskip("torch")

from side_by_side import ROOT, identical as _identical, run_ranks  # noqa: E402

pytestmark = pytest.mark.slow

SCRIPT = ROOT / "tests" / "eval_script.py"


@pytest.mark.parametrize("path", ["default", "no-shm"])
@pytest.mark.parametrize("world", [2, 3])
def test_an_evaluation_loop_gives_rank_0_gloos_results_bit_for_bit(tmp_path, world, path):
    got = run_ranks(SCRIPT, tmp_path, world, {"DDPWIRE_SHM": "0"} if path == "no-shm" else {})
    per_rank = {backend: [r["mine"] for r in ranks] for backend, ranks in got.items()}
    gloo, wire = got["gloo"][0]["at root"], got["ddpwire"][0]["at root"]
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
