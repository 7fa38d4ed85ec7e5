"""StreamLoader: correct data, exactly-once coverage over ranks and workers, order, resume, stats."""

from __future__ import annotations

import warnings
from collections import Counter

import numpy as np
import pytest
import torch

import fastio


def _epoch(loader) -> list[list[int]]:
    return [batch["y"].tolist() for batch in loader]


def _flat(batches: list[list[int]]) -> list[int]:
    return [y for b in batches for y in b]


def test_batches_hold_the_right_samples(shard_dir, fio):
    loader = fastio.StreamLoader(shard_dir, batch_size=10, shuffle=True, seed=5)
    ys = []
    for batch in loader:
        assert batch["x"].dtype == torch.int16 and batch["x"].shape[1:] == (3, 5)
        assert isinstance(batch["tokens"], list) and isinstance(batch["text"], list)
        ys += fio.check_batch(batch)
    assert sorted(ys) == list(range(fio.NUM_SAMPLES))
    assert len(loader) == 12 and len(ys) == 117


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_exactly_once_across_ranks_and_workers(shard_dir, fio, world):
    reference = None
    for workers in range(4):
        per_rank = [
            _epoch(
                fastio.StreamLoader(
                    shard_dir,
                    batch_size=8,
                    shuffle=True,
                    seed=2,
                    num_workers=workers,
                    order=fastio.OrderOptions(rank=r, world_size=world),
                )
            )
            for r in range(world)
        ]
        assert len({len(b) for b in per_rank}) == 1, "every rank must get the same number of batches"
        counts = Counter(_flat([y for rank in per_rank for y in rank]))
        assert set(counts) == set(range(fio.NUM_SAMPLES))
        padding = -fio.NUM_SAMPLES % world
        assert sum(counts.values()) == fio.NUM_SAMPLES + padding
        assert sum(c - 1 for c in counts.values()) == padding
        if reference is None:
            reference = per_rank
        assert per_rank == reference, f"num_workers={workers} changed the order"


def test_drop_last_gives_full_equal_batches(shard_dir):
    per_rank = [
        _epoch(
            fastio.StreamLoader(
                shard_dir, batch_size=8, drop_last=True, order=fastio.OrderOptions(rank=r, world_size=3)
            )
        )
        for r in range(3)
    ]
    assert [len(b) for b in per_rank] == [4, 4, 4]
    assert all(len(batch) == 8 for rank in per_rank for batch in rank)
    assert len(set(_flat([y for r in per_rank for y in r]))) == 96


def test_order_repeats_per_epoch_and_changes_across_epochs(shard_dir):
    loader = fastio.StreamLoader(shard_dir, batch_size=16, seed=9, num_workers=1, shuffle=True)
    first, again = _epoch(loader), _epoch(loader)
    assert first == again
    loader.set_epoch(1)
    second = _epoch(loader)
    assert second != first and sorted(_flat(second)) == sorted(_flat(first))
    other = fastio.StreamLoader(shard_dir, batch_size=16, seed=9, shuffle="shard")
    other.set_epoch(1)
    assert _epoch(other) != second
    plain = _epoch(fastio.StreamLoader(shard_dir, batch_size=16, shuffle=False))
    assert _flat(plain) == list(range(117))


@pytest.mark.parametrize("world", [1, 3])
def test_resume_at_every_batch_boundary(shard_dir, world):
    make = lambda workers, r: fastio.StreamLoader(  # noqa: E731
        shard_dir,
        batch_size=10,
        seed=4,
        num_workers=workers,
        order=fastio.OrderOptions(rank=r, world_size=world),
    )
    for rank in range(world):
        full = _epoch(make(0, rank))
        for k in range(len(full) + 1):
            loader = make(2, rank)
            loader.set_epoch(0)
            it = iter(loader)
            head = [next(it)["y"].tolist() for _ in range(k)]
            state = loader.state_dict()
            resumed = make(k % 4, rank)
            resumed.load_state_dict(state)
            assert head + _epoch(resumed) == full, f"rank {rank}, resumed after batch {k}"


