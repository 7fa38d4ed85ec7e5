"""Readers of the fastio shard format: one shard (:class:`ShardReader`) and a set (:class:`ShardSet`).

Checks, from cheap to thorough:

1. On every open: the magic, the version, the file size the prefix claims against the real size, the header's
   crc32, every section inside the file, and every offsets array monotone and ending at its payload's size.
   A truncated or overwritten shard fails here, naming the file, the field and expected vs actual.
2. Each section's crc32 (zlib) is checked once per process per file (keyed by path, inode, size and mtime)
   the first time a batch reads the shard, or for every shard at open with ``verify=True``; ``verify=False``
   skips it. A full checksum of a multi-GB set at every open would cost seconds, hence lazily.

Example::

    shards = ShardSet("data/train")
    reader = shards.readers[0]
    x0 = reader.fixed("x")[0]           # a numpy view into the mmap
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fastio.errors import CorruptShardError, EmptySourceError, MissingIndexError, SchemaMismatchError
from fastio.files.gather import read_chunks
from fastio.files.mapped import MappedFile
from fastio.format.shards.header import check_offsets, get_field, parse_json, parse_schema, read_header
from fastio.format.shards.layout import INDEX_NAME, SHARD_SUFFIX
from fastio.format.shards.schema import Schema

__all__ = ["ShardReader", "ShardSet"]

_VERIFIED: set[tuple[str, int, int, int]] = set()
_VERIFIED_LOCK = threading.Lock()


class ShardReader:
    """One ``.fio`` shard, memory-mapped, with its header checked (see the module docstring).

    Args:
        path: the shard file.
        verify: True to check every section's crc32 now; None (default) to check on first read
            (:meth:`ensure_verified`); False never.

    Example::

        r = ShardReader("data/train/shard-000000.fio")
        labels = r.fixed("y")            # numpy [N] view
        first_text = r.variable("text", 0)
    """

    def __init__(self, path: str | os.PathLike[str], verify: bool | None = None) -> None:
        self.path = str(path)
        self.verify = verify
        self.file = MappedFile(self.path)
        raw = self.file.array
        head = read_header(self.path, self.file.size, lambda start, stop: bytes(raw[start:stop]))
        self.num_samples, self.schema, self.sections = head.num_samples, head.schema, head.sections
        self._views: dict[str, Any] = {}
        for name, field in self.schema.items():
            start, nbytes, _ = self.sections[name]["data"]
            if field.kind == "fixed":
                self._views[name] = (
                    raw[start : start + nbytes].view(field.np_dtype).reshape((self.num_samples, *field.shape))
                )
            else:
                ostart, onbytes, _ = self.sections[name]["offsets"]
                # A copy, not a view: the loader indexes it every batch, and a copy cannot fault (SIGBUS) if
                # the file is truncated while mapped. 8 bytes per sample.
                offsets = raw[ostart : ostart + onbytes].view(np.int64).copy()
                check_offsets(self.path, name, offsets, nbytes)
                self._views[name] = (offsets, start)
        if verify:
            self.ensure_verified()

    def _identity(self) -> tuple[str, int, int, int]:
        st = os.stat(self.path)
        return (os.path.realpath(self.path), st.st_ino, st.st_size, st.st_mtime_ns)

    def ensure_verified(self) -> None:
        """Check every section's crc32 unless this process already did for this very file.

        Example::

            ShardReader(path).ensure_verified()   # raises CorruptShardError on a flipped byte
        """
        if self.verify is False:
            return
        key = self._identity()
        with _VERIFIED_LOCK:
            if key in _VERIFIED:
                return
        for name in self.schema:
            for part, (start, nbytes, crc) in self.sections[name].items():
                actual = 0
                for piece in read_chunks(self.file, start, nbytes):  # guarded: the file may shrink meanwhile
                    actual = zlib.crc32(piece, actual)
                if actual != crc:
                    label = name if part == "data" else f"{name}.{part}"
                    raise CorruptShardError(self.path, label, f"crc32 {crc:#010x}", f"crc32 {actual:#010x}")
        with _VERIFIED_LOCK:
            _VERIFIED.add(key)

    def fixed(self, name: str) -> np.ndarray:
        """The ``[N, *shape]`` numpy view of fixed field ``name``.

        Example::

            xs = reader.fixed("x")
        """
        view = self._views[name]
        if isinstance(view, tuple):
            raise TypeError(f"{self.path}: field {name!r} is variable-length; use variable()")
        return view

    def variable_layout(self, name: str) -> tuple[np.ndarray, int]:
        """(int64 ``[N + 1]`` byte offsets within the payload, payload start in the file) of a variable field.

        Example::

            offsets, base = reader.variable_layout("tokens")
        """
        view = self._views[name]
        if not isinstance(view, tuple):
            raise TypeError(f"{self.path}: field {name!r} is fixed-size; use fixed()")
        return view

    def variable(self, name: str, index: int) -> Any:
        """Sample ``index`` of variable field ``name``: bytes, str or a numpy array view.

        Example::

            text = reader.variable("text", 0)
        """
        offsets, base = self.variable_layout(name)
        start, end = base + int(offsets[index]), base + int(offsets[index + 1])
        field = self.schema[name]
        data = self.file.array[start:end]
        if field.kind == "bytes":
            return data.tobytes()
        if field.kind == "str":
            try:
                return data.tobytes().decode("utf-8")
            except UnicodeDecodeError:
                raise CorruptShardError(
                    self.path, f"{name}[{index}]", "UTF-8 text", repr(data[:40].tobytes())
                ) from None
        return data.view(field.np_dtype).reshape((-1, *field.shape))


def _shard_paths(directory: Path, index_path: str, entries: list[Any]) -> list[Path]:
    """The shard file of every ``index.json`` entry: a relative name inside ``directory`` (after resolving
    symlinks), listed once, with integer ``num_samples`` and ``file_nbytes``."""
    root = directory.resolve()
    seen: dict[Path, int] = {}
    paths = []
    for i, entry in enumerate(entries):
        label = f"shards[{i}]"
        if not isinstance(entry, dict):
            raise CorruptShardError(index_path, label, "an object", type(entry).__name__)
        name = get_field(index_path, entry, "file", str)
        for key in ("num_samples", "file_nbytes"):
            get_field(index_path, entry, key, int)
        path = directory / name
        resolved = path.resolve()
        if os.path.isabs(name) or not resolved.is_relative_to(root) or resolved == root:
            raise CorruptShardError(
                index_path, f"{label}.file", f"a file inside {root}", f"{name!r} (resolves to {resolved})"
            )
        if resolved in seen:
            raise CorruptShardError(
                index_path,
                f"{label}.file",
                "each shard listed once",
                f"{name!r} also at shards[{seen[resolved]}]",
            )
        seen[resolved] = i
        paths.append(path)
    return paths


class ShardSet:
    """A directory written by :class:`fastio.ShardWriter`: its ``index.json`` and every shard, opened.

    Raises ``FileNotFoundError`` for a path that does not exist, :class:`fastio.EmptySourceError` for an empty
    directory or a set of zero samples, :class:`fastio.MissingIndexError` for shards without ``index.json``,
    :class:`fastio.SchemaMismatchError` when a shard's schema differs from the index's, and
    :class:`fastio.CorruptShardError` for a shard whose size, sample count or bytes are wrong.

    Example::

        shards = ShardSet("data/train")
        print(shards.num_samples, shards.schema)
    """

    def __init__(self, directory: str | os.PathLike[str], verify: bool | None = None) -> None:
        self.directory = Path(directory)
        if not self.directory.exists():
            raise FileNotFoundError(f"{self.directory}: no such shard directory")
        if not self.directory.is_dir():
            raise NotADirectoryError(
                f"{self.directory}: expected a shard directory written by fastio.ShardWriter"
            )
        index_path = self.directory / INDEX_NAME
        if not index_path.exists():
            if any(p.suffix == SHARD_SUFFIX for p in self.directory.iterdir()):
                raise MissingIndexError(
                    str(index_path),
                    "the shards are there but the set was never closed "
                    "(ShardWriter.close() writes index.json)",
                )
            raise EmptySourceError(f"{self.directory}: empty directory (no {INDEX_NAME} and no shards)")
        where = str(index_path)
        index = parse_json(where, "index", index_path.read_bytes())
        if not isinstance(index, dict) or index.get("format") != "fastio-shards":
            found = index.get("format") if isinstance(index, dict) else type(index).__name__
            raise CorruptShardError(where, "format", "fastio-shards", found)
        self.schema: Schema = parse_schema(where, get_field(where, index, "schema", dict))
        entries = get_field(where, index, "shards", list)
        self.readers: list[ShardReader] = []
        for path, entry in zip(_shard_paths(self.directory, where, entries), entries, strict=True):
            if not path.exists():
                raise FileNotFoundError(f"{path}: listed in {index_path} but missing")
            actual_size = path.stat().st_size
            if actual_size != entry["file_nbytes"]:
                raise CorruptShardError(
                    str(path),
                    "file size",
                    f"{entry['file_nbytes']} bytes (index.json)",
                    f"{actual_size} bytes",
                )
            reader = ShardReader(path, verify=verify)
            for name, field in self.schema.items():
                if reader.schema.get(name) != field:
                    found = reader.schema[name].describe() if name in reader.schema else "no such field"
                    raise SchemaMismatchError(str(path), name, f"{field.describe()} (index.json)", found)
            if set(reader.schema) != set(self.schema):
                extra = sorted(set(reader.schema) - set(self.schema))
                raise SchemaMismatchError(
                    str(path), ", ".join(extra), "no such field (index.json)", "present"
                )
            if reader.num_samples != entry["num_samples"]:
                raise CorruptShardError(
                    str(path), "num_samples", f"{entry['num_samples']} (index.json)", reader.num_samples
                )
            self.readers.append(reader)
        self._count()

    @classmethod
    def from_readers(
        cls, directory: str | os.PathLike[str], schema: Schema, readers: Sequence[ShardReader]
    ) -> ShardSet:
        """A set of shards already opened (no I/O, no checks beyond a non-empty count): for sources that
        serve a subset of a set's shards, such as those a remote cache holds, with the set's ``schema``.

        Example::

            full = ShardSet("data/train")
            part = ShardSet.from_readers(full.directory, full.schema, full.readers[2:4])
        """
        shards = cls.__new__(cls)
        shards.directory, shards.schema, shards.readers = Path(directory), schema, list(readers)
        shards._count()
        return shards

    def _count(self) -> None:
        self.shard_sizes = [r.num_samples for r in self.readers]
        self.num_samples = int(sum(self.shard_sizes))
        if self.num_samples == 0:
            raise EmptySourceError(f"{self.directory}: the set holds no samples")
