"""The native kernels of fastio (``fastio._C``) and their torch-op fallbacks, chosen once at import.

``FASTIO_NO_NATIVE=1`` skips the native module at import (as it skips it at build time); otherwise a module
that fails to load (``ImportError``/``OSError`` only) leaves the torch fallback in place, and
:func:`backend` says which is live and why.

Example::

    import fastio
    print(fastio.backend())   # "native: fastio._C (...)" or "torch: <why>"
"""

from __future__ import annotations

import dataclasses
import mmap
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "MappedFile",
    "MappedTable",
    "TarScan",
    "backend",
    "default_threads",
    "gather_ranges",
    "gather_rows",
    "native",
    "read_chunks",
    "read_ranges",
    "scan_tar",
]

_C = None
if os.environ.get("FASTIO_NO_NATIVE", "0") == "1":
    _REASON = "torch: FASTIO_NO_NATIVE=1 is set"
else:
    try:
        from fastio import _C  # type: ignore[no-redef]

        _REASON = "native: fastio._C (threaded C++ gather, C++ tar scan)"
    except (ImportError, OSError) as exc:
        _REASON = (
            f"torch: fastio._C failed to load ({type(exc).__name__}: {exc}); rebuild with "
            "`python setup.py build_ext --inplace` (without FASTIO_NO_NATIVE=1)"
        )


def backend() -> str:
    """Which gather kernels are live (``"native: ..."`` or ``"torch: ..."``) and why.

    Example::

        assert fastio.backend().split(":")[0] in ("native", "torch")
    """
    return _REASON


def native() -> bool:
    """True when ``fastio._C`` is loaded and used.

    Example::

        threads = 4 if fastio.native() else 1
    """
    return _C is not None


def default_threads() -> int:
    """Threads one gather may use: the CPUs this process may run on, capped at 8 (memcpy saturates early).

    Example::

        n = default_threads()
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


class MappedFile:
    """A whole file mapped read-only into memory, as a numpy uint8 array and a torch uint8 tensor.

    The mapping is private copy-on-write (``ACCESS_COPY``) so numpy and torch accept it as writable without a
    warning; fastio never writes to it, so no page is ever copied. A file that shrinks while mapped would
    fault (SIGBUS) on its lost pages: :meth:`check_size` says so first, with a
    :class:`fastio.CorruptShardError`.

    Example::

        f = MappedFile("data/train/shard-000000.fio")
        magic = bytes(f.array[:8])
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        with open(self.path, "rb") as fh:
            self.size = os.fstat(fh.fileno()).st_size  # what is mapped, even if the file changes meanwhile
            self._mmap = mmap.mmap(fh.fileno(), self.size, access=mmap.ACCESS_COPY) if self.size else None
        if self._mmap is None:
            self.array = np.zeros(0, dtype=np.uint8)
        else:
            self.array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.tensor = torch.from_numpy(self.array)
        self.address = int(self.array.ctypes.data) if self.size else 0

    def current_size(self) -> int:
        """The size of the mapped file now (an fstat of the mapping's own descriptor, so a file renamed over
        this path does not count).

        Example::

            assert f.current_size() == f.size
        """
        return self._mmap.size() if self._mmap is not None else os.path.getsize(self.path)

    def check_size(self) -> None:
        """Raise :class:`fastio.CorruptShardError` when the file is no longer the size it was mapped at.

        Example::

            f.check_size()   # before reading from a file something else may truncate
        """
        actual = self.current_size()
        if actual != self.size:
            raise _truncated_error(self, actual)

    def __repr__(self) -> str:
        return f"MappedFile({Path(self.path).name!r}, {self.size} bytes)"


def _truncated_error(file: MappedFile, actual: int, detail: str = "") -> Exception:
    from fastio.errors import CorruptShardError

    return CorruptShardError(
        file.path,
        "file size",
        f"{file.size} bytes (as mapped)",
        f"{actual} bytes",
        "truncated while mapped" + (f"; {detail}" if detail else ""),
    )


