"""Parquet files read in place (fastio.format.parquet): a Hub-style folder of shards with row groups as the
shards, every column kind, columns=, shard-aware orders and rank splits over row groups, exact resume
(mid-epoch, after several epochs, another world size), kept batches, a memory budget smaller than the set,
token packing of a token column and of a text column, mixing with fastio shards, and bad input (a missing
column, a schema that differs between files, a corrupt or truncated footer, a file truncated while read)
as named errors naming the file and the column."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pa = pytest.importorskip("pyarrow", reason="the parquet extra (pyarrow) is not installed")
pq = pytest.importorskip("pyarrow.parquet", reason="the parquet extra (pyarrow) is not installed")

import fastio  # noqa: E402
from fastio.errors import CorruptShardError, SchemaMismatchError  # noqa: E402
from fastio.format.parquet import tokens  # noqa: E402
from fastio.format.parquet.decoded import DecodedRowGroups  # noqa: E402
from fastio.format.parquet.opening import parquet_source  # noqa: E402
from fastio.pipeline.order import epoch_order, rank_indices  # noqa: E402

ROWS = (40, 41, 36)  # per file; row groups of 13: 4 + 4 + 3 of them, the last of each shorter
GROUP = 13
TOTAL = sum(ROWS)


def _ids(i: int) -> np.ndarray:
    return np.arange(1 + (i * 7) % 5, dtype=np.int32) + 100 * i


def _table(first: int, rows: int) -> pa.Table:
    ys = np.arange(first, first + rows, dtype=np.int64)
    return pa.table({
        "y": ys,
        "emb": pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ys, 3).astype(np.float32)), 3),
        "ids": pa.array([_ids(int(i)) for i in ys], type=pa.list_(pa.int32())),
        "text": [f"row {i}" for i in ys],
        "maybe": pa.array([None if i % 4 == 0 else int(i) for i in ys], type=pa.int16()),
    })  # fmt: skip


def _write_set(folder: Path, rows: tuple[int, ...] = ROWS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    first = 0
    for f, n in enumerate(rows):
        pq.write_table(
            _table(first, n), folder / f"train-{f:05d}-of-{len(rows):05d}.parquet", row_group_size=GROUP
        )
        first += n
    return folder


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_set(tmp_path_factory.mktemp("parquet") / "data")


def _check(batch: dict) -> list[int]:
    ys = batch["y"].tolist()
    for row, i in enumerate(ys):
        assert batch["emb"][row].tolist() == [float(i)] * 3
        np.testing.assert_array_equal(batch["ids"][row].numpy(), _ids(i))
        assert batch["text"][row] == f"row {i}"
        assert batch["maybe"][row] == (None if i % 4 == 0 else i)
    return ys


def _ys(loader: fastio.StreamLoader) -> list[list[int]]:
    return [b["y"].tolist() for b in loader]


def test_a_hub_folder_reads_every_row_once_with_each_column_kind(data):
    loader = fastio.StreamLoader(str(data), batch_size=16, shuffle=True, seed=0)
    source = loader._source
    assert source.shard_sizes == [13, 13, 13, 1, 13, 13, 13, 2, 13, 13, 10]  # the row groups
    assert source.fixed_specs() == {"y": (torch.int64, ()), "emb": (torch.float32, (3,))}
    seen = [y for batch in loader for y in _check(batch)]
    assert sorted(seen) == list(range(TOTAL)) and seen != sorted(seen)


def test_a_pattern_a_list_and_a_file_open_like_the_folder(data):
    files = sorted(str(p) for p in data.glob("*.parquet"))
    for target in (str(data / "train-*.parquet"), files, files[0]):
        rows = [y for b in fastio.StreamLoader(target, batch_size=50) for y in _check(b)]
        assert rows == list(range(TOTAL if target != files[0] else ROWS[0]))


def test_a_folder_of_several_splits_is_refused_with_the_pattern_of_each(tmp_path):
    folder = _write_set(tmp_path / "data", rows=(20, 20))
    pq.write_table(_table(0, 5), folder / "test-00000-of-00001.parquet")
    with pytest.raises(
        ValueError, match=r"several splits .*test-\*\.parquet \(1 files\).*train-\*\.parquet \(2 files\)"
    ):
        fastio.StreamLoader(str(folder), batch_size=4)
    assert sum(len(b["y"]) for b in fastio.StreamLoader(str(folder / "train-*.parquet"), batch_size=8)) == 40


def test_columns_reads_only_those(data):
    loader = fastio.StreamLoader(parquet_source(data, columns=["text", "y"]), batch_size=8)
    batch = next(iter(loader))
    assert list(batch) == ["y", "text"] or set(batch) == {"y", "text"}
    assert batch["text"][:2] == ["row 0", "row 1"]


def test_read_options_columns_select_a_sets_columns_and_are_refused_where_they_cannot_hold(data, tmp_path):
    loader = fastio.StreamLoader(str(data), batch_size=8, read=fastio.ReadOptions(columns=["y", "ids"]))
    assert loader._source.selected_columns == ["y", "ids"] and next(iter(loader)).keys() == {"y", "ids"}
    with pytest.raises(ValueError, match="cannot select columns"):
        fastio.StreamLoader(
            str(_shard_tokens(tmp_path / "tokens")), batch_size=4, read=fastio.ReadOptions(columns=["ids"])
        )
    with pytest.raises(ValueError, match=r"parquet_source\(path, columns="):
        fastio.StreamLoader(parquet_source(data), batch_size=4, read=fastio.ReadOptions(columns=["y"]))
    with pytest.raises(TypeError, match=r"read=fastio.ReadOptions\(columns=...\)"):
        fastio.StreamLoader(str(data), batch_size=4, columns=["y"])
    with pytest.raises(TypeError, match="list of column names"):
        fastio.ReadOptions(columns="y")


def test_a_missing_column_names_the_file_and_the_column(data):
    with pytest.raises(SchemaMismatchError, match=r"train-00000-of-00003\.parquet.*'label'.*no such column"):
        parquet_source(data, columns=["y", "label"])


def test_a_schema_that_differs_between_files_names_the_file_and_the_column(tmp_path):
    folder = _write_set(tmp_path / "data", rows=(20, 20))
    table = _table(40, 20)
    pq.write_table(
        table.set_column(0, "y", table.column("y").cast(pa.int32())), folder / "train-00002-of-00003.parquet"
    )
    with pytest.raises(
        SchemaMismatchError, match=r"train-00002-of-00003\.parquet: field 'y': schema says int64"
    ):
        fastio.StreamLoader(str(folder), batch_size=4)
    pq.write_table(table.drop_columns(["text"]), folder / "train-00002-of-00003.parquet")
    with pytest.raises(
        SchemaMismatchError, match=r"train-00002-of-00003\.parquet: field 'text'.*no such column"
    ):
        fastio.StreamLoader(str(folder), batch_size=4)
    assert parquet_source(folder, columns=["y", "emb"]).shard_sizes == [
        13,
        7,
        13,
        7,
        20,
    ]  # text not read: fine


@pytest.mark.parametrize("damage", ["cut", "garbage", "tiny", "footer"])
def test_a_corrupt_or_truncated_footer_is_a_named_error(tmp_path, damage):
    folder = _write_set(tmp_path / "data", rows=(20, 20))
    path = folder / "train-00001-of-00002.parquet"
    data = path.read_bytes()
    damaged = {
        "cut": data[:-100],
        "garbage": data[:-4] + b"XXXX",
        "tiny": b"PAR1",
        "footer": data[:-200] + b"\x07" * 192 + data[-8:],
    }[damage]
    path.write_bytes(damaged)
    with pytest.raises(CorruptShardError, match=r"train-00001-of-00002\.parquet: field 'footer'"):
        fastio.StreamLoader(str(folder), batch_size=4)


def test_a_file_truncated_while_read_is_a_named_error_never_a_crash(tmp_path):
    folder = _write_set(tmp_path / "data", rows=(40, 40))
    loader = fastio.StreamLoader(str(folder), batch_size=10)
    it = iter(loader)
    next(it)
    path = folder / "train-00001-of-00002.parquet"
    os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(CorruptShardError, match=r"train-00001-of-00002\.parquet: field 'file size'"):
        list(it)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_after_several_epochs_gives_the_same_batches(data, num_workers):
    def make() -> fastio.StreamLoader:
        return fastio.StreamLoader(str(data), batch_size=7, shuffle=True, seed=3, num_workers=num_workers)

    loader = make()
    for epoch in range(2):
        loader.set_epoch(epoch)
        assert sorted(y for b in _ys(loader) for y in b) == list(range(TOTAL))
    loader.set_epoch(2)
    full = _ys(loader)
    it = iter(loader)
    head = [next(it)["y"].tolist() for _ in range(5)]
    state = loader.state_dict()
    again = make()
    again.load_state_dict(state)
    assert head + _ys(again) == full and full != _ys(make())


def test_resume_at_another_world_size_reads_the_rest_once(data):
    def make(rank: int, world: int) -> fastio.StreamLoader:
        order = fastio.OrderOptions(rank=rank, world_size=world)
        return fastio.StreamLoader(str(data), batch_size=5, shuffle="shard", seed=1, order=order)

    consumed, states = [], []
    for rank in range(2):
        loader = make(rank, 2)
        it = iter(loader)
        consumed += [y for _ in range(3) for y in next(it)["y"].tolist()]
        states.append(loader.state_dict())
    rest = []
    for rank in range(3):
        loader = make(rank, 3)
        loader.load_state_dict(states[0])
        rest += [y for b in _ys(loader) for y in b]
    assert len(set(consumed)) == len(consumed) and set(consumed) | set(rest) == set(range(TOTAL))
    assert len(consumed) + len(rest) - TOTAL <= 2


def test_shard_shuffle_and_ranks_split_by_row_group(data):
    """The order is fastio's shard-aware order over the row groups, split across ranks like any order."""
    groups = [13, 13, 13, 1, 13, 13, 13, 2, 13, 13, 10]
    order = epoch_order(groups, seed=4, epoch=1, shuffle="shard", block=8, window=2)
    for rank in range(2):
        options = fastio.OrderOptions(shuffle_window=2, shuffle_block=8, rank=rank, world_size=2)
        loader = fastio.StreamLoader(str(data), batch_size=8, shuffle="shard", seed=4, order=options)
        loader.set_epoch(1)
        assert [y for b in _ys(loader) for y in b] == rank_indices(
            order, 0, 2, rank, drop_last=False
        ).tolist()


