"""The byte layout of a fastio shard file (``shard-NNNNNN.fio``), shared by the writer and the reader.

::

    offset 0   prefix (32 bytes, little-endian): magic b"FASTIOSH", u32 version, u32 header_nbytes,
               u32 header_crc32, u32 reserved (0), u64 file_nbytes
    offset 64  sections, each 64-byte aligned: per fixed field one [N, *shape] array; per variable field
               an int64 [N + 1] byte-offset array then the payload
    then       the header: UTF-8 JSON {"num_samples", "schema", "sections": {field: {"data": [offset,
               nbytes, crc32], "offsets": [...]}}} at file_nbytes - header_nbytes

The prefix is checked on every open (magic, version, file size, header crc32), so a truncated or overwritten
file fails at once; section crc32s are checked lazily (see :mod:`fastio.format.shards.reader`).

Example::

    magic, version, header_nbytes, header_crc, _, file_nbytes = PREFIX.unpack(open(p, "rb").read(PREFIX.size))
"""

from __future__ import annotations

import struct

__all__ = ["ALIGN", "INDEX_NAME", "MAGIC", "PREFIX", "SHARD_SUFFIX", "VERSION", "align", "shard_name"]

MAGIC = b"FASTIOSH"
VERSION = 1
PREFIX = struct.Struct("<8sIIIIQ")
ALIGN = 64
SHARD_SUFFIX = ".fio"
INDEX_NAME = "index.json"


def align(n: int) -> int:
    """``n`` rounded up to the section alignment.

    Example::

        align(65) == 128
    """
    return (n + ALIGN - 1) // ALIGN * ALIGN


def shard_name(prefix: str, number: int) -> str:
    """File name of shard ``number``: ``shard-000000.fio``.

    Example::

        shard_name("shard", 3) == "shard-000003.fio"
    """
    return f"{prefix}-{number:06d}{SHARD_SUFFIX}"
