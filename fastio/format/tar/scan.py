"""One pass over a tar archive's headers: every regular member's name, data offset and size
(:func:`scan_tar`), natively (``fastio._C``, C++ ``csrc/io/tar_scan.cpp``) when :mod:`fastio._native` loaded
it, else by :func:`_scan_tar_reference`, its Python twin and the tests' oracle.

Example::

    scan = scan_tar("data/shard-000000.tar")
    assert scan.problem == "" and len(scan.names) == len(scan.offsets)
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from fastio import _native
from fastio.errors import CorruptShardError

__all__ = ["TarScan", "scan_tar"]


@dataclasses.dataclass
class TarScan:
    """What one pass over a tar's headers found: every regular file's raw name, data offset and size, in
    archive order, and ``problem``: empty, or why the archive fails the strict mode (a zero block followed by
    more data, no end-of-archive marker).

    Example::

        scan = scan_tar("data/shard-000000.tar")
        assert scan.problem == "" and len(scan.names) == len(scan.offsets)
    """

    names: list[bytes]
    offsets: np.ndarray
    sizes: np.ndarray
    problem: str


def scan_tar(path: str) -> TarScan:
    """Scan a tar archive's headers (native C++, or :func:`_scan_tar_reference`, its twin in Python).

    Raises :class:`fastio.CorruptShardError` naming the file, the byte and what is wrong for a malformed
    header (checksum, a numeric field that is not octal or is negative, a bad pax record) or a member that
    runs past the end of the file.

    Example::

        scan = scan_tar("data/shard-000000.tar")
    """
    try:
        if _native._C is not None:
            names, offsets, sizes, problem = _native._C.scan_tar(str(path))
            return TarScan(list(names), offsets, sizes, problem)
        return _scan_tar_reference(str(path))
    except (RuntimeError, ValueError) as exc:
        raise CorruptShardError(str(path), "tar header", "a well-formed tar archive", str(exc)) from None


_BLOCK = 512
_MAX_NAME_RECORD = 1 << 20
_MAX_PAX_HEADER = 1 << 24
_INT64_MAX = (1 << 63) - 1


def _tar_number(field: bytes, what: str, pos: int) -> int:
    if field[0] & 0x80:
        if field[0] & 0x40:
            raise ValueError(f"{what} field is a negative base-256 number at byte {pos}")
        value = int.from_bytes(bytes([field[0] & 0x3F]) + field[1:], "big")
        if value > _INT64_MAX:
            raise ValueError(f"{what} field (base-256) overflows int64 at byte {pos}")
        return value
    text = field.lstrip(b" ")
    digits = len(text) - len(text.lstrip(b"01234567"))
    if text[digits:].strip(b"\0 "):
        raise ValueError(f"{what} field holds non-octal bytes {field!r} at byte {pos}")
    return int(text[:digits], 8) if digits else 0


def _tar_checksum_ok(header: bytes, pos: int) -> bool:
    stored = _tar_number(header[148:156], "checksum", pos)
    unsigned = sum(header[:148]) + 8 * 32 + sum(header[156:])
    return stored in (unsigned, unsigned - 256 * sum(b >= 0x80 for b in header[:148] + header[156:]))


def _pax_records(data: bytes, pos: int) -> tuple[bytes, int]:
    path, size, at = b"", -1, 0
    while at < len(data):
        if not data[at:].strip(b"\0"):
            break
        space = data.find(b" ", at)
        digits = data[at:space] if space > at else b""
        length = int(digits) if digits.isdigit() and len(digits) <= 18 else -1
        end = at + length
        if length < len(digits) + 4 or end > len(data) or data[end - 1 : end] != b"\n":
            raise ValueError(f"pax header record at offset {at} has a bad length at byte {pos}")
        key, eq, value = data[space + 1 : at + length - 1].partition(b"=")
        if not eq:
            raise ValueError(f"pax header record at offset {at} has no '=' at byte {pos}")
        if key == b"path":
            path = value
        elif key == b"size":
            if not value.isdigit() or int(value) > _INT64_MAX - 9:
                raise ValueError(f"pax size {value!r} is not a non-negative int64 at byte {pos}")
            size = int(value)
        at += length
    return path, size


def _scan_tar_reference(path: str) -> TarScan:
    """The Python twin of the native ``scan_tar`` (csrc/io/tar_scan.cpp): the same members, the same
    refusals, the same ``problem`` text. Used without the native module, and as the tests' oracle."""
    names, offsets, sizes = [], [], []
    problem = ""
    with open(path, "rb") as fh:
        file_size = os.fstat(fh.fileno()).st_size

        def read(offset: int, n: int) -> bytes:
            data = os.pread(fh.fileno(), n, offset)
            if len(data) != n:
                raise ValueError(f"short read at byte {offset + len(data)}")
            return data

        long_name, pax_size, pos = b"", -1, 0
        while True:
            if pos >= file_size:
                problem = f"no end-of-archive marker: file ends at {file_size} after {len(names)} members"
                break
            if pos + _BLOCK > file_size:
                raise ValueError(f"truncated: a partial header at byte {pos}, the file ends at {file_size}")
            h = read(pos, _BLOCK)
            if not any(h):
                tail = pos + _BLOCK
                while tail < file_size:
                    chunk = read(tail, min(1 << 16, file_size - tail))
                    stripped = chunk.lstrip(b"\0")
                    if stripped:
                        block = (tail + len(chunk) - len(stripped)) // _BLOCK * _BLOCK
                        after = read(block, min(_BLOCK, file_size - block))
                        try:
                            header = len(after) == _BLOCK and _tar_checksum_ok(after, block)
                        except ValueError:
                            header = False
                        found = "a member header" if header else "non-zero data (a damaged header?)"
                        problem = f"zero block at byte {pos} followed by {found} at byte {block}"
                        break
                    tail += len(chunk)
                break
            if not _tar_checksum_ok(h, pos):
                raise ValueError(f"bad tar header checksum at byte {pos}")
            size = _tar_number(h[124:136], "size", pos)
            kind = h[156:157]
            if kind not in (b"x", b"g") and pax_size >= 0:
                size = pax_size
            data_offset = pos + _BLOCK
            if size > file_size - data_offset:
                raise ValueError(f"member at byte {pos} claims {size} bytes but the file ends at {file_size}")
            if kind == b"L":
                if size > _MAX_NAME_RECORD:
                    raise ValueError(f"GNU long name of {size} bytes at byte {pos}")
                long_name = read(data_offset, size).split(b"\0", 1)[0]
            elif kind == b"x":
                if size > _MAX_PAX_HEADER:
                    raise ValueError(f"pax header of {size} bytes at byte {pos}")
                pax_path, pax_size = _pax_records(read(data_offset, size), pos)
                if pax_path:
                    long_name = pax_path
            elif kind in (b"0", b"\0", b"7"):
                name = long_name
                if not name:
                    name = h[:100].split(b"\0", 1)[0]
                    prefix = h[345:500].split(b"\0", 1)[0]
                    if h[257:262] == b"ustar" and prefix:
                        name = prefix + b"/" + name
                names.append(name)
                offsets.append(data_offset)
                sizes.append(size)
                long_name, pax_size = b"", -1
            elif kind != b"g":
                long_name, pax_size = b"", -1
            pos = data_offset + (size + _BLOCK - 1) // _BLOCK * _BLOCK
    return TarScan(names, np.array(offsets, dtype=np.int64), np.array(sizes, dtype=np.int64), problem)
