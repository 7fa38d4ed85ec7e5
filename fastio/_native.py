"""The native kernels of fastio (``fastio._C``) and their torch-op fallbacks, chosen once at import.

``FASTIO_NO_NATIVE=1`` skips the native module at import (as it skips it at build time); otherwise a module
that fails to load (``ImportError``/``OSError`` only) leaves the torch fallback in place, and
:func:`backend` says which is live and why.

Example::

    import fastio
    print(fastio.backend())   # "native: fastio._C (...)" or "torch: <why>"
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "MappedFile",
    "MappedTable",
    "backend",
    "default_threads",
    "gather_ranges",
    "gather_rows",
    "native",
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
    warning; fastio never writes to it, so no page is ever copied.

    Example::

        f = MappedFile("data/train/shard-000000.fio")
        magic = bytes(f.array[:8])
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        self.size = os.path.getsize(self.path)
        if self.size == 0:
            self._mmap = None
            self.array = np.zeros(0, dtype=np.uint8)
        else:
            with open(self.path, "rb") as fh:
                self._mmap = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
            self.array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.tensor = torch.from_numpy(self.array)
        self.address = int(self.array.ctypes.data) if self.size else 0

    def __repr__(self) -> str:
        return f"MappedFile({Path(self.path).name!r}, {self.size} bytes)"


class MappedTable:
    """The files one batch may read from, with their base addresses and lengths laid out for the kernels.

    Example::

        table = MappedTable([MappedFile(p) for p in paths])
    """

    def __init__(self, files: Sequence[MappedFile]) -> None:
        self.files = list(files)
        self.bases = np.array([f.address for f in self.files], dtype=np.int64)
        self.limits = np.array([f.size for f in self.files], dtype=np.int64)


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
        _C.gather_rows(
            table.bases, table.limits, shard_ids, offsets, int(row_nbytes), flat.numpy(), int(num_threads)
        )
        return
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
    (ranges must not overlap there); returns the int64 start of each in ``out``.

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
        _C.gather_ranges(
            table.bases, table.limits, shard_ids, offsets, lengths, dst, flat.numpy(), int(num_threads)
        )
        return dst
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


def scan_tar(path: str) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Names, data offsets and sizes of every regular file of a tar archive, in archive order.

    Example::

        names, offsets, sizes = scan_tar("data/shard-000000.tar")
    """
    if _C is not None:
        try:
            raw_names, offsets, sizes = _C.scan_tar(str(path))
        except RuntimeError as exc:
            from fastio.errors import CorruptShardError

            raise CorruptShardError(str(path), "tar header", "a well-formed tar archive", str(exc)) from None
        names = [n.decode("utf-8", "surrogateescape") for n in raw_names]
        return names, offsets, sizes
    import tarfile

    from fastio.errors import CorruptShardError

    names, offsets, sizes = [], [], []
    try:
        with tarfile.open(path, "r:") as archive:
            for member in archive:
                if member.isfile():
                    names.append(member.name)
                    offsets.append(member.offset_data)
                    sizes.append(member.size)
    except tarfile.TarError as exc:
        raise CorruptShardError(str(path), "tar header", "a well-formed tar archive", str(exc)) from None
    total = os.path.getsize(path)
    for name, start, size in zip(names, offsets, sizes, strict=True):
        if start + size > total:
            raise CorruptShardError(str(path), name, f"{size} bytes at {start}", f"file ends at {total}")
    return names, np.array(offsets, dtype=np.int64), np.array(sizes, dtype=np.int64)