def test_resume_with_a_different_world_size_loses_nothing(shard_dir, fio):
    for old_world, new_world, k in [(2, 3, 3), (4, 1, 2), (1, 4, 5), (3, 2, 0), (2, 2, 6)]:
        states, consumed = [], []
        for r in range(old_world):
            loader = fastio.StreamLoader(
                shard_dir, batch_size=5, seed=1, order=fastio.OrderOptions(rank=r, world_size=old_world)
            )
            it = iter(loader)
            consumed += _flat([next(it)["y"].tolist() for _ in range(k)])
            states.append(loader.state_dict())
        rest = []
        for r in range(new_world):
            loader = fastio.StreamLoader(
                shard_dir, batch_size=5, seed=1, order=fastio.OrderOptions(rank=r, world_size=new_world)
            )
            loader.load_state_dict(states[0])
            rest += _flat(_epoch(loader))
        assert set(consumed) | set(rest) == set(range(fio.NUM_SAMPLES))
        assert len(set(consumed)) == len(consumed)
        repeats = len(consumed) + len(rest) - fio.NUM_SAMPLES
        assert repeats <= new_world - 1, (old_world, new_world, k, repeats)


def test_load_state_dict_mid_iteration_applies_to_next_iter(shard_dir):
    loader = fastio.StreamLoader(shard_dir, batch_size=10, seed=3)
    full = _epoch(loader)
    it = iter(loader)
    head = [next(it)["y"].tolist() for _ in range(4)]
    saved = loader.state_dict()
    it2 = iter(loader)
    next(it2)
    with pytest.warns(UserWarning, match="next iter"):
        loader.load_state_dict(saved)
    continued = [b["y"].tolist() for b in it2]  # the running iteration is neither restarted nor moved
    assert continued == full[1:]
    assert head + _epoch(loader) == full  # the next iter() resumes after batch 4
    assert _epoch(loader) == full  # and the one after is a fresh epoch


def test_set_epoch_drops_a_resume_point_of_another_epoch(shard_dir):
    loader = fastio.StreamLoader(shard_dir, batch_size=10, seed=3)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    with pytest.warns(UserWarning):
        loader.load_state_dict(state)
    loader.set_epoch(1)
    fresh = fastio.StreamLoader(shard_dir, batch_size=10, seed=3)
    fresh.set_epoch(1)
    assert _epoch(loader) == _epoch(fresh)


def test_state_dict_refuses_another_dataset_or_seed(shard_dir):
    state = fastio.StreamLoader(shard_dir, batch_size=10, seed=3).state_dict()
    with pytest.raises(ValueError, match="seed"):
        fastio.StreamLoader(shard_dir, batch_size=10, seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match="state dict"):
        fastio.StreamLoader(shard_dir, batch_size=10).load_state_dict({"epoch": 0})


def test_buffers_are_reused_unless_asked_not_to(shard_dir):
    reused = fastio.StreamLoader(shard_dir, batch_size=10, shuffle=False)
    it = iter(reused)
    a = next(it)["x"].data_ptr()
    b = next(it)["x"].data_ptr()
    assert a == b, "a batch nobody holds any more has its buffers refilled"
    owned = fastio.StreamLoader(
        shard_dir,
        batch_size=10,
        shuffle=False,
        batches=fastio.BatchOptions(reuse_buffers=False),
        num_workers=2,
    )
    kept = [batch["x"] for batch in owned]
    np.testing.assert_array_equal(torch.cat(kept)[:, 0, 0].numpy(), (np.arange(117) + 0).astype(np.int16))


