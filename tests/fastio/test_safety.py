"""Safe workers: per-sample randomness independent of num_workers, kept batches never overwritten, no
orphan workers or slot files after the parent dies, any batch structure through worker processes."""

from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import zlib

import numpy as np
import pytest
import torch

import fastio
from fastio import workers as fastio_workers
from fastio.workers import processes, threads

MODES = {
    "main": dict(num_workers=0),
    "threads": dict(num_workers=2, workers=fastio.WorkerOptions(mode="thread")),
}
MODES["processes"] = dict(num_workers=2, workers=fastio.WorkerOptions(mode="process"))


def _draws(sample: dict) -> dict:
    """Three global-RNG draws (torch, random, numpy) for the sample, as a transform would make them."""
    draw = torch.tensor([torch.rand(()).item(), random.random(), np.random.rand()])
    return {"y": sample["y"], "draw": draw}


def _draws_by_sample(loader) -> dict[int, tuple[float, ...]]:
    return {
        int(y): tuple(d.tolist())
        for batch in loader
        for y, d in zip(batch["y"].tolist(), batch["draw"], strict=True)
    }


def _rng_loader(shard_dir, num_workers: int, **kwargs):
    return fastio.StreamLoader(
        shard_dir, batch_size=10, shuffle=True, seed=11, num_workers=num_workers, transform=_draws, **kwargs
    )


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_transform_draws_do_not_depend_on_num_workers(shard_dir, workers):
    reference = _draws_by_sample(_rng_loader(shard_dir, 0))
    assert _draws_by_sample(_rng_loader(shard_dir, workers)) == reference


def test_no_two_samples_or_epochs_share_a_draw(shard_dir, fio):
    loader = _rng_loader(shard_dir, 2)
    first = _draws_by_sample(loader)
    loader.set_epoch(1)
    second = _draws_by_sample(loader)
    assert len(first) == fio.NUM_SAMPLES
    for column in range(3):  # torch, random, numpy each differ for every sample and every epoch
        values = [d[column] for d in first.values()] + [d[column] for d in second.values()]
        assert len(set(values)) == 2 * fio.NUM_SAMPLES


def test_resume_mid_epoch_reproduces_the_draws(shard_dir):
    full = _draws_by_sample(_rng_loader(shard_dir, 2))
    loader = _rng_loader(shard_dir, 3)
    it = iter(loader)
    for _ in range(4):
        next(it)
    state = loader.state_dict()
    resumed = _rng_loader(shard_dir, 1)
    resumed.load_state_dict(state)
    rest = _draws_by_sample(resumed)
    assert len(rest) == 117 - 40 and all(full[y] == d for y, d in rest.items())


class _NoisyDataset(torch.utils.data.Dataset):
    """Draws in ``__getitem__`` (torchvision-style datasets augment there)."""

    def __len__(self) -> int:
        return 47

    def __getitem__(self, i: int) -> dict:
        return {"i": i, "noise": torch.rand(()).item() + np.random.rand() + random.random()}


def _mix_collate(samples: list[dict]) -> dict:
    """A collate that draws (mixup-style weights)."""
    return {"i": [s["i"] for s in samples], "noise": [s["noise"] for s in samples], "w": torch.rand(())}


@pytest.mark.parametrize("workers", [1, 2])
def test_dataset_and_collate_draws_do_not_depend_on_num_workers(workers):
    def run(num_workers: int) -> tuple[dict[int, float], list[float]]:
        loader = fastio.StreamLoader(
            _NoisyDataset(),
            batch_size=5,
            shuffle=True,
            seed=2,
            num_workers=num_workers,
            collate_fn=_mix_collate,
        )
        batches = list(loader)
        noise = {i: n for b in batches for i, n in zip(b["i"], b["noise"], strict=True)}
        return noise, [float(b["w"]) for b in batches]

    noise, weights = run(0)
    assert run(workers) == (noise, weights)
    assert len(set(noise.values())) == 47 and len(set(weights)) == len(weights)


def test_the_consumers_global_rngs_are_untouched_without_workers(shard_dir):
    def sequence() -> list[float]:
        return [torch.rand(()).item(), random.random(), float(np.random.rand())]

    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    expected = sequence() + sequence()
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    got = sequence()
    for _ in fastio.StreamLoader(shard_dir, batch_size=10, transform=_draws):
        pass
    assert got + sequence() == expected


def test_worker_threads_never_reseed_the_shared_global_rngs(shard_dir, fio):
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    draws = _draws_by_sample(_rng_loader(shard_dir, 2, workers=fastio.WorkerOptions(mode="thread")))
    for column in range(3):  # one shared stream per generator, advanced by every draw: nothing repeats
        assert len({d[column] for d in draws.values()}) == fio.NUM_SAMPLES
    assert torch.initial_seed() == 5


