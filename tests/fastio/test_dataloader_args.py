"""StreamLoader on the rest of DataLoader's signature (sampler=, batch_sampler=, generator=,
persistent_workers=, prefetch_factor=, timeout=, multiprocessing_context=, pin_memory=, pin_memory_device=,
in_order=, batch_size=None): the same batches as ``torch.utils.data.DataLoader`` on the same map-style
dataset, and DataLoader's own warnings. The argument errors and what fastio refuses:
test_dataloader_args_errors.py; spawned and forkserver workers: test_dataloader_args_spawn.py."""

from __future__ import annotations

import inspect
import multiprocessing
import os
import pathlib
import re
import sys
import threading
import warnings
import zlib

import numpy as np
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

import fastio

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from _dataloader_args_helpers import NUM_SAMPLES, Numbers, same  # noqa: E402


class EveryThirdBackwards(Sampler[int]):
    """A user's own sampler: every third index, from the end."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -3))

    def __len__(self) -> int:
        return len(range(self.n - 1, -1, -3))


def _seed(case: object) -> int:
    return zlib.crc32(repr(case).encode())


def _indices(loader) -> list[list[int]]:
    return [batch[:, 0].tolist() for batch in loader]


def _sampler(kind: str, seed: int):
    weights = torch.rand(NUM_SAMPLES, generator=torch.Generator().manual_seed(seed)) + 0.1
    return {
        "subset_random": lambda: SubsetRandomSampler(list(range(3, NUM_SAMPLES, 2))),
        "weighted_random": lambda: WeightedRandomSampler(weights.tolist(), 29),
        "distributed": lambda: DistributedSampler(range(NUM_SAMPLES), num_replicas=3, rank=1, seed=seed),
        "users_own": lambda: EveryThirdBackwards(NUM_SAMPLES),
    }[kind]()


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("kind", ["subset_random", "weighted_random", "distributed", "users_own"])
def test_sampler_gives_dataloaders_batches(kind: str, drop_last: bool, workers: int) -> None:
    seed = _seed((kind, drop_last, workers))
    sampler = _sampler(kind, seed)
    for epoch in range(2):
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        torch.manual_seed(seed + epoch)
        expected = _indices(DataLoader(Numbers(), batch_size=5, sampler=sampler, drop_last=drop_last))
        torch.manual_seed(seed + epoch)
        loader = fastio.StreamLoader(
            Numbers(), batch_size=5, sampler=sampler, drop_last=drop_last, num_workers=workers
        )
        assert _indices(loader) == expected
        assert len(loader) == len(expected)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["batch_sampler", "users_lists"])
def test_batch_sampler_gives_its_batches(kind: str, workers: int) -> None:
    batch_sampler = (
        BatchSampler(SequentialSampler(range(NUM_SAMPLES)), 4, drop_last=True)
        if kind == "batch_sampler"
        else [[5, 1], [36], [0, 2, 4, 6, 8, 10, 12], [3, 3, 3]]
    )
    expected = _indices(DataLoader(Numbers(), batch_sampler=batch_sampler))
    loader = fastio.StreamLoader(Numbers(), batch_sampler=batch_sampler, num_workers=workers)
    assert _indices(loader) == expected


def test_batch_sampler_on_shard_directory_sizes_its_buffers(shard_dir, fio) -> None:
    batches = [[116, 0], list(range(40, 51)), [7]]  # one batch larger than batch_size would be
    loader = fastio.StreamLoader(shard_dir, batch_sampler=batches)
    assert [fio.check_batch(batch) for batch in loader] == batches


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("shuffle", [True, False])
def test_generator_gives_dataloaders_order(shuffle: bool, workers: int) -> None:
    seed = _seed(("generator", shuffle, workers))
    theirs, ours = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    dataloader = DataLoader(Numbers(), batch_size=6, shuffle=shuffle, generator=theirs)
    loader = fastio.StreamLoader(
        Numbers(), batch_size=6, shuffle=shuffle, generator=ours, num_workers=workers
    )
    for _ in range(3):
        assert _indices(loader) == _indices(dataloader)
    assert torch.equal(theirs.get_state(), ours.get_state())  # the run's later draws stay the same too


def test_persistent_generator_draws_as_dataloader_does() -> None:
    seed = _seed("persistent generator")
    theirs, ours = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    dataloader = DataLoader(
        Numbers(), 4, shuffle=True, generator=theirs, num_workers=2, persistent_workers=True
    )
    loader = fastio.StreamLoader(
        Numbers(), 4, shuffle=True, generator=ours, num_workers=2, persistent_workers=True
    )
    for _ in range(3):
        assert _indices(loader) == _indices(dataloader)


def _reader_pids(loader, epochs: int) -> list[set[int]]:
    pids = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        batches = list(loader)
        assert sorted(i for batch in batches for i in batch[:, 0].tolist()) == list(range(NUM_SAMPLES))
        pids.append({pid for batch in batches for pid in batch[:, 1].tolist()})
    return pids


def test_persistent_workers_serve_every_epoch() -> None:
    loader = fastio.StreamLoader(Numbers(), batch_size=3, num_workers=2, persistent_workers=True)
    pids = _reader_pids(loader, 3)
    assert pids[0] == pids[1] == pids[2]
    assert len(pids[0]) == 2 and os.getpid() not in pids[0]


def test_persistent_workers_survive_an_abandoned_epoch() -> None:
    loader = fastio.StreamLoader(
        Numbers(), batch_size=3, num_workers=2, shuffle=True, persistent_workers=True
    )
    first = {pid for pid in next(iter(loader))[:, 1].tolist()}
    assert _reader_pids(loader, 2)[1] >= first


def test_workers_close_at_the_end_of_each_epoch_by_default() -> None:
    loader = fastio.StreamLoader(Numbers(), batch_size=3, num_workers=2)
    first, second = _reader_pids(loader, 2)
    assert not first & second


@pytest.mark.parametrize(("workers", "factor", "prefetch"), [(1, 1, 1), (2, 2, 2), (3, 4, 9)])
def test_prefetch_factor_sets_batches_in_flight(workers: int, factor: int, prefetch: int) -> None:
    loader = fastio.StreamLoader(Numbers(), batch_size=4, num_workers=workers, prefetch_factor=factor)
    assert loader.prefetch == prefetch
    assert loader.workers.slots == max(workers * factor, workers + 1)
    assert sorted(i for batch in _indices(loader) for i in batch) == list(range(NUM_SAMPLES))


@pytest.mark.parametrize("context", ["fork", multiprocessing.get_context("fork")])
def test_fork_context_is_honoured(context) -> None:
    loader = fastio.StreamLoader(Numbers(), batch_size=4, num_workers=2, multiprocessing_context=context)
    assert loader.worker_mode == "process"
    assert _indices(loader) == _indices(DataLoader(Numbers(), batch_size=4))


def test_pin_memory_is_off_by_default() -> None:
    assert fastio.StreamLoader(Numbers(), batch_size=4).assembly.pin is False


def test_resume_with_a_repeating_sampler_continues_its_order() -> None:
    sampler = DistributedSampler(range(NUM_SAMPLES), num_replicas=2, rank=0, seed=_seed("resume"))
    sampler.set_epoch(4)
    expected = _indices(DataLoader(Numbers(), batch_size=3, sampler=sampler))
    loader = fastio.StreamLoader(Numbers(), batch_size=3, sampler=sampler)
    iterator = iter(loader)
    head = [next(iterator)[:, 0].tolist() for _ in range(4)]
    resumed = fastio.StreamLoader(Numbers(), batch_size=3, sampler=sampler)
    resumed.load_state_dict(loader.state_dict())
    assert head + _indices(resumed) == expected


def test_sampler_indices_reach_transforms_seeded_per_sample() -> None:
    def noisy(sample: torch.Tensor) -> float:
        return float(torch.rand(()))

    order = np.random.default_rng(_seed("transform")).permutation(NUM_SAMPLES).tolist()
    runs = [
        [
            batch.tolist()
            for batch in fastio.StreamLoader(Numbers(), batch_size=4, sampler=order, transform=noisy)
        ]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


# -- pin_memory_device, in_order, persistent_workers on every source, batch_size=None, sampler with ranks and
# pack= (issue 39): each against DataLoader on the same data where DataLoader defines the result.


class SlowFirst(Numbers):
    """Numbers whose sample 0 takes a while: the batch holding it is made last."""

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 0:
            threading.Event().wait(0.4)
        return super().__getitem__(i)


def _warnings(make) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        next(iter(make()))
    return sorted(str(w.message) for w in caught if "pin" in str(w.message))


@pytest.mark.parametrize("pin_memory", [True, False])
def test_pin_memory_device_warns_as_dataloader_does(pin_memory: bool) -> None:
    kwargs = dict(batch_size=4, pin_memory=pin_memory, pin_memory_device="cuda")
    theirs = _warnings(lambda: DataLoader(Numbers(), **kwargs))
    assert _warnings(lambda: fastio.StreamLoader(Numbers(), **kwargs)) == theirs
    assert bool(theirs) == pin_memory


def test_pin_memory_without_an_accelerator_pins_nothing_on_a_shard_directory(shard_dir, fio) -> None:
    if torch.accelerator.is_available():
        pytest.skip("an accelerator pins the buffers")
    with pytest.warns(UserWarning, match="no accelerator is found"):
        loader = fastio.StreamLoader(shard_dir, batch_size=8, pin_memory=True)
    assert loader.assembly.pin is False and fio.check_batch(next(iter(loader))) == list(range(8))


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_out_of_order_batches_come_as_they_are_ready(mode: str) -> None:
    kwargs = dict(batch_size=4, num_workers=2, in_order=False)
    loader = fastio.StreamLoader(SlowFirst(), workers=fastio.WorkerOptions(mode=mode), **kwargs)
    kept = list(loader)  # kept without .clone(): each batch must stay what it was
    ours = [batch[:, 0].tolist() for batch in kept]
    theirs = _indices(DataLoader(SlowFirst(), **kwargs))
    assert sorted(ours) == sorted(theirs) == _indices(DataLoader(Numbers(), batch_size=4))
    assert ours[0] != [0, 1, 2, 3], "the slow first batch does not hold the others back"
    assert fastio.StreamLoader(SlowFirst(), batch_size=4, num_workers=2).in_order is True


@pytest.mark.parametrize("order", ["own", "sampler"])
def test_out_of_order_resume_hands_over_the_rest_exactly(order: str) -> None:
    kwargs = {"sampler": range(NUM_SAMPLES)} if order == "sampler" else {"shuffle": False}
    loader = fastio.StreamLoader(
        SlowFirst(), batch_size=4, num_workers=2, in_order=False, workers=fastio.WorkerOptions(mode="thread"),
        **kwargs,
    )  # fmt: skip
    for epoch in range(2):
        loader.set_epoch(epoch)
        assert len(list(loader)) == 10
    loader.set_epoch(2)
    iterator = iter(loader)
    head = [next(iterator)[:, 0].tolist() for _ in range(3)]
    state = loader.state_dict()
    assert state["batches_ahead"], "batch 0 was still being made: the batches after it came first"
    resumed = fastio.StreamLoader(SlowFirst(), batch_size=4, num_workers=2, in_order=False, **kwargs)
    resumed.load_state_dict(state)
    rest = _indices(resumed)
    assert sorted(head + rest) == _indices(DataLoader(Numbers(), batch_size=4))
    if order == "own":
        other = fastio.StreamLoader(SlowFirst(), batch_size=5, num_workers=2, in_order=False)
        with pytest.raises(ValueError, match="out of order .*same batch_size and world_size"):
            other.load_state_dict(state)


class _Starts:
    """A worker_init_fn that counts its calls."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, worker_id: int) -> None:
        self.calls.append(worker_id)


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_persistent_workers_on_a_shard_directory_serve_every_epoch(shard_dir, fio, mode: str) -> None:
    kwargs = dict(batch_size=10, shuffle=True, seed=5, num_workers=2, transform=same)
    starts = _Starts()
    loader = fastio.StreamLoader(
        shard_dir, persistent_workers=True, worker_init_fn=starts, workers=fastio.WorkerOptions(mode=mode),
        **kwargs,
    )  # fmt: skip
    fresh = fastio.StreamLoader(shard_dir, **kwargs)
    first = iter(loader)
    pipeline = first.pipeline
    for epoch in range(3):
        loader.set_epoch(epoch)
        fresh.set_epoch(epoch)
        kept = list(loader)  # kept without .clone()
        assert [fio.check_batch(b) for b in kept] == [b["y"].tolist() for b in fresh]
        assert loader._current.pipeline is None and loader._batches.kept.pipeline is pipeline
    if mode == "thread":
        assert sorted(starts.calls) == [0, 1], "worker_init_fn runs once per worker, not per epoch"


