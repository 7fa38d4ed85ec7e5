"""Sources of a :class:`fastio.StreamLoader`: each turns global sample indices into one batch.

The contract is :class:`Source` (:mod:`fastio.sources.base`); :mod:`fastio.registry` says which source opens
what the loader was given (this package does not import it: every format's source imports this package). Each
shard format's source lives in its folder under :mod:`fastio.format`:

* :class:`~fastio.format.shards.source.ShardSource` (a fastio shard directory): fixed fields gathered
  natively into the caller's output tensors, variable fields into one reused payload buffer, as views.
* :class:`~fastio.format.tar.source.TarSource` (WebDataset tar shards): uniform ``.npy`` members gathered
  like fixed fields, integer members decoded once at open, everything else decoded per sample.
* :class:`DatasetSource` (:mod:`~fastio.sources.dataset`, any map-style ``Dataset``): ``__getitems__`` when
  present, else ``__getitem__``.

The reused output memory they fill is :mod:`fastio.sources.buffers`.

Example::

    source = fastio.registry.open_source("data/train")
    batch = source.fetch(np.arange(8), BatchBuffers(source.fixed_specs(), 8, pin=False), 2, StageTimes())
"""

from fastio.sources.base import (
    ReadPlan,
    ShardParts,
    Source,
    StageTimes,
    TokenDocuments,
    missing_members,
    shard_read_order,
    torch_dtype,
)
from fastio.sources.buffers import BatchBuffers, BufferPool, storage_refs
from fastio.sources.dataset import DatasetSource

__all__ = [
    "BatchBuffers",
    "BufferPool",
    "DatasetSource",
    "ReadPlan",
    "ShardParts",
    "Source",
    "StageTimes",
    "TokenDocuments",
    "missing_members",
    "shard_read_order",
    "storage_refs",
    "torch_dtype",
]
