"""Weighted streams resume exactly: mid-epoch, after several epochs, at another world size or batch size,
with sources gathered at once or stream by stream, and with pack=."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import fastio

sys.path.insert(0, str(Path(__file__).parent))
from _mixing_helpers import epoch_ids, flat, mixed_loader, write_shards, write_tar  # noqa: E402


# -- resume --
@pytest.mark.parametrize(("num_workers", "mode"), [(0, "thread"), (2, "thread"), (2, "process")])
@pytest.mark.parametrize("stop", [(0, 3), (2, 1), (3, 5)])  # (epoch, batches) of the interrupted run
def test_resume_is_exact_mid_epoch_and_after_several_epochs(tmp_path, fio, num_workers, mode, stop):
    a, b = write_shards(tmp_path / "a", 0, 40, fio), write_shards(tmp_path / "b", 1000, 15, fio)

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
            mixed_loader(
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
        consumed += flat([next(it)["id"].tolist() for _ in range(2)])
        states.append(loader.state_dict())
    rest = []
    for loader in ranks(new, batch_size=5):
        loader.load_state_dict(states[0])
        rest += flat([batch["id"].tolist() for batch in loader])
    epoch = collections.Counter(flat(epoch_ids(mixed_loader([37, 29], [0.6, 0.4]), 1)))
    got = collections.Counter(consumed + rest)
    assert not got - epoch  # nothing beyond the epoch, nothing twice
    left = 66 - old * 2 * 8
    tail = left - new * (left // new // 5 * 5)  # drop_last: the rank split's and the batches' remainders
    assert sum((epoch - got).values()) == tail


def test_resume_chained_across_world_sizes_keeps_the_epoch_list():
    def ranks(world):
        return [
            mixed_loader(
                [37, 29], [0.6, 0.4], drop_last=True, order=fastio.OrderOptions(world_size=world, rank=r)
            )
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
            seen += flat([batch["id"].tolist() for batch in taken])
            states.append(loader.state_dict())
        assert all(s["layout_world_size"] == 2 for s in states)  # the epoch keeps the list it began with
        state = states[0]
    epoch = collections.Counter(flat(epoch_ids(mixed_loader([37, 29], [0.6, 0.4]), 1)))
    assert not collections.Counter(seen) - epoch
    assert sum((epoch - collections.Counter(seen)).values()) == (66 - 2 * 8 - 3 * 8) % 8  # the last partial


@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_get_equal_batch_counts(world, drop_last):
    counts = {
        len(
            epoch_ids(
                mixed_loader(
                    [23, 11], [2, 1], order=fastio.OrderOptions(world_size=world, rank=r), drop_last=drop_last
                ),
                0,
            )
        )
        for r in range(world)
    }
    assert len(counts) == 1
    assert counts.pop() == len(
        mixed_loader(
            [23, 11], [2, 1], order=fastio.OrderOptions(world_size=world, rank=0), drop_last=drop_last
        )
    )


@pytest.mark.parametrize("fused", [True, False])
def test_resume_at_another_batch_size_keeps_rows_in_the_asked_order(tmp_path, monkeypatch, fused):
    if not fused:  # stream by stream: rows gathered grouped by stream, then put back in the asked order
        monkeypatch.setattr(fastio.format.tar.source.TarSource, "joined", lambda self, others: None)
    plain, other = write_tar(tmp_path / "a.tar", 0, 40), write_tar(tmp_path / "b.tar", 500, 15)
    streams = [fastio.Stream(plain, 0.5), fastio.Stream(other, 0.5)]
    first = fastio.StreamLoader(streams, batch_size=6, shuffle=True, seed=2)
    expected = flat([batch["cls"].tolist() for batch in first])
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
    plain, other = write_tar(tmp_path / "a.tar", 0, 40), write_tar(tmp_path / "b.tar", 500, 15)

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
    a, b = write_shards(tmp_path / "a", 0, 40, fio), write_shards(tmp_path / "b", 1000, 15, fio)

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
    expected = flat([batch["v"].tolist() for batch in first])
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
    state = mixed_loader([20, 10], [1, 1]).state_dict()
    with pytest.raises(ValueError, match="stream_weights"):
        mixed_loader([20, 10], [1, 2]).load_state_dict(state)
    with pytest.raises(ValueError, match="epoch_size"):
        mixed_loader([20, 10], [1, 1], mixing=fastio.MixingOptions(epoch_size=25)).load_state_dict(state)
    with pytest.raises(ValueError, match="mixes streams"):
        mixed_loader([20, 10], [1, 1]).load_state_dict(fastio.StreamLoader(shard_dir).state_dict())


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