def test_persistent_workers_resume_mid_epoch_after_several_epochs(shard_dir, fio) -> None:
    kwargs = dict(batch_size=10, shuffle=True, seed=2, num_workers=2, persistent_workers=True)
    loader = fastio.StreamLoader(shard_dir, **kwargs)
    for epoch in range(2):
        loader.set_epoch(epoch)
        list(loader)
    loader.set_epoch(2)
    iterator = iter(loader)
    head = [fio.check_batch(next(iterator)) for _ in range(4)]
    state = loader.state_dict()
    with pytest.warns(UserWarning, match="the running iteration continues unchanged"):
        loader.load_state_dict(state)
    rest = [fio.check_batch(b) for b in loader]
    again = fastio.StreamLoader(shard_dir, batch_size=10, shuffle=True, seed=2)
    again.set_epoch(2)
    assert head + rest == [b["y"].tolist() for b in again]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("how", ["sequential", "generator", "sampler", "collate_fn"])
def test_batch_size_none_gives_dataloaders_samples(how: str, workers: int) -> None:
    seed = _seed(("unbatched", how, workers))
    kwargs = {
        "sequential": lambda: {},
        "generator": lambda: {"shuffle": True, "generator": torch.Generator().manual_seed(seed)},
        "sampler": lambda: {"sampler": EveryThirdBackwards(NUM_SAMPLES)},
        "collate_fn": lambda: {"collate_fn": _first_and_twice},
    }[how]
    theirs = [s.tolist() for s in DataLoader(Numbers(), batch_size=None, **kwargs())]
    loader = fastio.StreamLoader(Numbers(), batch_size=None, num_workers=workers, **kwargs())
    ours = [s.tolist() for s in loader]
    assert [s[0] for s in ours] == [s[0] for s in theirs]
    assert len(loader) == len(theirs) and loader.batch_size is None


