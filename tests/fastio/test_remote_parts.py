"""``shuffle=True`` on remote fastio shards whose cache cannot hold every shard: parts of shards, fetched by
byte range and cached one by one, read in a sliding window over a permutation of every part
(fastio.pipeline.order's "parts"): each sample once per epoch, deterministic, resumable across a part
boundary, the cache within its promise, short reads and corrupt headers named errors."""

from __future__ import annotations

import io
import sys
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import fastio
from fastio.errors import CorruptShardError
from fastio.format.shards.remote import RemoteShardSource
from fastio.format.tar.remote import RemoteTarSource
from fastio.pipeline.order import epoch_order, rank_indices
from fastio.remote import RemoteReadError
from fastio.remote.fetch import cat_ranges, with_retries
from fastio.remote.parts import MAX_PARTS, choose_parts, expected_shards, part_bounds
from fastio.remote.shard import Shard

sys.path.insert(0, str(Path(__file__).parent))
from _remote_helpers import FAST_RETRY, cache_folder_bytes  # noqa: E402

from benchmarks.http_server import HttpServer  # noqa: E402


def _source(url: str, cache_dir: Path, shards_held: float | None, **kwargs) -> RemoteShardSource:
    """A remote source whose cache_limit holds ``shards_held`` of its largest whole shards."""
    probe = RemoteShardSource(url, cache_dir=cache_dir, retry=FAST_RETRY)
    largest = max(s.footprint for s in probe.shards)
    probe.close()
    limit = None if shards_held is None else int(shards_held * largest)
    return RemoteShardSource(url, cache_dir=cache_dir, cache_limit=limit, retry=FAST_RETRY, **kwargs)


@pytest.mark.parametrize("num_samples, parts", [(10, 4), (13, 4), (3, 5), (12, 3), (1, 1)])
def test_parts_cover_a_shard_once_in_order_with_sizes_one_apart(num_samples, parts):
    bounds = part_bounds(num_samples, parts)
    assert [b for _, b in bounds[:-1]] == [a for a, _ in bounds[1:]]
    assert bounds[0][0] == 0 and bounds[-1][1] == num_samples
    sizes = [b - a for a, b in bounds]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1 and len(bounds) == min(parts, num_samples)


def test_a_window_of_parts_is_expected_to_reach_more_shards_than_its_whole_shards():
    assert expected_shards(16, [1] * 16) == 16.0
    assert expected_shards(4, [1] * 16) == pytest.approx(4.0)
    # 32 of 16 x 8 parts: a shard is missing with probability about (3/4) ** 8.
    assert expected_shards(32, [8] * 16) == pytest.approx(16 * (1 - 0.75**8), rel=0.05)


def test_a_cache_that_holds_every_shard_keeps_whole_shards(shard_dir, server, tmp_path):
    source = _source(server.url("train"), tmp_path / "cache", 9)
    try:
        assert choose_parts(source.shards, source.cache.limit, 0, 8, lambda parts: []) is None
        assert source.split_shards(8) is None
    finally:
        source.close()


@pytest.mark.parametrize("num_workers, worker_mode", [(0, "thread"), (2, "thread"), (2, "process")])
def test_shuffle_true_under_a_cache_limit_reads_each_sample_once_from_a_window_of_parts(
    shard_dir, server, tmp_path, fio, num_workers, worker_mode
):
    source = _source(server.url("train"), tmp_path / "cache", 3)
    epochs = []
    try:
        for epoch in (0, 1):
            loader = fastio.StreamLoader(source, batch_size=8, shuffle=True, seed=5, num_workers=num_workers,
                                         workers=fastio.WorkerOptions(mode=worker_mode))  # fmt: skip
            loader.set_epoch(epoch)
            ys = [y for batch in loader for y in fio.check_batch(batch)]
            stats = loader.stats()
            assert stats["shuffle_mode"] == "parts" and stats["shuffle_parts"] > 1
            window = stats["shuffle_window_parts"]
            assert window > 3  # more parts open than the 3 whole shards the cache holds
            # The order is fastio.pipeline.order's sliding window over the parts (source.shard_sizes lists
            # them).
            expected = epoch_order(source.shard_sizes, 5, epoch, "parts", window=window)
            assert ys == expected.tolist()
            assert sorted(ys) == list(range(fio.NUM_SAMPLES))
            epochs.append(ys)
    finally:
        source.close()
    assert epochs[0] != epochs[1]
    assert source.cache.evictions > 0  # the limit bit: parts came and went