class MappedTable:
    """The files one batch may read from, with their base addresses and lengths laid out for the kernels.

    Example::

        table = MappedTable([MappedFile(p) for p in paths])
    """

    def __init__(self, files: Sequence[MappedFile]) -> None:
        self.files = list(files)
        self.bases = np.array([f.address for f in self.files], dtype=np.int64)
        self.limits = np.array([f.size for f in self.files], dtype=np.int64)

    def check_sizes(self, shard_ids: np.ndarray) -> None:
        """:meth:`MappedFile.check_size` of every file ``shard_ids`` names (one fstat per distinct file).

        Example::

            table.check_sizes(np.array([0, 0, 2], np.int32))
        """
        if len(shard_ids) == 0:
            return
        try:
            touched = np.flatnonzero(np.bincount(shard_ids, minlength=len(self.files))[: len(self.files)])
        except ValueError:  # a negative shard id: the gather itself refuses it, naming the sample
            return
        for shard in touched.tolist():
            self.files[shard].check_size()

    def raise_fault(self, shard_ids: np.ndarray, offsets: np.ndarray, sample: int) -> None:
        """The error for a native copy that took SIGBUS at ``sample`` (its file shrank under the mapping)."""
        file = self.files[int(shard_ids[sample])]
        actual = file.current_size()
        if actual == file.size:  # the source is whole: the fault was in the output's memory
            raise RuntimeError(
                f"fastio gather: SIGBUS copying sample {sample} from {file.path}, which is still {actual} "
                "bytes: the output buffer's memory faulted (a mapped output that shrank, a full /dev/shm)"
            )
        raise _truncated_error(file, actual, f"SIGBUS reading sample {sample} at byte {int(offsets[sample])}")


def _flat_bytes(out: torch.Tensor) -> torch.Tensor:
    if not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError("fastio gather: output must be a contiguous CPU tensor")
    return out.view(-1).view(torch.uint8)


def gather_rows(
    table: MappedTable,
    shard_ids: np.ndarray,
    offsets: np.ndarray,
    row_nbytes: int,
    out: torch.Tensor,
    num_threads: int = 1,
) -> None:
    """Copy ``row_nbytes`` bytes from ``(shard_ids[i], offsets[i])`` to row ``i`` of ``out``.

    Raises :class:`fastio.CorruptShardError` for a file that shrank since it was mapped: the native copy
    turns the SIGBUS of a read past the new end into that error; the torch fallback checks every touched
    file's size before it copies.

    Args:
        table: the mapped files ``shard_ids`` refer to.
        shard_ids: int32 ``[B]``, an index into ``table.files`` per sample.
        offsets: int64 ``[B]``, the byte offset of each row in its file.
        row_nbytes: bytes per row.
        out: a contiguous CPU tensor of at least ``B * row_nbytes`` bytes; row ``i`` lands at byte
            ``i * row_nbytes``.
        num_threads: threads of the native copy (the torch fallback uses torch's own).

    Example::

        out = torch.empty(2, 64, dtype=torch.uint8)
        gather_rows(table, np.zeros(2, np.int32), np.array([0, 64]), 64, out)
    """
    shard_ids = np.ascontiguousarray(shard_ids, dtype=np.int32)
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    flat = _flat_bytes(out)
    if _C is not None:
        # No size check first: the copy is guarded, and a SIGBUS in it becomes the same named error.
        fault = _C.gather_rows(
            table.bases, table.limits, shard_ids, offsets, int(row_nbytes), flat.numpy(), int(num_threads)
        )
        if fault >= 0:
            table.raise_fault(shard_ids, offsets, fault)
        return
    table.check_sizes(shard_ids)  # the torch copies below have no SIGBUS guard: refuse a shrunk file first
    batch = len(offsets)
    rows = flat[: batch * row_nbytes].view(batch, row_nbytes)
    for shard in np.unique(shard_ids):
        src = table.files[int(shard)].tensor
        if len(src) < row_nbytes:
            raise IndexError(f"fastio gather: {table.files[int(shard)].path} is shorter than one row")
        # Every byte position as the start of a row: index_select then bounds-checks each offset.
        windows = src.as_strided((len(src) - row_nbytes + 1, row_nbytes), (1, 1))
        mask = shard_ids == shard
        picked = torch.from_numpy(offsets[mask])
        if mask.all():
            torch.index_select(windows, 0, picked, out=rows)
        else:
            rows[torch.from_numpy(np.flatnonzero(mask))] = torch.index_select(windows, 0, picked)


