"""Local steps with an outer optimizer (ddpwire.torch.local_steps.DiLoCo)
in two CPU processes: identical parameters and outer state after every
round, on backend ddpwire and on gloo; one SGD step per round with an outer
SGD(lr=1) is synchronous SGD."""
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from test_torch_backend import run_script_ranks  # noqa: E402

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parent / "local_steps_script.py"
sys.path.insert(0, str(SCRIPT.parent))
import local_steps_script as script  # noqa: E402


def run_ranks(tmp_path, backend, mode, world=2):
    tmp_path.mkdir(parents=True, exist_ok=True)
    run_script_ranks(SCRIPT, [tmp_path / "run", backend, mode], world)
    return [torch.load(tmp_path / f"run.{mode}.rank{r}.pt") for r in range(world)]


@pytest.mark.parametrize("backend", ["ddpwire", "gloo"])
def test_every_round_ends_with_identical_parameters_and_outer_state(tmp_path, backend):
    ranks = run_ranks(tmp_path, backend, "rounds")
    assert len(ranks[0]) == script.STEPS // 5
    for a, b in zip(*ranks):
        assert len(a["buffers"]) == 3  # BatchNorm: mean, var, count
        for x, y in zip(a["params"] + a["momentum"] + a["buffers"],
                        b["params"] + b["momentum"] + b["buffers"]):
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


def test_a_bf16_pseudo_gradient_is_within_bf16_rounding_of_the_float32_one(tmp_path):
    f32 = run_ranks(tmp_path, "ddpwire", "f32")[0]
    b16 = run_ranks(tmp_path, "ddpwire", "bf16")
    for x, y in zip(b16[0][-1]["params"], b16[1][-1]["params"]):
        assert torch.equal(x, y)  # still the same bits on every rank
    start = f32[0]["anchor"]
    for s, a, b in zip(start, f32[-1]["params"], b16[0][-1]["params"]):
        step = (s - a).abs().max()  # the outer step: lr 0.7 * (1 + 0.9) times the average
        # each rank's pseudo-gradient rounded to bf16 (8 bits of mantissa), then the
        # average: an error within 2**-8 of the largest value, with room for the
        # ranks' values being larger than their average
        assert (a - b).abs().max() <= step * 2.0 ** -7
        assert not torch.equal(a, b), "bf16 should round something"
    with pytest.raises(ValueError, match="wire"):
        from ddpwire.torch.local_steps import DiLoCo
        DiLoCo(torch.nn.Linear(2, 2), None, sync_every=2, wire="int4")


def test_an_int8_pseudo_gradient_is_within_its_block_scales_and_the_same_on_any_backend(
        tmp_path):
    f32 = run_ranks(tmp_path / "f32", "ddpwire", "f32")[0]
    # the ddpwire backend's flat int8 allreduce, and gloo's all_gather of
    # every rank's bytes averaged by each rank: the same bits on every rank
    q8 = run_ranks(tmp_path / "ddpwire", "ddpwire", "int8")
    gloo = run_ranks(tmp_path / "gloo", "gloo", "int8")
    for rank in q8[1:] + gloo:
        for x, y in zip(q8[0][-1]["params"], rank[-1]["params"]):
            assert torch.equal(x, y)
    start = f32[0]["anchor"]
    for s, a, b in zip(start, f32[-1]["params"], q8[0][-1]["params"]):
        step = (s - a).abs().max()  # lr 0.7 * (1 + 0.9) times the average
        # each rank's pseudo-gradient within half a block's scale (its
        # largest magnitude over 127) of itself, and the average again:
        # 2**-8 of the largest value each time, with room for the ranks'
        # values being larger than their average
        assert (a - b).abs().max() <= step * 2.0 ** -6
        assert not torch.equal(a, b), "8 bits should round something"
