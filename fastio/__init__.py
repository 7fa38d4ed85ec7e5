"""fastio: memory-mapped columnar shards, WebDataset tar shards read in place, and ``StreamLoader``.

Example::

    import numpy as np, fastio
    with fastio.ShardWriter("data/train", max_samples=50_000) as w:
        w.write({"x": np.ones((3, 32, 32), np.uint8), "y": 3, "text": b"..."})
    loader = fastio.StreamLoader("data/train", batch_size=256, shuffle=True, seed=0)
    for batch in loader:   # dict: field -> tensor [B, ...] (fixed shapes) or list (variable ones)
        ...
"""

from fastio._native import backend
from fastio.errors import (
    CorruptShardError,
    EmptySourceError,
    FastIOError,
    MissingIndexError,
    SchemaMismatchError,
)
from fastio.format.decode import decode_default
from fastio.format.reader import ShardReader, ShardSet
from fastio.format.schema import Field
from fastio.format.tar import TarShardSet, index_tar
from fastio.format.writer import ShardWriter
from fastio.loader import StreamLoader, collate_samples

__all__ = [
    "CorruptShardError",
    "EmptySourceError",
    "FastIOError",
    "Field",
    "MissingIndexError",
    "SchemaMismatchError",
    "ShardReader",
    "ShardSet",
    "ShardWriter",
    "StreamLoader",
    "TarShardSet",
    "backend",
    "collate_samples",
    "decode_default",
    "index_tar",
]