def gather_ranges(
    table: MappedTable,
    shard_ids: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    out: torch.Tensor,
    num_threads: int = 1,
    dst: np.ndarray | None = None,
) -> np.ndarray:
    """Copy variable-length ranges into ``out``: back to back, or to the byte offsets ``dst`` when given
    (ranges must not overlap there); returns the int64 start of each in ``out``. A file that shrank since it
    was mapped raises :class:`fastio.CorruptShardError`, as in :func:`gather_rows`.

    Example::

        out = torch.empty(int(lengths.sum()), dtype=torch.uint8)
        starts = gather_ranges(table, ids, offsets, lengths, out)
    """
    shard_ids = np.ascontiguousarray(shard_ids, dtype=np.int32)
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    if dst is None:
        dst = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1], out=dst[1:])
    else:
        dst = np.ascontiguousarray(dst, dtype=np.int64)
        if dst.shape != lengths.shape:
            raise ValueError(f"fastio gather_ranges: dst has shape {dst.shape}, lengths {lengths.shape}")
    flat = _flat_bytes(out)
    if _C is not None:
        fault = _C.gather_ranges(
            table.bases, table.limits, shard_ids, offsets, lengths, dst, flat.numpy(), int(num_threads)
        )
        if fault >= 0:
            table.raise_fault(shard_ids, offsets, fault)
        return dst
    table.check_sizes(shard_ids)
    if len(lengths) and int((dst + lengths).max()) > len(flat) or (dst < 0).any():
        raise ValueError(
            f"fastio gather_ranges: output holds {len(flat)} bytes, batch writes up to "
            f"{int((dst + lengths).max())}"
        )
    for i, (shard, start, length, to) in enumerate(zip(shard_ids, offsets, lengths, dst, strict=True)):
        src = table.files[int(shard)]
        if start < 0 or start + length > src.size:
            raise IndexError(f"fastio gather: sample {i} reads past the end of {src.path} ({src.size} bytes)")
        flat[to : to + length] = src.tensor[start : start + length]
    return dst


def read_ranges(
    table: MappedTable, shard_ids: np.ndarray, offsets: np.ndarray, lengths: np.ndarray
) -> list[bytes]:
    """The bytes of each range, as :class:`bytes` objects, read through :func:`gather_ranges` (so a file
    truncated while mapped raises :class:`fastio.CorruptShardError` rather than killing the process).

    Example::

        texts = read_ranges(table, ids, offsets, lengths)
    """
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    payload = np.empty(int(lengths.sum()), dtype=np.uint8)
    starts = gather_ranges(table, shard_ids, offsets, lengths, torch.from_numpy(payload))
    raw = payload.tobytes()  # one copy more, but slicing bytes is 2x faster than slicing a memoryview
    return [raw[a : a + n] for a, n in zip(starts.tolist(), lengths.tolist(), strict=True)]


def read_chunks(file: MappedFile, start: int, nbytes: int, chunk: int = 4 << 20) -> Iterator[memoryview]:
    """Bytes ``[start, start + nbytes)`` of ``file`` in pieces of at most ``chunk`` bytes. With the native
    module each piece is a guarded copy (a file truncated meanwhile raises :class:`fastio.CorruptShardError`);
    without it, views of the mapping after a size check.

    Example::

        crc = 0
        for piece in read_chunks(f, 0, f.size):
            crc = zlib.crc32(piece, crc)
    """
    file.check_size()
    if _C is None:
        view = memoryview(file.array)
        for at in range(start, start + nbytes, chunk):
            yield view[at : min(at + chunk, start + nbytes)]
        return
    table = MappedTable([file])
    scratch = torch.empty(min(chunk, nbytes), dtype=torch.uint8)
    one = np.zeros(1, dtype=np.int32)
    for at in range(start, start + nbytes, chunk):
        n = min(chunk, start + nbytes - at)
        gather_ranges(table, one, np.array([at], np.int64), np.array([n], np.int64), scratch[:n])
        yield memoryview(scratch.numpy())[:n]


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
    from fastio.errors import CorruptShardError

    try:
        if _C is not None:
            names, offsets, sizes, problem = _C.scan_tar(str(path))
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
