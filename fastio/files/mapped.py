"""Whole files mapped read-only (:class:`MappedFile`) and the table of them a batch reads from
(:class:`MappedTable`), with the size checks that turn a file truncated under its mapping into a named error.

Example::

    table = MappedTable([MappedFile("data/train/shard-000000.fio")])
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from fastio.errors import CorruptShardError

__all__ = ["MappedFile", "MappedTable"]


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
