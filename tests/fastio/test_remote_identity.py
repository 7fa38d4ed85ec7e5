"""fastio.remote.identity: a remote object's version is its store's validators (an HTTP server's ETag and
Last-Modified), and the cache names an entry after it, so a tar republished at the same URL with the same
size is downloaded again rather than served from the cache; one left as it was is not downloaded again."""

from __future__ import annotations

import io
import os
import sys
import tarfile
from pathlib import Path

import numpy as np

import fastio
from fastio.format.tar.remote import RemoteTarSource
from fastio.remote.identity import version_of
from fastio.remote.shard import cache_key

sys.path.insert(0, str(Path(__file__).parent))
from _remote_helpers import FAST_RETRY  # noqa: E402

from benchmarks.http_server import HttpServer  # noqa: E402


def _write_tar(path: Path, first_key: int, samples: int = 7) -> None:
    """Samples ``first_key, first_key + 1, ...``, each an ``x.npy`` holding its key: tars of the same sample
    count and key width have the same size whatever their keys."""
    with tarfile.open(path, "w") as tar:
        for key in range(first_key, first_key + samples):
            buf = io.BytesIO()
            np.save(buf, np.full(2, key, np.int64))
            info = tarfile.TarInfo(f"k{key:05d}.x.npy")
            info.size = len(buf.getvalue())
            tar.addfile(info, io.BytesIO(buf.getvalue()))


def _keys(url: str, cache_dir: Path) -> list[int]:
    source = RemoteTarSource(url, cache_dir=cache_dir, retry=FAST_RETRY)
    with fastio.StreamLoader(source, batch_size=4) as loader:
        return sorted(int(x[0]) for batch in loader for x in batch["x.npy"])


def test_a_tar_republished_with_the_same_size_is_read_anew(tmp_path) -> None:
    # The cache knew a tar by its URL and size: one rewritten in place with other samples, same size, was
    # served from the cache, the old samples, silently.
    (tmp_path / "data").mkdir()
    changed, kept = tmp_path / "data" / "shard-000.tar", tmp_path / "data" / "shard-001.tar"
    _write_tar(changed, 100)
    _write_tar(kept, 200)
    with HttpServer(tmp_path / "data") as server:
        url = server.url("shard-{000..001}.tar")
        assert _keys(url, tmp_path / "cache") == [*range(100, 107), *range(200, 207)]
        before = changed.stat()
        _write_tar(changed, 300)
        os.utime(changed, ns=(before.st_atime_ns, before.st_mtime_ns + 2 * 10**9))  # rewritten later
        assert changed.stat().st_size == before.st_size
        served = server.bytes_served("/shard-001.tar")
        assert _keys(url, tmp_path / "cache") == [*range(200, 207), *range(300, 307)]
        assert server.bytes_served("/shard-001.tar") == served  # unchanged: read from the cache


def test_the_version_is_every_validator_the_store_reports() -> None:
    http = {"size": 10, "ETag": '"5f-a"', "Last-Modified": "Mon, 07 Dec 2026 06:00:00 GMT"}
    assert version_of(http) == 'ETag="5f-a";Last-Modified=Mon, 07 Dec 2026 06:00:00 GMT'
    assert version_of({"size": 10, "ETag": "", "mimetype": "x"}) is None  # none: the URL and size only
    url = "http://host/train/shard-000.bin"
    assert cache_key(url, "shard-000.bin", None) == cache_key(url, "shard-000.bin")
    assert cache_key(url, "shard-000.bin", 'ETag="5f-a"') != cache_key(url, "shard-000.bin", 'ETag="60-a"')


def _read_k(url: str, cache: Path) -> list[int]:
    """Every ``k`` a fresh loader over ``url`` reads through the cache at ``cache``, sorted."""
    with fastio.StreamLoader(url, batch_size=8, remote=fastio.RemoteOptions(cache_dir=str(cache))) as loader:
        return sorted(int(k) for batch in loader for k in batch["k"])


def _rewrite_later(path: Path, write) -> None:
    """``write(path)`` again, its mtime 2 s later (as a later publish would have it), the size unchanged."""
    before = path.stat()
    write(path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 2 * 10**9))
    assert path.stat().st_size == before.st_size


def test_a_parquet_file_republished_with_the_same_size_is_read_anew(tmp_path) -> None:
    # Its footer and row groups were kept by URL and size: a file rewritten with other values of the same
    # widths (same size) was read from the cache, the old rows.
    import pyarrow as pa
    import pyarrow.parquet as pq

    def write(first: int):
        def to(path: Path) -> None:
            table = pa.table({"k": np.arange(first, first + 50, dtype=np.int64)})
            pq.write_table(table, path, compression="none", use_dictionary=False, write_statistics=False,
                           row_group_size=20)  # fmt: skip

        return to

    (tmp_path / "data").mkdir()
    path = tmp_path / "data" / "part-0.parquet"
    write(100)(path)
    with HttpServer(tmp_path / "data") as server:
        url = server.url("part-0.parquet")
        assert _read_k(url, tmp_path / "c") == list(range(100, 150))
        _rewrite_later(path, write(300))
        assert _read_k(url, tmp_path / "c") == list(range(300, 350))


def test_a_shard_set_written_again_with_the_same_sizes_is_read_anew(tmp_path) -> None:
    # The shards were kept by URL and size: a set written again in place (its index last, as the writer
    # does) with other values of the same shapes was read from the cache, the old samples.
    def write(first: int) -> None:
        schema = {"k": ("int64", ())}
        with fastio.ShardWriter(str(tmp_path / "data"), schema=schema, max_samples=16, overwrite=True) as w:
            for k in range(first, first + 40):
                w.write({"k": k})

    write(100)
    with HttpServer(tmp_path / "data") as server:
        assert _read_k(server.url(""), tmp_path / "c") == list(range(100, 140))
        before = (tmp_path / "data" / "index.json").stat().st_mtime_ns
        write(300)
        index = tmp_path / "data" / "index.json"
        os.utime(index, ns=(before, max(index.stat().st_mtime_ns, before + 2 * 10**9)))
        assert _read_k(server.url(""), tmp_path / "c") == list(range(300, 340))