def test_the_same_seed_and_epoch_give_the_same_batches_on_a_fresh_cache(shard_dir, server, tmp_path, fio):
    runs = []
    for name in ("a", "b"):
        source = _source(server.url("train"), tmp_path / name, 3)
        try:
            loader = fastio.StreamLoader(source, batch_size=8, shuffle=True, seed=9, num_workers=2)
            runs.append([fio.check_batch(batch) for batch in loader])
        finally:
            source.close()
    assert runs[0] == runs[1]


def _mid_part_cut(batches: list[list[int]], part_sizes: list[int], after: int) -> int:
    """The first batch count from ``after`` on after which some part is read in part: read before the cut
    and after it."""
    cumulative = np.cumsum([0, *part_sizes])
    part = [[int(p) for p in np.searchsorted(cumulative, b, side="right") - 1] for b in batches]
    for cut in range(after, len(batches)):
        if {p for b in part[:cut] for p in b} & {p for b in part[cut:] for p in b}:
            return cut
    raise AssertionError("no batch boundary falls inside a part")


@pytest.mark.parametrize("num_workers, worker_mode", [(0, "thread"), (2, "thread"), (2, "process")])
@pytest.mark.parametrize("after", [1, 6])
def test_a_parts_order_resumes_mid_part_with_the_same_batches(server, tmp_path, fio, num_workers, worker_mode,
                                                              after):  # fmt: skip
    workers = fastio.WorkerOptions(mode=worker_mode)
    options = dict(batch_size=4, shuffle=True, seed=2, num_workers=num_workers, workers=workers)
    first = _source(server.url("train"), tmp_path / "cache", 4)
    try:
        whole = [fio.check_batch(batch) for batch in fastio.StreamLoader(first, **options)]
        cut = _mid_part_cut(whole, list(first.shard_sizes), after)
        loader = fastio.StreamLoader(first, **options)
        it = iter(loader)
        assert [fio.check_batch(next(it)) for _ in range(cut)] == whole[:cut]
        state = loader.state_dict()
        del it
    finally:
        first.close()
    second = _source(server.url("train"), tmp_path / "cache", 4)
    resumed = fastio.StreamLoader(second, **options)
    resumed.load_state_dict(state)
    try:
        assert [fio.check_batch(batch) for batch in resumed] == whole[cut:]
        assert resumed.stats()["shuffle_mode"] == "parts" and resumed.stats()["part_samples"] > 1
    finally:
        second.close()


def test_a_state_saved_under_other_parts_is_refused(server, tmp_path):
    small = _source(server.url("train"), tmp_path / "cache", 2)
    state = fastio.StreamLoader(small, batch_size=8, shuffle=True).state_dict()
    small.close()
    large = _source(server.url("train"), tmp_path / "cache", 5)
    try:
        with pytest.raises(ValueError, match="state_dict shuffle_(parts|window)=.* but this loader has"):
            fastio.StreamLoader(large, batch_size=8, shuffle=True).load_state_dict(state)
    finally:
        large.close()


def test_ranks_reading_a_parts_order_share_the_epoch_exactly_once(server, tmp_path, fio):
    seen: Counter = Counter()
    counts = []
    for rank in range(3):
        source = _source(server.url("train"), tmp_path / "cache", 3)
        loader = fastio.StreamLoader(
            source, batch_size=1, shuffle=True, seed=7, order=fastio.OrderOptions(rank=rank, world_size=3)
        )
        try:
            batches = [fio.check_batch(batch) for batch in loader]
        finally:
            source.close()
        assert loader.stats()["shuffle_mode"] == "parts"
        counts.append(len(batches))
        seen.update(y for batch in batches for y in batch)
    assert counts == [39, 39, 39]
    assert sorted(seen) == list(range(fio.NUM_SAMPLES)) and set(seen.values()) == {1}


@pytest.mark.parametrize("num_workers, worker_mode", [(0, "thread"), (2, "process")])
def test_the_cache_folder_never_holds_more_than_its_limit_and_one_part(
    server, tmp_path, fio, num_workers, worker_mode
):
    source = _source(server.url("train"), tmp_path / "cache", 2.5)
    try:
        loader = fastio.StreamLoader(source, batch_size=4, shuffle=True, seed=1, num_workers=num_workers,
                                     workers=fastio.WorkerOptions(mode=worker_mode))  # fmt: skip
        largest_part = max(s.footprint for s in source.shards)
        peak = 0
        for batch in loader:
            fio.check_batch(batch)
            peak = max(peak, cache_folder_bytes(tmp_path / "cache"))
        assert loader.stats()["shuffle_mode"] == "parts"
        assert 0 < peak <= source.cache.limit + largest_part
    finally:
        source.close()


