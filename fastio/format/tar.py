"""WebDataset tar shards read in place: a one-pass index (:func:`index_tar`) and a set of indexed shards.

1. :func:`index_tar` scans the headers once (C++ ``scan_tar``, Python ``tarfile`` without the native
   module), groups consecutive members by WebDataset key (the path up to the first dot of the file name:
   ``a/b.x.npy`` -> key ``a/b``, field ``x.npy``), and writes a sidecar ``<shard>.fidx`` (an ``.npz``:
   keys, field names, offsets and sizes per sample and field, and the tar's size and mtime).
2. :class:`TarShardSet` maps every tar and serves samples by slicing the mapping: no extraction, no tar
   parsing per sample. A sidecar whose recorded size or mtime no longer matches its tar is rebuilt (or raises
   :class:`fastio.MissingIndexError` with ``build=False``).

Example::

    fastio.index_tar("data/shard-000000.tar")
    shards = TarShardSet("data/shard-{000000..000009}.tar")
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fastio._native import MappedFile, scan_tar
from fastio.errors import CorruptShardError, EmptySourceError, MissingIndexError

__all__ = ["INDEX_SUFFIX", "TarIndex", "TarShardSet", "expand_pattern", "index_tar", "load_tar_index"]

INDEX_SUFFIX = ".fidx"
_INDEX_VERSION = 1


class TarIndex:
    """Where every sample's members lie in one tar: ``offsets[i, j]``/``sizes[i, j]`` for sample ``i`` and
    field ``fields[j]`` (-1 where the sample lacks the field), and ``keys[i]``.

    Example::

        idx = index_tar("shard.tar")
        start, size = idx.offsets[0, idx.fields.index("cls")], idx.sizes[0, idx.fields.index("cls")]
    """

    def __init__(
        self, path: str, keys: np.ndarray, fields: list[str], offsets: np.ndarray, sizes: np.ndarray
    ):
        self.path, self.keys, self.fields, self.offsets, self.sizes = path, keys, fields, offsets, sizes

    @property
    def num_samples(self) -> int:
        return len(self.keys)


def _split_name(name: str) -> tuple[str, str] | None:
    folder, _, base = name.rpartition("/")
    dot = base.find(".")
    if dot <= 0:
        return None
    return (f"{folder}/" if folder else "") + base[:dot], base[dot + 1 :]


def _tar_identity(path: str) -> np.ndarray:
    st = os.stat(path)
    return np.array([_INDEX_VERSION, st.st_size, st.st_mtime_ns], dtype=np.int64)


def index_tar(path: str | os.PathLike[str], write: bool = True) -> TarIndex:
    """Scan ``path`` once and write its sidecar index ``<path>.fidx`` (atomically); returns the index.

    Example::

        idx = fastio.index_tar("data/shard-000000.tar")
        print(idx.num_samples, idx.fields)
    """
    path = str(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such tar shard")
    names, member_offsets, member_sizes = scan_tar(path)
    keys: list[str] = []
    rows: list[dict[str, int]] = []
    fields: dict[str, int] = {}
    for i, name in enumerate(names):
        parts = _split_name(name)
        if parts is None:
            continue
        key, ext = parts
        if not keys or keys[-1] != key:
            keys.append(key)
            rows.append({})
        fields.setdefault(ext, len(fields))
        rows[-1][ext] = i
    offsets = np.full((len(keys), len(fields)), -1, dtype=np.int64)
    sizes = np.full((len(keys), len(fields)), -1, dtype=np.int64)
    for r, row in enumerate(rows):
        for ext, member in row.items():
            offsets[r, fields[ext]] = member_offsets[member]
            sizes[r, fields[ext]] = member_sizes[member]
    index = TarIndex(path, np.array(keys, dtype=str), list(fields), offsets, sizes)
    if write:
        sidecar = path + INDEX_SUFFIX
        tmp = f"{os.path.dirname(sidecar) or '.'}/.{os.path.basename(sidecar)}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as fh:
                np.savez(
                    fh,
                    identity=_tar_identity(path),
                    keys=index.keys,
                    fields=np.array(index.fields, dtype=str),
                    offsets=offsets,
                    sizes=sizes,
                )
            os.replace(tmp, sidecar)
        except OSError:
            Path(tmp).unlink(missing_ok=True)  # a read-only dataset directory: keep the index in memory only
    return index


def load_tar_index(path: str | os.PathLike[str], build: bool = True) -> TarIndex:
    """The sidecar index of ``path``; built (:func:`index_tar`) when missing or stale and ``build`` is True.

    Example::

        idx = load_tar_index("data/shard-000000.tar", build=False)   # MissingIndexError if never indexed
    """
    path = str(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such tar shard")
    sidecar = path + INDEX_SUFFIX
    if os.path.exists(sidecar):
        try:
            with np.load(sidecar, allow_pickle=False) as data:
                if np.array_equal(data["identity"], _tar_identity(path)):
                    return TarIndex(
                        path, data["keys"], [str(f) for f in data["fields"]], data["offsets"], data["sizes"]
                    )
        except (OSError, ValueError, KeyError):
            pass  # unreadable sidecar: treat as stale
        if not build:
            raise MissingIndexError(
                sidecar, f"stale or unreadable for {path}; run fastio.index_tar({path!r})"
            )
    elif not build:
        raise MissingIndexError(sidecar, f"run fastio.index_tar({path!r}) or let StreamLoader build it")
    return index_tar(path)


_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")
_ALTERNATIVES = re.compile(r"\{([^{}]*,[^{}]*)\}")


def expand_pattern(pattern: str | Sequence[str]) -> list[str]:
    """Paths named by brace ranges (``{000..099}``), alternatives (``{a,b}``) and globs, in that order.

    Example::

        expand_pattern("data/shard-{000000..000002}.tar")   # three paths, zero padding kept
    """
    if not isinstance(pattern, str):
        return [p for item in pattern for p in expand_pattern(item)]
    candidates = [m for m in (_RANGE.search(pattern), _ALTERNATIVES.search(pattern)) if m is not None]
    if candidates:
        match = min(
            candidates, key=lambda m: m.start()
        )  # leftmost group first: "{a,b}-{1..2}" -> a-1, a-2, ...
        head, tail = pattern[: match.start()], pattern[match.end() :]
        if match.re is _RANGE:
            first, last = match.group(1), match.group(2)
            width = len(first) if first.startswith("0") or len(first) == len(last) else 0
            names = [f"{n:0{width}d}" for n in range(int(first), int(last) + 1)]
        else:
            names = match.group(1).split(",")
        return [p for name in names for p in expand_pattern(head + name + tail)]
    if glob.has_magic(pattern):
        found = sorted(glob.glob(pattern))
        if not found:
            raise EmptySourceError(f"{pattern}: the pattern matches no file")
        return found
    return [pattern]


class TarShardSet:
    """Every tar named by ``pattern``, indexed (sidecars built where missing) and memory-mapped.

    Example::

        shards = TarShardSet("data/shard-{000000..000003}.tar")
        print(shards.num_samples, shards.fields)
    """

    def __init__(self, pattern: str | Sequence[str], build_index: bool = True) -> None:
        self.paths = expand_pattern(pattern)
        if not self.paths:
            raise EmptySourceError(f"{pattern}: names no tar shard")
        for p in self.paths:
            if not os.path.exists(p):
                raise FileNotFoundError(f"{p}: no such tar shard")
        self.indexes = [load_tar_index(p, build=build_index) for p in self.paths]
        self.files = [MappedFile(p) for p in self.paths]
        for index, file in zip(self.indexes, self.files, strict=True):
            ends = index.offsets + index.sizes
            if index.num_samples and ends.max() > file.size:
                raise CorruptShardError(
                    file.path, "tar data", f">= {int(ends.max())} bytes", f"{file.size} bytes"
                )
        fields: dict[str, None] = {}
        for index in self.indexes:
            fields.update(dict.fromkeys(index.fields))
        self.fields = list(fields)
        self.shard_sizes = [index.num_samples for index in self.indexes]
        self.num_samples = int(sum(self.shard_sizes))
        if self.num_samples == 0:
            raise EmptySourceError(f"{pattern}: the tar shards hold no samples")

    def column(self, field: str) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, sizes) of ``field`` over every sample of the set in order (-1 where absent).

        Example::

            offsets, sizes = shards.column("x.npy")
        """
        offsets, sizes = [], []
        for index in self.indexes:
            if field in index.fields:
                j = index.fields.index(field)
                offsets.append(index.offsets[:, j])
                sizes.append(index.sizes[:, j])
            else:
                offsets.append(np.full(index.num_samples, -1, np.int64))
                sizes.append(np.full(index.num_samples, -1, np.int64))
        return np.concatenate(offsets), np.concatenate(sizes)
