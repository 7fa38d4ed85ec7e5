"""Any map-style ``torch.utils.data.Dataset`` as a batch source: whole batches through ``__getitems__``
where the dataset has it, else one ``__getitem__`` per sample.

Example::

    source = DatasetSource(torchvision_dataset)
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fastio.sources.base import Source, StageTimes
from fastio.sources.buffers import BatchBuffers

if TYPE_CHECKING:
    from fastio.options import OpenOptions

__all__ = ["DatasetSource", "open_dataset"]


class DatasetSource(Source):
    """A map-style ``torch.utils.data.Dataset`` as a batch source: whole batches through ``__getitems__``
    where the dataset has it, else one ``__getitem__`` per sample. Returns the list of samples.

    Example::

        source = DatasetSource(torchvision_dataset)
    """

    per_sample = True

    def __init__(self, dataset: Any) -> None:
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise TypeError(
                f"{type(dataset).__name__} is not a map-style Dataset (needs __len__ and __getitem__)"
            )
        self.dataset = dataset
        self.name = type(dataset).__name__
        self.num_samples = len(dataset)
        self.shard_sizes = [self.num_samples]

    def fixed_specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return {}

    def fetch(self, indices: np.ndarray, buffers: BatchBuffers, threads: int, times: StageTimes) -> list[Any]:
        start = time.perf_counter()
        wanted = indices.tolist()
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = list(getitems(wanted)) if getitems is not None else [self.dataset[i] for i in wanted]
        times.add("read", time.perf_counter() - start)
        return samples


def open_dataset(dataset: Any, options: OpenOptions) -> DatasetSource:
    """The registry's opener of a map-style ``Dataset`` (``TypeError`` for an object that is not one).

    Example::

        source = open_dataset([{"x": 1}, {"x": 2}], OpenOptions())
    """
    return DatasetSource(dataset)
