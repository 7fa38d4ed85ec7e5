"""The seam sources plug into: fastio.registry (formats, URL schemes) and the fastio.sources.Source
protocol, exercised through StreamLoader with a toy format and a toy scheme defined in this file."""

from __future__ import annotations

import os
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch

import fastio
from fastio import registry
from fastio.registry import open_source
from fastio.sources import ReadPlan, Source, shard_read_order

_SHARDS = [13, 7, 1, 13, 9]  # odd sizes: 43 samples


def _rng(case: object) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(case).encode()))


class NpyDirSource(Source):
    """A toy format: a directory of ``part-*.npy`` files, each one shard of rows (field ``x``)."""

    def __init__(self, directory: str) -> None:
        self.name = directory
        self.parts = [np.load(os.path.join(directory, f)) for f in sorted(os.listdir(directory))]
        self.shard_sizes = [len(p) for p in self.parts]
        self.num_samples = sum(self.shard_sizes)
        self.rows = np.concatenate(self.parts)

    def fixed_specs(self):
        return {"x": (torch.float32, self.rows.shape[1:])}

    def fetch(self, indices, buffers, threads, times):
        out = buffers.fixed("x", len(indices))
        out.copy_(torch.from_numpy(self.rows[indices]))
        return {"x": out, "index": indices.tolist()}


def _is_npy_dir(target) -> bool:
    return (
        isinstance(target, str)
        and os.path.isdir(target)
        and bool(os.listdir(target))
        and all(f.endswith(".npy") for f in os.listdir(target))
    )


class MemorySource(Source):
    """A toy remote source: shards held in ``_STORE`` under a ``mem://`` URL, read shard by shard."""

    requires_shard_order = True

    def __init__(self, url: str, shard_sizes: list[int]) -> None:
        self.name, self.shard_sizes, self.num_samples = url, shard_sizes, sum(shard_sizes)
        self.cumulative = np.cumsum([0, *shard_sizes])
        self.prepared: list[tuple[list[int], int]] = []
        self.fetched_shards: list[int] = []

    def prepare(self, shard_order, epoch, indices=None):
        self.prepared.append((shard_order.tolist(), epoch))
        self.prepared_indices = indices.tolist()

    def fixed_specs(self):
        return {"y": (torch.int64, ())}

    def fetch(self, indices, buffers, threads, times):
        shards = np.searchsorted(self.cumulative, indices, side="right") - 1
        self.fetched_shards.extend(shards.tolist())
        out = buffers.fixed("y", len(indices))
        out.copy_(torch.from_numpy(indices * 3 + 1))
        return {"y": out}


_STORE: dict[str, MemorySource] = {}


def _open_memory(url, options):
    return _STORE[url]


@pytest.fixture
def toy_registry():
    registry.register_format(
        "npy-dir", _is_npy_dir, lambda t, options: NpyDirSource(t), "a directory of .npy"
    )
    registry.register_scheme("mem", _open_memory)
    yield
    registry.unregister_format("npy-dir")
    registry.unregister_scheme("mem")
    _STORE.clear()


@pytest.fixture
def npy_dir(tmp_path):
    rng = _rng("npy_dir")
    parts = [rng.standard_normal((n, 3, 2)).astype(np.float32) for n in _SHARDS]
    for i, part in enumerate(parts):
        np.save(tmp_path / f"part-{i:03d}.npy", part)
    return str(tmp_path), np.concatenate(parts)


@pytest.mark.parametrize("num_workers,worker_mode", [(0, "thread"), (2, "thread"), (2, "process")])
def test_toy_format_reads_every_sample_through_the_loader(toy_registry, npy_dir, num_workers, worker_mode):
    directory, rows = npy_dir
    loader = fastio.StreamLoader(
        directory,
        batch_size=5,
        shuffle=True,
        seed=3,
        num_workers=num_workers,
        workers=fastio.WorkerOptions(mode=worker_mode),
    )
    assert isinstance(loader._source, NpyDirSource)
    seen = []
    for batch in loader:
        assert torch.equal(batch["x"], torch.from_numpy(rows[batch["index"]]))
        seen.extend(batch["index"])
    assert sorted(seen) == list(range(len(rows)))
    assert seen != sorted(seen)


