"""StreamLoader on DataLoader's arguments, the refusals: DataLoader's own argument errors (the same messages),
a timeout that names the batch it waited for, and named errors for what fastio refuses (samplers and worker
processes on a source read shard by shard, an index outside the dataset, another kind of order's state). The
batches themselves against ``torch.utils.data.DataLoader``: test_dataloader_args.py."""

from __future__ import annotations

import pathlib
import sys
import threading

import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler

import fastio
from fastio.sources import Source

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from _dataloader_args_helpers import NUM_SAMPLES, Numbers, same  # noqa: E402


class Blocking(Dataset):
    """Does not answer until the test is over: each read waits on :attr:`release` (set by the test at its end,
    so that no worker thread stays blocked in this process for the tests after it: ``test_safety`` joins the
    threads of every pipeline still running, as atexit does)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __len__(self) -> int:
        return 5

    def __getitem__(self, i: int) -> int:
        self.release.wait()
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


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_timeout_raises_a_named_error(mode: str) -> None:
    blocking = Blocking()
    loader = fastio.StreamLoader(
        blocking, batch_size=2, num_workers=1, timeout=0.2, workers=fastio.WorkerOptions(mode=mode)
    )
    try:
        with pytest.raises(fastio.WorkerTimeoutError, match=r"batch 0 not made within timeout=0.2 s"):
            next(iter(loader))
    finally:
        blocking.release.set()


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
        ({"num_workers": 1, "multiprocessing_context": "bogus"}, ValueError, "should specify a valid start"),
        ({"num_workers": 1, "multiprocessing_context": 3}, TypeError, "should be a valid context object"),
        (
            {
                "num_workers": 1,
                "multiprocessing_context": "spawn",
                "workers": fastio.WorkerOptions(mode="thread"),
            },
            ValueError,
            "WorkerOptions(mode='thread')",
        ),
        ({"generator": torch.Generator(), "shuffle": "shard"}, ValueError, "shard-aware shuffle"),
        (
            {"sampler": [1, 2], "shuffle": "shard"},
            ValueError,
            "mutually exclusive with shuffle: shuffle='shard'",
        ),
        (
            {
                "sampler": DistributedSampler(range(4), 2, 0),
                "order": fastio.OrderOptions(world_size=2, rank=0),
            },
            ValueError,
            "both split the indices",
        ),
        (
            {"batch_size": None, "drop_last": True},
            ValueError,
            "batch_size=None option disables auto-batching",
        ),
        (
            {"batch_size": None, "batch_sampler": [[1]]},
            ValueError,
            "batch_sampler option is mutually exclusive",
        ),
    ],
)
def test_contradictory_arguments_raise(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        fastio.StreamLoader(Numbers(), **kwargs)


def test_sampler_on_a_source_read_shard_by_shard_is_refused() -> None:
    with pytest.raises(ValueError, match="read shard by shard.*shuffle='shard'"):
        fastio.StreamLoader(ShardOrderSquares(), batch_sampler=[[0, 9]])


def test_persistent_worker_processes_on_a_source_read_shard_by_shard_are_refused() -> None:
    with pytest.raises(ValueError, match="persistent_workers=True with worker processes on .*mode='thread'"):
        fastio.StreamLoader(
            ShardOrderSquares(), batch_size=2, num_workers=1, persistent_workers=True, transform=same
        )


def test_spawned_workers_on_a_source_read_shard_by_shard_are_refused() -> None:
    with pytest.raises(ValueError, match="multiprocessing_context='spawn' on .*read shard by shard"):
        fastio.StreamLoader(ShardOrderSquares(), batch_size=2, num_workers=1, multiprocessing_context="spawn")


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
