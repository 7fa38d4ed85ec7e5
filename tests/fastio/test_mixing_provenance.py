"""Weighted streams over real sources (shard sets, tars, compressed and remote ones, datasets): the provenance
field says which stream each sample came from."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest
import torch

import fastio

sys.path.insert(0, str(Path(__file__).parent))
from _mixing_helpers import write_shards, write_tar  # noqa: E402


def test_provenance_field_says_each_sample_stream(tmp_path, fio):
    a, b = write_shards(tmp_path / "a", 0, 40, fio), write_shards(tmp_path / "b", 1000, 23, fio)
    loader = fastio.StreamLoader([fastio.Stream(a, 0.6), fastio.Stream(b, 0.4)], batch_size=7, shuffle=True)
    rows = 0
    for batch in loader:
        ys = fio.check_batch(batch)  # every field of every row is the sample its y names
        assert batch["stream"].dtype == torch.int64
        assert batch["stream"].tolist() == [int(y >= 1000) for y in ys]
        rows += len(ys)
    assert rows == 63


def test_tar_and_compressed_tar_streams_mix(tmp_path):
    plain, packed = write_tar(tmp_path / "a.tar", 0, 30), write_tar(tmp_path / "b.tar.gz", 500, 12, "gz")
    streams = [fastio.Stream(plain, 2), fastio.Stream(packed, 1)]
    loader = fastio.StreamLoader(
        streams, batch_size=6, shuffle="shard", remote=fastio.RemoteOptions(cache_dir=tmp_path / "cache")
    )
    seen = []
    for batch in loader:
        assert batch["stream"].tolist() == [int(c >= 500) for c in batch["cls"].tolist()]
        assert batch["txt"] == [f"doc {c}" for c in batch["cls"].tolist()]
        seen += batch["cls"].tolist()
    assert collections.Counter(c >= 500 for c in seen) == {False: 28, True: 14}


def test_a_remote_stream_mixes_with_a_local_one(tmp_path, fio):
    from benchmarks.http_server import HttpServer

    write_shards(tmp_path / "www" / "web", 0, 40, fio)
    local = write_shards(tmp_path / "code", 1000, 15, fio)
    with HttpServer(tmp_path / "www") as server:
        streams = [fastio.Stream(server.url("web/"), 0.6, name="web"), fastio.Stream(local, 0.4, name="code")]
        with pytest.raises(ValueError, match="shuffle='shard'"):
            fastio.StreamLoader(
                streams, shuffle=True, remote=fastio.RemoteOptions(cache_dir=tmp_path / "cache")
            )
        loader = fastio.StreamLoader(
            streams, batch_size=6, shuffle="shard", remote=fastio.RemoteOptions(cache_dir=tmp_path / "cache")
        )
        seen = collections.Counter()
        for batch in loader:
            ys = fio.check_batch(batch)
            assert batch["stream"].tolist() == [int(y >= 1000) for y in ys]
            seen.update(int(y >= 1000) for y in ys)
        assert seen == {0: 33, 1: 22}
        stats = loader.stats()["source"]
        assert stats["streams"]["web"]["downloaded_bytes"] > 0 and stats["streams"]["code"] == {}
        loader._source.sources[0].close()


def test_dataset_streams_tag_dict_samples():
    web = [{"v": i} for i in range(20)]
    code = [{"v": 100 + i} for i in range(10)]
    loader = fastio.StreamLoader([fastio.Stream(web, 1), fastio.Stream(code, 1)], batch_size=5, num_workers=0)
    for batch in loader:
        assert batch["stream"].tolist() == [int(v >= 100) for v in batch["v"].tolist()]
    assert "stream" not in web[0]  # the dataset's own samples are left alone
