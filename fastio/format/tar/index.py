"""WebDataset tar shards read in place: a one-pass index (:func:`index_tar`) and a set of indexed shards.

1. :func:`index_tar` scans the headers once (C++ ``scan_tar``, its Python twin without the native
   module), groups consecutive members by WebDataset key (the path up to the first dot of the file name:
   ``a/b.x.npy`` -> key ``a/b``, field ``x.npy``), and writes a sidecar ``<shard>.fidx`` (an ``.npz``:
   keys, field names, offsets and sizes per sample and field, and the tar's size and mtime).
2. :class:`TarShardSet` maps every tar and serves samples by slicing the mapping: no extraction, no tar
   parsing per sample. A sidecar whose recorded size, mtime or content fingerprint no longer matches its tar
   is rebuilt (or raises :class:`fastio.MissingIndexError` with ``build=False``); one whose offsets the tar
   cannot hold raises :class:`fastio.CorruptShardError`.
3. Strict by default: a tar that does not end in a clean end-of-archive marker is refused (``strict=False``
   reads the members before the damage).

Example::

    fastio.index_tar("data/shard-000000.tar")
    shards = TarShardSet("data/shard-{000000..000009}.tar")
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fastio.errors import CorruptShardError, EmptySourceError, MissingIndexError
from fastio.files.mapped import MappedFile
from fastio.files.paths import expand_pattern
from fastio.format.tar.npy import load_npz
from fastio.format.tar.scan import scan_tar

__all__ = ["INDEX_SUFFIX", "TarIndex", "TarShardSet", "index_tar", "load_tar_index"]

INDEX_SUFFIX = ".fidx"
_INDEX_VERSION = 2


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


_EDGE_BYTES = 1 << 16
_SAMPLED_HEADERS = 64


def _tar_fingerprint(path: str, offsets: np.ndarray) -> np.ndarray:
    """crc32 of the tar's first and last 64 KiB and of up to 64 member header blocks spread evenly over the
    archive (the 512 bytes before each sampled member's data): a few hundred KiB read at most.

    Catches a same-size tar whose mtime was copied but whose contents differ anywhere in those bytes: another
    first or last member, any change of name, size, mtime or order of the sampled members (a header holds all
    of them). It misses edits inside member data between the edges, which the index does not depend on.
    """
    starts = offsets[offsets >= 0].ravel()
    if not (starts[1:] >= starts[:-1]).all():  # an index in archive order is sorted already
        starts = np.sort(starts)
    picked = starts[np.linspace(0, len(starts) - 1, min(len(starts), _SAMPLED_HEADERS)).astype(np.int64)]
    crc = 0
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        crc = zlib.crc32(os.pread(fh.fileno(), _EDGE_BYTES, 0), crc)
        crc = zlib.crc32(os.pread(fh.fileno(), _EDGE_BYTES, max(0, size - _EDGE_BYTES)), crc)
        for start in picked.tolist():
            crc = zlib.crc32(os.pread(fh.fileno(), 512, max(0, start - 512)), crc)
    return np.array([crc, len(picked)], dtype=np.int64)


def _check_index(sidecar: str, tar_size: int, index: TarIndex) -> None:
    """Refuse a sidecar whose offsets the tar cannot hold: every present member's data must start after a
    header block, on a block boundary, end inside the tar, and not overlap another member or its header."""
    n, f = len(index.keys), len(index.fields)
    for name, array in (("offsets", index.offsets), ("sizes", index.sizes)):
        if array.shape != (n, f) or array.dtype != np.int64:
            raise CorruptShardError(
                sidecar, name, f"int64 {(n, f)} (keys x fields)", f"{array.dtype} {array.shape}"
            )
    present = index.offsets != -1
    if (index.sizes[~present] != -1).any():
        raise CorruptShardError(sidecar, "sizes", "-1 where a member is absent", "a size without an offset")
    starts, sizes = index.offsets[present], index.sizes[present]
    if len(starts) == 0:
        return
    bad = (starts < 512) | (starts % 512 != 0) | (sizes < 0) | (sizes > tar_size - starts)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise CorruptShardError(
            sidecar,
            "offsets",
            f"block-aligned member data in [512, {tar_size}) of the tar",
            f"{int(sizes[k])} bytes at {int(starts[k])}",
        )
    if not (starts[1:] >= starts[:-1]).all():  # an index in archive order (as index_tar writes) is sorted
        order = np.argsort(starts, kind="stable")
        starts, sizes = starts[order], sizes[order]
    padded_ends = starts + (sizes + 511) // 512 * 512
    overlap = starts[1:] < padded_ends[:-1] + 512
    if overlap.any():
        k = int(np.flatnonzero(overlap)[0])
        raise CorruptShardError(
            sidecar,
            "offsets",
            f"members apart by a header block (the next after {int(padded_ends[k]) + 512})",
            f"a member at {int(starts[k + 1])} after {int(sizes[k])} bytes at {int(starts[k])}",
        )


def _raise_problem(path: str, problem: str) -> None:
    raise CorruptShardError(
        path,
        "end of archive",
        "members up to an end-of-archive marker, then only zeros",
        problem,
        "strict tar mode; pass strict=False to read the members before it",
    )


def index_tar(path: str | os.PathLike[str], write: bool = True, strict: bool = True) -> TarIndex:
    """Scan ``path`` once and write its sidecar index ``<path>.fidx`` (atomically); returns the index.

    Args:
        path: the tar shard.
        write: write the sidecar (skipped quietly where the directory is read-only).
        strict: refuse an archive whose end is not a clean end-of-archive marker: a zero block followed by
            more data (a zeroed header, concatenated archives) or a file that ends without the marker (cut at
            a block boundary). With ``strict=False`` the members before that point are indexed and served.
            GNU tar's two zero blocks and its padding to a 10 KiB record are clean either way.

    Raises :class:`fastio.CorruptShardError` for a malformed header, a member running past the end, a member
    name that is not UTF-8, or (strict) the endings above; the error names the file and the byte.

    Example::

        idx = fastio.index_tar("data/shard-000000.tar")
        print(idx.num_samples, idx.fields)
    """
    path = str(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such tar shard")
    scan = scan_tar(path)
    keys: list[str] = []
    rows: list[dict[str, int]] = []
    fields: dict[str, int] = {}
    for i, raw_name in enumerate(scan.names):
        try:
            name = raw_name.decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptShardError(
                path, f"member name at byte {int(scan.offsets[i]) - 512}", "UTF-8", repr(raw_name)
            ) from None
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
            offsets[r, fields[ext]] = scan.offsets[member]
            sizes[r, fields[ext]] = scan.sizes[member]
    index = TarIndex(path, np.array(keys, dtype=str), list(fields), offsets, sizes)
    if write:
        sidecar = path + INDEX_SUFFIX
        tmp = f"{os.path.dirname(sidecar) or '.'}/.{os.path.basename(sidecar)}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as fh:
                np.savez(
                    fh,
                    identity=_tar_identity(path),
                    fingerprint=_tar_fingerprint(path, offsets),
                    problem=np.array(scan.problem),
                    keys=index.keys,
                    fields=np.array(index.fields, dtype=str),
                    offsets=offsets,
                    sizes=sizes,
                )
            os.replace(tmp, sidecar)
        except OSError:
            Path(tmp).unlink(missing_ok=True)  # a read-only dataset directory: keep the index in memory only
    if strict and scan.problem:
        _raise_problem(path, scan.problem)
    return index


def load_tar_index(path: str | os.PathLike[str], build: bool = True, strict: bool = True) -> TarIndex:
    """The sidecar index of ``path``; built (:func:`index_tar`) when missing or stale and ``build`` is True.

    A sidecar is stale when the tar's size or mtime differ from what it recorded, or when a cheap fingerprint
    of the tar's bytes does (see ``_tar_fingerprint``: the first and last 64 KiB and sampled member headers).
    A sidecar whose offsets the tar cannot hold (negative, unaligned, overlapping, past the end) raises
    :class:`fastio.CorruptShardError` naming it. ``strict`` as in :func:`index_tar` (the sidecar records what
    the scan found, so the check costs nothing here).

    Example::

        idx = load_tar_index("data/shard-000000.tar", build=False)   # MissingIndexError if never indexed
    """
    path = str(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such tar shard")
    sidecar = path + INDEX_SUFFIX
    if os.path.exists(sidecar):
        index, problem = None, ""
        try:
            data = load_npz(sidecar)
            identity = _tar_identity(path)
            if np.array_equal(data["identity"], identity):
                index = TarIndex(
                    path, data["keys"], [str(f) for f in data["fields"]], data["offsets"], data["sizes"]
                )
                fingerprint, problem = data["fingerprint"], str(data["problem"])
        except (OSError, ValueError, KeyError):
            index = None  # unreadable sidecar: treat as stale
        if index is not None:
            _check_index(sidecar, int(identity[1]), index)
            if np.array_equal(fingerprint, _tar_fingerprint(path, index.offsets)):
                if strict and problem:
                    _raise_problem(path, problem)
                return index
        if not build:
            raise MissingIndexError(
                sidecar, f"stale or unreadable for {path}; run fastio.index_tar({path!r})"
            )
    elif not build:
        raise MissingIndexError(sidecar, f"run fastio.index_tar({path!r}) or let StreamLoader build it")
    return index_tar(path, strict=strict)


class TarShardSet:
    """Every tar named by ``pattern``, indexed (sidecars built where missing) and memory-mapped.

    ``strict`` (default True) refuses a tar with a zero block followed by more data or without an
    end-of-archive marker (see :func:`index_tar`); ``strict=False`` serves the members before that point.

    Example::

        shards = TarShardSet("data/shard-{000000..000003}.tar")
        print(shards.num_samples, shards.fields)
    """

    def __init__(self, pattern: str | Sequence[str], build_index: bool = True, strict: bool = True) -> None:
        self.paths = expand_pattern(pattern)
        if not self.paths:
            raise EmptySourceError(f"{pattern}: names no tar shard")
        for p in self.paths:
            if not os.path.exists(p):
                raise FileNotFoundError(f"{p}: no such tar shard")
        self._fill([load_tar_index(p, build=build_index, strict=strict) for p in self.paths], pattern)

    @classmethod
    def from_parts(
        cls, paths: Sequence[str], indexes: Sequence[TarIndex], files: Sequence[MappedFile] | None = None
    ) -> TarShardSet:
        """A set of tars already indexed (:func:`load_tar_index`), mapped here unless ``files`` are given:
        for sources that serve a subset of a set's shards, such as those a remote cache holds. The same
        checks as the constructor (every index fits its mapped file, some samples).

        Example::

            part = TarShardSet.from_parts(paths[:2], [load_tar_index(p) for p in paths[:2]])
        """
        shards = cls.__new__(cls)
        shards.paths = list(paths)
        if len(indexes) != len(shards.paths) or (files is not None and len(files) != len(shards.paths)):
            raise ValueError(f"TarShardSet.from_parts: {len(shards.paths)} paths but {len(indexes)} indexes")
        shards._fill(list(indexes), shards.paths[0] if shards.paths else "[]", files)
        return shards

    def _fill(
        self, indexes: list[TarIndex], pattern: object, files: Sequence[MappedFile] | None = None
    ) -> None:
        self.indexes = indexes
        self.files = list(files) if files is not None else [MappedFile(p) for p in self.paths]
        for index, file in zip(self.indexes, self.files, strict=True):
            ends = index.offsets + index.sizes
            if index.num_samples and ends.max() > file.size:  # the tar changed between its index and its map
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
