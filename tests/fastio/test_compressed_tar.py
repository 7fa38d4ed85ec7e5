"""Compressed WebDataset tar shards (.tgz, .tar.gz, .tar.zst), local and over HTTP: decompressed once (locally
into cache_dir without any remote code, remotely into the shard cache), then read like plain tars; checked
against webdataset.WebDataset and fastio's own tar reader."""

from __future__ import annotations

import gzip
import io
import json
import subprocess
import sys
import tarfile
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import fastio
from fastio.errors import CorruptShardError
from fastio.format.tar.compressed import open_compressed_tars
from fastio.format.tar.compression import COMPRESSED_SUFFIXES, decompress, is_compressed_tar
from fastio.format.tar.remote import RemoteTarSource
from fastio.registry import OpenOptions, open_source
from fastio.remote import RetryPolicy, ShardCache

sys.path.insert(0, str(Path(__file__).parent))
from benchmarks.http_server import HttpServer  # noqa: E402

FAST_RETRY = RetryPolicy(retries=4, backoff=0.005, max_backoff=0.05, timeout=5.0, chunk_bytes=4096)


def _raw(field: str, data: bytes) -> bytes:
    return data


def _members(shard: int, count: int) -> list[tuple[str, bytes]]:
    """WebDataset sample.tgz's shape: per key a .cls, a .jpg (random bytes, compared raw) and a .json."""
    rng = np.random.default_rng(zlib.crc32(repr(("compressed", shard)).encode()))
    members = []
    for i in range(count):
        key = f"sample/{shard:02d}{i:04d}"
        jpg = rng.integers(0, 256, int(rng.integers(100, 3000)), dtype=np.uint8).tobytes()
        members += [
            (f"{key}.cls", str(int(rng.integers(0, 10))).encode()),
            (f"{key}.jpg", jpg),
            (f"{key}.json", json.dumps({"i": i, "shard": shard}).encode()),
        ]
    return members