def test_shard_and_storage_orders_read_whole_shards_after_a_parts_loader(shard_dir, server, tmp_path, fio):
    source = _source(server.url("train"), tmp_path / "cache", 3)
    try:
        parted = fastio.StreamLoader(source, batch_size=8, shuffle=True, seed=3)
        assert parted.stats()["shuffle_mode"] == "parts" and len(source.shard_sizes) > 9
        for shuffle in ("shard", False):
            remote = fastio.StreamLoader(
                source, batch_size=8, shuffle=shuffle, seed=3, order=fastio.OrderOptions(shuffle_window=2)
            )
            local = fastio.StreamLoader(
                shard_dir, batch_size=8, shuffle=shuffle, seed=3, order=fastio.OrderOptions(shuffle_window=2)
            )
            assert [fio.check_batch(b) for b in remote] == [fio.check_batch(b) for b in local]
            assert source.shard_sizes == [13] * 9
    finally:
        source.close()


def test_unequal_shards_split_into_parts_that_do_not_divide_them(tmp_path, fio):
    root = tmp_path / "www"
    with fastio.ShardWriter(root / "odd", schema=fio.SCHEMA, max_bytes=700) as writer:
        for i in range(fio.NUM_SAMPLES):
            writer.write(fio.make_sample(i))
    with HttpServer(root) as server:
        source = _source(server.url("odd"), tmp_path / "cache", 2)
        whole = list(source.shard_sizes)
        assert len(set(whole)) > 1  # shards of unequal sample counts
        try:
            loader = fastio.StreamLoader(source, batch_size=5, shuffle=True, seed=4, num_workers=2)
            ys = [y for batch in loader for y in fio.check_batch(batch)]
            stats = loader.stats()
            assert stats["shuffle_mode"] == "parts"
            assert any(n % stats["shuffle_parts"] for n in whole)  # some shard is not split evenly
            assert sorted(ys) == list(range(fio.NUM_SAMPLES))
        finally:
            source.close()


@pytest.mark.parametrize("shuffle, parts, message", [
    ("parts", None, "shuffle_parts= goes with shuffle='parts'"),
    (True, 4, "shuffle_parts= goes with shuffle='parts'"),
    ("parts", 4, "only a remote source that reads parts of shards"),
])  # fmt: skip
def test_shuffle_parts_goes_with_its_split_on_a_source_with_parts(shard_dir, shuffle, parts, message):
    with pytest.raises(ValueError, match=message):
        fastio.StreamLoader(
            shard_dir, batch_size=8, shuffle=shuffle, order=fastio.OrderOptions(shuffle_parts=parts)
        )


@pytest.mark.parametrize("world_size", [1, 3])
def test_a_parts_state_resumes_under_another_world_size_when_its_split_is_named(server, tmp_path, fio,
                                                                                world_size):  # fmt: skip
    # Two ranks read 3 batches each, then the job restarts with another world size: its own choice of parts
    # differs (the reads around a batch count every rank), so the state is refused, unless the saved split is
    # named; then the rest of the epoch is read, each sample once, none of the first 24 again.
    options = dict(batch_size=4, shuffle=True, seed=8)
    read, states = Counter(), []
    for rank in range(2):
        source = _source(server.url("train"), tmp_path / "cache", 4)
        try:
            loader = fastio.StreamLoader(
                source, order=fastio.OrderOptions(rank=rank, world_size=2), **options
            )
            it = iter(loader)
            read.update(y for _ in range(3) for y in fio.check_batch(next(it)))
            states.append(loader.state_dict())
            del it
        finally:
            source.close()
    state = states[0]
    assert state["shuffle"] == "parts"
    rest = Counter()
    for rank in range(world_size):
        source = _source(server.url("train"), tmp_path / "cache", 4)
        try:
            chosen = fastio.StreamLoader(
                source, order=fastio.OrderOptions(rank=rank, world_size=world_size), **options
            )
            if (chosen.order.shuffle_window, chosen.order.shuffle_parts) != (
                state["shuffle_window"], state["shuffle_parts"]
            ):
                with pytest.raises(ValueError, match="state_dict shuffle_"):
                    chosen.load_state_dict(state)
            named = fastio.OrderOptions(
                rank=rank, world_size=world_size, shuffle_window=state["shuffle_window"],
                shuffle_parts=state["shuffle_parts"],
            )  # fmt: skip
            resumed = fastio.StreamLoader(source, order=named, **dict(options, shuffle="parts"))
            resumed.load_state_dict(state)
            rest.update(y for batch in resumed for y in fio.check_batch(batch))
        finally:
            source.close()
    assert sum(read.values()) == 24 and set(read.values()) == {1}
    assert sorted([*read, *rest]) == list(range(fio.NUM_SAMPLES))  # nothing lost, nothing read twice...
    assert sum(rest.values()) - len(rest) < world_size  # ...but DistributedSampler's padding of the tail


