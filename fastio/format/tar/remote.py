"""WebDataset tar shards at URLs, plain or compressed (``.tar.gz``/``.tgz``/``.tar.zst``), read through the
node-local shard cache (:mod:`fastio.remote`): the format's half of a remote source. Compressed shards are
decompressed once, streaming, on their way into the cache (:mod:`fastio.format.tar.compression` gives the
remote layer the decompressor). :func:`open_remote_tars` is the opener in :mod:`fastio.registry`.

Sample counts come before the order, in this order of preference: (a) a sidecar ``<shard>.fidx`` next to the
remote tar (what :func:`fastio.index_tar` writes; a small download, and the cached tar then reuses it once its
bytes are checked against the sidecar's fingerprint); (b) otherwise the shard is downloaded at open and
indexed. Either way a meta (count, sizes, fields) is kept beside the cache entry, ``<entry>.meta.json``, so
the next run opens without a request: under ``cache_limit``, in the room reserved with the download at (b),
else through :meth:`fastio.remote.cache.ShardCache.keep` (skipped while the cache is full of pinned
shards). Compressed shards always take (b). (a) is what a publisher should provide: opening then costs one
small request per shard, not the dataset.

Example::

    source = RemoteTarSource("http://127.0.0.1:8000/shard-{000..009}.tar", cache_dir="/tmp/fastio-cache")
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import io
import json
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from fastio.errors import CorruptShardError
from fastio.files.mapped import MappedFile
from fastio.format.tar.compression import compression_of, decompress, decompressed_name
from fastio.format.tar.decode import npy_layout
from fastio.format.tar.index import INDEX_SUFFIX, TarIndex, TarShardSet, load_tar_index
from fastio.format.tar.npy import load_npz
from fastio.format.tar.parts import parse_sidecar, part_index, part_range
from fastio.format.tar.source import NpySpec, TarLayout, TarSource, decide_layout
from fastio.remote.base import RemoteSource
from fastio.remote.cache import ShardCache
from fastio.remote.fetch import (
    RemoteNotFoundError,
    RetryPolicy,
    expand_urls,
    filesystem,
    read_bytes,
    remote_size,
    with_retries,
)
from fastio.remote.parts import choose_parts, part_bounds, part_key, parts_of
from fastio.remote.shard import Shard, cache_key
from fastio.sources.base import ShardParts

__all__ = ["RemoteTarSource", "open_remote_tars"]


def _decompressor(kind: str) -> Callable[[IO[bytes], IO[bytes]], int]:
    """What the remote layer runs on a compressed shard's stream on its way into the cache."""

    def unpack(raw: IO[bytes], out: IO[bytes]) -> int:
        return decompress(raw, kind, out)

    return unpack


@dataclasses.dataclass
class _TarMeta:
    """What the source keeps per tar shard beside its cache entry: enough to open without downloading."""

    remote_size: int
    tar_size: int
    num_samples: int
    fields: list[str]
    present: list[bool]  # per field: in every sample of the shard
    uniform: list[int]  # per field: the one member size of every sample, or -1
    index_bytes: int = 0  # the index cached beside the tar


def _meta_of(index: TarIndex, tar_size: int, remote_size: int, index_bytes: int) -> _TarMeta:
    present = (index.sizes >= 0).all(axis=0) if index.num_samples else np.zeros(len(index.fields), bool)
    uniform = [
        int(col[0]) if len(col) and (col == col[0]).all() and col[0] >= 0 else -1 for col in index.sizes.T
    ]
    fields = list(index.fields)
    return _TarMeta(remote_size, tar_size, index.num_samples, fields, present.tolist(), uniform, index_bytes)


def _meta_bytes(meta: _TarMeta) -> bytes:
    return json.dumps(dataclasses.asdict(meta)).encode()


def _holds(path: Path, data: bytes) -> bool:
    """True when the file at ``path`` is there with exactly ``data`` in it."""
    with contextlib.suppress(OSError):
        return path.read_bytes() == data
    return False


