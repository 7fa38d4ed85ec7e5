"""Weighted streams (fastio.Stream, fastio.mixing): what an epoch means, line by line, its exact and elastic
resume, provenance, pack=, and the errors for bad input."""

from __future__ import annotations

import collections
import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

import fastio
from fastio.mixing.schedule import epoch_counts, stream_walk
from fastio.pipeline.settings import OrderSettings
from fastio.sources import Source


class _Ids(Source):
    """``n`` samples whose field ``"id"`` is ``base + local index``: which stream and sample a row holds."""

    def __init__(self, n: int, base: int, shard: int = 7, dtype: torch.dtype = torch.int64) -> None:
        self.name, self.num_samples, self.base, self.dtype = f"ids{base}", n, base, dtype
        self.shard_sizes = [min(shard, n - k) for k in range(0, n, shard)]

    def fixed_specs(self):
        return {"id": (self.dtype, ())}

    def fetch(self, indices, buffers, threads, times):
        out = buffers.fixed("id", len(indices))
        out.copy_(torch.from_numpy(indices + self.base))
        return {"id": out}


BASE = 10_000  # stream i's ids are i * BASE + local index


def _loader(sizes, weights, **kwargs) -> fastio.StreamLoader:
    streams = [
        fastio.Stream(_Ids(n, i * BASE), w) for i, (n, w) in enumerate(zip(sizes, weights, strict=True))
    ]
    kwargs = {"batch_size": 8, "shuffle": True, "seed": 3, **kwargs}
    return fastio.StreamLoader(streams, **kwargs)


def _ids(loader: fastio.StreamLoader, epoch: int) -> list[list[int]]:
    loader.set_epoch(epoch)
    return [batch["id"].tolist() for batch in loader]


def _flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


# -- what an epoch means --
def test_each_stream_walks_fresh_permutations_and_continues_across_epochs():
    loader = _loader([10, 60], [1, 1], mixing=fastio.MixingOptions(epoch_size=40))  # 20 of each per epoch
    seen = [_flat(_ids(loader, e)) for e in range(6)]
    small = [i for epoch in seen for i in epoch if i < BASE]
    large = [i - BASE for epoch in seen for i in epoch if i >= BASE]
    assert len(small) == len(large) == 120
    passes = [small[k : k + 10] for k in range(0, 120, 10)]
    assert all(sorted(p) == list(range(10)) for p in passes)  # upsampled only after all were used
    assert len({tuple(p) for p in passes}) == len(passes)  # a fresh permutation each pass
    assert sorted(large[:60]) == list(range(60))  # the large one: no repeat before it is exhausted...
    assert large[60:] != large[:60] and sorted(large[60:]) == list(range(60))  # ...spanning 3 epochs
    walk = stream_walk([7] * 8 + [4], 1, 20 * 2, 20, OrderSettings(seed=3, shuffle=True))
    assert large[40:60] == walk.tolist()  # epoch 2 continues at position 2 * 20 of stream 1's walk


def test_stream_order_depends_on_seed():
    assert _flat(_ids(_loader([10, 60], [1, 1], seed=0), 0)) != _flat(
        _ids(_loader([10, 60], [1, 1], seed=1), 0)
    )
    assert _flat(_ids(_loader([10, 60], [1, 1], seed=5), 2)) == _flat(
        _ids(_loader([10, 60], [1, 1], seed=5), 2)
    )