def _first_and_twice(sample: torch.Tensor) -> torch.Tensor:
    return torch.stack([sample[0], 2 * sample[0]])


def test_batch_size_none_on_a_shard_directory_gives_one_sample_at_a_time(shard_dir, fio) -> None:
    loader = fastio.StreamLoader(shard_dir, batch_size=None, shuffle=True, seed=4)
    rows = fastio.StreamLoader(shard_dir, batch_size=1, shuffle=True, seed=4)
    iterator = iter(loader)
    head = [next(iterator) for _ in range(5)]  # kept without .clone()
    state = loader.state_dict()
    rest = list(iterator)
    samples = head + rest
    assert [s["y"].item() for s in samples] == [b["y"].item() for b in rows]
    for sample in samples:
        np.testing.assert_array_equal(sample["x"].numpy(), fio.make_sample(sample["y"].item())["x"])
    resumed = fastio.StreamLoader(shard_dir, batch_size=None, shuffle=True, seed=4)
    resumed.load_state_dict(state)
    assert [s["y"].item() for s in resumed] == [s["y"].item() for s in rest]


@pytest.mark.parametrize("drop_last", [False, True])
def test_sampler_split_across_ranks_as_distributed_sampler_splits(drop_last: bool) -> None:
    seed = _seed(("ranks", drop_last))
    sequence = list(SubsetRandomSampler(range(NUM_SAMPLES), torch.Generator().manual_seed(seed)))
    seen = []
    for rank in range(3):
        sampler = SubsetRandomSampler(range(NUM_SAMPLES), torch.Generator().manual_seed(seed))
        ranks = fastio.OrderOptions(rank=rank, world_size=3)
        loader = fastio.StreamLoader(
            Numbers(), batch_size=4, sampler=sampler, drop_last=drop_last, order=ranks
        )
        mine = DistributedSampler(sequence, num_replicas=3, rank=rank, shuffle=False, drop_last=drop_last)
        expected = _indices(DataLoader(Numbers(), batch_size=4, drop_last=drop_last,
                                       sampler=[sequence[i] for i in mine]))  # fmt: skip
        assert _indices(loader) == expected and len(loader) == len(expected)
        seen += [i for batch in expected for i in batch]
    assert set(seen) == set(range(NUM_SAMPLES)) or drop_last