def _report_worker(sample: dict) -> dict:
    mine, theirs = fastio_workers.worker_info(), torch.utils.data.get_worker_info()
    own = torch.Generator().manual_seed(mine.sample_seed)
    return {
        "y": sample["y"],
        "fastio": torch.tensor([mine.id, mine.num_workers, mine.seed, mine.epoch]),
        "torch": torch.tensor([-1, -1] if theirs is None else [theirs.id, theirs.num_workers]),
        "own_draw": torch.rand((), generator=own),
    }


@pytest.mark.parametrize("mode", list(MODES))
def test_worker_info_inside_workers(shard_dir, mode):
    loader = fastio.StreamLoader(shard_dir, batch_size=10, seed=4, transform=_report_worker, **MODES[mode])
    loader.set_epoch(2)
    workers = MODES[mode]["num_workers"]
    ids, draws = set(), {}
    for batch in loader:
        for y, info, theirs, draw in zip(
            batch["y"], batch["fastio"], batch["torch"], batch["own_draw"], strict=True
        ):
            ids.add(int(info[0]))
            assert info[1:].tolist() == [workers, 4, 2]
            expected_torch = [int(info[0]), workers] if mode == "processes" else [-1, -1]
            assert theirs.tolist() == expected_torch, "get_worker_info() answers in worker processes only"
            draws[int(y)] = float(draw)
    assert ids == set(range(max(workers, 1)))
    assert len(set(draws.values())) == 117
    main = fastio.StreamLoader(shard_dir, batch_size=10, seed=4, transform=_report_worker)
    main.set_epoch(2)
    assert {int(y): float(d) for b in main for y, d in zip(b["y"], b["own_draw"], strict=True)} == draws
    assert fastio_workers.worker_info() is None


def _identity(sample: dict) -> dict:
    return sample


KEEP_CASES = [(mode, transform, reuse) for mode in MODES for transform in (0, 1) for reuse in (True, False)]


@pytest.mark.parametrize(("mode", "transform", "reuse"), KEEP_CASES)
def test_kept_batches_are_never_overwritten(shard_dir, fio, mode, transform, reuse):
    loader = fastio.StreamLoader(
        shard_dir,
        batch_size=10,
        shuffle=True,
        seed=zlib.crc32(repr((mode, transform, reuse)).encode()),
        transform=_identity if transform else None,
        batches=fastio.BatchOptions(reuse_buffers=reuse),
        **MODES[mode],
    )
    kept = list(loader)
    ys = [y for batch in kept for y in fio.check_batch(batch)]
    assert sorted(ys) == list(range(fio.NUM_SAMPLES))


@pytest.mark.parametrize("mode", list(MODES))
def test_kept_slices_and_numpy_views_are_never_overwritten(shard_dir, fio, mode):
    loader = fastio.StreamLoader(shard_dir, batch_size=10, shuffle=True, seed=3, **MODES[mode])
    slices, arrays = [], []
    for batch in loader:
        slices.append((batch["y"].tolist()[2:5], batch["y"][2:5]))
        arrays.append((int(batch["y"][0]), batch["x"].numpy()[0]))
    for expected, kept in slices:
        assert kept.tolist() == expected
    for y, x in arrays:
        np.testing.assert_array_equal(x, fio.make_sample(y)["x"])


class _Big(torch.utils.data.Dataset):
    """Samples of 80 KB each, with contents no other sample has: a slot holds more than gets copied out."""

    def __len__(self) -> int:
        return 41

    def __getitem__(self, i: int) -> dict:
        values = torch.randint(0, 1 << 30, (20_000,), generator=torch.Generator().manual_seed(_case_seed(i)))
        return {"i": i, "values": values.int()}


def _case_seed(case: object) -> int:
    return zlib.crc32(repr(case).encode())


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts /proc/self/fd")
@pytest.mark.parametrize("reuse", [True, False])
def test_kept_large_batches_from_processes_stay_valid_and_hold_no_fds(reuse):
    dataset = _Big()
    loader = fastio.StreamLoader(
        dataset,
        batch_size=2,
        num_workers=2,
        workers=fastio.WorkerOptions(mode="process"),
        batches=fastio.BatchOptions(reuse_buffers=reuse),
    )
    before = _open_fds()
    kept = list(loader)
    assert _open_fds() <= before, "kept batches hold mappings, not file descriptors"
    for batch in kept:
        for i, values in zip(batch["i"].tolist(), batch["values"], strict=True):
            assert torch.equal(values, dataset[i]["values"])