def test_kept_batches_are_never_overwritten_without_clone(data):
    loader = fastio.StreamLoader(str(data), batch_size=9, shuffle=True, seed=5, num_workers=2)
    kept = list(loader)  # no .clone(): the loader must not refill what is still viewed
    assert sorted(y for b in kept for y in _check(b)) == list(range(TOTAL))


def test_a_set_larger_than_its_memory_budget_is_read_in_a_window_of_row_groups(data):
    source = parquet_source(data, memory_limit=3000)
    assert source.requires_shard_order and 1 <= source.shards_held() < len(source.shard_sizes)
    loader = fastio.StreamLoader(source, batch_size=8, shuffle=True, seed=0)
    seen = [y for b in loader for y in _check(b)]
    assert sorted(seen) == list(range(TOTAL))
    assert source.stats()["row_groups_decoded"] <= len(source.shard_sizes) + 2  # each about once
    assert source.stats()["decoded_bytes"] <= 3000 + max(g.decoded_bytes for g in source.row_groups) * 2


def _shard_tokens(folder: Path) -> Path:
    with fastio.ShardWriter(folder, schema={"ids": ("int32", None)}, max_samples=GROUP) as writer:
        for i in range(TOTAL):
            writer.write({"ids": _ids(i)})
    return folder


def test_packing_a_token_column_gives_what_the_same_documents_in_fastio_shards_give(
    data, tmp_path, monkeypatch
):
    monkeypatch.setenv("FASTIO_CACHE", str(tmp_path / "cache"))
    pack = fastio.Pack("ids", seq_len=16, eos=7, shift=True, positions=True)
    ours = fastio.StreamLoader(str(data), batch_size=4, shuffle=True, seed=2, pack=pack)
    theirs = fastio.StreamLoader(
        str(_shard_tokens(tmp_path / "tokens")), batch_size=4, shuffle=True, seed=2, pack=pack
    )
    got, want = list(ours), list(theirs)
    assert len(got) == len(want) > 3
    for a, b in zip(got, want, strict=True):
        assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_the_token_files_are_kept_for_the_next_loader_and_made_again_for_a_changed_file(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("FASTIO_CACHE", str(tmp_path / "cache"))
    folder = _write_set(tmp_path / "data", rows=(30, 30))
    pack = fastio.Pack("ids", seq_len=8)
    first = [b["tokens"] for b in fastio.StreamLoader(str(folder), batch_size=4, pack=pack)]
    kept = sorted((tmp_path / "cache" / "local" / "parquet-tokens").glob("*.tokens"))
    assert len(kept) == 2

    def no_decode(*args):
        raise AssertionError("decoded again")

    with monkeypatch.context() as patched:
        patched.setattr(tokens, "_column_tokens", no_decode)
        again = [b["tokens"] for b in fastio.StreamLoader(str(folder), batch_size=4, pack=pack)]
    assert all((a == b).all() for a, b in zip(first, again, strict=True))
    pq.write_table(_table(30, 31), folder / "train-00001-of-00002.parquet", row_group_size=GROUP)  # rewritten
    changed = [b["tokens"] for b in fastio.StreamLoader(str(folder), batch_size=4, pack=pack)]
    assert len(sorted((tmp_path / "cache" / "local" / "parquet-tokens").glob("*.tokens"))) == 3
    monkeypatch.setenv("FASTIO_CACHE", str(tmp_path / "fresh"))
    fresh = [b["tokens"] for b in fastio.StreamLoader(str(folder), batch_size=4, pack=pack)]
    assert len(changed) == len(fresh) and all((a == b).all() for a, b in zip(changed, fresh, strict=True))


@pytest.mark.parametrize("memory_limit", [10**9, 1], ids=["in-memory", "token-files"])
def test_a_packed_token_column_resumes_exactly_from_memory_and_from_token_files(
    data, tmp_path, monkeypatch, memory_limit
):
    monkeypatch.setenv("FASTIO_CACHE", str(tmp_path / "cache"))
    source = parquet_source(data, columns=["ids"], memory_limit=memory_limit)
    held = {type(entry).__name__ for entry in source.token_documents("ids").table.files}
    assert held == ({"_HeldTokens"} if memory_limit > 1 else {"MappedFile"})  # decoded once into either
    pack = fastio.Pack("ids", seq_len=8, eos=0, shift=True)

    def loader(of: object, shuffle: bool) -> fastio.StreamLoader:
        return fastio.StreamLoader(of, batch_size=3, shuffle=shuffle, seed=5, pack=pack)

    first = loader(source, True)
    it = iter(first)
    next(it), next(it)
    state = first.state_dict()
    rest = [b["tokens"] for b in it]
    again = loader(source, True)
    again.load_state_dict(state)
    assert len(rest) > 3
    assert all((a == b).all() for a, b in zip(rest, (b["tokens"] for b in again), strict=True))
    ours = [b["tokens"] for b in loader(source, False)]
    want = [b["tokens"] for b in loader(str(_shard_tokens(tmp_path / "tokens")), False)]
    assert len(ours) == len(want) and all((a == b).all() for a, b in zip(ours, want, strict=True))


def test_kept_token_files_are_written_past_the_page_cache_whole_or_the_plain_way(tmp_path, monkeypatch):
    monkeypatch.setattr(tokens, "_BLOCK", 8192)  # several staged blocks, the last one padded then cut
    arrays = [np.arange(n, dtype=np.int32) * (n + 1) for n in (1, 2047, 3000, 5)]
    want = np.concatenate(arrays).tobytes()
    if tokens._write_direct(tmp_path / "direct", arrays):  # False where the filesystem refuses O_DIRECT
        assert (tmp_path / "direct").read_bytes() == want
    monkeypatch.delattr(tokens.os, "O_DIRECT", raising=False)
    assert not tokens._write_direct(tmp_path / "plain", arrays)
    decoded = [(None, np.array([len(a)]), a) for a in arrays]
    rows = tokens._write(decoded, tmp_path / "kept.tokens", keep_counts=True, direct=True)
    assert (tmp_path / "kept.tokens").read_bytes() == want and rows.tolist() == [1, 2047, 3000, 5]


def test_packing_a_text_column_through_a_tokenizer(data, tmp_path, monkeypatch):
    monkeypatch.setenv("FASTIO_CACHE", str(tmp_path / "cache"))

    def tokenizer(texts: list[str]) -> list[list[int]]:
        return [[int(word) for word in t.split()[1:]] for t in texts]  # "row 12" -> [12]

    source = parquet_source(data, columns=["text"], tokenizer=tokenizer)
    batches = list(fastio.StreamLoader(source, batch_size=8, pack=fastio.Pack("text", seq_len=6, eos=-1)))
    stream = np.concatenate([b["tokens"].reshape(-1).numpy() for b in batches])
    assert stream[:8].tolist() == [0, -1, 1, -1, 2, -1, 3, -1]
    with pytest.raises(SchemaMismatchError, match="tokenizer="):
        fastio.StreamLoader(str(data), batch_size=8, pack=fastio.Pack("text", seq_len=6))


def test_parquet_mixes_with_fastio_shards_through_streams(data, tmp_path):
    with fastio.ShardWriter(tmp_path / "other", max_samples=10) as writer:
        for i in range(30):
            writer.write({"y": 10_000 + i})
    streams = [
        fastio.Stream(parquet_source(data, columns=["y"]), weight=0.75),
        fastio.Stream(str(tmp_path / "other"), weight=0.25),
    ]
    loader = fastio.StreamLoader(streams, batch_size=16, shuffle="shard", seed=0,
                                 mixing=fastio.MixingOptions(epoch_size=160))  # fmt: skip
    batches = list(loader)
    assert sum(len(b["y"]) for b in batches) == 160
    for batch in batches[:-1]:
        assert batch["stream"].tolist().count(0) in (12, 13)
        assert ((batch["y"] >= 10_000) == (batch["stream"] == 1)).all()


def test_row_groups_decode_ahead_of_the_pass_each_once(data):
    source = parquet_source(data)  # the set fits its memory budget: DECODE_AHEAD row groups decode ahead
    loader = fastio.StreamLoader(source, batch_size=5)
    batches = iter(loader)
    first = _check(next(batches))  # needs the first row group only
    deadline = time.monotonic() + 10
    while source.stats()["row_groups_decoded"] < 1 + source.DECODE_AHEAD and time.monotonic() < deadline:
        time.sleep(0.01)
    assert source.stats()["row_groups_decoded"] == 1 + source.DECODE_AHEAD, "decoded before any batch asked"
    assert first + [y for b in batches for y in _check(b)] == list(range(TOTAL))
    assert source.stats()["row_groups_decoded"] == len(source.shard_sizes), "each row group decoded once"


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_shuffled_pass_decodes_its_row_groups_side_by_side_in_threads_and_processes(data, mode):
    loader = fastio.StreamLoader(
        str(data), batch_size=9, shuffle=True, seed=2, num_workers=2, workers=fastio.WorkerOptions(mode=mode)
    )
    assert sorted(y for b in loader for y in _check(b)) == list(range(TOTAL))


def test_a_background_decode_that_fails_is_raised_by_the_batch_that_needs_it():
    decoded = DecodedRowGroups()

    def bad() -> dict:
        raise CorruptShardError("a.parquet", "row group 3", "a row group pyarrow can decode", "ArrowInvalid")

    decoded.prefetch("a", bad)
    with pytest.raises(CorruptShardError, match="row group 3"):
        decoded.get("a", bad)
    decoded.prefetch("a", lambda: {"y": np.arange(4)})
    deadline = time.monotonic() + 10
    while not decoded.decodes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert decoded.get("a", bad)["y"].tolist() == [0, 1, 2, 3], "kept from the background decode"
