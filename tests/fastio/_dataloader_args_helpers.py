"""What the DataLoader-argument tests (tests/fastio/test_dataloader_args*.py) read: a map-style dataset
whose samples say which index and which process read them, and a transform that changes nothing.

Example::

    loader = fastio.StreamLoader(Numbers(), batch_size=5, num_workers=2, transform=same)
    assert sorted(i for batch in loader for i in batch[:, 0].tolist()) == list(range(NUM_SAMPLES))
"""

from __future__ import annotations

import os

import torch
from torch.utils.data import Dataset

__all__ = ["NUM_SAMPLES", "Numbers", "same"]

NUM_SAMPLES = 37


class Numbers(Dataset):
    """Sample ``i`` is ``[i, pid of the process that read it]``."""

    def __init__(self, n: int = NUM_SAMPLES) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, os.getpid()])


def same(sample):
    """A transform that returns its sample: it sends a loader down the per-sample (Python) path."""
    return sample
