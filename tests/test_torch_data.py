"""Demo data and the shard-to-rows map."""
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from ddpwire.torch.data import ShardSampler, digits_split, token_sequences  # noqa: E402


def coordinator_shards(total_samples, n):
    size = total_samples // n
    return [(i * size, total_samples if i == n - 1 else (i + 1) * size) for i in range(n)]


def test_digits_split_is_deterministic_disjoint_and_standardised():
    train, held = digits_split(seed=4)
    again, _ = digits_split(seed=4)
    other, _ = digits_split(seed=5)
    assert len(train) + len(held) == 1797 and len(held) == round(1797 * 0.2)
    assert torch.equal(train.features, again.features) and torch.equal(train.targets, again.targets)
    assert not torch.equal(train.features, other.features)
    assert train.features.dtype == torch.float32 and train.targets.dtype == torch.int64
    mean, std = train.features.mean(0), train.features.std(0, unbiased=False)
    assert torch.allclose(mean, torch.zeros(64), atol=1e-5)
    varying = std > 0
    assert torch.allclose(std[varying], torch.ones(int(varying.sum())), atol=1e-4)
    rows = {tuple(r.tolist()) for r in train.features}
    assert not any(tuple(r.tolist()) in rows for r in held.features if r.abs().sum() > 0)
    with pytest.raises(ValueError, match="held_out_fraction"):
        digits_split(held_out_fraction=1.0)


def test_token_sequences_targets_are_the_next_token():
    data = token_sequences(10, seq_len=6, vocab=9, seed=1)
    assert data.features.shape == data.targets.shape == (10, 6)
    assert torch.equal(data.features[:, 1:], data.targets[:, :-1])
    stride = (data.features[:, 1] - data.features[:, 0]) % 9
    assert torch.equal((data.features[:, -1] + stride) % 9, data.targets[:, -1])


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_shards_of_one_step_partition_an_epoch(n):
    sampler = ShardSampler(dataset_len=23, samples_per_step=23, seed=9)
    for step in range(3):
        parts = [sampler.indices(step, a, b) for a, b in coordinator_shards(23, n)]
        assert sorted(torch.cat(parts).tolist()) == list(range(23))
    assert not torch.equal(sampler.indices(0, 0, 23), sampler.indices(1, 0, 23))


def test_steps_walk_the_stream_across_epochs():
    sampler = ShardSampler(dataset_len=10, samples_per_step=4, seed=0)
    stream = torch.cat([sampler.indices(s, 0, 4) for s in range(5)]).tolist()  # 20 positions: two epochs
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:]) == list(range(10))
    assert stream[:10] != stream[10:]
    # a fresh sampler (another worker) computes the same rows for any shard
    assert ShardSampler(10, 4, seed=0).indices(2, 1, 3).tolist() == stream[9:11]


def test_shard_outside_samples_per_step_is_refused():
    sampler = ShardSampler(dataset_len=10, samples_per_step=4)
    with pytest.raises(ValueError, match="samples_per_step=4"):
        sampler.indices(0, 2, 5)
    with pytest.raises(ValueError, match="samples_per_step must be positive"):
        ShardSampler(10, 0)
    assert sampler.indices(0, 3, 3).numel() == 0


def test_core_package_does_not_import_torch():
    code = "import sys, ddpwire; assert 'torch' not in sys.modules, 'ddpwire imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