def test_a_slot_file_that_cannot_be_made_raises_instead_of_hanging(monkeypatch):
    made = []
    create = processes._SlotFile.create

    def create_until_the_disk_is_full() -> object:
        made.append(1)
        if len(made) > 5:  # the ring's own files, then none: a kept batch needs one more
            raise OSError(28, "No space left on device")
        return create()

    monkeypatch.setattr(processes._SlotFile, "create", staticmethod(create_until_the_disk_is_full))
    loader = fastio.StreamLoader(
        _Big(), batch_size=2, num_workers=2, workers=fastio.WorkerOptions(mode="process")
    )
    previous = signal.signal(signal.SIGALRM, lambda *_: pytest.fail("the loader hung"))
    signal.alarm(30)
    try:
        with pytest.raises(OSError, match="No space"):
            kept = list(loader)  # noqa: F841 -- every batch kept, so every slot is held when refilled
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("mode", list(MODES))
def test_keeping_only_labels_leaves_the_rest_of_each_batch_reused(shard_dir, mode):
    # Processes: large tensors stay views of the slot file (small ones are copied out), so use _Big there.
    source, label, big = (_Big(), "i", "values") if mode == "processes" else (shard_dir, "y", "x")
    loader = fastio.StreamLoader(source, batch_size=2, **MODES[mode])
    labels, pointers = [], set()
    for batch in loader:
        labels.append(batch[label])
        pointers.add(batch[big].data_ptr())
    assert torch.cat(labels).tolist() == list(range(loader.num_samples))
    assert len(pointers) <= 2 + 2 + 2, "the large buffers are recycled although every label is kept"


def test_dropped_batches_reuse_their_buffers(shard_dir):
    loader = fastio.StreamLoader(
        shard_dir, batch_size=10, num_workers=2, workers=fastio.WorkerOptions(mode="thread")
    )
    pointers = {batch["x"].data_ptr() for batch in loader}
    assert len(pointers) <= 2 + 2 + 2, "the fast path recycles a bounded set of buffers"


_ORPHAN_SCRIPT = """
import multiprocessing, sys, time
import fastio

def slow(sample):
    time.sleep(0.05)
    return sample

loader = fastio.StreamLoader(sys.argv[1], batch_size=5, num_workers=2, transform=slow)
it = iter(loader)
next(it)
print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
time.sleep(60)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_workers_and_slot_files_die_with_the_parent(shard_dir, tmp_path, sig):
    env = dict(os.environ, FASTIO_WORKER_DIR=str(tmp_path))
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_ORPHAN_SCRIPT), str(shard_dir)],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and not any(_gone(p) for p in pids)
        parent.send_signal(sig)
        parent.wait(timeout=5)
        deadline = time.monotonic() + 2.0
        while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert all(_gone(p) for p in pids), "worker processes outlived their parent by 2 s"
        left = [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files]
        assert left == [], f"slot files left behind: {left}"
    finally:
        parent.kill()
        parent.wait()


_EARLY_EXIT_SCRIPT = """
import itertools, sys
import fastio

loader = fastio.StreamLoader(sys.argv[1], batch_size=256, num_workers=2, worker_mode="thread", prefetch=4)
for _ in itertools.islice(loader, 3):
    pass
"""


def test_leaving_a_loop_early_and_exiting_never_aborts(tmp_path):
    rng = np.random.default_rng(_case_seed("early exit"))
    with fastio.ShardWriter(
        tmp_path / "set", schema={"x": ("uint8", (3, 32, 32))}, max_samples=1000
    ) as writer:
        for _ in range(2000):
            writer.write({"x": rng.integers(0, 256, (3, 32, 32), dtype=np.uint8)})
    # Worker threads still inside the native gather at interpreter shutdown used to abort the process
    # (about every other run): a few runs at once.
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", _EARLY_EXIT_SCRIPT, str(tmp_path / "set")],
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    for run in runs:
        _, stderr = run.communicate(timeout=120)
        assert run.returncode == 0, stderr[-2000:]


def test_running_thread_pipelines_are_stopped_and_joined_at_exit():
    def produce(job: int) -> tuple[int, int]:
        time.sleep(0.01)
        return job, 1

    pipeline = fastio_workers.ThreadPipeline(produce, n_batches=1000, num_workers=2, slots=4)
    assert pipeline.get(0)[0]
    threads._stop_thread_pipelines()  # what atexit runs
    assert not any(t.is_alive() for t in pipeline.threads)


Pair = collections.namedtuple("Pair", ["x", "name"])


class _Pairs(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 23

    def __getitem__(self, i: int) -> Pair:
        return Pair(torch.full((2,), float(i)), f"item-{i}")


class _Names(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 23

    def __getitem__(self, i: int) -> dict:
        return {"name": f"item-{i}", "n": str(i)}


def test_namedtuple_batches_through_worker_processes():
    loader = fastio.StreamLoader(
        _Pairs(), batch_size=5, num_workers=2, workers=fastio.WorkerOptions(mode="process")
    )
    batches = list(loader)
    assert all(type(b) is Pair for b in batches)
    xs = torch.cat([b.x for b in batches])
    assert xs[:, 1].tolist() == [float(i) for i in range(23)]
    assert [n for b in batches for n in b.name] == [f"item-{i}" for i in range(23)]


def test_batches_without_tensors_through_worker_processes():
    loader = fastio.StreamLoader(
        _Names(), batch_size=5, num_workers=2, workers=fastio.WorkerOptions(mode="process")
    )
    assert [n for b in loader for n in b["name"]] == [f"item-{i}" for i in range(23)]
