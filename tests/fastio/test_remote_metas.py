"""What a remote source keeps in the cache for good (a tar's meta: enough to open without downloading) stays
inside ``cache_limit``: written in the room reserved with the download at open, or through
:meth:`ShardCache.keep`, which evicts for its room or skips the write; never beside a full cache."""

from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path

import numpy as np

import fastio
from fastio.format.tar.remote import RemoteTarSource
from fastio.remote.cache import ShardCache

sys.path.insert(0, str(Path(__file__).parent))
from _remote_helpers import FAST_RETRY, cache_folder_bytes  # noqa: E402

from benchmarks.http_server import HttpServer  # noqa: E402


def _tars(directory: Path, shards: int, samples: int) -> list[Path]:
    rng = np.random.default_rng(11)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(shards):
        path = directory / f"shard-{s:03d}.tar"
        with tarfile.open(path, "w") as tar:
            for i in range(samples):
                buf = io.BytesIO()
                np.save(buf, rng.standard_normal(7).astype(np.float32))
                info = tarfile.TarInfo(f"s{s:02d}-{i:04d}.x.npy")
                info.size = len(buf.getvalue())
                tar.addfile(info, io.BytesIO(buf.getvalue()))
        paths.append(path)
    return paths


def _open(url: str, cache_dir: Path, limit: int) -> RemoteTarSource:
    return RemoteTarSource(url, cache_dir=cache_dir, cache_limit=limit, retry=FAST_RETRY, download_threads=1)


def test_a_meta_made_at_open_is_written_in_the_room_of_its_download(tmp_path, monkeypatch):
    # A tar without a sidecar is downloaded and indexed at open, and its meta kept. Other readers of the node
    # cache take the room the moment the tar is let go (here: two reservations while it is still pinned,
    # bringing the folder to the limit plus one shard); a meta written after that would be over the bound.
    (path,) = _tars(tmp_path / "www", shards=1, samples=40)
    tar_bytes, cache_dir = path.stat().st_size, tmp_path / "cache"
    limit = 3 * tar_bytes
    other, jobs = ShardCache(cache_dir, cache_limit=limit), []
    unpin = ShardCache.unpin

    def unpin_after_others_reserve(cache: ShardCache, key: str) -> None:
        if not jobs and key.endswith(".tar"):
            jobs.append(other.reserve("other/a.bin", limit - other.usage()))  # up to the limit
            jobs.append(other.reserve("other/b.bin", tar_bytes))  # the one download beyond it
        unpin(cache, key)

    monkeypatch.setattr(ShardCache, "unpin", unpin_after_others_reserve)
    with HttpServer(tmp_path / "www") as server:
        source = _open(server.url("shard-000.tar"), cache_dir, limit)
        try:
            held = cache_folder_bytes(cache_dir)
            for job in jobs:
                job.abort()
            assert len(jobs) == 2 and all(job is not None for job in jobs)
            assert held <= limit + tar_bytes, f"{held - limit - tar_bytes} bytes over limit + one shard"
            meta = json.loads((cache_dir / source.shards[0].key).with_suffix(".tar.meta.json").read_text())
            assert meta["num_samples"] == source.num_samples == 40 and meta["remote_size"] == tar_bytes
        finally:
            source.close()


def test_metas_from_sidecars_are_skipped_while_the_cache_is_full(tmp_path):
    # Sidecars give the metas without a download; with every byte of the cache pinned (another reader's
    # downloads), they are not written beside it, and the source opens and reads all the same.
    paths = _tars(tmp_path / "www", shards=3, samples=20)
    for path in paths:
        fastio.index_tar(path)
    tar_bytes, cache_dir = max(p.stat().st_size for p in paths), tmp_path / "cache"
    limit = 2 * tar_bytes
    other = ShardCache(cache_dir, cache_limit=limit)
    jobs = [other.reserve("other/a.bin", limit), other.reserve("other/b.bin", tar_bytes)]
    with HttpServer(tmp_path / "www") as server:
        source = _open(server.url("shard-{000..002}.tar"), cache_dir, limit)
        try:
            held = cache_folder_bytes(cache_dir)
            assert held <= limit + tar_bytes, f"{held - limit - tar_bytes} bytes over limit + one shard"
            assert not list(cache_dir.rglob("*.meta.json")) and source.num_samples == 60
            for job in jobs:
                job.abort()
            keys = [k for batch in fastio.StreamLoader(source, batch_size=16) for k in batch["__key__"]]
            assert sorted(keys) == sorted(f"s{s:02d}-{i:04d}" for s in range(3) for i in range(20))
        finally:
            source.close()
        _open(server.url("shard-{000..002}.tar"), cache_dir, limit).close()  # room now: the metas are kept
    assert len(list(cache_dir.rglob("*.meta.json"))) == 3


def test_keep_evicts_an_unpinned_entry_for_its_room(tmp_path):
    cache = ShardCache(tmp_path, cache_limit=1000)
    for key, size in (("a.bin", 600), ("b.bin", 390)):  # filled and let go, as a source does
        with cache.pinned(key):
            cache.fill(key, size, lambda part, size=size: part.write_bytes(b"e" * size))
    data = bytes(range(50))
    assert cache.keep("a.bin.meta.json", data)
    assert cache.path("a.bin.meta.json").read_bytes() == data
    assert not cache.has("a.bin") and cache.has("b.bin")  # the least recent entry made way
    assert cache.usage() <= cache.limit and cache.evictions == 1


def test_keep_writes_nothing_when_every_entry_is_pinned(tmp_path):
    cache = ShardCache(tmp_path, cache_limit=1000)
    cache.fill("a.bin", 980, lambda part: part.write_bytes(b"a" * 980))
    with cache.pinned("a.bin"):
        assert not cache.keep("a.bin.meta.json", b"m" * 30)
    assert not cache.path("a.bin.meta.json").exists() and cache.has("a.bin", 980)
    assert sorted(p.name for p in tmp_path.iterdir() if "part" in p.name) == []  # no temporary file left
    assert cache.keep("a.bin.meta.json", b"m" * 30)  # unpinned now: it makes way
    assert cache.usage() <= cache.limit


def test_keep_without_a_limit_overwrites(tmp_path):
    cache = ShardCache(tmp_path)
    assert cache.keep("ds/x.meta.json", b"one") and cache.keep("ds/x.meta.json", b"two!")
    assert cache.path("ds/x.meta.json").read_bytes() == b"two!"