def test_transform_and_collate(shard_dir, fio):
    def transform(sample):
        return {"y2": sample["y"] * 2, "n": len(sample["tokens"]), "x": sample["x"].float()}

    loader = fastio.StreamLoader(shard_dir, batch_size=7, seed=0, num_workers=2, transform=transform)
    seen = []
    for batch in loader:
        assert batch["x"].dtype == torch.float32 and batch["x"].shape[1:] == (3, 5)
        ys = (batch["y2"] // 2).tolist()
        assert batch["n"].tolist() == [len(fio.make_sample(y)["tokens"]) for y in ys]
        np.testing.assert_array_equal(batch["x"][:, 0, 0].numpy(), np.array(ys, dtype=np.float32))
        seen += ys
    assert sorted(seen) == list(range(117))
    custom = fastio.StreamLoader(
        shard_dir, batch_size=7, collate_fn=lambda samples: [int(s["y"]) for s in samples]
    )
    assert sorted(_flat(list(custom))) == list(range(117))


class _Squares(torch.utils.data.Dataset):
    def __init__(self, n: int, batched: bool) -> None:
        self.n, self.calls = n, Counter()
        if batched:
            self.__getitems__ = self._getitems

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        self.calls["item"] += 1
        return torch.tensor([i, i * i]), i

    def _getitems(self, indices):
        self.calls["items"] += 1
        return [(torch.tensor([i, i * i]), i) for i in indices]


@pytest.mark.parametrize("batched", [False, True])
def test_map_style_dataset_source(batched):
    dataset = _Squares(53, batched)
    loader = fastio.StreamLoader(
        dataset, batch_size=8, seed=1, num_workers=1, order=fastio.OrderOptions(rank=1, world_size=2)
    )
    seen = []
    for x, i in loader:
        assert (x[:, 1] == x[:, 0] ** 2).all() and (x[:, 0] == i).all()
        seen += i.tolist()
    other = [
        i.tolist()
        for _, i in fastio.StreamLoader(
            dataset, batch_size=8, seed=1, order=fastio.OrderOptions(rank=0, world_size=2)
        )
    ]
    assert sorted(set(seen) | set(_flat(other))) == list(range(53))
    assert (
        dataset.calls["items" if batched else "item"] > 0
        and dataset.calls["item" if batched else "items"] == 0
    )


def test_stats_and_progress(shard_dir, capsys):
    loader = fastio.StreamLoader(
        shard_dir, batch_size=10, num_workers=1, batches=fastio.BatchOptions(progress=True)
    )
    for _ in loader:
        pass
    stats = loader.stats()
    assert stats["samples"] == 117 and stats["batches"] == 12
    assert stats["samples_per_s"] > 0 and stats["mb_per_s"] > 0 and stats["stage_s"]["read"] > 0
    assert 0 <= stats["wait_share"] <= 1
    assert "12/12" in capsys.readouterr().err
    inline = fastio.StreamLoader(shard_dir, batch_size=10, num_workers=0)
    for _ in inline:
        pass
    # Gathering inline, the consumer's time is all gathering but for an empty loop body.
    assert inline.stats()["input_bound"] is True


def test_bad_arguments(shard_dir):
    for kwargs, word in [
        ({"batch_size": 0}, "batch_size"),
        ({"num_workers": -1}, "num_workers"),
        ({"shuffle": "sometimes"}, "shuffle"),
        ({"order": fastio.OrderOptions(rank=2, world_size=2)}, "rank"),
    ]:
        with pytest.raises(ValueError, match=word):
            fastio.StreamLoader(shard_dir, **{"batch_size": 4, **kwargs})


def test_abandoned_iterators_do_not_block(shard_dir):
    loader = fastio.StreamLoader(
        shard_dir, batch_size=4, num_workers=3, workers=fastio.WorkerOptions(prefetch=1)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(5):
            next(iter(loader))
    assert sum(len(b) for b in _epoch(loader)) == 117


def test_rank_and_world_size_come_from_torch_distributed(shard_dir, monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 3)
    implicit = fastio.StreamLoader(shard_dir, batch_size=8, seed=2)
    assert (implicit.rank, implicit.world_size) == (1, 3) and len(implicit) == 5
    explicit = _epoch(
        fastio.StreamLoader(shard_dir, batch_size=8, seed=2, order=fastio.OrderOptions(rank=1, world_size=3))
    )
    assert _epoch(implicit) == explicit
    overridden = fastio.StreamLoader(
        shard_dir, batch_size=8, seed=2, order=fastio.OrderOptions(rank=0, world_size=1)
    )
    assert len(_flat(_epoch(overridden))) == 117


def test_resume_with_another_batch_size_and_worker_processes(shard_dir, fio):
    loader = fastio.StreamLoader(shard_dir, batch_size=10, seed=8)
    it = iter(loader)
    head = _flat([next(it)["y"].tolist() for _ in range(3)])
    resumed = fastio.StreamLoader(shard_dir, batch_size=7, seed=8, num_workers=2, transform=lambda s: s)
    resumed.load_state_dict(loader.state_dict())
    rest = _flat(_epoch(resumed))
    assert head + rest == _flat(_epoch(loader))
    assert sorted(head + rest) == list(range(fio.NUM_SAMPLES))


def test_defaults_follow_dataloader(shard_dir):
    import inspect

    loader = fastio.StreamLoader(shard_dir)
    assert loader.batch_size == 1 and loader.num_workers == 0 and loader.drop_last is False
    assert loader.shuffle == "none", "shuffle defaults to False, as in DataLoader"
    assert _flat(_epoch(fastio.StreamLoader(shard_dir, batch_size=10))) == list(range(117))
    assert fastio.StreamLoader(shard_dir, shuffle=True).shuffle == "full"
    params = inspect.signature(fastio.StreamLoader).parameters
    dataloader = inspect.signature(torch.utils.data.DataLoader).parameters
    for name in ("batch_size", "shuffle", "num_workers", "drop_last"):
        assert (params[name].default or False) == (dataloader[name].default or False), name


def test_progress_without_tqdm_names_the_extra(shard_dir, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def refuse_tqdm(name, *args, **kwargs):
        if name == "tqdm" or name.startswith("tqdm."):
            raise ImportError("No module named 'tqdm'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", refuse_tqdm)
    with pytest.raises(ImportError, match=r"fastcomm\[progress\]"):
        iter(fastio.StreamLoader(shard_dir, batch_size=10, batches=fastio.BatchOptions(progress=True)))


def _record_worker(worker_id: int) -> None:
    import os

    info = fastio.worker_info()
    assert info is not None and info.id == worker_id
    os.environ["FASTIO_TEST_WORKER_INIT"] = str(worker_id)


def _tag_with_init(sample: dict) -> dict:
    import os

    sample["init"] = int(os.environ.get("FASTIO_TEST_WORKER_INIT", "-1"))
    return sample


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_dataloader_keywords_collate_fn_and_worker_init_fn(shard_dir, monkeypatch, mode):
    monkeypatch.delenv("FASTIO_TEST_WORKER_INIT", raising=False)

    def collate_fn(samples):
        return torch.tensor([int(s["y"]) for s in samples]), [s["init"] for s in samples]

    loader = fastio.StreamLoader(
        shard_dir,
        batch_size=10,
        num_workers=2,
        workers=fastio.WorkerOptions(mode=mode),
        transform=_tag_with_init,
        collate_fn=collate_fn,
        worker_init_fn=_record_worker,
    )
    ys, inits = zip(*loader, strict=True)
    assert torch.cat(ys).tolist() == list(range(117))
    if mode == "process":  # each process ran the hook before its first sample
        assert {i for batch in inits for i in batch} == {0, 1}
    with pytest.raises(ValueError, match="collate_fn"):
        fastio.StreamLoader(shard_dir, collate=collate_fn, collate_fn=collate_fn)