def _write_tar(path: Path, members: list[tuple[str, bytes]], mode: str = "w") -> Path:
    with tarfile.open(path, mode) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _write_zst(path: Path, members: list[tuple[str, bytes]]) -> Path:
    zstandard = pytest.importorskip("zstandard", reason="the optional zstandard extra is not installed")
    plain = io.BytesIO()
    with tarfile.open(fileobj=plain, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path.write_bytes(zstandard.ZstdCompressor().compress(plain.getvalue()))
    return path


def _fastio_samples(loader: fastio.StreamLoader) -> dict[str, dict[str, bytes]]:
    out = {}
    for batch in loader:
        for row, key in enumerate(batch["__key__"]):
            out[key] = {f: batch[f][row] for f in ("cls", "jpg", "json")}
    return out


def test_tgz_gives_the_keys_and_bytes_webdataset_gives(tmp_path):
    webdataset = pytest.importorskip("webdataset", reason="webdataset is the reference here")
    path = _write_tar(tmp_path / "sample.tgz", _members(0, 23), "w:gz")
    loader = fastio.StreamLoader(
        str(path),
        batch_size=5,
        read=fastio.ReadOptions(decode=_raw),
        remote=fastio.RemoteOptions(cache_dir=str(tmp_path / "cache")),
    )
    mine = _fastio_samples(loader)
    theirs = {
        s["__key__"]: {f: s[f] for f in ("cls", "jpg", "json")}
        for s in webdataset.WebDataset(str(path), shardshuffle=False, empty_check=False)
    }
    assert len(theirs) == 23
    assert mine == theirs


@pytest.mark.parametrize("suffix", [".tar.gz", ".tar.zst"])
def test_compressed_shards_read_like_the_plain_tars(tmp_path, suffix):
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    plain.mkdir()
    packed.mkdir()
    for shard in range(3):
        members = _members(shard, 7 + 3 * shard)
        _write_tar(plain / f"shard-{shard:03d}.tar", members)
        if suffix == ".tar.gz":
            _write_tar(packed / f"shard-{shard:03d}{suffix}", members, "w:gz")
        else:
            _write_zst(packed / f"shard-{shard:03d}{suffix}", members)
    options = OpenOptions(decode=_raw, cache_dir=str(tmp_path / "cache"))
    source = open_compressed_tars(str(packed / f"shard-{{000..002}}{suffix}"), options)
    reference = fastio.StreamLoader(
        str(plain / "shard-{000..002}.tar"),
        batch_size=4,
        shuffle="shard",
        seed=9,
        read=fastio.ReadOptions(decode=_raw),
    )
    mine = fastio.StreamLoader(source, batch_size=4, shuffle="shard", seed=9, num_workers=2)
    for a, b in zip(reference, mine, strict=True):
        assert a == b


def test_tgz_over_http_is_decompressed_once_and_resumes(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    for shard in range(4):
        _write_tar(root / f"shard-{shard:03d}.tgz", _members(shard, 6 + shard), "w:gz")
    with HttpServer(root) as server:
        source = RemoteTarSource(
            server.url("shard-{000..003}.tgz"), cache_dir=tmp_path / "cache", retry=FAST_RETRY, decode=_raw
        )
        loader = fastio.StreamLoader(source, batch_size=4, shuffle="shard", seed=2)
        first = iter(loader)
        seen = Counter(k for _ in range(2) for k in next(first)["__key__"])
        state = loader.state_dict()
        resumed = fastio.StreamLoader(source, batch_size=4, shuffle="shard", seed=2)
        resumed.load_state_dict(state)
        seen.update(k for batch in resumed for k in batch["__key__"])
        # A second source on the same cache opens from what the first one kept: nothing is downloaded.
        served = sum(r.sent for r in server.log())
        again = RemoteTarSource(
            server.url("shard-{000..003}.tgz"), cache_dir=tmp_path / "cache", retry=FAST_RETRY, decode=_raw
        )
        assert [len(list(b["__key__"])) for b in fastio.StreamLoader(again, batch_size=100)] == [
            sum(range(6, 10))
        ]
        assert sum(r.sent for r in server.log() if r.method == "GET") == served
        source.close()
        again.close()
    assert sum(seen.values()) == sum(range(6, 10)) and set(seen.values()) == {1}
    for shard in range(4):  # each compressed shard crossed the network exactly once
        assert (
            server.bytes_served(f"/shard-{shard:03d}.tgz") == (root / f"shard-{shard:03d}.tgz").stat().st_size
        )


def test_truncated_gzip_names_the_shard(tmp_path):
    path = _write_tar(tmp_path / "bad.tar.gz", _members(0, 5), "w:gz")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CorruptShardError, match="bad.tar.gz"):
        open_compressed_tars(str(path), OpenOptions(cache_dir=str(tmp_path / "cache")))
    assert not any(p.name.endswith(".tar") for p in (tmp_path / "cache").rglob("*"))  # nothing half-made


def test_zst_without_zstandard_says_which_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import zstandard now raises ImportError
    with pytest.raises(ImportError, match="pip install zstandard"):
        decompress(io.BytesIO(b"\x28\xb5\x2f\xfd"), "zstd", io.BytesIO())


def test_gzip_decompress_streams_what_gzip_wrote():
    data = np.random.default_rng(3).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    out = io.BytesIO()
    assert decompress(io.BytesIO(gzip.compress(data)), "gzip", out) == len(data)
    assert out.getvalue() == data


@pytest.mark.parametrize(
    "target, expected",
    [("a/shard-{000..009}.tar.gz", True), ("a/x.tgz", True), ("a/x.tar.zst", True), ("a/x.tar", False),
     (["a.tgz", "b.tar.gz"], True), (["a.tgz", "b.tar"], False)],
)  # fmt: skip
def test_is_compressed_tar(target, expected):
    assert is_compressed_tar(target) is expected


@pytest.mark.parametrize("suffix", list(COMPRESSED_SUFFIXES))
def test_every_compressed_suffix_opens_locally_and_over_http(tmp_path, suffix):
    root = tmp_path / "www"
    root.mkdir()
    path = root / f"shard-000{suffix}"
    members = _members(0, 5)
    if COMPRESSED_SUFFIXES[suffix] == "gzip":
        _write_tar(path, members, "w:gz")
    else:
        _write_zst(path, members)
    expected = sorted({name.rsplit(".", 1)[0] for name, _ in members})

    def keys(target: str, cache: str) -> list[str]:
        source = open_source(target, OpenOptions(decode=_raw, cache_dir=str(tmp_path / cache)))
        found = sorted(k for b in fastio.StreamLoader(source, batch_size=100) for k in b["__key__"])
        if hasattr(source, "close"):  # a remote source's prefetcher and pins; a local one holds neither
            source.close()
        return found

    assert keys(str(path), "local") == expected
    with HttpServer(root) as server:
        assert keys(server.url(path.name), "remote") == expected


def test_int_fields_of_compressed_tars_are_tensors(tmp_path):
    path = _write_tar(tmp_path / "s.tgz", _members(1, 9), "w:gz")
    batch = next(
        iter(
            fastio.StreamLoader(
                str(path), batch_size=9, remote=fastio.RemoteOptions(cache_dir=str(tmp_path / "cache"))
            )
        )
    )
    assert batch["cls"].dtype == torch.int64 and len(batch["__key__"]) == 9


def test_local_compressed_tars_run_no_remote_code(tmp_path):
    path = _write_tar(tmp_path / "s.tgz", _members(2, 4), "w:gz")
    cache = str(tmp_path / "cache")
    code = (
        "import sys, fastio; "
        f"remote = fastio.RemoteOptions(cache_dir={cache!r}); "
        f"loader = fastio.StreamLoader({str(path)!r}, batch_size=4, remote=remote); "
        "keys = [k for b in loader for k in b['__key__']]; "
        "print(len(keys), 'fastio.remote' in sys.modules, 'fsspec' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["4", "False", "False"]


def test_a_local_compressed_tar_is_decompressed_again_only_when_it_changes(tmp_path):
    path = _write_tar(tmp_path / "s.tgz", _members(3, 5), "w:gz")
    options = OpenOptions(decode=_raw, cache_dir=str(tmp_path / "cache"))
    first = open_compressed_tars(str(path), options).shards.paths[0]
    made = Path(first).stat().st_mtime_ns
    assert open_compressed_tars(str(path), options).shards.paths[0] == first
    assert Path(first).stat().st_mtime_ns == made  # reused, not decompressed again
    _write_tar(path, _members(4, 6), "w:gz")
    again = open_compressed_tars(str(path), options)
    assert again.num_samples == 6


def test_local_copies_are_not_the_remote_cache_s_entries(tmp_path):
    path = _write_tar(tmp_path / "s.tgz", _members(5, 7), "w:gz")
    cache = tmp_path / "cache"
    open_compressed_tars(str(path), OpenOptions(cache_dir=str(cache)))
    assert any(cache.rglob("*.tar"))
    assert ShardCache(cache).usage() == 0  # neither counted against a cache_limit nor evicted
