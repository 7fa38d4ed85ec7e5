"""StreamLoader's worker processes started by ``"spawn"`` and ``"forkserver"`` (DataLoader's
``multiprocessing_context``), as a user runs them: a script with an ``if __name__ == "__main__":`` guard and a
module-level ``worker_init_fn``, transform and Dataset. This file is that script: the test runs it once in a
subprocess (each spawned worker imports torch, a few CPU-seconds, so one run of three worker processes checks
everything) and each test below reads one of its findings.

Run by hand: ``python tests/fastio/test_dataloader_args_spawn.py OUT_DIR``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, SubsetRandomSampler, get_worker_info

import fastio

NUM_SAMPLES = 37
STARTED = {"worker": -1}  # what worker_init_fn leaves in each worker process


def started(worker_id: int) -> None:
    STARTED["worker"] = 100 + worker_id


def tagged(sample: dict) -> dict:
    return {**sample, "init": STARTED["worker"], "pid": os.getpid()}


class WhoRead(Dataset):
    """Sample ``i`` is ``[i, the id torch.utils.data.get_worker_info() gives where it was read]``."""

    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, i: int) -> torch.Tensor:
        info = get_worker_info()
        return torch.tensor([i, -1 if info is None else info.id])


def _ys(batches) -> list[list[int]]:
    return [batch["y"].tolist() for batch in batches]


def _spawned_shards(root: str) -> dict[str, bool]:
    """Two spawned workers (a context object, persistent, with worker_init_fn) over a shard directory."""
    kwargs = dict(batch_size=5, shuffle=True, seed=3, transform=tagged)
    forked = fastio.StreamLoader(root, num_workers=2, **kwargs)
    spawned = fastio.StreamLoader(
        root, num_workers=2, worker_init_fn=started, persistent_workers=True,
        multiprocessing_context=multiprocessing.get_context("spawn"), **kwargs,
    )  # fmt: skip
    found, pids, expected = {}, [], []
    for epoch in range(2):
        forked.set_epoch(epoch)
        spawned.set_epoch(epoch)
        expected.append(_ys(forked))
        kept = list(spawned)  # kept without .clone()
        found[f"order_exact_epoch_{epoch}"] = _ys(kept) == expected[-1]
        pids.append({pid for batch in kept for pid in batch["pid"].tolist()})
        found[f"worker_init_fn_ran_epoch_{epoch}"] = {i for b in kept for i in b["init"].tolist()} == {
            100,
            101,
        }
    found["workers_are_new_processes"] = len(pids[0]) == 2 and os.getpid() not in pids[0]
    found["persistent_workers_serve_every_epoch"] = pids[0] == pids[1]
    spawned.set_epoch(1)
    iterator = iter(spawned)
    head = [next(iterator)["y"].tolist() for _ in range(3)]
    state = spawned.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # loading during an iteration applies at the next iter()
        spawned.load_state_dict(state)
    rest = list(spawned)
    found["resume_mid_epoch_exact"] = head + _ys(rest) == expected[1]
    found["resume_served_by_the_kept_workers"] = {p for b in rest for p in b["pid"].tolist()} == pids[0]
    return found


def _forkserver_dataset() -> dict[str, bool]:
    """One forkserver worker over a Dataset with a sampler, against DataLoader on the same data."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", "fastio"])
    sampler = SubsetRandomSampler(range(0, NUM_SAMPLES, 2))  # draws from torch's global generator
    torch.manual_seed(0)
    theirs = [b[:, 0].tolist() for b in DataLoader(WhoRead(), batch_size=4, sampler=sampler)]
    torch.manual_seed(0)
    loader = fastio.StreamLoader(
        WhoRead(), batch_size=4, sampler=sampler, num_workers=1, multiprocessing_context="forkserver"
    )
    batches = list(loader)
    return {
        "forkserver_same_batches_as_dataloader": [b[:, 0].tolist() for b in batches] == theirs,
        "forkserver_worker_info_set": {i for b in batches for i in b[:, 1].tolist()} == {0},
    }


def _unpicklable_is_named(root: str) -> dict[str, bool]:
    loader = fastio.StreamLoader(
        root, 5, num_workers=1, transform=lambda s: s, multiprocessing_context="spawn"
    )
    try:
        next(iter(loader))
    except TypeError as error:
        return {"unpicklable_transform_named": "multiprocessing_context='spawn'" in str(error)}
    return {"unpicklable_transform_named": False}


def main(out: str) -> None:
    root = os.path.join(out, "train")
    with fastio.ShardWriter(root, max_samples=13) as writer:
        for i in range(NUM_SAMPLES):
            writer.write({"x": np.full(4, i, np.int32), "y": i})
    found = {**_spawned_shards(root), **_forkserver_dataset(), **_unpicklable_is_named(root)}
    with open(os.path.join(out, "found.json"), "w") as fh:
        json.dump(found, fh)


CHECKS = [
    "order_exact_epoch_0",
    "order_exact_epoch_1",
    "worker_init_fn_ran_epoch_0",
    "worker_init_fn_ran_epoch_1",
    "workers_are_new_processes",
    "persistent_workers_serve_every_epoch",
    "resume_mid_epoch_exact",
    "resume_served_by_the_kept_workers",
    "forkserver_same_batches_as_dataloader",
    "forkserver_worker_info_set",
    "unpicklable_transform_named",
]


@pytest.fixture(scope="module")
def found(tmp_path_factory) -> dict[str, bool]:
    out = tmp_path_factory.mktemp("spawn")
    run = subprocess.run(
        [sys.executable, __file__, str(out)], capture_output=True, text=True, timeout=240, check=False
    )
    assert run.returncode == 0, run.stderr[-4000:]
    with open(out / "found.json") as fh:
        return json.load(fh)


@pytest.mark.parametrize("check", CHECKS)
def test_spawned_and_forkserver_workers(found: dict[str, bool], check: str) -> None:
    assert found[check], f"{check} failed; all findings: {found}"


def test_every_finding_is_checked(found: dict[str, bool]) -> None:
    assert sorted(found) == sorted(CHECKS)


if __name__ == "__main__":
    main(sys.argv[1])
