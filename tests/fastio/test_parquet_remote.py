"""Parquet files over HTTP (fastio.format.parquet.remote), on the local Range server of the benchmarks: only
the footers and the selected columns' chunks of the row groups read are fetched (bytes and requests
counted), batches equal a local source's, shuffle=True under a small cache reads each row once within the
cache's limit, a resume downloads only what it still reads, packing works, a corrupt footer is named."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow", reason="the parquet extra (pyarrow) is not installed")
pq = pytest.importorskip("pyarrow.parquet", reason="the parquet extra (pyarrow) is not installed")
pytest.importorskip("aiohttp", reason="HTTP needs fsspec's aiohttp")

import fastio  # noqa: E402
from fastio.errors import CorruptShardError  # noqa: E402
from fastio.format.parquet.opening import parquet_source  # noqa: E402
from fastio.format.parquet.remote import RemoteParquetSource  # noqa: E402
from fastio.remote import RemoteNotFoundError  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _remote_helpers import FAST_RETRY, cache_folder_bytes  # noqa: E402

from benchmarks.http_server import HttpServer  # noqa: E402

FILES, ROWS, GROUP = 3, 60, 15  # 4 row groups per file
BLOB = 2000  # bytes of the unselected "blob" column per row: most of each file


def _write(folder: Path) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    names = []
    for f in range(FILES):
        ys = np.arange(f * ROWS, (f + 1) * ROWS, dtype=np.int64)
        table = pa.table({
            "y": ys,
            "ids": pa.array([np.arange(1 + i % 6, dtype=np.int32) + i for i in ys], pa.list_(pa.int32())),
            "blob": [rng.bytes(BLOB) for _ in ys],  # random: it does not compress
        })  # fmt: skip
        name = f"train-{f:05d}-of-{FILES:05d}.parquet"
        pq.write_table(table, folder / name, row_group_size=GROUP)
        names.append(name)
    return names


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("www")
    names = _write(root / "data")
    with HttpServer(root) as server:
        yield server, root, names


def _url(server: HttpServer) -> str:
    return server.url(f"data/train-{{00000..{FILES - 1:05d}}}-of-{FILES:05d}.parquet")


def test_only_footers_and_the_selected_chunks_are_fetched(served, tmp_path):
    server, root, names = served
    server.clear_log()
    source = RemoteParquetSource(
        _url(server), columns=["y", "ids"], cache_dir=tmp_path / "cache", retry=FAST_RETRY
    )
    loader = fastio.StreamLoader(source, batch_size=16, shuffle=True, seed=0)
    rows = [y for b in loader for y in b["y"].tolist()]
    assert sorted(rows) == list(range(FILES * ROWS))
    for name in names:
        meta = pq.read_metadata(root / "data" / name)
        size = (root / "data" / name).stat().st_size
        groups = [meta.row_group(g) for g in range(meta.num_row_groups)]
        # y and ids (a dictionary page first): (start, bytes) of each chunk
        chunks = [
            (r.column(c).dictionary_page_offset, r.column(c).total_compressed_size)
            for r in groups
            for c in (0, 1)
        ]
        gets = [r for r in server.log(f"/data/{name}") if r.method == "GET"]
        assert len(gets) == 1 + meta.num_row_groups  # the tail, then one request per row group
        assert gets[0].end == size and gets[0].start <= size - meta.serialized_size - 8
        for r in gets[1:]:  # y and ids of one row group, nothing of the blob column
            inside = [(a, n) for a, n in chunks if r.start <= a < r.end]
            assert r.end - r.start == sum(n for _, n in inside) and len(inside) == 2, (r, chunks)


def test_footers_are_kept_in_the_cache_within_its_limit_and_fetched_again_for_a_changed_file(tmp_path):
    names = _write(tmp_path / "www" / "data")
    with HttpServer(tmp_path / "www") as server:
        first = RemoteParquetSource(_url(server), ["y"], tmp_path / "cache", "1MB", retry=FAST_RETRY)
        footers = [pq.read_metadata(tmp_path / "www" / "data" / n).serialized_size for n in names]
        assert first.resident_bytes() == sum(8 + f + 8 for f in footers)  # size, footer, its length and PAR1
        server.clear_log()
        again = RemoteParquetSource(_url(server), ["y"], tmp_path / "cache", "1MB", retry=FAST_RETRY)
        assert {r.method for r in server.log()} == {"HEAD"} and len(server.log()) == FILES
        assert again.shard_sizes == first.shard_sizes
        changed = tmp_path / "www" / "data" / names[0]
        pq.write_table(pa.table({"y": np.arange(7), "ids": [[1]] * 7, "blob": [b""] * 7}), changed)
        server.clear_log()
        fresh = RemoteParquetSource(_url(server), ["y"], tmp_path / "cache", "1MB", retry=FAST_RETRY)
        assert [r.path for r in server.log() if r.method == "GET"] == [f"/data/{names[0]}"]
        assert fresh.shard_sizes[0] == 7
        assert cache_folder_bytes(tmp_path / "cache") <= 1_000_000


def test_remote_batches_equal_a_local_sources_and_come_from_the_cache_next_epoch(served, tmp_path):
    server, root, _ = served
    local = fastio.StreamLoader(
        parquet_source(root / "data", columns=["y", "ids"]), batch_size=10, shuffle="shard", seed=1
    )
    remote = parquet_source(_url(server), ["y", "ids"], cache_dir=tmp_path / "c")
    url = fastio.StreamLoader(remote, batch_size=10, shuffle="shard", seed=1)
    for epoch in range(2):
        local.set_epoch(epoch)
        url.set_epoch(epoch)
        for a, b in zip(local, url, strict=True):
            assert a["y"].tolist() == b["y"].tolist()
            assert all(np.array_equal(x.numpy(), z.numpy()) for x, z in zip(a["ids"], b["ids"], strict=True))
        downloaded = url.stats()["source"]["downloaded_bytes"]
        assert (downloaded > 0) == (epoch == 0)


def test_a_url_opens_through_the_registry_with_every_column(served, tmp_path):
    server, _, _ = served
    loader = fastio.StreamLoader(
        _url(server), batch_size=32, remote=fastio.RemoteOptions(cache_dir=str(tmp_path))
    )
    batch = next(iter(loader))
    assert set(batch) == {"y", "ids", "blob"} and len(batch["blob"][0]) == BLOB


def test_shuffle_true_under_a_small_cache_reads_each_row_once_within_the_limit(served, tmp_path):
    server, _, _ = served
    cache = tmp_path / "cache"
    probe = RemoteParquetSource(_url(server), columns=["y", "blob"], cache_dir=cache, retry=FAST_RETRY)
    unit = max(s.footprint for s in probe.shards)
    probe.close()
    limit = 4 * unit
    source = RemoteParquetSource(
        _url(server), columns=["y", "blob"], cache_dir=cache, cache_limit=limit, retry=FAST_RETRY
    )
    loader = fastio.StreamLoader(source, batch_size=8, shuffle=True, seed=0)
    it = iter(loader)
    rows, peak = [], 0
    for batch in it:
        rows += batch["y"].tolist()
        peak = max(peak, cache_folder_bytes(cache))
    assert sorted(rows) == list(range(FILES * ROWS)) and rows != sorted(rows)
    assert loader.stats()["shuffle_mode"] == "window" and peak <= limit + unit


def test_a_resume_gives_the_same_batches_and_downloads_only_what_it_still_reads(served, tmp_path):
    server, _, _ = served

    def make(cache: Path) -> fastio.StreamLoader:
        source = RemoteParquetSource(_url(server), columns=["y"], cache_dir=cache, retry=FAST_RETRY)
        return fastio.StreamLoader(source, batch_size=15, shuffle="shard", seed=2,
                                   order=fastio.OrderOptions(shuffle_window=1, shuffle_block=15))  # fmt: skip

    loader = make(tmp_path / "a")
    full = [b["y"].tolist() for b in loader]
    it = iter(loader)
    head = [next(it)["y"].tolist() for _ in range(8)]
    state = loader.state_dict()
    again = make(tmp_path / "b")
    again.load_state_dict(state)
    assert head + [b["y"].tolist() for b in again] == full
    assert again.stats()["source"]["downloads"] == 4  # the 4 row groups of the last third


def test_packing_a_remote_token_column(served, tmp_path, monkeypatch):
    monkeypatch.setenv("FASTIO_CACHE", str(tmp_path / "tokens"))
    server, root, _ = served
    pack = fastio.Pack("ids", seq_len=12, eos=0)
    source = parquet_source(_url(server), ["ids"], cache_dir=tmp_path)
    remote = fastio.StreamLoader(source, batch_size=4, seed=3, shuffle=True, pack=pack)
    local = fastio.StreamLoader(
        parquet_source(root / "data", ["ids"]), batch_size=4, seed=3, shuffle=True, pack=pack
    )
    for a, b in zip(remote, local, strict=True):
        assert (a["tokens"] == b["tokens"]).all()


def test_a_corrupt_remote_footer_is_a_named_error(tmp_path):
    names = _write(tmp_path / "data")
    path = tmp_path / "data" / names[1]
    path.write_bytes(path.read_bytes()[:-3000])
    with (
        HttpServer(tmp_path) as server,
        pytest.raises(CorruptShardError, match=rf"{names[1]}: field 'footer'"),
    ):
        RemoteParquetSource(_url(server), cache_dir=tmp_path / "cache", retry=FAST_RETRY)


def test_a_folder_url_reads_its_parquet_files_where_the_store_lists_them_else_asks_for_a_glob(
    served, tmp_path
):
    server, root, names = served
    fsspec = pytest.importorskip("fsspec")
    memory = fsspec.filesystem("memory")
    for name in names:
        memory.pipe(f"/hub-{tmp_path.name}/data/{name}", (root / "data" / name).read_bytes())
    folder = f"memory://hub-{tmp_path.name}/data/"
    loader = fastio.StreamLoader(
        folder, batch_size=32, read=fastio.ReadOptions(columns=["y"]), remote=fastio.RemoteOptions(tmp_path)
    )
    assert sorted(y for b in loader for y in b["y"].tolist()) == list(range(FILES * ROWS))
    memory.pipe(
        f"/hub-{tmp_path.name}/data/test-00000-of-00001.parquet", (root / "data" / names[0]).read_bytes()
    )
    with pytest.raises(ValueError, match=r"several splits .*test-\*\.parquet.*train-\*\.parquet"):
        fastio.StreamLoader(folder, batch_size=32, remote=fastio.RemoteOptions(tmp_path))
    with pytest.raises(RemoteNotFoundError, match=r"no index\.json .*name them with a glob"):
        fastio.StreamLoader(server.url("data/"), batch_size=32, remote=fastio.RemoteOptions(tmp_path))
