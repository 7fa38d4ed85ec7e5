"""What the remote tar source (:mod:`fastio.format.tar.remote`) keeps per tar in the node cache for good, so
that the next run opens without a request and reads parts of every plain tar: its meta (:class:`TarMeta`,
``<entry>.meta.json``: count, sizes, fields) and a plain tar's index (``<entry>`` +
:data:`KEPT_INDEX_SUFFIX`: the bytes of a ``.fidx`` sidecar, published or made from the tar). They count
against ``cache_limit`` as the source's resident bytes; the cache never evicts a source's own (it protects
them: ``ShardCache(kept=...)``), and evicts other sources' after every unpinned entry, oldest first.

Example::

    meta = meta_of(index, tar_size=40960, remote_size=40960, index_bytes=2048)
    if not holds(path, meta_bytes(meta)):
        write_whole(path, meta_bytes(meta))
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
from pathlib import Path

import numpy as np

from fastio.format.tar.index import TarIndex

__all__ = ["KEPT_INDEX_SUFFIX", "TarMeta", "holds", "meta_bytes", "meta_of", "write_whole"]

KEPT_INDEX_SUFFIX = ".meta.fidx"  # not the evicted sidecar's ".fidx": kept after its tar is evicted


@dataclasses.dataclass
class TarMeta:
    """What the source keeps per tar shard beside its cache entry: enough to open without downloading.

    Example::

        meta = TarMeta(**json.loads(path.read_text()))
    """

    remote_size: int
    tar_size: int
    num_samples: int
    fields: list[str]
    present: list[bool]  # per field: in every sample of the shard
    uniform: list[int]  # per field: the one member size of every sample, or -1
    index_bytes: int = 0  # the index cached beside the tar (and, for a plain tar, kept: the same bytes)


def meta_of(index: TarIndex, tar_size: int, remote_size: int, index_bytes: int) -> TarMeta:
    """The meta of a tar of ``tar_size`` bytes (cached; ``remote_size`` at its URL) indexed as ``index``.

    Example::

        meta = meta_of(load_tar_index(path), path.stat().st_size, remote_size, index_bytes=2048)
    """
    present = (index.sizes >= 0).all(axis=0) if index.num_samples else np.zeros(len(index.fields), bool)
    uniform = [
        int(col[0]) if len(col) and (col == col[0]).all() and col[0] >= 0 else -1 for col in index.sizes.T
    ]
    fields = list(index.fields)
    return TarMeta(remote_size, tar_size, index.num_samples, fields, present.tolist(), uniform, index_bytes)


def meta_bytes(meta: TarMeta) -> bytes:
    """The meta as it is kept (JSON)."""
    return json.dumps(dataclasses.asdict(meta)).encode()


def holds(path: Path, data: bytes) -> bool:
    """True when the file at ``path`` is there with exactly ``data`` in it."""
    with contextlib.suppress(OSError):
        return path.read_bytes() == data
    return False


def write_whole(path: Path, data: bytes) -> None:
    """Write ``path`` under a download's temporary name, then rename: a reader sees all of it or none (the
    name is one :meth:`fastio.remote.cache.ShardCache.clear_stale_parts` removes if this process dies
    meanwhile)."""
    part = path.with_name(f".{path.name}.part-{os.getpid()}-{threading.get_ident()}")
    part.write_bytes(data)
    os.replace(part, path)