@pytest.mark.parametrize("weights", [(0.7, 0.3), (3, 2, 1), (1, 1, 5)])
def test_epoch_takes_each_stream_share_within_one(weights):
    sizes = [31, 17, 9][: len(weights)]
    loader = _loader(sizes, weights, mixing=fastio.MixingOptions(epoch_size=101))
    for epoch in range(2):
        counts = collections.Counter(i // BASE for i in _flat(_ids(loader, epoch)))
        for i, w in enumerate(weights):
            assert abs(counts[i] - w / sum(weights) * 101) < 1
        assert sum(counts.values()) == 101


def test_epoch_size_defaults_to_the_sum_of_stream_sizes():
    loader = _loader([31, 17], [1, 4])
    assert len(_flat(_ids(loader, 0))) == 48 and len(loader) == 6


@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_batch_holds_each_stream_share_within_one(world):
    for rank in range(world):
        loader = _loader(
            [400, 300],
            [0.7, 0.3],
            batch_size=64,
            mixing=fastio.MixingOptions(epoch_size=640 * world),
            order=fastio.OrderOptions(world_size=world, rank=rank),
        )
        for batch in _ids(loader, 1)[:-1]:
            streams = [i // BASE for i in batch]
            assert streams.count(0) in (44, 45) and streams.count(1) in (19, 20)


def test_three_streams_mix_within_one_per_batch():
    loader = _loader(
        [50, 40, 30], [0.5, 0.3, 0.2], batch_size=20, mixing=fastio.MixingOptions(epoch_size=200)
    )
    for batch in _ids(loader, 0):
        streams = [i // BASE for i in batch]
        assert [abs(streams.count(i) - 20 * w) < 1 for i, w in enumerate((0.5, 0.3, 0.2))] == [True] * 3


@pytest.mark.parametrize("world", [1, 2])
def test_mix_batch_gives_one_stream_per_batch_in_proportion(world):
    per_batch = collections.Counter()
    for rank in range(world):
        loader = _loader(
            [90, 40],
            [0.7, 0.3],
            batch_size=8,
            mixing=fastio.MixingOptions(mix="batch"),
            order=fastio.OrderOptions(world_size=world, rank=rank),
        )
        batches = _ids(loader, 0)
        assert all(len({i // BASE for i in batch}) == 1 for batch in batches[:-2])
        per_batch.update(batch[0] // BASE for batch in batches[:-2])
    share = per_batch[0] / sum(per_batch.values())
    assert abs(share - 0.7) < 0.1


def test_provenance_field_says_each_sample_stream(tmp_path, fio):
    a, b = _shards(tmp_path / "a", 0, 40, fio), _shards(tmp_path / "b", 1000, 23, fio)
    loader = fastio.StreamLoader([fastio.Stream(a, 0.6), fastio.Stream(b, 0.4)], batch_size=7, shuffle=True)
    rows = 0
    for batch in loader:
        ys = fio.check_batch(batch)  # every field of every row is the sample its y names
        assert batch["stream"].dtype == torch.int64
        assert batch["stream"].tolist() == [int(y >= 1000) for y in ys]
        rows += len(ys)
    assert rows == 63


def _shards(directory: Path, base: int, n: int, fio) -> str:
    with fastio.ShardWriter(directory, schema=fio.SCHEMA, max_samples=fio.SHARD_SAMPLES) as writer:
        for i in range(base, base + n):
            writer.write(fio.make_sample(i))
    return str(directory)


def _tar(path: Path, base: int, n: int, compress: str = "", extra: str | None = None) -> str:
    with tarfile.open(path, "w" + (f":{compress}" if compress else "")) as tar:
        for i in range(base, base + n):
            members = [("cls", str(i).encode()), ("txt", f"doc {i}".encode())]
            for ext, data in members + ([(extra, b"x")] if extra else []):
                info = tarfile.TarInfo(f"s{i:05d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)


def test_tar_and_compressed_tar_streams_mix(tmp_path):
    plain, packed = _tar(tmp_path / "a.tar", 0, 30), _tar(tmp_path / "b.tar.gz", 500, 12, "gz")
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

    _shards(tmp_path / "www" / "web", 0, 40, fio)
    local = _shards(tmp_path / "code", 1000, 15, fio)
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


# -- resume --
@pytest.mark.parametrize(("num_workers", "mode"), [(0, "thread"), (2, "thread"), (2, "process")])
@pytest.mark.parametrize("stop", [(0, 3), (2, 1), (3, 5)])  # (epoch, batches) of the interrupted run
def test_resume_is_exact_mid_epoch_and_after_several_epochs(tmp_path, fio, num_workers, mode, stop):
    a, b = _shards(tmp_path / "a", 0, 40, fio), _shards(tmp_path / "b", 1000, 15, fio)

    def make():
        streams = [fastio.Stream(a, 0.5), fastio.Stream(b, 0.5)]
        return fastio.StreamLoader(
            streams,
            batch_size=6,
            shuffle=True,
            seed=4,
            num_workers=num_workers,
            workers=fastio.WorkerOptions(mode=mode),
        )

    full = make()
    expected = []
    for epoch in range(stop[0] + 2):
        full.set_epoch(epoch)
        expected.append(list(full))  # kept without .clone(): buffers are refilled only when nobody holds them
    first = make()
    first.set_epoch(stop[0])
    it = iter(first)
    for _ in range(stop[1]):
        next(it)
    state = first.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    for epoch in range(stop[0], stop[0] + 2):
        resumed.set_epoch(epoch)
        got = list(resumed)
        want = expected[epoch][stop[1] :] if epoch == stop[0] else expected[epoch]
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert g["y"].tolist() == w["y"].tolist() and g["stream"].tolist() == w["stream"].tolist()
            assert g["text"] == w["text"]


@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 1), (2, 2)])
def test_resume_at_another_world_size_sees_nothing_twice(old, new):
    def ranks(world, **kwargs):
        return [
            _loader(
                [37, 29],
                [0.6, 0.4],
                drop_last=True,
                order=fastio.OrderOptions(world_size=world, rank=r),
                **kwargs,
            )
            for r in range(world)
        ]

    consumed, states = [], []
    for loader in ranks(old):
        loader.set_epoch(1)
        it = iter(loader)
        consumed += _flat([next(it)["id"].tolist() for _ in range(2)])
        states.append(loader.state_dict())
    rest = []
    for loader in ranks(new, batch_size=5):
        loader.load_state_dict(states[0])
        rest += _flat([batch["id"].tolist() for batch in loader])
    epoch = collections.Counter(_flat(_ids(_loader([37, 29], [0.6, 0.4]), 1)))
    got = collections.Counter(consumed + rest)
    assert not got - epoch  # nothing beyond the epoch, nothing twice
    left = 66 - old * 2 * 8
    tail = left - new * (left // new // 5 * 5)  # drop_last: the rank split's and the batches' remainders
    assert sum((epoch - got).values()) == tail


def test_resume_chained_across_world_sizes_keeps_the_epoch_list():
    def ranks(world):
        return [
            _loader([37, 29], [0.6, 0.4], drop_last=True, order=fastio.OrderOptions(world_size=world, rank=r))
            for r in range(world)
        ]

    seen, state = [], None
    for world, batches in ((2, 1), (3, 1), (1, None)):  # 2 ranks, then 3, then 1 to the end
        states = []
        for loader in ranks(world):
            if state is not None:
                loader.load_state_dict(state)
            else:
                loader.set_epoch(1)
            it = iter(loader)
            taken = list(it) if batches is None else [next(it) for _ in range(batches)]
            seen += _flat([batch["id"].tolist() for batch in taken])
            states.append(loader.state_dict())
        assert all(s["layout_world_size"] == 2 for s in states)  # the epoch keeps the list it began with
        state = states[0]
    epoch = collections.Counter(_flat(_ids(_loader([37, 29], [0.6, 0.4]), 1)))
    assert not collections.Counter(seen) - epoch
    assert sum((epoch - collections.Counter(seen)).values()) == (66 - 2 * 8 - 3 * 8) % 8  # the last partial


@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_get_equal_batch_counts(world, drop_last):
    counts = {
        len(
            _ids(
                _loader(
                    [23, 11], [2, 1], order=fastio.OrderOptions(world_size=world, rank=r), drop_last=drop_last
                ),
                0,
            )
        )
        for r in range(world)
    }
    assert len(counts) == 1
    assert counts.pop() == len(
        _loader([23, 11], [2, 1], order=fastio.OrderOptions(world_size=world, rank=0), drop_last=drop_last)
    )


@pytest.mark.parametrize("fused", [True, False])
def test_resume_at_another_batch_size_keeps_rows_in_the_asked_order(tmp_path, monkeypatch, fused):
    if not fused:  # stream by stream: rows gathered grouped by stream, then put back in the asked order
        monkeypatch.setattr(fastio.format.tar.source.TarSource, "joined", lambda self, others: None)
    plain, other = _tar(tmp_path / "a.tar", 0, 40), _tar(tmp_path / "b.tar", 500, 15)
    streams = [fastio.Stream(plain, 0.5), fastio.Stream(other, 0.5)]
    first = fastio.StreamLoader(streams, batch_size=6, shuffle=True, seed=2)
    expected = _flat([batch["cls"].tolist() for batch in first])
    it = iter(first)
    next(it)
    resumed = fastio.StreamLoader(streams, batch_size=4, shuffle=True, seed=2)
    resumed.load_state_dict(first.state_dict())
    assert (resumed._source.fused is not None) == fused
    got = []
    for batch in resumed:  # batches of 4 cut across the groups of 6
        assert batch["stream"].tolist() == [int(c >= 500) for c in batch["cls"].tolist()]
        assert batch["txt"] == [f"doc {c}" for c in batch["cls"].tolist()]
        assert batch["__key__"] == [f"s{c:05d}" for c in batch["cls"].tolist()]
        got += batch["cls"].tolist()
    assert got == expected[6:]


def test_tar_streams_gathered_at_once_equal_stream_by_stream(tmp_path, monkeypatch):
    plain, other = _tar(tmp_path / "a.tar", 0, 40), _tar(tmp_path / "b.tar", 500, 15)

    def epoch():
        loader = fastio.StreamLoader(
            [fastio.Stream(plain, 2), fastio.Stream(other, 1)], batch_size=6, shuffle=True
        )
        return [{k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in loader]

    at_once = epoch()
    monkeypatch.setattr(fastio.format.tar.source.TarSource, "joined", lambda self, others: None)
    assert epoch() == at_once
    assert at_once[0]["__key__"] == [f"s{c:05d}" for c in at_once[0]["cls"]]


@pytest.mark.parametrize("batch_size", [6, 4])
def test_shard_streams_gathered_at_once_equal_stream_by_stream(tmp_path, fio, monkeypatch, batch_size):
    a, b = _shards(tmp_path / "a", 0, 40, fio), _shards(tmp_path / "b", 1000, 15, fio)

    def epoch(**kwargs):
        loader = fastio.StreamLoader([fastio.Stream(a, 2), fastio.Stream(b, 1)], shuffle=True, **kwargs)
        assert (loader._source.fused is None) == joined_off
        return [(fio.check_batch(batch), batch["stream"].tolist()) for batch in loader]

    joined_off = False
    at_once = epoch(batch_size=batch_size)
    monkeypatch.setattr(fastio.format.shards.source.ShardSource, "joined", lambda self, others: None)
    joined_off = True
    assert epoch(batch_size=batch_size) == at_once
    assert [[int(y >= 1000) for y in ys] for ys, _ in at_once] == [s for _, s in at_once]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataset_streams_resume_exactly_at_another_batch_size(num_workers):
    web, code = [{"v": i} for i in range(23)], [{"v": 100 + i} for i in range(9)]

    def make(batch_size):
        streams = [fastio.Stream(web, 2), fastio.Stream(code, 1)]
        return fastio.StreamLoader(
            streams, batch_size=batch_size, shuffle=True, seed=1, num_workers=num_workers
        )

    first = make(5)
    expected = _flat([batch["v"].tolist() for batch in first])
    it = iter(first)
    next(it), next(it)
    resumed = make(3)
    resumed.load_state_dict(first.state_dict())
    got = []
    for batch in resumed:
        assert batch["stream"].tolist() == [int(v >= 100) for v in batch["v"].tolist()]
        got += batch["v"].tolist()
    assert got == expected[10:]


def test_state_dict_refuses_other_streams_or_a_single_source(shard_dir):
    state = _loader([20, 10], [1, 1]).state_dict()
    with pytest.raises(ValueError, match="stream_weights"):
        _loader([20, 10], [1, 2]).load_state_dict(state)
    with pytest.raises(ValueError, match="epoch_size"):
        _loader([20, 10], [1, 1], mixing=fastio.MixingOptions(epoch_size=25)).load_state_dict(state)
    with pytest.raises(ValueError, match="mixes streams"):
        _loader([20, 10], [1, 1]).load_state_dict(fastio.StreamLoader(shard_dir).state_dict())


# -- pack= --
def _corpus(directory: Path, base: int, n: int) -> str:
    rng = np.random.default_rng(base + n)
    with fastio.ShardWriter(directory, schema={"tokens": ("int32", None)}, max_samples=9) as writer:
        for i in range(n):
            writer.write({"tokens": np.full(int(rng.integers(3, 40)), base + i, dtype=np.int32)})
    return str(directory)


def test_pack_draws_rows_from_token_corpora_in_proportion_and_resumes(tmp_path):
    web, code = _corpus(tmp_path / "web", 1, 60), _corpus(tmp_path / "code", 100_000, 30)

    def make(**kwargs):
        streams = [fastio.Stream(web, 0.75), fastio.Stream(code, 0.25)]
        pack = fastio.Pack("tokens", seq_len=16, eos=0)
        return fastio.StreamLoader(streams, batch_size=3, shuffle=True, seed=7, pack=pack, **kwargs)

    full = make()
    full.set_epoch(2)
    expected = [batch["tokens"].clone() for batch in full]
    docs = collections.Counter()
    for batch in expected:
        ids = batch[batch > 0]
        docs.update(int(i >= 100_000) for i in torch.unique(ids).tolist())
    assert abs(docs[1] / (docs[0] + docs[1]) - 0.25) < 0.1  # documents drawn about 3:1
    first = make(num_workers=2)
    first.set_epoch(2)
    it = iter(first)
    next(it), next(it)
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    got = [batch["tokens"] for batch in resumed]
    assert len(got) == len(expected) - 2
    assert all(torch.equal(g, w) for g, w in zip(got, expected[2:], strict=True))
    with pytest.raises(ValueError, match='mix="batch"'):
        make(mixing=fastio.MixingOptions(mix="batch"))


# -- bad input --
@pytest.mark.parametrize("weight", [0, -1, float("nan"), float("inf"), "heavy"])
def test_stream_weight_must_be_positive(weight):
    with pytest.raises(ValueError, match="weight"):
        fastio.Stream("data", weight=weight)


def test_bad_stream_lists_and_arguments(shard_dir):
    with pytest.raises(fastio.EmptySourceError, match="empty list"):
        fastio.StreamLoader([], batch_size=2)
    with pytest.raises(ValueError, match="wrap every source"):
        fastio.StreamLoader([fastio.Stream(shard_dir), shard_dir], batch_size=2)
    with pytest.raises(ValueError, match="mix must be one of"):
        _loader([5, 5], [1, 1], mixing=fastio.MixingOptions(mix="round-robin"))
    with pytest.raises(ValueError, match="epoch_size"):
        _loader([5, 5], [1, 1], mixing=fastio.MixingOptions(epoch_size=0))
    with pytest.raises(ValueError, match="apply to a list of fastio.Stream"):
        fastio.StreamLoader(shard_dir, mixing=fastio.MixingOptions(mix="batch"))
    with pytest.raises(ValueError, match="fastio's own order of the streams"):
        _loader([5, 5], [1, 1], shuffle=False, sampler=range(10))


def test_streams_with_incompatible_fields_are_named():
    streams = [
        fastio.Stream(_Ids(5, 0), name="web"),
        fastio.Stream(_Ids(5, 9, dtype=torch.int32), name="code"),
    ]
    with pytest.raises(ValueError, match=r"'web' and 'code' disagree on field 'id'"):
        fastio.StreamLoader(streams)
    with pytest.raises(ValueError, match="cannot share a batch"):
        fastio.StreamLoader([fastio.Stream(_Ids(5, 0)), fastio.Stream([{"v": 1}])])


def test_a_field_named_stream_is_refused(tmp_path):
    tars = [_tar(tmp_path / f"{k}.tar", 9 * k, 5, extra="stream") for k in range(2)]  # "s00000.stream"...
    with pytest.raises(ValueError, match="provenance field"):
        list(fastio.StreamLoader([fastio.Stream(t) for t in tars], batch_size=20))


def test_streams_whose_batches_differ_in_fields_are_named(tmp_path, fio):
    shards, tar = _shards(tmp_path / "a", 0, 10, fio), _tar(tmp_path / "b.tar", 0, 10)
    with pytest.raises(ValueError, match="disagree on field"):
        fastio.StreamLoader([fastio.Stream(shards), fastio.Stream(tar)])


def test_epoch_counts_sum_to_the_epoch_size():
    assert epoch_counts([0.7, 0.3], 64).tolist() == [45, 19]
    assert epoch_counts([1, 1, 1], 10).tolist() == [4, 3, 3]
