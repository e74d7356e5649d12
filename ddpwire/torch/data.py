"""Demo datasets, and the map from a coordinator's shard to dataset rows.

Nothing here downloads anything: the digits come with scikit-learn and the
token task is generated from a seed.

How a shard picks rows (every worker computes the same thing, so no row lists
travel over the wire): the training run reads an endless stream made of
per-epoch permutations of the dataset, each drawn from ``(seed, epoch)``. Step
``s`` covers stream positions ``[s*T, (s+1)*T)`` where ``T`` is
``samples_per_step`` and must equal the coordinator's ``total_samples``; the
shard ``[shard_start, shard_end)`` of that step is the rows at positions
``s*T + shard_start .. s*T + shard_end - 1``. With ``T`` equal to the dataset
size, step ``s`` is exactly epoch ``s`` split among the workers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

import numpy as np
import torch

__all__ = ["ArrayDataset", "ShardSampler", "digits_split", "token_sequences"]


@dataclass(frozen=True)
class ArrayDataset:
    """Features and targets as CPU tensors with a shared first dimension."""

    features: torch.Tensor
    targets: torch.Tensor

    def __post_init__(self) -> None:
        if self.features.shape[0] != self.targets.shape[0]:
            raise ValueError(
                f"features have {self.features.shape[0]} rows but targets {self.targets.shape[0]}"
            )

    def __len__(self) -> int:
        return int(self.features.shape[0])

    def rows(self, index: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The features and targets at ``index`` (an int64 tensor)."""
        return self.features[index], self.targets[index]


def digits_split(seed: int = 0, held_out_fraction: float = 0.2) -> Tuple[ArrayDataset, ArrayDataset]:
    """scikit-learn's 8x8 digits as (train, held_out), features standardised.

    The split is a permutation drawn from ``seed``; mean and deviation come
    from the training rows only, and constant pixels (deviation 0) are only
    centred.
    """
    if not 0.0 < held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction must be in (0, 1), got {held_out_fraction}")
    from sklearn.datasets import load_digits  # heavy import, only when asked for

    digits = load_digits()
    x = digits.data.astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    n_held = int(round(len(x) * held_out_fraction))
    held, train = order[:n_held], order[n_held:]
    mean = x[train].mean(axis=0)
    std = x[train].std(axis=0)
    std[std == 0] = 1.0
    x = (x - mean) / std
    return (
        ArrayDataset(torch.from_numpy(x[train].copy()), torch.from_numpy(y[train].copy())),
        ArrayDataset(torch.from_numpy(x[held].copy()), torch.from_numpy(y[held].copy())),
    )


def token_sequences(num_sequences: int, seq_len: int, vocab: int, seed: int = 0) -> ArrayDataset:
    """Next-token prediction on counting sequences ``t, t+k, t+2k, ... (mod vocab)``.

    Each sequence has its own start ``t`` and stride ``k`` in ``1..3``, so the
    model must read the context to infer ``k``. Features are the first
    ``seq_len`` tokens, targets the same shifted by one.
    """
    if vocab < 4 or seq_len < 2 or num_sequences < 1:
        raise ValueError("token_sequences needs vocab >= 4, seq_len >= 2, num_sequences >= 1")
    rng = np.random.default_rng(seed)
    start = rng.integers(0, vocab, size=(num_sequences, 1))
    stride = rng.integers(1, 4, size=(num_sequences, 1))
    tokens = (start + stride * np.arange(seq_len + 1)) % vocab
    tokens = torch.from_numpy(tokens.astype(np.int64))
    return ArrayDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


class ShardSampler:
    """Turn ``(step, shard_start, shard_end)`` into dataset row indices (see the module doc)."""

    def __init__(self, dataset_len: int, samples_per_step: int, seed: int = 0) -> None:
        if dataset_len < 1:
            raise ValueError("dataset is empty")
        if samples_per_step < 1:
            raise ValueError(f"samples_per_step must be positive, got {samples_per_step}")
        self.dataset_len = dataset_len
        self.samples_per_step = samples_per_step
        self.seed = seed
        self._perms: Dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            if len(self._perms) > 4:  # steps move forward; old epochs are not read again
                self._perms.pop(min(self._perms))
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.dataset_len)
            self._perms[epoch] = perm
        return perm

    def indices(self, step: int, shard_start: int, shard_end: int) -> torch.Tensor:
        """Row indices (int64) of this worker's shard of ``step``."""
        if not 0 <= shard_start <= shard_end <= self.samples_per_step:
            raise ValueError(
                f"shard [{shard_start}, {shard_end}) of step {step} does not fit in "
                f"samples_per_step={self.samples_per_step}; it must match the coordinator's total_samples"
            )
        positions = step * self.samples_per_step + np.arange(shard_start, shard_end, dtype=np.int64)
        epochs = positions // self.dataset_len
        out = np.empty(len(positions), dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = self._perm(int(epoch))[positions[mask] % self.dataset_len]
        return torch.from_numpy(out)
