"""``shuffle=True`` on remote WebDataset tars published without a ``.fidx`` sidecar: each tar's index, made
when the tar is downloaded at open, is kept in the node cache (``<entry>.meta.fidx``, counted against
``cache_limit``), so every plain tar is read in parts like a tar with a sidecar: the same order as with
sidecars, whatever the cache holds (empty, the index kept, the kept index cut or of another tar), each
sample once, resumed exactly, the second epoch reading parts only. Compressed tars are read whole, in a
window, and say so once per loader."""

from __future__ import annotations

import gzip
import io
import logging
import os
import shutil
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

import fastio
from fastio.errors import CorruptShardError
from fastio.format.tar.kept import KEPT_INDEX_SUFFIX
from fastio.format.tar.remote import RemoteTarSource

sys.path.insert(0, str(Path(__file__).parent))
from _remote_helpers import FAST_RETRY, cache_folder_bytes  # noqa: E402

from benchmarks.http_server import HttpServer  # noqa: E402

TARS = 8
PATTERN = "shard-{000..007}.tar"


def _write_tar(path: Path, shard: int, samples: int, swap: bool = False) -> None:
    """One class-sorted tar: sample ``k`` (numbered across the set) holds ``x.npy`` = ``k``, ``cls`` = its
    tar, and a ``pad`` of 100 or 700 bytes, alternating (``swap``: the other way round, a tar of the same size
    whose members lie elsewhere)."""
    with tarfile.open(path, "w") as tar:
        for i in range(samples):
            key = shard * 100 + i
            buf = io.BytesIO()
            np.save(buf, np.full(2, key, np.int64))
            pad = b"p" * (100 if (i % 2 == 0) != swap else 700)
            for ext, data in (("x.npy", buf.getvalue()), ("cls", str(shard).encode()), ("pad", pad)):
                info = tarfile.TarInfo(f"k{key:05d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def _write_set(directory: Path, sidecars: bool = False) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"shard-{s:03d}.tar" for s in range(TARS)]
    for s, path in enumerate(paths):
        _write_tar(path, s, samples=10 + s % 3)  # unequal tars
        if sidecars:
            fastio.index_tar(path)
    return paths


def _source(server: HttpServer, cache_dir: Path, limit: int, pattern: str = PATTERN) -> RemoteTarSource:
    return RemoteTarSource(server.url(pattern), cache_dir=cache_dir, cache_limit=limit, retry=FAST_RETRY)


def _keys(batches, peaks: list[int] | None = None, cache_dir: Path | None = None) -> list[str]:
    """Every key of ``batches``, each sample checked to be the one its key names."""
    keys = []
    for batch in batches:
        for x, key in zip(batch["x.npy"], batch["__key__"], strict=True):
            assert int(x[0]) == int(key[1:]), key
            keys.append(key)
        if peaks is not None:
            peaks.append(cache_folder_bytes(cache_dir))
    return keys


def _loader(source: RemoteTarSource, **kwargs) -> fastio.StreamLoader:
    return fastio.StreamLoader(source, batch_size=4, shuffle=True, seed=3, **kwargs)


@pytest.fixture
def tars(tmp_path: Path) -> list[Path]:
    return _write_set(tmp_path / "www")


@pytest.fixture
def limit(tars: list[Path]) -> int:
    return 3 * max(p.stat().st_size for p in tars)  # a cache of 3 of the 8 tars (their indexes beside)


def test_tars_without_sidecars_read_the_parts_and_the_order_of_tars_with_them(tmp_path, tars, limit):
    _write_set(tmp_path / "indexed", sidecars=True)
    epochs, peaks = {}, []
    for name in ("www", "indexed"):
        with HttpServer(tmp_path / name) as server:
            source = _source(server, tmp_path / f"cache-{name}", limit)
            try:
                loader = _loader(source)
                epochs[name] = _keys(loader, peaks, tmp_path / f"cache-{name}")
                assert loader.stats()["shuffle_mode"] == "parts" and source.cache.evictions > 0
            finally:
                source.close()
    assert epochs["www"] == epochs["indexed"]
    assert sorted(epochs["www"]) == sorted(set(epochs["www"])) and len(epochs["www"]) == 87
    largest = max(p.stat().st_size for p in tars)
    assert max(peaks) <= limit + largest, f"{max(peaks) - limit - largest} bytes over limit + one tar"


def test_the_order_and_its_resume_are_the_same_whatever_the_cache_keeps(tmp_path, tars, limit):
    cache_dir, sizes = tmp_path / "cache", {f"/{p.name}": p.stat().st_size for p in tars}
    with HttpServer(tmp_path / "www") as server:
        first = _source(server, cache_dir, limit)  # an empty cache: every tar downloaded and indexed
        try:
            loader = _loader(first)
            _keys(loader)
            loader.set_epoch(1)
            server.clear_log()
            second_epoch = _keys(loader)
        finally:
            first.close()
        # The second epoch reads parts of tars, by range, and nothing else.
        gets = [r for r in server.log() if r.method == "GET"]
        assert gets and all(r.path in sizes and r.end - r.start < sizes[r.path] for r in gets)
        assert sum(r.sent for r in gets) <= sum(sizes.values())
        kept = sorted(cache_dir.rglob(f"*{KEPT_INDEX_SUFFIX}"))
        assert len(kept) == TARS

        server.clear_log()
        again = _source(server, cache_dir, limit)  # opens from what the cache keeps: no tar, no sidecar
        try:
            assert all(r.path in sizes and r.end - r.start <= 4096 for r in server.log() if r.method == "GET")
            loader = _loader(again)
            loader.set_epoch(1)
            it = iter(loader)
            head = _keys(next(it) for _ in range(5))
            state = loader.state_dict()
            del it
        finally:
            again.close()
        assert head == second_epoch[:20]

        whole = {path: path.read_bytes() for path in kept}
        for path, data in whole.items():  # cut: refused, made again from the tar, never read
            path.write_bytes(data[: len(data) // 2])
        resumed_source = _source(server, cache_dir, limit)
        try:
            resumed = _loader(resumed_source)
            resumed.load_state_dict(state)
            assert _keys(resumed) == second_epoch[20:]
        finally:
            resumed_source.close()
    # A cut index never stays: it is removed when refused and kept again whole where the cache has room
    # for it then (cache.keep: nothing written while every entry is pinned; made again next time).
    remade = [path for path in kept if path.exists()]
    assert all(len(path.read_bytes()) == len(whole[path]) for path in remade)


def test_a_kept_index_of_another_tar_of_the_same_size_is_refused_never_read(tmp_path, tars, limit):
    cache_dir = tmp_path / "cache"
    with HttpServer(tmp_path / "www") as server:
        first = _source(server, cache_dir, 100 * limit)  # indexes kept, and every whole tar
        key = first.shards[0].key
        first.cache.pin(key)  # the old tar: the most recent entry, the last one evicted for room
        first.cache.unpin(key)
        first.close()
        before = tars[0].stat()
        _write_tar(tars[0], 0, samples=10, swap=True)  # republished: same size, members elsewhere
        # and its mtime kept, so the server's validators (ETag, Last-Modified) do not tell: the cache key
        # is the old one, and the kept index is what must catch it
        os.utime(tars[0], ns=(before.st_atime_ns, before.st_mtime_ns))
        assert tars[0].stat().st_size == before.st_size
        stale = _source(server, cache_dir, limit)
        try:
            with pytest.raises(CorruptShardError, match="shard-000.tar.*tar index.*header"):
                _keys(_loader(stale))
        finally:
            stale.close()
        # The index dropped, and the old tar cached under the same key (indexed again, it would give the old
        # index back): the tar is downloaded and indexed again.
        assert not first.cache.has(key)
        fresh = _source(server, cache_dir, limit)
        try:
            keys = _keys(_loader(fresh))
        finally:
            fresh.close()
    assert len(keys) == len(set(keys)) == 87


def test_compressed_tars_read_a_window_of_whole_tars_and_say_so_once_per_loader(tmp_path, tars, caplog):
    www = tmp_path / "gz"
    www.mkdir()
    for path in tars[:3]:
        (www / f"{path.name}.gz").write_bytes(gzip.compress(path.read_bytes(), compresslevel=1))
    with HttpServer(www) as server:
        limit = 2 * max(p.stat().st_size for p in tars)
        source = _source(server, tmp_path / "cache", limit, "shard-{000..002}.tar.gz")
        try:
            with caplog.at_level(logging.WARNING, logger="fastio.format.tar.remote"):
                loaders = [_loader(source) for _ in range(2)]
                keys = _keys(loaders[0])
            assert loaders[0].stats()["shuffle_mode"] == "window" and len(set(keys)) == len(keys) == 33
        finally:
            source.close()
    said = [r for r in caplog.records if "cannot be read by byte range" in r.getMessage()]
    assert len(said) == 2 and "3 of them are compressed" in said[0].getMessage()


def test_two_loaders_on_one_node_cache_index_each_tar_once_and_read_it_whole(tmp_path, tars):
    cache_dir = tmp_path / "cache"
    limit = 6 * max(p.stat().st_size for p in tars)
    with HttpServer(tmp_path / "www") as server:
        sources = [_source(server, cache_dir, limit) for _ in range(2)]
        try:
            loaders = [_loader(source) for source in sources]
            iters = [iter(loader) for loader in loaders]
            interleaved: list[list[str]] = [[], []]
            for _ in range(22):  # the two passes a batch apart, on one cache
                for i, it in enumerate(iters):
                    interleaved[i] += _keys([next(it)])
        finally:
            for source in sources:
                source.close()
        at_open = sum(r.sent for r in server.log() if r.method == "GET" and r.end - r.start > 4096)
    assert interleaved[0] == interleaved[1] and sorted(interleaved[0]) == sorted(set(interleaved[0]))
    assert at_open >= sum(p.stat().st_size for p in tars)  # the tars, indexed at the first open
    kept = list(cache_dir.rglob(f"*{KEPT_INDEX_SUFFIX}"))
    assert len(kept) == TARS
    shutil.rmtree(cache_dir)


def test_another_datasets_kept_indexes_make_way_and_the_order_stays(tmp_path, tars, limit):
    # Kept indexes and metas of a dataset no loader of this process reads (the same tars at another URL) were
    # never evicted: they piled up in a shared cache_dir and the next loader stalled, "every entry pinned".
    cache_dir, epochs = tmp_path / "cache", []
    for _ in range(3):  # a new server, a new port: another dataset to the cache
        with HttpServer(tmp_path / "www") as server:
            source = _source(server, cache_dir, limit)
            source.cache.stall_s = 3.0
            try:
                epochs.append(_keys(_loader(source)))
            finally:
                source.close()
    assert epochs[0] == epochs[1] == epochs[2] and len(epochs[0]) == 87
    assert len(list(cache_dir.rglob(f"*{KEPT_INDEX_SUFFIX}"))) < 3 * TARS  # others' made way