def test_verify_true_keeps_whole_shards(server, tmp_path):
    source = _source(server.url("train"), tmp_path / "cache", 3, verify=True)
    try:
        assert fastio.StreamLoader(source, batch_size=8, shuffle=True).stats()["shuffle_mode"] == "window"
    finally:
        source.close()


def test_a_range_read_past_the_end_of_an_object_raises(shard_dir, server):
    url = server.url("train/shard-000000.fio")
    size = (shard_dir / "shard-000000.fio").stat().st_size
    (head, tail), whole = cat_ranges(url, [(0, 64), (size - 8, size)], size, FAST_RETRY, None)
    assert (len(head), len(tail), whole) == (64, 8, False)
    assert head + tail == (shard_dir / "shard-000000.fio").read_bytes()[:64] + (
        shard_dir / "shard-000000.fio"
    ).read_bytes()[-8:]
    past_end = [(0, 8), (size - 8, size + 8)]
    with pytest.raises(RemoteReadError, match="shard-000000.fio"):
        with_retries(lambda: cat_ranges(url, past_end, size + 8, FAST_RETRY, None), url, FAST_RETRY)


def test_a_shard_truncated_after_its_header_was_read_is_a_named_error_never_wrong_data(
    shard_dir, tmp_path, fio
):
    root = tmp_path / "www"
    fio.write_set(root / "train")
    with HttpServer(root) as server:
        source = _source(server.url("train"), tmp_path / "cache", 3)
        try:
            loader = fastio.StreamLoader(source, batch_size=8, shuffle=True, seed=0)
            assert loader.stats()["shuffle_mode"] == "parts"  # headers were read when the loader was built
            shard = root / "train" / "shard-000004.fio"
            shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
            with pytest.raises(RemoteReadError, match="shard-000004.fio"):
                for batch in loader:
                    fio.check_batch(batch)
        finally:
            source.close()


def test_a_corrupt_remote_header_is_a_named_error(tmp_path, fio):
    root = tmp_path / "www"
    fio.write_set(root / "train")
    shard = root / "train" / "shard-000002.fio"
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0xFF  # inside the header: its crc32 no longer matches
    shard.write_bytes(bytes(raw))
    with HttpServer(root) as server:
        source = _source(server.url("train"), tmp_path / "cache", 3)
        try:
            with pytest.raises(CorruptShardError, match="shard-000002.fio.*header"):
                fastio.StreamLoader(source, batch_size=8, shuffle=True)
        finally:
            source.close()


def test_the_order_of_parts_splits_across_ranks_like_every_order():
    sizes = [3, 4, 3, 3] * 4
    order = epoch_order(sizes, seed=1, epoch=0, shuffle="parts", window=6)
    assert sorted(order.tolist()) == list(range(sum(sizes)))
    mine = [rank_indices(order, 0, 2, r, drop_last=False) for r in (0, 1)]
    assert sorted(np.concatenate(mine).tolist()) == list(range(sum(sizes)))


