"""Parts of remote tar shards (:mod:`fastio.remote.parts` says why and how many): where a part's samples lie
in its tar, from the tar's index (the ``.fidx`` sidecar :func:`fastio.index_tar` writes, published beside the
tar, or made from the tar and kept in the cache), the index of a cached part, and the check of its bytes.

1. :func:`parse_sidecar`: a sidecar's index, refused (None) when it is not one this fastio reads (a cut or
   damaged file too: the archive's crc32s) or describes another version of the tar;
   :class:`fastio.CorruptShardError` when its members do not lie inside the tar.
2. :func:`part_range`: samples ``[first, stop)`` of a tar are one byte range, from the header of their first
   member to the last byte of their last member's data (a WebDataset tar keeps a sample's members together;
   the headers between them come along).
3. :func:`part_index`: the index of that range once cached: the same members, offsets taken from its start.
4. :func:`check_part`: every member's header in the cached range (the 512 bytes before its data) is a tar
   header, checksum and size as the index says: an index of another tar of the same size is refused, never
   read at its offsets.

Compressed tars cannot be read by range: they have no parts.

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

__all__ = ["check_part", "parse_sidecar", "part_index", "part_range"]

_BLOCK = 512


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
    if int(index.offsets[present].min(initial=_BLOCK)) < _BLOCK:
        raise CorruptShardError(url, "sidecar", "members after their header", "a member at byte < 512")
    return index


def part_range(index: TarIndex, first: int, stop: int) -> tuple[int, int]:
    """The byte range ``[lo, hi)`` of the tar that holds every member of samples ``[first, stop)``, from
    their first member's header.

    Example::

        lo, hi = part_range(index, 0, 64)
    """
    offsets, sizes = index.offsets[first:stop], index.sizes[first:stop]
    present = offsets >= 0
    if not present.any(axis=1).all():
        raise CorruptShardError(index.path, "index", "at least one member per sample", "a sample without any")
    return int(offsets[present].min()) - _BLOCK, int((offsets + sizes)[present].max())


def part_index(index: TarIndex, path: str, first: int, stop: int) -> TarIndex:
    """The index of samples ``[first, stop)`` cached at ``path`` as :func:`part_range` gives them.

    Example::

        cached = part_index(index, str(cache.path(key)), 0, 64)
    """
    lo, _ = part_range(index, first, stop)
    offsets = index.offsets[first:stop]
    rebased = np.where(offsets >= 0, offsets - lo, -1).astype(np.int64)
    return TarIndex(path, index.keys[first:stop], list(index.fields), rebased, index.sizes[first:stop].copy())


def _header_size(header: bytes) -> int | None:
    """The member size a 512-byte tar header records; None when it is no header (its checksum is wrong)."""
    if len(header) != _BLOCK:
        return None
    unsigned = sum(header[:148]) + 8 * 32 + sum(header[156:])
    field = header[124:136]
    try:
        if int(header[148:156].split(b"\0", 1)[0].strip(), 8) != unsigned:
            return None
        if field[0] & 0x80:  # base-256, for members past 8 GiB
            return int.from_bytes(field[1:], "big")
        return int(field.split(b"\0", 1)[0].strip() or b"0", 8)
    except ValueError:  # not octal digits: no header
        return None


def check_part(index: TarIndex, first: int, stop: int, path: str) -> None:
    """Raise :class:`fastio.CorruptShardError` unless the range of samples ``[first, stop)`` cached at
    ``path`` has each member's tar header where ``index`` puts it, with the size it records.

    Example::

        check_part(index, 0, 64, str(job.part))
    """
    lo, _ = part_range(index, first, stop)
    offsets, sizes = index.offsets[first:stop], index.sizes[first:stop]
    with open(path, "rb") as fh:
        for i, j in zip(*np.nonzero(offsets >= 0), strict=True):
            fh.seek(int(offsets[i, j]) - _BLOCK - lo)
            size = _header_size(fh.read(_BLOCK))
            if size != int(sizes[i, j]):
                member = f"{index.keys[first + i]}.{index.fields[j]}"
                at = int(offsets[i, j]) - _BLOCK
                expected = f"the header of {member} ({int(sizes[i, j])} bytes) at byte {at}"
                found = "no tar header" if size is None else f"a header of a {size}-byte member"
                raise CorruptShardError(index.path, "tar index", expected, found)
