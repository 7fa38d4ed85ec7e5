"""StreamLoader on the rest of DataLoader's signature (sampler=, batch_sampler=, generator=,
persistent_workers=, prefetch_factor=, timeout=, multiprocessing_context=, pin_memory=): the same batches as
``torch.utils.data.DataLoader`` on the same map-style dataset, DataLoader's own argument errors, and named
errors for what fastio refuses."""

from __future__ import annotations

import multiprocessing
import os
import threading
import zlib

import numpy as np
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

import fastio
from fastio.sources import Source

NUM_SAMPLES = 37


class Numbers(Dataset):
    """Sample ``i`` is ``[i, pid of the process that read it]``."""

    def __init__(self, n: int = NUM_SAMPLES) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, os.getpid()])


class EveryThirdBackwards(Sampler[int]):
    """A user's own sampler: every third index, from the end."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -3))

    def __len__(self) -> int:
        return len(range(self.n - 1, -1, -3))


class Blocking(Dataset):
    """Never answers: each read waits on an event nobody sets."""

    def __len__(self) -> int:
        return 5

    def __getitem__(self, i: int) -> int:
        threading.Event().wait()
        return i


class ShardOrderSquares(Source):
    """A source read shard by shard (as remote stores are)."""

    name, num_samples, shard_sizes, requires_shard_order = "shard-order squares", 10, [5, 5], True

    def fixed_specs(self):
        return {"y": (torch.int64, ())}

    def fetch(self, indices, buffers, threads, times):
        out = buffers.fixed("y", len(indices))
        out.copy_(torch.from_numpy(indices) ** 2)
        return {"y": out}


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


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_timeout_raises_a_named_error(mode: str) -> None:
    loader = fastio.StreamLoader(
        Blocking(), batch_size=2, num_workers=1, timeout=0.2, workers=fastio.WorkerOptions(mode=mode)
    )
    with pytest.raises(fastio.WorkerTimeoutError, match=r"batch 0 not made within timeout=0.2 s"):
        next(iter(loader))


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


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"sampler": [1, 2], "shuffle": True},
            ValueError,
            "sampler option is mutually exclusive with shuffle",
        ),
        ({"batch_sampler": [[1]], "batch_size": 3}, ValueError, "batch_sampler option is mutually exclusive"),
        (
            {"batch_sampler": [[1]], "drop_last": True},
            ValueError,
            "batch_sampler option is mutually exclusive",
        ),
        ({"batch_sampler": [[1]], "sampler": [1]}, ValueError, "batch_sampler option is mutually exclusive"),
        ({"timeout": -1}, ValueError, "timeout option should be non-negative"),
        (
            {"prefetch_factor": 2},
            ValueError,
            "prefetch_factor option could only be specified in multiprocessing",
        ),
        (
            {"num_workers": 1, "prefetch_factor": -1},
            ValueError,
            "prefetch_factor option should be non-negative",
        ),
        (
            {"num_workers": 1, "prefetch_factor": 2, "workers": fastio.WorkerOptions(prefetch=3)},
            ValueError,
            "not both",
        ),
        ({"persistent_workers": True}, ValueError, "persistent_workers option needs num_workers > 0"),
        ({"multiprocessing_context": "fork"}, ValueError, "can only be used with multi-process loading"),
        ({"num_workers": 1, "multiprocessing_context": "spawn"}, ValueError, "worker processes are forked"),
        (
            {"num_workers": 1, "multiprocessing_context": multiprocessing.get_context("forkserver")},
            ValueError,
            "'forkserver'",
        ),
        (
            {"num_workers": 1, "persistent_workers": True, "workers": fastio.WorkerOptions(mode="thread")},
            ValueError,
            "WorkerOptions(mode='thread')",
        ),
        ({"generator": torch.Generator(), "shuffle": "shard"}, ValueError, "shard-aware shuffle"),
        (
            {"sampler": [1, 2], "order": fastio.OrderOptions(world_size=2, rank=0)},
            ValueError,
            "DistributedSampler",
        ),
        ({"batch_size": None}, ValueError, "batch_size=None"),
    ],
)
def test_contradictory_arguments_raise(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        fastio.StreamLoader(Numbers(), **kwargs)


def test_sampler_on_a_source_read_shard_by_shard_is_refused() -> None:
    with pytest.raises(ValueError, match="read shard by shard.*shuffle='shard'"):
        fastio.StreamLoader(ShardOrderSquares(), batch_sampler=[[0, 9]])


def test_persistent_workers_on_a_shard_directory_is_refused(shard_dir) -> None:
    with pytest.raises(ValueError, match="persistent_workers=True on .*map-style Dataset"):
        fastio.StreamLoader(shard_dir, batch_size=4, num_workers=1, persistent_workers=True)


def test_sampler_index_outside_the_dataset_is_named() -> None:
    loader = fastio.StreamLoader(Numbers(), batch_size=2, sampler=[3, NUM_SAMPLES + 4])
    with pytest.raises(IndexError, match=f"index {NUM_SAMPLES + 4}, outside the {NUM_SAMPLES} samples"):
        next(iter(loader))


def test_state_of_another_kind_of_order_is_refused() -> None:
    sampled = fastio.StreamLoader(Numbers(), batch_size=2, sampler=range(NUM_SAMPLES))
    seeded = fastio.StreamLoader(Numbers(), batch_size=2, shuffle=True, seed=3)
    with pytest.raises(ValueError, match="sampler"):
        seeded.load_state_dict(sampled.state_dict())
    with pytest.raises(ValueError, match="fastio's own order"):
        sampled.load_state_dict(seeded.state_dict())


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
