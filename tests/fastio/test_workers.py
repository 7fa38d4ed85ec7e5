"""Worker threads and worker processes: same batches, errors re-raised, dead workers reported, no /dev/shm."""

from __future__ import annotations

import os
import pickle
import threading

import numpy as np
import pytest
import torch

import fastio
from fastio.workers import ThreadPipeline


def _identity(sample: dict) -> dict:
    return sample


def _ys(loader) -> list[list[int]]:
    return [b["y"].tolist() for b in loader]


def _open_slot_files(directory) -> list[str]:
    """Files in ``directory`` this process holds open (unlinked ones too: Linux names them ``(deleted)``)."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except FileNotFoundError:
            pass  # the fd listdir itself used
    return [t for t in targets if t.startswith(f"{directory}/")]


@pytest.mark.parametrize("workers", [1, 3])
def test_processes_and_threads_give_the_same_batches(shard_dir, fio, workers, tmp_path, monkeypatch):
    monkeypatch.setenv("FASTIO_WORKER_DIR", str(tmp_path))
    ranks = fastio.OrderOptions(rank=1, world_size=2)
    kwargs = dict(batch_size=10, seed=6, num_workers=workers, transform=_identity, order=ranks)
    threads = fastio.StreamLoader(shard_dir, workers=fastio.WorkerOptions(mode="thread"), **kwargs)
    processes = fastio.StreamLoader(shard_dir, **kwargs)
    assert processes.worker_mode == "process"
    seen = []
    it = iter(processes)
    for batch in it:
        assert _open_slot_files(tmp_path), "slot files live in FASTIO_WORKER_DIR while iterating"
        seen.append(fio.check_batch(batch))
        assert os.listdir(tmp_path) == [], "slot files have no path: nothing can outlive the loader"
    assert seen == _ys(threads)
    assert _open_slot_files(tmp_path) == [], "the slot files are closed at the end of the epoch"
    assert fio.check_batch(batch) == seen[-1], "the mapping of a batch still held stays valid"
    stats = processes.stats()
    assert stats["samples"] == 59 and stats["stage_s"]["read"] > 0 and stats["stage_s"]["collate"] > 0


def test_batch_valid_until_next_request_with_processes(shard_dir):
    loader = fastio.StreamLoader(shard_dir, batch_size=10, shuffle=False, num_workers=2, transform=_identity)
    for k, batch in enumerate(loader):
        expected = np.arange(10 * k, min(10 * k + 10, 117))
        np.testing.assert_array_equal(batch["x"][:, 0, 0].numpy(), expected.astype(np.int16))


def _explode(sample: dict) -> dict:
    if int(sample["y"]) == 50:
        raise KeyError("sample 50 is cursed")
    return sample


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_transform_errors_reach_the_consumer(shard_dir, mode):
    loader = fastio.StreamLoader(
        shard_dir, batch_size=10, num_workers=2, transform=_explode, workers=fastio.WorkerOptions(mode=mode)
    )
    with pytest.raises(KeyError, match="cursed"):
        for _ in loader:
            pass


def _die(sample: dict) -> dict:
    os._exit(3)


def test_a_dead_worker_process_raises_instead_of_hanging(shard_dir):
    loader = fastio.StreamLoader(shard_dir, batch_size=10, num_workers=1, transform=_die)
    with pytest.raises(RuntimeError, match="exited"):
        next(iter(loader))


def test_errors_survive_pickling():
    for err in [
        fastio.CorruptShardError("a.fio", "x", "crc32 1", "crc32 2", "flipped"),
        fastio.MissingIndexError("index.json", "write it"),
        fastio.SchemaMismatchError("a.fio", "x", "int8 (2,)", "int8 (3,)"),
    ]:
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)


def test_thread_pipeline_keeps_order_and_bounds_in_flight():
    started = []

    def produce(job: int) -> tuple[torch.Tensor, int]:
        started.append(job)
        return torch.tensor([job]), 1

    pipeline = ThreadPipeline(produce, n_batches=20, num_workers=3, slots=2)
    for job in range(20):
        ok, (value, _) = pipeline.get(job)
        assert ok and value.item() == job
        assert max(started) < job + 2, "never more than `slots` batches ahead of the consumer"
    pipeline.stop()


def test_thread_pipeline_out_of_order_hands_what_is_ready_within_the_window():
    first_may_finish = threading.Event()

    def produce(job: int) -> tuple[int, int]:
        if job == 0:
            first_may_finish.wait()
        return job, 1

    pipeline = ThreadPipeline(produce, n_batches=6, num_workers=2, slots=3, timeout=0.3)
    ready = sorted(pipeline.get_ready(0)[0] for _ in range(2))
    assert ready == [1, 2], "batches 1 and 2 come while batch 0 is still being made"
    job, ok, error = pipeline.get_ready(0)
    assert not ok and isinstance(error, fastio.WorkerTimeoutError), "no batch beyond the window of 3 starts"
    first_may_finish.set()
    assert pipeline.get_ready(0)[:2] == (0, True)
    assert sorted(pipeline.get_ready(3)[0] for _ in range(3)) == [3, 4, 5]
    pipeline.stop()


def test_kept_thread_pipeline_serves_the_next_pass_with_one_init_per_thread():
    inits, pass_inits = [], []
    pipeline = ThreadPipeline(
        lambda job: ("first", job), n_batches=3, num_workers=2, slots=2, worker_init=inits.append,
        persistent=True,
    )  # fmt: skip
    assert [pipeline.get(job) for job in range(2)] == [(True, ("first", 0)), (True, ("first", 1))]
    assert pipeline.next_pass((lambda job: ("second", job), pass_inits.append), n_batches=4, times=None)
    assert [pipeline.get(job) for job in range(4)] == [(True, ("second", j)) for j in range(4)]
    assert sorted(inits) == [0, 1] and set(pass_inits) <= {0, 1} and pass_inits
    assert all(thread.is_alive() for thread in pipeline.threads), "kept threads wait for the next pass"
    pipeline.stop()


@pytest.mark.parametrize("workers", [1, 3])
def test_thread_pipeline_in_units_makes_each_batch_once_in_order_within_one_unit_per_worker(workers):
    # Packing's groups: a worker takes `unit` consecutive batches at once (the last unit short here).
    made, lock = [], threading.Lock()

    def produce(job: int) -> tuple[int, threading.Thread]:
        with lock:
            made.append(job)
        return job, threading.current_thread()

    n, unit = 23, 4
    pipeline = ThreadPipeline(produce, n_batches=n, num_workers=workers, slots=2, unit=unit)
    makers = []
    for job in range(n):
        ok, (value, thread) = pipeline.get(job)
        assert ok and value == job
        makers.append(thread)
        with lock:
            assert max(made) < job + max(2, unit * workers), "at most one unit per worker ahead"
    pipeline.stop()
    assert sorted(made) == list(range(n)), "each batch made once"
    assert all(len(set(makers[u : u + unit])) == 1 for u in range(0, n, unit)), "a unit is one worker's"


def test_thread_pipeline_in_units_hands_a_failure_over_and_a_kept_one_serves_the_next_pass():
    def produce(job: int) -> int:
        if job == 5:
            raise ValueError("batch 5 is bad")
        return job

    pipeline = ThreadPipeline(produce, n_batches=8, num_workers=2, slots=2, unit=3, persistent=True)
    assert [pipeline.get(job) for job in range(5)] == [(True, j) for j in range(5)]
    ok, error = pipeline.get(5)
    assert not ok and isinstance(error, ValueError) and "batch 5" in str(error)
    assert pipeline.next_pass((lambda job: -job, None), n_batches=7, times=None)
    assert [pipeline.get(job) for job in range(7)] == [(True, -j) for j in range(7)]
    pipeline.stop()
