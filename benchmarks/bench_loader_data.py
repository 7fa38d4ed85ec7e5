"""bench_loader's data: the sets each case writes (in a temp dir) and the map-style datasets over their bytes.

Example::

    fixed_dir = write_fixed(root, 100_000)
    x, y, n = memmap_views(fixed_dir)
    dataset = MemmapImages(x, y)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

__all__ = [
    "IMAGE_BYTES",
    "IMAGE_SHAPE",
    "PACK_MEAN_TOKENS",
    "MemmapImages",
    "MemmapTokens",
    "memmap_views",
    "write_fixed",
    "write_packing",
    "write_tar",
    "write_variable",
]

IMAGE_SHAPE = (3, 32, 32)
IMAGE_BYTES = int(np.prod(IMAGE_SHAPE))
PACK_MEAN_TOKENS = 500


def write_fixed(root: Path, n: int, name: str = "fixed", seed: int = 0) -> Path:
    """``n`` random images of :data:`IMAGE_SHAPE` uint8 with an int64 label, as one fastio shard in
    ``root/name``; the folder."""
    import fastio

    rng = np.random.default_rng(seed)
    chunk = 100_000
    with fastio.ShardWriter(
        root / name,
        schema={"x": ("uint8", IMAGE_SHAPE), "y": ("int64", ())},
        max_samples=n,
        max_bytes=1 << 40,
    ) as writer:
        for start in range(0, n, chunk):
            k = min(chunk, n - start)
            writer.write_many(
                {
                    "x": np.frombuffer(rng.bytes(k * IMAGE_BYTES), np.uint8).reshape(k, *IMAGE_SHAPE),
                    "y": np.arange(start, start + k, dtype=np.int64) % 1000,
                }
            )
    return root / name


def write_variable(root: Path, n: int) -> Path:
    """``n`` int32 token sequences of 64-2048 tokens with an int64 id: one fastio shard, ``root/variable``."""
    import fastio

    rng = np.random.default_rng(1)
    lengths = rng.integers(64, 2049, size=n)
    with fastio.ShardWriter(
        root / "variable",
        schema={"tokens": ("int32", None), "y": ("int64", ())},
        max_samples=n,
        max_bytes=1 << 40,
    ) as writer:
        chunk = 20_000
        for start in range(0, n, chunk):
            ls = lengths[start : start + chunk]
            flat = rng.integers(0, 50_000, size=int(ls.sum()), dtype=np.int32)
            writer.write_many(
                {"tokens": np.split(flat, np.cumsum(ls)[:-1]), "y": np.arange(start, start + len(ls))}
            )
    return root / "variable"


def write_tar(root: Path, fixed_dir: Path, n: int, per_shard: int) -> str:
    """The first ``n`` samples of ``fixed_dir`` as WebDataset tars (``x.npy`` + ``cls``) of ``per_shard``
    samples in ``root/tar``; their brace pattern."""
    import webdataset as wds

    from fastio.format.shards.reader import ShardSet

    reader = ShardSet(fixed_dir).readers[0]
    xs, ys = reader.fixed("x"), reader.fixed("y")
    (root / "tar").mkdir()
    with wds.ShardWriter(str(root / "tar" / "shard-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i in range(n):
            sink.write({"__key__": f"s{i:08d}", "x.npy": np.array(xs[i]), "cls": int(ys[i])})
    shards = -(-n // per_shard)
    return str(root / "tar" / f"shard-{{000000..{shards - 1:06d}}}.tar")


def memmap_views(fixed_dir: Path) -> tuple[np.memmap, np.ndarray, int]:
    """The images of a :func:`write_fixed` shard as a memmap, its labels, and its sample count."""
    from fastio.format.shards.reader import ShardSet

    reader = ShardSet(fixed_dir).readers[0]
    start, nbytes, _ = reader.sections["x"]["data"]
    n = reader.num_samples
    x = np.memmap(reader.path, dtype=np.uint8, mode="r", offset=start, shape=(n, *IMAGE_SHAPE))
    return x, np.array(reader.fixed("y")), n


def write_packing(root: Path, n: int) -> Path:
    """``n`` int32 token documents of lognormal lengths (mean ~:data:`PACK_MEAN_TOKENS`), 4 fastio shards in
    ``root/packing``."""
    import fastio

    rng = np.random.default_rng(2)
    sigma = 1.0
    lengths = np.maximum(1, rng.lognormal(np.log(PACK_MEAN_TOKENS) - sigma**2 / 2, sigma, n).astype(np.int64))
    flat = rng.integers(0, 50_000, size=int(lengths.sum()), dtype=np.int32)
    with fastio.ShardWriter(
        root / "packing", schema={"tokens": ("int32", None)}, max_samples=-(-n // 4), max_bytes=1 << 40
    ) as writer:
        writer.write_many({"tokens": np.split(flat, np.cumsum(lengths)[:-1])})
    return root / "packing"


class MemmapImages(torch.utils.data.Dataset):
    """A map-style dataset of ``(image tensor, label)`` over a memmap: what a DataLoader user writes."""

    def __init__(self, x: np.memmap, y: np.ndarray) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.from_numpy(np.array(self.x[i])), int(self.y[i])


class MemmapTokens(torch.utils.data.Dataset):
    """A map-style dataset of token tensors over a variable field's payload and byte offsets."""

    def __init__(self, payload: np.ndarray, offsets: np.ndarray) -> None:
        self.payload, self.offsets = payload, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(np.array(self.payload[self.offsets[i] // 4 : self.offsets[i + 1] // 4]))