def _write_tars(directory: Path, shards: int, samples: int, sidecars: bool) -> list[Path]:
    """``shards`` WebDataset tars of ``samples`` samples each (``x.npy`` holds the sample's number, ``cls``
    its shard), indexed beside them (``.fidx``) when ``sidecars``."""
    directory.mkdir(parents=True, exist_ok=True)
    paths, key = [], 0
    for s in range(shards):
        path = directory / f"shard-{s:03d}.tar"
        with tarfile.open(path, "w") as tar:
            for _ in range(samples + s % 3):  # unequal tars
                buf = io.BytesIO()
                np.save(buf, np.full((2, 3), key, np.int64))
                for ext, data in (("x.npy", buf.getvalue()), ("cls", str(s).encode())):
                    info = tarfile.TarInfo(f"k{key:05d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                key += 1
        if sidecars:
            fastio.index_tar(path)
        paths.append(path)
    return paths


def _tar_source(server: HttpServer, cache_dir: Path, tars_held: int) -> RemoteTarSource:
    pattern = server.url("shard-{000..008}.tar")
    probe = RemoteTarSource(pattern, cache_dir=cache_dir, retry=FAST_RETRY)
    largest = max(s.footprint for s in probe.shards)
    probe.close()
    return RemoteTarSource(pattern, cache_dir=cache_dir, cache_limit=tars_held * largest, retry=FAST_RETRY)


def _tar_keys(loader: fastio.StreamLoader) -> list[str]:
    keys = []
    for batch in loader:
        for x, key in zip(batch["x.npy"], batch["__key__"], strict=True):
            assert int(x[0, 0]) == int(key[1:]), key  # every member belongs to its sample
            keys.append(key)
    return keys


@pytest.mark.parametrize("num_workers, worker_mode", [(0, "thread"), (2, "process")])
def test_tar_shards_with_sidecars_read_parts_each_sample_once_and_resume_exactly(
    tmp_path, num_workers, worker_mode
):
    _write_tars(tmp_path / "www", shards=9, samples=13, sidecars=True)
    workers = fastio.WorkerOptions(mode=worker_mode)
    options = dict(batch_size=4, shuffle=True, seed=6, num_workers=num_workers, workers=workers)
    with HttpServer(tmp_path / "www") as server:
        source = _tar_source(server, tmp_path / "cache", 3)
        try:
            loader = fastio.StreamLoader(source, **options)
            whole = _tar_keys(loader)
            stats = loader.stats()
            assert stats["shuffle_mode"] == "parts" and stats["part_samples"] > 1
            assert sorted(whole) == sorted(set(whole)) and len(whole) == source.num_samples
            assert source.cache.evictions > 0
            loader = fastio.StreamLoader(source, **options)
            it = iter(loader)
            first = [key for _ in range(7) for key in next(it)["__key__"]]
            state = loader.state_dict()
            del it
        finally:
            source.close()
        assert first == whole[:28]
        again = _tar_source(server, tmp_path / "cache", 3)
        try:
            resumed = fastio.StreamLoader(again, **options)
            resumed.load_state_dict(state)
            assert _tar_keys(resumed) == whole[28:]
        finally:
            again.close()


@pytest.mark.parametrize("shards, most_listings", [(200, 7), (1000, 11)])
def test_the_number_of_parts_is_found_in_a_few_listings_of_them(shards, most_listings):
    # Shards of 1000 samples through a cache of 20: a window of whole shards would mix 20. 200 shards: a P
    # reaches 90% of them, found by bisection; 1000: none does, the best of a few is taken (the most parts).
    files = [Shard(f"http://h/s{i}", f"k/s{i}", 10**6, 10**6, 1000) for i in range(shards)]
    listed = []

    def units_for(parts: int) -> list[Shard]:
        listed.append(parts)
        return [
            Shard(f.url, f"{f.key}@{a}-{b}", f.remote_size, (b - a) * 1000, b - a, ranges=((a, b),))
            for f in files for a, b in part_bounds(f.num_samples, parts)
        ]  # fmt: skip

    split, units = choose_parts(files, 20 * 10**6, 0, 256, units_for)
    assert len(listed) <= most_listings and len(units) == shards * split.parts
    cover = expected_shards(split.window, [split.parts] * shards)
    if shards == 200:
        assert cover >= 0.9 * shards and split.parts < MAX_PARTS
    else:
        assert split.parts == MAX_PARTS and split.window > 20 * MAX_PARTS // 2


def test_a_shard_replaced_after_its_header_was_read_is_refused_never_read_at_old_offsets(tmp_path, fio):
    root = tmp_path / "www"
    fio.write_set(root / "train")
    with HttpServer(root) as server:
        source = _source(server.url("train"), tmp_path / "cache", 3)
        try:
            loader = fastio.StreamLoader(source, batch_size=8, shuffle=True, seed=0)
            assert loader.stats()["shuffle_mode"] == "parts"  # headers were read when the loader was built
            shard = root / "train" / "shard-000004.fio"
            shard.write_bytes((root / "train" / "shard-000005.fio").read_bytes())  # another shard's bytes
            with pytest.raises((CorruptShardError, RemoteReadError), match="shard-000004.fio"):
                for batch in loader:
                    fio.check_batch(batch)
        finally:
            source.close()
