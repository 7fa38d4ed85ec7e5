"""Parts of remote tar shards (:mod:`fastio.remote.parts` says why and how many): where a part's samples lie
in its tar, from the tar's index (the ``.fidx`` sidecar :func:`fastio.index_tar` writes beside it), and the
index of a cached part.

1. :func:`parse_sidecar`: a sidecar's index, refused (None) when it is not one this fastio reads or
   describes another version of the tar; :class:`fastio.CorruptShardError` when its members do not lie
   inside the tar.
2. :func:`part_range`: samples ``[first, stop)`` of a tar are one byte range, from the first byte of their
   first member's data to the last byte of their last one (a WebDataset tar keeps a sample's members
   together; the headers between them come along).
3. :func:`part_index`: the index of that range once cached: the same members, offsets taken from its start.

Only plain tars whose sidecar is published read parts: a compressed tar cannot be read by range, and a tar
without a sidecar is indexed by downloading it whole (its index is not kept once it is evicted).

Example::

    index = parse_sidecar(url, read_bytes(url + ".fidx", RetryPolicy()), size)
    lo, hi = part_range(index, 0, 64)
"""

from __future__ import annotations

import io

import numpy as np

from fastio.errors import CorruptShardError
from fastio.format.tar.index import TarIndex
from fastio.format.tar.npy import load_npz

__all__ = ["parse_sidecar", "part_index", "part_range"]


def parse_sidecar(url: str, sidecar: bytes, remote_size: int) -> TarIndex | None:
    """The index a ``.fidx`` sidecar holds for the ``remote_size``-byte tar at ``url`` (see the module
    docstring).

    Example::

        index = parse_sidecar("http://host/shard-000.tar", sidecar_bytes, 40960)
    """
    try:
        data = load_npz(io.BytesIO(sidecar))
        identity = data["identity"]
        index = TarIndex(url, data["keys"], [str(f) for f in data["fields"]], data["offsets"], data["sizes"])
    except (OSError, ValueError, KeyError):
        return None  # not a sidecar this fastio reads
    if int(identity[1]) != remote_size:
        return None  # the sidecar describes another version of the tar
    present = index.offsets >= 0
    if index.num_samples and int((index.offsets + index.sizes)[present].max(initial=0)) > remote_size:
        expected = f"members inside the tar's {remote_size} bytes"
        raise CorruptShardError(url, "sidecar", expected, "a member past its end")
    return index


def part_range(index: TarIndex, first: int, stop: int) -> tuple[int, int]:
    """The byte range ``[lo, hi)`` of the tar that holds every member of samples ``[first, stop)``.

    Example::

        lo, hi = part_range(index, 0, 64)
    """
    offsets, sizes = index.offsets[first:stop], index.sizes[first:stop]
    present = offsets >= 0
    if not present.any(axis=1).all():
        raise CorruptShardError(index.path, "index", "at least one member per sample", "a sample without any")
    return int(offsets[present].min()), int((offsets + sizes)[present].max())


def part_index(index: TarIndex, path: str, first: int, stop: int) -> TarIndex:
    """The index of samples ``[first, stop)`` cached at ``path`` as :func:`part_range` gives them.

    Example::

        cached = part_index(index, str(cache.path(key)), 0, 64)
    """
    lo, _ = part_range(index, first, stop)
    offsets = index.offsets[first:stop]
    rebased = np.where(offsets >= 0, offsets - lo, -1).astype(np.int64)
    return TarIndex(path, index.keys[first:stop], list(index.fields), rebased, index.sizes[first:stop].copy())