class RemoteTarSource(RemoteSource):
    """WebDataset tar shards at URLs, read through the shard cache: plain tars
    are downloaded whole, compressed ones decompressed once on the way in (see the module docstring for how
    sample counts are known before the order).

    Batches are what :class:`~fastio.format.tar.source.TarSource` gives over the same tars (fields as
    WebDataset names them, ``__key__``): a ``.npy`` field whose members have one size throughout the set and
    an int field present in every sample come as tensors, everything else decoded per sample. A ``.npy``
    field of one size whose header differs between shards raises :class:`fastio.SchemaMismatchError` naming
    the shard (a remote set cannot be scanned whole before its first batch); pass ``decode=`` a callable to
    decode it yourself.

    Args:
        urls: a URL, brace pattern or glob (``http://host/shard-{000..099}.tar``), or a list of them (local
            paths are read through fsspec too).
        cache_dir, cache_limit, storage_options, retry, download_threads, ahead: as
            :class:`fastio.format.shards.remote.RemoteShardSource`.
        decode: as :class:`fastio.StreamLoader`'s ``decode``.
        tar_strict: as :class:`fastio.StreamLoader`'s ``tar_strict``.

    Example::

        source = RemoteTarSource("http://127.0.0.1:8000/shard-{000..009}.tar", cache_dir="/tmp/fastio-cache")
        loader = fastio.StreamLoader(source, batch_size=64, shuffle="shard", num_workers=2)
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | str | None = None,
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        decode: Any = None,
        tar_strict: bool = True,
        download_threads: int = 4,
        ahead: int = 8,
    ) -> None:
        listed = expand_urls(urls, storage_options)
        if not listed:
            raise RemoteNotFoundError(str(urls), "the pattern names no shard")
        name = listed[0] if len(listed) == 1 else f"{listed[0]} (+{len(listed) - 1})"
        super().__init__(
            name, ShardCache(cache_dir, cache_limit, sidecars=(INDEX_SUFFIX,)), retry or RetryPolicy(),
            storage_options,
            download_threads, ahead,
        )  # fmt: skip
        if decode is not None and decode != "pil" and not callable(decode):
            raise ValueError(f"decode must be None, 'pil' or a callable, got {decode!r}")
        self.decode, self.tar_strict = decode, tar_strict
        self._sidecars: dict[int, bytes] = {}
        self._files = self.shards  # the whole tars, whichever units are read (use_units makes a new list)
        self._indexes: list[TarIndex] | None = None  # from the sidecars, at the first split into parts
        self._part_of: dict[str, tuple[int, int, int]] = {}  # a part's cache key -> (tar, first, stop)
        # Sizes, sidecars and (without sidecars) whole downloads at open go download_threads at a time.
        with concurrent.futures.ThreadPoolExecutor(
            download_threads, thread_name_prefix="fastio-open"
        ) as pool:
            sizes = list(pool.map(lambda url: remote_size(url, self.retry, self.storage_options), listed))
            for url, size in zip(listed, sizes, strict=True):
                key, kind = cache_key(url, decompressed_name(url)), compression_of(url)
                unpack = None if kind is None else _decompressor(kind)
                self.shards.append(Shard(url, key, size, None, encoding=kind, unpack=unpack))
            metas = list(pool.map(self._meta, range(len(self.shards))))
        for info, meta in zip(self.shards, metas, strict=True):
            info.local_size, info.num_samples = meta.tar_size, meta.num_samples
            info.index_bytes = meta.index_bytes
        self._layout = self._plan_layout(metas)
        self.shards_ready()

    # -- opening -------------------------------------------------------------------------------------------
    def _meta_path(self, shard: int) -> Path:
        return Path(f"{self.cache.path(self._files[shard].key)}.meta.json")

    def resident_bytes(self) -> int:
        """The metas: kept for good, so that the next run opens without downloading."""
        paths = [self._meta_path(s) for s in range(len(self._files))]
        return sum(p.stat().st_size for p in paths if p.exists())

    def _meta(self, shard: int) -> _TarMeta:
        """The shard's meta: kept from an earlier run, else from a remote sidecar, else by indexing it."""
        info = self.shards[shard]
        meta_path = self._meta_path(shard)
        with contextlib.suppress(OSError, ValueError, TypeError):
            meta = _TarMeta(**json.loads(meta_path.read_text()))
            if meta.remote_size == info.remote_size:
                return meta
        meta = None
        if info.encoding is None:
            try:
                sidecar = read_bytes(info.url + INDEX_SUFFIX, self.retry, self.storage_options)
            except RemoteNotFoundError:
                sidecar = None
            if sidecar is not None:
                meta = self._meta_from_sidecar(shard, sidecar)
        if meta is None:  # download (and decompress) the shard now and index it
            info.local_size = None if info.encoding else info.remote_size
            # The room of its index and meta (not known before the scan, both smaller than the tar):
            info.index_bytes = info.local_size or info.remote_size
            with self.cached(shard) as path:  # after_download writes the meta in that room
                meta = self._meta_of_cached(shard, path, load_tar_index(path, strict=self.tar_strict))
        data = _meta_bytes(meta)
        if not _holds(meta_path, data):  # not written in its download's room: kept now, where there is room
            self.cache.keep(f"{self._files[shard].key}.meta.json", data)
        return meta

    def _meta_of_cached(self, shard: int, path: Path, index: TarIndex) -> _TarMeta:
        index_path = Path(f"{path}{INDEX_SUFFIX}")
        index_bytes = index_path.stat().st_size if index_path.exists() else 0
        return _meta_of(index, path.stat().st_size, self.shards[shard].remote_size, index_bytes)

    def _meta_from_sidecar(self, shard: int, sidecar: bytes) -> _TarMeta | None:
        info = self.shards[shard]
        index = parse_sidecar(info.url, sidecar, info.remote_size)
        if index is None:
            return None  # not a sidecar this fastio reads, or of another tar: index the shard instead
        self._sidecars[shard] = sidecar
        return _meta_of(index, info.remote_size, info.remote_size, len(sidecar))

    # -- parts ---------------------------------------------------------------------------------------------
    def split_shards(self, reach: int | None, parts: int | None = None) -> ShardParts | None:
        """Parts of tars for ``shuffle=True`` under a cache that cannot hold every tar
        (:mod:`fastio.remote.parts`, :mod:`fastio.format.tar.parts`), where every tar is plain and has its
        ``.fidx`` sidecar published beside it; else (and for None) whole tars. ``parts``: that many per tar,
        whatever the cache.

        Example::

            source.split_shards(reach=64)   # ShardParts(parts=8, ...), or None: whole tars
        """
        indexes = None if reach is None else self._part_indexes()
        chosen = None
        if indexes is not None:
            limit, resident = self.cache.limit, self.resident_bytes()
            units_for = functools.partial(self._parts, indexes=indexes)
            chosen = choose_parts(self._files, limit, resident, reach, units_for, parts)
        self._part_of = {} if chosen is None else parts_of(self._files, chosen)
        self.use_units(self._files if chosen is None else chosen[1])
        return None if chosen is None else chosen[0]

    def _part_indexes(self) -> list[TarIndex] | None:
        """Every tar's index from its sidecar (fetched where the source opened without it), or None when a
        tar is compressed or has none: then no tar is split, so the order is the same on every run."""
        if self._indexes is None:
            if any(info.encoding is not None for info in self._files):
                return None
            indexes = []
            for shard, info in enumerate(self._files):
                sidecar = self._sidecars.get(shard)
                if sidecar is None:
                    try:
                        sidecar = read_bytes(info.url + INDEX_SUFFIX, self.retry, self.storage_options)
                    except RemoteNotFoundError:
                        return None
                index = parse_sidecar(info.url, sidecar, info.remote_size)
                if index is None or index.num_samples != info.num_samples:
                    return None
                indexes.append(index)
            self._indexes = indexes
        return self._indexes

    def _parts(self, parts: int, indexes: list[TarIndex]) -> list[Shard]:
        """Every non-empty part of every tar split into ``parts`` (:func:`part_bounds`), storage order."""
        units = []
        for shard, info in enumerate(self._files):
            for first, stop in part_bounds(info.num_samples, parts):
                lo, hi = part_range(indexes[shard], first, stop)
                key, size = part_key(info, first, stop), info.remote_size
                units.append(Shard(info.url, key, size, hi - lo, stop - first, ranges=((lo, hi),)))
        return units

    def after_download(self, shard: int, path: Path) -> None:
        """Put the tar's index beside it, in the room the cache reserved for it: the remote sidecar, with the
        tar's mtime set to what the sidecar recorded so the tar is not re-scanned
        (:func:`fastio.format.tar.index.load_tar_index` still checks its fingerprint of the bytes and
        rebuilds on any mismatch), else the index built from the cached tar."""
        if self.shards[shard].key in self._part_of:
            return  # a part: its index is the tar's, kept in memory
        sidecar = self._sidecars.get(shard)
        if sidecar is None:
            index = load_tar_index(path, strict=self.tar_strict)
            # Opening (no meta kept yet): the meta too, where the room reserved for the index holds it.
            meta = self._meta_of_cached(shard, path, index)
            meta_path, data = Path(f"{path}.meta.json"), _meta_bytes(meta)
            if not _holds(meta_path, data) and meta.index_bytes + len(data) <= self.shards[shard].index_bytes:
                meta_path.write_bytes(data)
            return
        mtime_ns = int(load_npz(io.BytesIO(sidecar))["identity"][2])
        os.utime(path, ns=(mtime_ns, mtime_ns))
        target = Path(f"{path}{INDEX_SUFFIX}")
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        tmp.write_bytes(sidecar)
        os.replace(tmp, target)

    def _plan_layout(self, metas: list[_TarMeta]) -> TarLayout:
        """The field decisions of the whole set, as a local TarSource over every tar would make them: a
        ``.npy`` field of one member size in every sample of every shard is gathered fixed (its dtype and
        shape read from the first member), an int field present in every sample is an int64 tensor."""
        fields: dict[str, None] = {}
        for meta in metas:
            fields.update(dict.fromkeys(meta.fields))

        def where(field: str) -> list[int]:
            return [m.fields.index(field) if field in m.fields else -1 for m in metas]

        def present(field: str) -> bool:
            return all(j >= 0 and m.present[j] for m, j in zip(metas, where(field), strict=True))

        def uniform_npy(field: str) -> NpySpec | None:
            sizes = {m.uniform[j] for m, j in zip(metas, where(field), strict=True)}
            return self._npy_spec(field, sizes.pop()) if len(sizes) == 1 and -1 not in sizes else None

        return decide_layout(list(fields), present, uniform_npy, self.decode)

    def _npy_spec(self, field: str, size: int) -> NpySpec | None:
        """(dtype, shape, header bytes) of ``field`` from the first sample of the first shard (the shard's
        start of the member read remotely when it is not cached; compressed shards are cached at open)."""
        shard = 0
        info = self.shards[shard]
        head_len = min(size, 4096)
        path = self.cache.path(info.key)
        sidecar = self._sidecars.get(shard)
        if sidecar is not None:
            data = load_npz(io.BytesIO(sidecar))
            fields = [str(f) for f in data["fields"]]
            offset = int(data["offsets"][0, fields.index(field)])
            url = info.url

            def head() -> bytes:
                fs, fspath = filesystem(url, self.storage_options, self.retry.timeout)
                return bytes(fs.cat_file(fspath, start=offset, end=offset + head_len))

            first = with_retries(head, url, self.retry)
        else:
            with self.cached(shard) as path:
                index = load_tar_index(path, strict=self.tar_strict)
                offset = int(index.offsets[0, index.fields.index(field)])
                with open(path, "rb") as fh:
                    fh.seek(offset)
                    first = fh.read(head_len)
        dtype, shape, fortran, header = npy_layout(first, size, info.url, f"{field} of the first sample")
        if fortran or dtype.hasobject or not dtype.isnative:
            return None
        return dtype, tuple(shape), header

    def fixed_specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return self._layout.fixed_specs()

    # -- reading -------------------------------------------------------------------------------------------
    def open_shard(self, shard: int, path: Path) -> tuple[TarIndex, MappedFile]:
        part = self._part_of.get(self.shards[shard].key)
        if part is not None and self._indexes is not None:
            return part_index(self._indexes[part[0]], str(path), part[1], part[2]), MappedFile(path)
        index = load_tar_index(path, strict=self.tar_strict)
        info = self.shards[shard]
        if index.num_samples != info.num_samples:
            raise CorruptShardError(
                str(path), "samples", f"{info.num_samples} (when the source opened)", index.num_samples
            )
        return index, MappedFile(path)

    def local_source(self, shards: tuple[int, ...], opened: list[tuple[TarIndex, MappedFile]]) -> TarSource:
        paths = [str(self.cache.path(self.shards[s].key)) for s in shards]
        subset = TarShardSet.from_parts(paths, [o[0] for o in opened], [o[1] for o in opened])
        return TarSource(subset, decode=self.decode, layout=self._layout)


def open_remote_tars(target: str | list[str], options: Any) -> RemoteTarSource:
    """The registry's opener of tar shards at URLs, plain or compressed (``options``: a
    :class:`fastio.options.OpenOptions`; its cache, storage, ``decode`` and ``tar_strict`` settings apply).

    Example::

        source = open_remote_tars("http://127.0.0.1:8000/shard-{000..009}.tar", OpenOptions(cache_dir="/c"))
    """
    return RemoteTarSource(
        target,
        cache_dir=options.cache_dir,
        cache_limit=options.cache_limit,
        storage_options=dict(options.storage_options or {}),
        decode=options.decode,
        tar_strict=options.tar_strict,
    )
