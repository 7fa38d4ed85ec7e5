"""WebDataset tar shards at URLs, plain or compressed (``.tar.gz``/``.tgz``/``.tar.zst``), read through the
node-local shard cache (:mod:`fastio.remote`): the format's half of a remote source. Compressed shards are
decompressed once, streaming, on their way into the cache (:mod:`fastio.format.tar.compression` gives the
remote layer the decompressor). :func:`open_remote_tars` is the opener in :mod:`fastio.registry`.

Sample counts come before the order, in this order of preference: (a) a sidecar ``<shard>.fidx`` next to the
remote tar (what :func:`fastio.index_tar` writes; a small download, and the cached tar then reuses it once its
bytes are checked against the sidecar's fingerprint); (b) otherwise the shard is downloaded at open and
indexed. Either way a meta (count, sizes, fields) is kept beside the cache entry, ``<entry>.meta.json``, and
for a plain tar its index too, ``<entry>.meta.fidx`` (the sidecar's bytes, or those of the index made from
the tar), so the next run opens without a request and ``shuffle=True`` reads parts of every plain tar
(:mod:`fastio.format.tar.parts`) whether or not its publisher put a sidecar beside it. Both are kept under
``cache_limit``: in the room reserved with the download at (b), else through
:meth:`fastio.remote.cache.ShardCache.keep` (skipped while the cache is full of pinned shards: made again
when next needed). A kept index that is cut, damaged or of another tar is refused (the archive's crc32s, its
recorded size; a part's headers are checked against it) and made again. Compressed shards always take (b),
and have no parts (they cannot be read by range): ``shuffle=True`` reads them whole, in a window of what the
cache holds, and says so once per loader in the log. (a) is what a publisher should provide: opening then
costs one small request per shard, not the dataset.

Example::

    source = RemoteTarSource("http://127.0.0.1:8000/shard-{000..009}.tar", cache_dir="/tmp/fastio-cache")
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import torch

from fastio.errors import CorruptShardError
from fastio.files.mapped import MappedFile
from fastio.format.tar.compression import compression_of, decompress, decompressed_name
from fastio.format.tar.decode import npy_layout
from fastio.format.tar.index import INDEX_SUFFIX, TarIndex, TarShardSet, load_tar_index
from fastio.format.tar.kept import KEPT_INDEX_SUFFIX, TarMeta, holds, meta_bytes, meta_of, write_whole
from fastio.format.tar.npy import load_npz
from fastio.format.tar.parts import check_part, parse_sidecar, part_index, part_range
from fastio.format.tar.source import NpySpec, TarLayout, TarSource, decide_layout
from fastio.remote.base import RemoteSource
from fastio.remote.cache import ShardCache
from fastio.remote.fetch import (
    RemoteNotFoundError,
    RetryPolicy,
    expand_urls,
    filesystem,
    read_bytes,
    with_retries,
)
from fastio.remote.identity import remote_object
from fastio.remote.parts import choose_parts, part_bounds, part_key, parts_of
from fastio.remote.shard import Shard, cache_key
from fastio.sources.base import ShardParts

__all__ = ["RemoteTarSource", "open_remote_tars"]

_log = logging.getLogger(__name__)
_KEPT = (".meta.json", KEPT_INDEX_SUFFIX)  # kept per tar; another dataset's are evicted for room


def _decompressor(kind: str) -> Callable[[IO[bytes], IO[bytes]], int]:
    """What the remote layer runs on a compressed shard's stream on its way into the cache."""

    def unpack(raw: IO[bytes], out: IO[bytes]) -> int:
        return decompress(raw, kind, out)

    return unpack


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
            name, ShardCache(cache_dir, cache_limit, sidecars=(INDEX_SUFFIX,), kept=_KEPT),
            retry or RetryPolicy(), storage_options,
            download_threads, ahead,
        )  # fmt: skip
        if decode is not None and decode != "pil" and not callable(decode):
            raise ValueError(f"decode must be None, 'pil' or a callable, got {decode!r}")
        self.decode, self.tar_strict = decode, tar_strict
        self._sidecars: dict[int, bytes] = {}  # a plain tar's index (.fidx bytes): published, kept or made
        self._files = self.shards  # the whole tars, whichever units are read (use_units makes a new list)
        self._indexes: list[TarIndex] | None = None  # every tar's, at the first split into parts
        self._part_of: dict[str, tuple[int, int, int]] = {}  # a part's cache key -> (tar, first, stop)
        # Sizes, sidecars and (without sidecars) whole downloads at open go download_threads at a time.
        with concurrent.futures.ThreadPoolExecutor(
            download_threads, thread_name_prefix="fastio-open"
        ) as pool:
            # The cache key names the tar's version (ETag, Last-Modified...: fastio.remote.identity).
            objects = pool.map(lambda url: remote_object(url, self.retry, self.storage_options), listed)
            for obj in objects:
                kind = compression_of(obj.url)
                key = cache_key(obj.url, decompressed_name(obj.url), obj.version)
                unpack = None if kind is None else _decompressor(kind)
                self.shards.append(Shard(obj.url, key, obj.size, None, encoding=kind, unpack=unpack))
            for shard in range(len(self.shards)):  # its kept files: others' are evicted for room, not these
                self.cache.protected.update((self._meta_path(shard), self._kept_index_path(shard)))
            metas = list(pool.map(self._meta, range(len(self.shards))))
        for info, meta in zip(self.shards, metas, strict=True):
            info.local_size, info.num_samples = meta.tar_size, meta.num_samples
            info.index_bytes = meta.index_bytes
        self._metas = metas
        self._layout = self._plan_layout(metas)
        self.shards_ready()

    # -- opening -------------------------------------------------------------------------------------------
    def _meta_path(self, shard: int) -> Path:
        return Path(f"{self.cache.path(self._files[shard].key)}.meta.json")

    def _kept_index_path(self, shard: int) -> Path:
        return Path(f"{self.cache.path(self._files[shard].key)}{KEPT_INDEX_SUFFIX}")

    def resident_bytes(self) -> int:
        """The metas and the plain tars' indexes, kept for good so that the next run opens without
        downloading and reads parts. Their sizes as the metas record them, whether or not they are in the
        cache now: the window a cache limit gives depends on the data, never on what the cache holds."""
        return sum(
            len(meta_bytes(meta)) + (meta.index_bytes if info.encoding is None else 0)
            for meta, info in zip(self._metas, self._files, strict=True)
        )

    def _meta(self, shard: int) -> TarMeta:
        """The shard's meta: kept from an earlier run (its kept index is read when needed), else from a remote
        sidecar, else by indexing it."""
        info = self.shards[shard]
        with contextlib.suppress(OSError, ValueError, TypeError):
            meta = TarMeta(**json.loads(self._meta_path(shard).read_text()))
            if meta.remote_size == info.remote_size:
                return meta
        meta = None
        if info.encoding is None:
            sidecar = self._remote_sidecar(shard)
            if sidecar is not None:
                meta = self._meta_from_sidecar(shard, sidecar)
        if meta is None:  # download (and decompress) the shard now and index it
            info.local_size = None if info.encoding else info.remote_size
            # The room of its index, kept index and meta (not known before the scan, together smaller than
            # the tar but for the tiniest):
            info.index_bytes = info.local_size or info.remote_size
            meta = self._index_cached(shard)
            self.cache.mark_read(info.key)  # indexed: let it go before any shard a pass reads
        data = meta_bytes(meta)
        if not holds(self._meta_path(shard), data):  # not written in its download's room: kept now, if room
            self.cache.keep(f"{self._files[shard].key}.meta.json", data)
        self._keep_index(shard)
        return meta

    def _index_cached(self, shard: int) -> TarMeta:
        """Index the tar in the cache (downloaded here if no process has); its meta, and a plain tar's index
        bytes kept in memory for its parts."""
        with self.cached(shard) as path:  # after_download writes the meta and kept index in its room
            meta = self._meta_of_cached(shard, path, load_tar_index(path, strict=self.tar_strict))
            if self.shards[shard].encoding is None:
                with contextlib.suppress(OSError):
                    self._sidecars[shard] = Path(f"{path}{INDEX_SUFFIX}").read_bytes()
        return meta

    def _remote_sidecar(self, shard: int) -> bytes | None:
        """The ``.fidx`` published beside the tar, or None where there is none."""
        try:
            return read_bytes(self._files[shard].url + INDEX_SUFFIX, self.retry, self.storage_options)
        except RemoteNotFoundError:
            return None

    def _read_kept_index(self, shard: int) -> bytes | None:
        """The index kept in the cache, when it is whole and of this tar (size and sample count), else None;
        taken as the tar's."""
        info, path = self._files[shard], self._kept_index_path(shard)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        with contextlib.suppress(CorruptShardError, ValueError):
            index = parse_sidecar(info.url, data, info.remote_size)
            if index is not None and index.num_samples == info.num_samples:
                self._sidecars[shard] = data
                return data
        path.unlink(missing_ok=True)  # cut, or not this tar's: its room freed; made again from the tar
        return None

    def _keep_index(self, shard: int) -> None:
        """Keep a plain tar's index in the cache (counted in :meth:`resident_bytes`), unless it is there."""
        data = self._sidecars.get(shard)
        if data is not None and not holds(self._kept_index_path(shard), data):
            self.cache.keep(f"{self._files[shard].key}{KEPT_INDEX_SUFFIX}", data)

    def _meta_of_cached(self, shard: int, path: Path, index: TarIndex) -> TarMeta:
        index_path = Path(f"{path}{INDEX_SUFFIX}")
        index_bytes = index_path.stat().st_size if index_path.exists() else 0
        return meta_of(index, path.stat().st_size, self.shards[shard].remote_size, index_bytes)

    def _meta_from_sidecar(self, shard: int, sidecar: bytes) -> TarMeta | None:
        info = self.shards[shard]
        index = parse_sidecar(info.url, sidecar, info.remote_size)
        if index is None:
            return None  # not a sidecar this fastio reads, or of another tar: index the shard instead
        self._sidecars[shard] = sidecar
        return meta_of(index, info.remote_size, info.remote_size, len(sidecar))

    # -- parts ---------------------------------------------------------------------------------------------
    def split_shards(self, reach: int | None, parts: int | None = None) -> ShardParts | None:
        """Parts of tars for ``shuffle=True`` under a cache that cannot hold every tar
        (:mod:`fastio.remote.parts`, :mod:`fastio.format.tar.parts`), where every tar is plain (its index
        published, kept, or made again from the tar); else (and for None) whole tars: compressed ones say so
        in the log. ``parts``: that many per tar, whatever the cache.

        Example::

            source.split_shards(reach=64)   # ShardParts(parts=8, ...), or None: whole tars
        """
        compressed = any(info.encoding is not None for info in self._files)
        chosen = None
        if reach is not None and not compressed:  # the indexes are read when the cache needs parts
            limit, resident = self.cache.limit, self.resident_bytes()
            chosen = choose_parts(self._files, limit, resident, reach, self._parts, parts)
        self._part_of = {} if chosen is None else parts_of(self._files, chosen)
        self.use_units(self._files if chosen is None else chosen[1])
        if reach is not None and compressed and self.shards_held() is not None:
            compressed = sum(info.encoding is not None for info in self._files)
            _log.warning(
                "%s: shuffle=True through a cache that holds %d of its %d tars reads whole tars in a sliding "
                "window of them, so a batch mixes about that many tars: %d of them are compressed, and a "
                "compressed tar cannot be read by byte range (parts of every tar, as plain .tar shards get). "
                "Publish plain .tar shards, or raise cache_limit to %d bytes for the full permutation",
                self.name, self.shards_held(), len(self._files), compressed, self._whole_set_bytes(),
            )  # fmt: skip
        return None if chosen is None else chosen[0]

    def _whole_set_bytes(self) -> int:
        return sum(info.footprint for info in self._files) + self.resident_bytes()

    def _part_indexes(self) -> list[TarIndex]:
        """Every plain tar's index: at hand, kept, published, or made again from the tar (its kept copy gone
        or refused), and kept."""
        if self._indexes is None:
            missing = [s for s in range(len(self._files)) if s not in self._sidecars]
            if missing:
                self._part_of = {}
                self.use_units(self._files)  # whole tars, to index them
                with concurrent.futures.ThreadPoolExecutor(self.download_threads) as pool:
                    list(pool.map(self._find_index, missing))
            indexes = []
            for shard, info in enumerate(self._files):
                index = parse_sidecar(info.url, self._sidecars[shard], info.remote_size)
                if index is None or index.num_samples != info.num_samples:
                    found = "none" if index is None else f"{index.num_samples} samples"
                    expected = f"{info.num_samples} samples (when the source opened)"
                    raise CorruptShardError(info.url, "tar index", expected, found)
                indexes.append(index)
            self._indexes = indexes
        return self._indexes

    def _find_index(self, shard: int) -> None:
        """A plain tar's index, for its parts: kept, else published, else made from the tar; kept."""
        info = self._files[shard]
        if self._read_kept_index(shard) is None:
            sidecar = self._remote_sidecar(shard)
            index = None if sidecar is None else parse_sidecar(info.url, sidecar, info.remote_size)
            if index is not None and index.num_samples == info.num_samples:
                self._sidecars[shard] = sidecar
            else:
                self._index_cached(shard)
                self.cache.mark_read(info.key)
        self._keep_index(shard)

    def _parts(self, parts: int) -> list[Shard]:
        """Every non-empty part of every tar split into ``parts`` (:func:`part_bounds`), storage order."""
        indexes, units = self._part_indexes(), []
        for shard, info in enumerate(self._files):
            for first, stop in part_bounds(info.num_samples, parts):
                lo, hi = part_range(indexes[shard], first, stop)
                key, size = part_key(info, first, stop), info.remote_size
                units.append(Shard(info.url, key, size, hi - lo, stop - first, ranges=((lo, hi),)))
        return units

    def check_download(self, shard: int, part: Path) -> None:
        """A part's members must have their tar headers where the tar's index puts them
        (:func:`fastio.format.tar.parts.check_part`); where not, the index (kept or published) is of another
        tar of the same size, republished with the same validators: the kept index and meta are dropped, and
        so are the tar and its parts cached under its key (of the old bytes, which the index describes), so
        the next run downloads the tar and indexes it again."""
        where = self._part_of.get(self.shards[shard].key)
        if where is None or self._indexes is None:
            return
        try:
            check_part(self._indexes[where[0]], where[1], where[2], str(part))
        except CorruptShardError:
            for path in (self._kept_index_path(where[0]), self._meta_path(where[0])):
                path.unlink(missing_ok=True)
            self.cache.discard(self._files[where[0]].key)
            raise

    def after_download(self, shard: int, path: Path) -> None:
        """Put the tar's index beside it, in the room the cache reserved for it: the index the source holds
        (published, or kept), with the tar's mtime set to what it recorded so the tar is not re-scanned
        (:func:`fastio.format.tar.index.load_tar_index` still checks its fingerprint of the bytes and
        rebuilds on any mismatch), else the index built from the cached tar."""
        info = self.shards[shard]
        if info.key in self._part_of:
            return  # a part: its index is the tar's, kept in memory
        sidecar = self._sidecars.get(shard)
        if sidecar is None and info.encoding is None and info.key == self._files[shard].key:
            sidecar = self._read_kept_index(shard)
        if sidecar is None:
            index = load_tar_index(path, strict=self.tar_strict)
            # Opening (no meta kept yet): the meta and a plain tar's index kept too, where the room reserved
            # for the index holds them.
            meta = self._meta_of_cached(shard, path, index)
            room = info.index_bytes - meta.index_bytes
            kept = [(Path(f"{path}.meta.json"), meta_bytes(meta))]
            if info.encoding is None:
                with contextlib.suppress(OSError):
                    index_bytes = Path(f"{path}{INDEX_SUFFIX}").read_bytes()
                    kept.append((Path(f"{path}{KEPT_INDEX_SUFFIX}"), index_bytes))
            for target, data in kept:
                if not holds(target, data) and len(data) <= room:
                    write_whole(target, data)
                    room -= len(data)
            return
        mtime_ns = int(load_npz(io.BytesIO(sidecar))["identity"][2])
        os.utime(path, ns=(mtime_ns, mtime_ns))
        write_whole(Path(f"{path}{INDEX_SUFFIX}"), sidecar)

    def _plan_layout(self, metas: list[TarMeta]) -> TarLayout:
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
        start of the member read remotely when it is not cached and its index is at hand; compressed shards
        are cached at open)."""
        shard = 0
        info = self.shards[shard]
        head_len = min(size, 4096)
        cached = self.cache.has(info.key, info.local_size)
        sidecar = self._sidecars.get(shard)
        if sidecar is None and not cached and info.encoding is None:
            sidecar = self._read_kept_index(shard)
        if sidecar is not None and not cached:
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
