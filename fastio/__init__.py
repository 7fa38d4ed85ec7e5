"""fastio: memory-mapped columnar shards, WebDataset tar shards read in place, and ``StreamLoader``.

Example::

    import numpy as np, fastio
    with fastio.ShardWriter("data/train", max_samples=50_000) as w:
        w.write({"x": np.ones((3, 32, 32), np.uint8), "y": 3, "text": b"..."})
    loader = fastio.StreamLoader("data/train", batch_size=256, shuffle=True, seed=0)
    for batch in loader:   # dict: field -> tensor [B, ...] (fixed shapes) or list (variable ones)
        ...

Built in: :class:`ImageStage` (decode + RandomResizedCrop/flip or centre crop into the batch buffer,
``batches=BatchOptions(stages=[...])``), :class:`Pack` (token documents packed into fixed rows, ``pack=...``),
:func:`worker_info` (inside workers: id, num_workers, seed, epoch), :class:`Stream` (weighted sources mixed
in proportion: ``StreamLoader([Stream(a, 0.7), Stream(b, 0.3)], ...)``). fastio's own loader options come
grouped, one object per concern (:mod:`fastio.options`: :class:`RemoteOptions`, :class:`WorkerOptions`...),
beside DataLoader's flat keyword names.

Where things live: ``loader.py`` (:class:`StreamLoader`) and ``options.py`` (its options); ``registry.py``
(what opens a path, URL or Dataset); ``pipeline/`` (the epoch's order, its batches, DataLoader's samplers,
one pass); ``assembly/`` (how one batch is made: gather, stages, collate, packing); ``workers/`` (threads and
processes that make batches ahead); ``mixing/`` (weighted streams); ``sources/`` (the :class:`Source`
contract); ``format/`` (each shard format: reader, writer, source, remote source); ``remote/`` (downloads
and the node-local cache, no format); ``files/`` (patterns, mapped files, the native gathers).
"""

from fastio._native import backend
from fastio.assembly.collate import collate_samples
from fastio.assembly.image import ImageStage
from fastio.assembly.pack import Pack
from fastio.assembly.stages import BatchStage, StageContext
from fastio.errors import (
    CorruptShardError,
    EmptySourceError,
    FastIOError,
    MissingFieldError,
    MissingIndexError,
    SchemaMismatchError,
    WorkerTimeoutError,
)
from fastio.format.shards.reader import ShardReader, ShardSet
from fastio.format.shards.schema import Field
from fastio.format.shards.writer import ShardWriter
from fastio.format.tar.decode import decode_default
from fastio.format.tar.index import TarShardSet, index_tar
from fastio.loader import StreamLoader
from fastio.mixing import Stream
from fastio.options import (
    BatchOptions,
    MixingOptions,
    OrderOptions,
    ReadOptions,
    RemoteOptions,
    WorkerOptions,
)
from fastio.registry import register_format, register_scheme
from fastio.sources import Source
from fastio.workers import WorkerInfo, worker_info

__all__ = [
    "BatchOptions",
    "BatchStage",
    "CorruptShardError",
    "EmptySourceError",
    "FastIOError",
    "Field",
    "ImageStage",
    "MissingFieldError",
    "MissingIndexError",
    "MixingOptions",
    "OrderOptions",
    "Pack",
    "ReadOptions",
    "RemoteOptions",
    "SchemaMismatchError",
    "ShardReader",
    "ShardSet",
    "ShardWriter",
    "Source",
    "StageContext",
    "Stream",
    "StreamLoader",
    "TarShardSet",
    "WorkerInfo",
    "WorkerOptions",
    "WorkerTimeoutError",
    "backend",
    "collate_samples",
    "decode_default",
    "index_tar",
    "register_format",
    "register_scheme",
    "worker_info",
]