def test_toy_format_with_the_python_path(toy_registry, npy_dir):
    directory, rows = npy_dir
    loader = fastio.StreamLoader(directory, batch_size=4, transform=lambda s: {**s, "x": s["x"] * 2})
    batch = next(iter(loader))
    assert torch.equal(batch["x"], torch.from_numpy(rows[:4]) * 2)


@pytest.mark.parametrize("num_workers,worker_mode", [(0, "thread"), (2, "thread"), (2, "process")])
def test_toy_scheme_reads_every_sample(toy_registry, num_workers, worker_mode):
    _STORE["mem://train"] = MemorySource("mem://train", _SHARDS)
    loader = fastio.StreamLoader(
        "mem://train",
        batch_size=6,
        shuffle="shard",
        order=fastio.OrderOptions(shuffle_block=4),
        workers=fastio.WorkerOptions(mode=worker_mode),
        seed=1,
        num_workers=num_workers,
    )
    ys = torch.cat([batch["y"] for batch in loader])
    assert sorted(((ys - 1) // 3).tolist()) == list(range(sum(_SHARDS)))


def _first_touched(shards: list[int]) -> list[int]:
    """Reference twin of shard_read_order: each shard once, in the order first seen (a plain loop)."""
    seen: list[int] = []
    for s in shards:
        if s not in seen:
            seen.append(s)
    return seen


@pytest.mark.parametrize("rank", [0, 1])
def test_prepare_gets_the_order_this_rank_reads_shards_in(toy_registry, rank):
    source = _STORE["mem://a"] = MemorySource("mem://a", _SHARDS)
    loader = fastio.StreamLoader(
        "mem://a",
        batch_size=4,
        shuffle="shard",
        order=fastio.OrderOptions(shuffle_block=3, shuffle_window=2, rank=rank, world_size=2),
        seed=7,
    )
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        source.fetched_shards.clear()
        fetched = [((y - 1) // 3).tolist() for batch in loader for y in batch["y"]]
        assert source.prepared_indices == fetched
        order, prepared_epoch = source.prepared[-1]
        assert prepared_epoch == epoch
        assert order == _first_touched(source.fetched_shards)
    assert source.prepared[0][0] != source.prepared[1][0]  # this seed reorders the shards between epochs


def test_prepare_on_resume_gets_only_the_shards_still_to_read(toy_registry):
    source = _STORE["mem://r"] = MemorySource("mem://r", _SHARDS)
    loader = fastio.StreamLoader(
        "mem://r", batch_size=4, shuffle="shard", order=fastio.OrderOptions(shuffle_block=3), seed=2
    )
    it = iter(loader)
    for _ in range(6):
        next(it)
    state = loader.state_dict()
    resumed = fastio.StreamLoader(
        "mem://r", batch_size=4, shuffle="shard", order=fastio.OrderOptions(shuffle_block=3), seed=2
    )
    resumed.load_state_dict(state)
    source.fetched_shards.clear()
    rest = [((y - 1) // 3).tolist() for batch in resumed for y in batch["y"]]
    assert len(rest) == len(source.prepared_indices) == sum(_SHARDS) - 6 * 4
    assert source.prepared_indices == rest
    order, epoch = source.prepared[-1]
    assert epoch == 0 and order == _first_touched(source.fetched_shards)


def test_prepare_is_called_before_worker_processes_fork(toy_registry):
    source = _STORE["mem://p"] = MemorySource("mem://p", _SHARDS)
    loader = fastio.StreamLoader(
        "mem://p", batch_size=8, shuffle="shard", num_workers=2, workers=fastio.WorkerOptions(mode="process")
    )
    list(loader)
    assert len(source.prepared) == 1 and sorted(source.prepared[0][0]) == list(range(len(_SHARDS)))


class HoldingSource(MemorySource):
    """A toy source read shard by shard whose cache holds two shards at once."""

    def shards_held(self):
        return 2


@pytest.mark.parametrize("kind, mode", [(MemorySource, "full"), (HoldingSource, "window")])
def test_full_shuffle_on_a_source_read_shard_by_shard_mixes_what_it_holds(toy_registry, kind, mode):
    _STORE["mem://s"] = kind("mem://s", _SHARDS)
    loader = fastio.StreamLoader("mem://s", batch_size=1, shuffle=True)
    assert loader.shuffle == mode and loader.stats()["shuffle_mode"] == mode
    expected = 2 if mode == "window" else len(_SHARDS)
    assert loader.stats()["shuffle_window_shards"] == expected
    assert sorted((int(b["y"]) - 1) // 3 for b in loader) == list(range(sum(_SHARDS)))  # y = 3 * index + 1


def test_unknown_scheme_names_the_url_and_the_registered_schemes(toy_registry):
    with pytest.raises(ValueError, match=r"nope://bucket/train.*'nope'.*registered: .*mem"):
        fastio.StreamLoader("nope://bucket/train", batch_size=4)


def test_a_list_mixing_schemes_is_refused(toy_registry):
    with pytest.raises(ValueError, match="one URL scheme"):
        open_source(["mem://a", "data/b.tar"])


def test_file_urls_are_local_paths(toy_registry, npy_dir):
    directory, rows = npy_dir
    assert open_source(f"file://{directory}").num_samples == len(rows)


def test_a_source_object_is_used_as_it_is():
    source = MemorySource("mem://direct", [4, 4])
    loader = fastio.StreamLoader(source, batch_size=8)
    assert torch.equal(next(iter(loader))["y"], torch.arange(8) * 3 + 1)


def test_an_opener_returning_a_non_source_names_what_is_missing(toy_registry):
    registry.register_scheme("mem", lambda url, options: object())
    with pytest.raises(TypeError, match=r"mem://.*object.*num_samples.*fetch\(\)"):
        open_source("mem://x")


def test_an_empty_directory_a_format_takes_is_named_as_empty(tmp_path):
    registry.register_format("any-dir", os.path.isdir, lambda t, options: NpyDirSource(t), "a directory")
    (tmp_path / "empty").mkdir()
    try:
        expected = r"empty: empty directory; format 'any-dir' \(a directory\) matched it"
        with pytest.raises(fastio.EmptySourceError, match=expected):
            fastio.StreamLoader(tmp_path / "empty", batch_size=4)
    finally:
        registry.unregister_format("any-dir")


@pytest.mark.parametrize("shards", [[], [0, 0]], ids=["no-shards", "empty-shards"])
def test_a_source_opened_with_no_samples_is_refused_by_name(toy_registry, shards):
    _STORE["mem://empty"] = MemorySource("mem://empty", shards)
    with pytest.raises(fastio.EmptySourceError, match=r"mem://empty: the opener of mem:// .* no samples"):
        fastio.StreamLoader("mem://empty", batch_size=4)


def test_a_path_no_format_takes_lists_what_they_expect(toy_registry, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    with pytest.raises(
        ValueError, match=r"notes\.txt: expected a directory of \.npy, a fastio shard dir"
    ) as err:
        fastio.StreamLoader(path, batch_size=4)
    assert str(err.value).endswith(" or WebDataset .tar shards")


def test_a_path_no_format_takes_keeps_the_builtin_message(tmp_path):
    path = tmp_path / "data.zip"
    path.write_bytes(b"PK")
    with pytest.raises(
        ValueError, match=r"data\.zip: expected a fastio shard directory, .* or WebDataset \.tar"
    ):
        fastio.StreamLoader(path, batch_size=4)


@pytest.mark.parametrize(
    "target", ["a/shard-{000..003}.tar.gz", "b.TGZ", ["c.tar.zst", "d.tgz"]], ids=["brace", "upper", "list"]
)
def test_compressed_tars_go_to_their_format_not_the_tar_one(target):
    row = next(r for r in registry.formats() if registry._resolve(r.matches)(target))
    assert row.name == "compressed-tar"


def test_matching_a_local_tar_does_not_import_the_remote_package(tmp_path):
    code = (
        "import sys, fastio.registry as r; "
        "[r._resolve(f.matches)('x.tar') for f in r.formats()]; "
        "print('fastio.remote' in sys.modules, 'fsspec' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_builtin_formats_cannot_be_replaced():
    with pytest.raises(ValueError, match="built in"):
        registry.register_format("fastio-shards", _is_npy_dir, lambda t, o: NpyDirSource(t))


def test_a_bad_scheme_name_is_refused():
    with pytest.raises(ValueError, match="without '://'"):
        registry.register_scheme("s3://", _open_memory)


def test_lazy_opener_that_fails_to_import_says_which(toy_registry):
    registry.register_scheme("mem", "fastio.no_such_module:open")
    with pytest.raises(ImportError, match="fastio.no_such_module:open"):
        open_source("mem://x")


def test_shard_read_order_matches_its_reference_on_random_indices():
    rng = _rng("shard_read_order")
    sizes = rng.integers(1, 9, size=11).tolist()
    indices = rng.integers(0, sum(sizes), size=60)
    cumulative = np.cumsum([0, *sizes])
    shards = [int(np.searchsorted(cumulative, i, side="right") - 1) for i in indices]
    assert shard_read_order(sizes, indices).tolist() == _first_touched(shards)


class CountingSource(MemorySource):
    """A toy remote source with counters of its own."""

    def stats(self):
        return {
            "network_wait_s": 0.25,
            "downloaded_bytes": 3_000_000,
            "cache_bytes": 2_000_000,
            "cache_limit": None,
        }


def test_a_source_s_own_counters_reach_loader_stats():
    loader = fastio.StreamLoader(CountingSource("mem://c", _SHARDS), batch_size=8)
    assert loader.stats()["source"]["downloaded_bytes"] == 3_000_000
    list(loader)
    stats = loader.stats()
    assert stats["network_wait_s"] == 0.25 and stats["samples"] == sum(_SHARDS)


def test_a_source_without_counters_adds_nothing_to_stats():
    loader = fastio.StreamLoader(MemorySource("mem://n", _SHARDS), batch_size=8)
    list(loader)
    assert "source" not in loader.stats() and "network_wait_s" not in loader.stats()


def test_the_progress_bar_shows_downloads_and_cache_use():
    pytest.importorskip("tqdm")
    it = iter(
        fastio.StreamLoader(
            CountingSource("mem://b", _SHARDS), batch_size=8, batches=fastio.BatchOptions(progress=True)
        )
    )
    next(it)
    assert it.bar.postfix == "3 MB down, cache 2/- MB, net wait 0.2 s"
    it.close()


class PlannedSource(MemorySource):
    """A toy source that records how the loader says it will fetch, and when."""

    def __init__(self, url: str, shard_sizes: list[int]) -> None:
        super().__init__(url, shard_sizes)
        self.calls: list[object] = []

    def plan_reads(self, plan):
        self.calls.append(plan)

    def prepare(self, shard_order, epoch, indices=None):
        self.calls.append("prepare")


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_says_how_it_fetches_before_each_pass(workers):
    source = PlannedSource("mem://planned", _SHARDS)
    list(
        fastio.StreamLoader(
            source,
            batch_size=8,
            num_workers=workers,
            workers=fastio.WorkerOptions(prefetch=2),
            order=fastio.OrderOptions(world_size=2, rank=1),
        )
    )
    in_flight = workers + 2 if workers else 1
    assert source.calls == [ReadPlan(8, in_flight, False, True), "prepare"]