def test_sampler_orders_the_documents_of_packed_rows(tmp_path) -> None:
    with fastio.ShardWriter(tmp_path / "docs", max_samples=5, schema={"tokens": ("int32", None)}) as w:
        for i in range(12):
            w.write({"tokens": np.arange(100 * i, 100 * i + 3 + i % 4, dtype=np.int32)})
    pack = fastio.Pack("tokens", seq_len=8)
    own = [b["tokens"].tolist() for b in fastio.StreamLoader(tmp_path / "docs", 2, pack=pack)]
    sequential = SequentialSampler(range(12))
    ours = fastio.StreamLoader(tmp_path / "docs", 2, pack=pack, sampler=sequential)
    assert [b["tokens"].tolist() for b in ours] == own
    backwards = fastio.StreamLoader(tmp_path / "docs", 2, pack=pack, sampler=list(range(11, -1, -1)))
    assert next(iter(backwards))["tokens"][0, 0].item() == 1100  # the last document comes first
    with pytest.raises(ValueError, match="batch_sampler= with pack="):
        fastio.StreamLoader(tmp_path / "docs", pack=pack, batch_sampler=[[0, 1]])


def test_the_docs_table_lists_every_dataloader_argument() -> None:
    table = pathlib.Path(__file__).resolve().parents[2] / "docs" / "loader.md"
    rows = re.findall(r"^\| `(\w+)` \|", table.read_text(), flags=re.MULTILINE)
    assert set(inspect.signature(DataLoader).parameters) <= set(rows)
    assert set(inspect.signature(DataLoader).parameters) - {"dataset"} <= set(
        inspect.signature(fastio.StreamLoader).parameters
    )


def test_sampler_split_across_ranks_resumes_on_the_same_world_size() -> None:
    sampler = SequentialSampler(range(NUM_SAMPLES))
    ranks = fastio.OrderOptions(rank=1, world_size=3)
    loader = fastio.StreamLoader(Numbers(), batch_size=2, sampler=sampler, order=ranks)
    iterator = iter(loader)
    head = [next(iterator)[:, 0].tolist() for _ in range(2)]
    resumed = fastio.StreamLoader(Numbers(), batch_size=2, sampler=sampler, order=ranks)
    resumed.load_state_dict(loader.state_dict())
    assert head + _indices(resumed) == _indices(loader)
    other = fastio.StreamLoader(Numbers(), batch_size=2, sampler=sampler, order=fastio.OrderOptions(0, 2))
    with pytest.raises(ValueError, match="resumes on the same world size"):
        other.load_state_dict(loader.state_dict())
