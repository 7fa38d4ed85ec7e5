"""What the weighted-stream tests (tests/fastio/test_mixing_*.py) build their streams from: an in-memory
source whose ids say which stream and sample each row holds, a loader over several of them, and small shard
sets and tars whose samples say the same.

Example::

    loader = mixed_loader([10, 60], [1, 1], mixing=fastio.MixingOptions(epoch_size=40))
    ids = flat(epoch_ids(loader, 0))  # stream k's samples are k * BASE + local index
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import torch

import fastio
from fastio.sources import Source

__all__ = ["BASE", "Ids", "epoch_ids", "flat", "mixed_loader", "write_shards", "write_tar"]


class Ids(Source):
    """``n`` samples whose field ``"id"`` is ``base + local index``: which stream and sample a row holds."""

    def __init__(self, n: int, base: int, shard: int = 7, dtype: torch.dtype = torch.int64) -> None:
        self.name, self.num_samples, self.base, self.dtype = f"ids{base}", n, base, dtype
        self.shard_sizes = [min(shard, n - k) for k in range(0, n, shard)]

    def fixed_specs(self):
        return {"id": (self.dtype, ())}

    def fetch(self, indices, buffers, threads, times):
        out = buffers.fixed("id", len(indices))
        out.copy_(torch.from_numpy(indices + self.base))
        return {"id": out}


BASE = 10_000  # stream i's ids are i * BASE + local index


def mixed_loader(sizes, weights, **kwargs) -> fastio.StreamLoader:
    """A loader over one :class:`Ids` stream per size, weighted by ``weights`` (batches of 8, shuffled)."""
    streams = [
        fastio.Stream(Ids(n, i * BASE), w) for i, (n, w) in enumerate(zip(sizes, weights, strict=True))
    ]
    kwargs = {"batch_size": 8, "shuffle": True, "seed": 3, **kwargs}
    return fastio.StreamLoader(streams, **kwargs)


def epoch_ids(loader: fastio.StreamLoader, epoch: int) -> list[list[int]]:
    """The ids of each batch of ``epoch``."""
    loader.set_epoch(epoch)
    return [batch["id"].tolist() for batch in loader]


def flat(batches: list[list[int]]) -> list[int]:
    """The ids of ``batches`` in one list, in order."""
    return [i for batch in batches for i in batch]


def write_shards(directory: Path, base: int, n: int, fio) -> str:
    """A shard set of the conftest samples ``base`` to ``base + n - 1`` (``fio`` is the conftest fixture)."""
    with fastio.ShardWriter(directory, schema=fio.SCHEMA, max_samples=fio.SHARD_SAMPLES) as writer:
        for i in range(base, base + n):
            writer.write(fio.make_sample(i))
    return str(directory)


def write_tar(path: Path, base: int, n: int, compress: str = "", extra: str | None = None) -> str:
    """A tar (``compress``: "" or a tarfile suffix such as "gz") of samples ``s{i:05d}`` with a .cls of
    ``i`` and a .txt of ``doc {i}``, and an ``extra`` member of ``b"x"`` when given."""
    with tarfile.open(path, "w" + (f":{compress}" if compress else "")) as tar:
        for i in range(base, base + n):
            members = [("cls", str(i).encode()), ("txt", f"doc {i}".encode())]
            for ext, data in members + ([(extra, b"x")] if extra else []):
                info = tarfile.TarInfo(f"s{i:05d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)
