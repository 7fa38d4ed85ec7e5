"""Remote sources over a real HTTP server on 127.0.0.1 (benchmarks/http_server.py): batches equal the
local loader's, faults are survived or named, the cache stays bounded and is shared, resume downloads only
what is left."""

from __future__ import annotations

import io
import sys
import tarfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import fastio
from fastio.format.shards.remote import RemoteShardSource
from fastio.format.tar.remote import RemoteTarSource
from fastio.remote import (
    CacheFullError,
    CacheStalledError,
    RemoteNotFoundError,
    RemoteReadError,
    RetryPolicy,
    ShardCache,
)

sys.path.insert(0, str(Path(__file__).parent))
from _remote_helpers import FAST_RETRY, cache_folder_bytes  # noqa: E402

from benchmarks.http_server import Faults, HttpServer  # noqa: E402


def _shard_files(shard_dir: Path) -> list[Path]:
    return sorted(shard_dir.glob("*.fio"))


def _same_batches(local: fastio.StreamLoader, remote: fastio.StreamLoader) -> int:
    count = 0
    for a, b in zip(local, remote, strict=True):
        assert a.keys() == b.keys()
        for name in a:
            if isinstance(a[name], torch.Tensor):
                assert torch.equal(a[name], b[name]), name
            elif a[name] and isinstance(a[name][0], torch.Tensor):
                assert all(torch.equal(x, y) for x, y in zip(a[name], b[name], strict=True)), name
            else:
                assert a[name] == b[name], name
        count += 1
    return count


@pytest.mark.parametrize("num_workers", [0, 2])
def test_epoch_over_http_equals_local_loader(shard_dir, server, tmp_path, num_workers):
    source = RemoteShardSource(server.url("train"), cache_dir=tmp_path / "cache", retry=FAST_RETRY)
    try:
        for epoch in (0, 1):
            local = fastio.StreamLoader(
                shard_dir, batch_size=10, shuffle="shard", seed=5, num_workers=num_workers
            )
            remote = fastio.StreamLoader(
                source, batch_size=10, shuffle="shard", seed=5, num_workers=num_workers
            )
            local.set_epoch(epoch)
            remote.set_epoch(epoch)
            assert _same_batches(local, remote) == len(local)
    finally:
        source.close()
    for path in _shard_files(shard_dir):  # epoch 1 read the cache: each shard crossed the network once
        assert server.bytes_served(f"/train/{path.name}") == path.stat().st_size


def test_process_workers_read_the_shared_cache(shard_dir, server, tmp_path, fio):
    source = RemoteShardSource(server.url("train"), cache_dir=tmp_path / "cache", retry=FAST_RETRY)
    loader = fastio.StreamLoader(
        source,
        batch_size=8,
        shuffle="shard",
        seed=1,
        num_workers=2,
        workers=fastio.WorkerOptions(mode="process"),
    )
    for epoch in (0, 1):  # epoch 1: every shard cached, read through one source over the whole set
        loader.set_epoch(epoch)
        seen = Counter(y for batch in loader for y in fio.check_batch(batch))
        assert sorted(seen) == list(range(fio.NUM_SAMPLES)) and set(seen.values()) == {1}
    source.close()
    for path in _shard_files(shard_dir):
        assert server.bytes_served(f"/train/{path.name}") == path.stat().st_size


def test_a_url_opens_through_the_registry_and_reports_io(shard_dir, server, tmp_path, fio):
    loader = fastio.StreamLoader(
        server.url("train/"),
        batch_size=16,
        shuffle="shard",
        remote=fastio.RemoteOptions(cache_dir=str(tmp_path / "cache"), cache_limit="1GB"),
    )
    seen = Counter(y for batch in loader for y in fio.check_batch(batch))
    stats = loader.stats()
    assert sorted(seen) == list(range(fio.NUM_SAMPLES))
    total = sum(p.stat().st_size for p in _shard_files(shard_dir))
    assert stats["source"]["downloaded_bytes"] == total and stats["source"]["downloads"] == len(
        _shard_files(shard_dir)
    )
    assert stats["source"]["cache_bytes"] >= total and stats["network_wait_s"] >= 0.0
    loader._source.close()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dropped_connections_and_503s_leave_every_sample_once(tmp_path, fio, num_workers):
    # Shards of 2 samples: 59 shard GETs (HTTP shards stream as one GET each), about 3 of them faulted.
    fio.write_set(tmp_path / "www" / "train", shard_samples=2)
    with HttpServer(tmp_path / "www", Faults(fault_rate=0.05, seed=num_workers)) as server:
        source = RemoteShardSource(server.url("train"), cache_dir=tmp_path / "cache", retry=FAST_RETRY)
        loader = fastio.StreamLoader(source, batch_size=8, shuffle="shard", seed=2, num_workers=num_workers)
        seen = Counter(y for batch in loader for y in fio.check_batch(batch))
        stats = source.stats()
        source.close()
        assert server.failures() > 0, "the fault injection injected nothing: the test would prove nothing"
    assert sorted(seen) == list(range(fio.NUM_SAMPLES)) and set(seen.values()) == {1}
    assert stats["retries"] >= 1


def test_missing_shard_raises_named_error_at_once(shard_dir, server, tmp_path):
    victim = _shard_files(shard_dir)[3].name
    server.faults.missing.add(f"/train/{victim}")
    source = RemoteShardSource(server.url("train"), cache_dir=tmp_path / "cache", retry=FAST_RETRY)
    loader = fastio.StreamLoader(source, batch_size=8, shuffle=False)
    with pytest.raises(RemoteNotFoundError, match=victim) as caught:
        for _ in loader:
            pass
    source.close()
    assert caught.value.code == "404"
    assert len(server.log(f"/train/{victim}")) == 1  # a 404 is never retried


def test_persistent_503_raises_after_the_retry_budget(shard_dir, server, tmp_path):
    victim = _shard_files(shard_dir)[0].name
    server.faults.fail_next[f"/train/{victim}"] = 10**6
    retry = RetryPolicy(retries=3, backoff=0.001, max_backoff=0.01, timeout=5.0)
    source = RemoteShardSource(server.url("train"), cache_dir=tmp_path / "cache", retry=retry)
    with pytest.raises(RemoteReadError, match="503") as caught:
        for _ in fastio.StreamLoader(source, batch_size=8, shuffle=False):
            pass
    source.close()
    assert caught.value.attempts == 4
    assert len(server.log(f"/train/{victim}")) == 4  # the first try and 3 retries, then the named error


@pytest.mark.parametrize("num_workers", [0, 2])
def test_cache_limit_bounds_the_cache_during_the_epoch(shard_dir, server, tmp_path, fio, num_workers):
    sizes = [p.stat().st_size for p in _shard_files(shard_dir)]
    limit = sum(sizes) // 4
    cache_dir = tmp_path / "cache"
    source = RemoteShardSource(
        server.url("train"), cache_dir=cache_dir, cache_limit=limit, retry=FAST_RETRY, ahead=2
    )
    peaks: list[int] = []  # by a walk under the cache's lock: no file counted between two names
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peaks.append(cache_folder_bytes(cache_dir))
            stop.wait(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        for epoch in (0, 1):
            loader = fastio.StreamLoader(
                source,
                batch_size=4,
                shuffle="shard",
                seed=3,
                num_workers=num_workers,
                order=fastio.OrderOptions(shuffle_window=1),
            )
            loader.set_epoch(epoch)
            seen = Counter()
            for batch in loader:
                peaks.append(cache_folder_bytes(cache_dir))
                seen.update(fio.check_batch(batch))
            assert sorted(seen) == list(range(fio.NUM_SAMPLES)) and set(seen.values()) == {1}
    finally:
        stop.set()
        sampler.join()
        source.close()
    assert len(peaks) > 10
    assert max(peaks) <= limit + max(sizes)
    assert source.cache.evictions > 0  # the limit really bit: shards came and went


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_cache_limit_too_small_for_the_read_order_fails_at_once(shard_dir, server, tmp_path, num_workers):
    # shuffle="shard" interleaves the blocks of `shuffle_window` shards: all of them stay cached until read to
    # the end. A limit under that working set must fail with a named error at once, not wait on the pass's
    # own pins (the cache's wait_s is 600 s).
    sizes = [p.stat().st_size for p in _shard_files(shard_dir)]
    source = RemoteShardSource(server.url("train"), cache_dir=tmp_path / "cache", cache_limit=max(sizes) + 1,
                               retry=FAST_RETRY)
    loader = fastio.StreamLoader(source, batch_size=4, shuffle="shard", seed=3, num_workers=num_workers,
                                 order=fastio.OrderOptions(shuffle_window=4))
    start = time.monotonic()
    try:
        with pytest.raises(CacheFullError, match="cannot hold the shards this rank's read order keeps open"):
            for _ in loader:
                pass
    finally:
        source.close()
    assert time.monotonic() - start < 30


def _epoch_within(loader: fastio.StreamLoader, fio, timeout_s: float = 120.0) -> Counter:
    """The samples of one epoch of ``loader``, read in a thread: a hang fails the test instead of CI."""
    seen: Counter = Counter()
    raised: list[BaseException] = []

    def read() -> None:
        try:
            for batch in loader:
                seen.update(fio.check_batch(batch))
        except BaseException as exc:  # raised in the test's thread below
            raised.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    assert not reader.is_alive(), f"the epoch still had not ended after {timeout_s} s"
    if raised:
        raise raised[0]
    return seen


@pytest.mark.parametrize(
    "num_workers, worker_mode, batch_size", [(0, "thread", 4), (2, "thread", 7), (2, "process", 4)]
)
def test_the_cache_limit_an_error_suggests_runs_the_epoch(
    shard_dir, server, tmp_path, fio, num_workers, worker_mode, batch_size
):
    # A user told "raise cache_limit to at least N bytes" sets exactly N: the epoch must run. N covers every
    # shard a batch reads together, the shards shuffle="shard" keeps open (counted per batch, the last one
    # admitted being the smallest) and, with worker processes, a worker's pins until its next fetch.
    options = dict(batch_size=batch_size, shuffle="shard", seed=3, num_workers=num_workers,
                   order=fastio.OrderOptions(shuffle_block=3, shuffle_window=3),
                   workers=fastio.WorkerOptions(mode=worker_mode))  # fmt: skip
    probe = RemoteShardSource(server.url("train"), cache_dir=tmp_path / "probe", cache_limit=1,
                              retry=FAST_RETRY)  # fmt: skip
    try:
        with pytest.raises(CacheFullError) as refused:
            next(iter(fastio.StreamLoader(probe, **options)))
    finally:
        probe.close()
    suggested = refused.value.suggested_limit
    assert f"at least {suggested} bytes" in str(refused.value)
    assert suggested < sum(p.stat().st_size for p in _shard_files(shard_dir))  # the limit really binds
    source = RemoteShardSource(server.url("train"), cache_dir=tmp_path / "cache", cache_limit=suggested,
                               retry=FAST_RETRY)  # fmt: skip
    try:
        seen = _epoch_within(fastio.StreamLoader(source, **options), fio)
    finally:
        source.close()
    assert sorted(seen) == list(range(fio.NUM_SAMPLES)) and set(seen.values()) == {1}


@pytest.mark.parametrize("num_workers, worker_mode", [(0, "thread"), (2, "thread"), (2, "process")])
def test_a_pass_that_can_never_get_room_raises_a_named_error_within_seconds(
    shard_dir, server, tmp_path, fio, caplog, num_workers, worker_mode
):
    # Another job sharing the cache_dir pins an entry that takes all the room: no shard of the pass can come
    # in, and no pin will go. The pass must say why it waits and raise CacheStalledError once nothing changed
    # for stall_s (10 s by default; 3 s here), not wait the 600 s of wait_s in silence.
    cache_dir = tmp_path / "cache"
    limit = sum(p.stat().st_size for p in _shard_files(shard_dir))
    blob = bytes(i % 251 + 1 for i in range(limit + 1))
    other = ShardCache(cache_dir)
    other.pin("other-job/blob")
    other.fill("other-job/blob", len(blob), lambda part: part.write_bytes(blob))
    source = RemoteShardSource(server.url("train"), cache_dir=cache_dir, cache_limit=limit, retry=FAST_RETRY)
    source.cache.stall_s = 3.0
    loader = fastio.StreamLoader(source, batch_size=4, shuffle="shard", seed=3, num_workers=num_workers,
                                 workers=fastio.WorkerOptions(mode=worker_mode))  # fmt: skip
    try:
        with caplog.at_level("WARNING", logger="fastio.remote.cache"):
            with pytest.raises(CacheStalledError, match="other processes or ranks sharing this cache_dir"):
                _epoch_within(loader, fio, timeout_s=60.0)
    finally:
        source.close()
        other.unpin("other-job/blob")
    assert any("every entry pinned" in record.getMessage() for record in caplog.records)


def test_two_ranks_sharing_a_cache_download_each_shard_once(shard_dir, server, tmp_path, fio):
    cache_dir = tmp_path / "cache"
    sources = [
        RemoteShardSource(server.url("train"), cache_dir=cache_dir, retry=FAST_RETRY) for _ in range(2)
    ]
    seen: list[Counter] = [Counter(), Counter()]
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            loader = fastio.StreamLoader(
                sources[rank],
                batch_size=5,
                shuffle="shard",
                seed=4,
                order=fastio.OrderOptions(rank=rank, world_size=2),
                drop_last=True,
            )
            for batch in loader:
                seen[rank].update(fio.check_batch(batch))
        except BaseException as exc:  # raised in the test's thread below
            errors.append(exc)

    ranks = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join(timeout=120)
    for source in sources:
        source.close()
    assert not errors, errors
    assert not set(seen[0]) & set(seen[1])
    for path in _shard_files(shard_dir):
        assert server.bytes_served(f"/train/{path.name}") == path.stat().st_size


def test_resume_downloads_only_what_is_left(shard_dir, server, tmp_path, fio):
    first = RemoteShardSource(server.url("train"), cache_dir=tmp_path / "node-a", retry=FAST_RETRY)
    loader = fastio.StreamLoader(
        first, batch_size=13, shuffle="shard", seed=6, order=fastio.OrderOptions(shuffle_window=1)
    )
    seen = Counter()
    it = iter(loader)
    for _ in range(5):
        seen.update(fio.check_batch(next(it)))
    state = loader.state_dict()
    del it
    first.close()

    with HttpServer(shard_dir.parent) as second_server:  # its log is the resumed node's alone
        second = RemoteShardSource(
            second_server.url("train"), cache_dir=tmp_path / "node-b", retry=FAST_RETRY
        )
        resumed = fastio.StreamLoader(
            second, batch_size=13, shuffle="shard", seed=6, order=fastio.OrderOptions(shuffle_window=1)
        )
        resumed.load_state_dict(state)
        rest = Counter(y for batch in resumed for y in fio.check_batch(batch))
        second.close()
    assert sorted(seen + rest) == list(range(fio.NUM_SAMPLES)) and set((seen + rest).values()) == {1}
    # The shards the rest of the epoch reads, and nothing else, were downloaded by the second node.
    needed = {y // fio.SHARD_SAMPLES for y in rest}
    files = _shard_files(shard_dir)
    for shard, path in enumerate(files):
        fetched = second_server.bytes_served(f"/train/{path.name}")
        assert fetched == (path.stat().st_size if shard in needed else 0), (shard, fetched)
    assert len(needed) < len(files)


def _write_tars(directory: Path, shards: int = 4, samples: int = 0) -> list[Path]:
    rng = np.random.default_rng(7)
    directory.mkdir(parents=True, exist_ok=True)
    paths, key = [], 0
    for s in range(shards):
        path = directory / f"shard-{s:03d}.tar"
        with tarfile.open(path, "w") as tar:
            for _ in range(samples or 9 + 2 * s):
                arr = rng.standard_normal((3, 4)).astype(np.float32)
                buf = io.BytesIO()
                np.save(buf, arr)
                for ext, data in (
                    ("x.npy", buf.getvalue()),
                    ("cls", str(key % 5).encode()),
                    ("txt", b"t" * key),
                ):
                    info = tarfile.TarInfo(f"k{key:05d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                key += 1
        paths.append(path)
    return paths


@pytest.mark.parametrize("sidecars", [False, True])
def test_tar_shards_over_http_equal_local_tars(tmp_path, sidecars):
    root = tmp_path / "www"
    paths = _write_tars(root)
    if sidecars:
        for path in paths:
            fastio.index_tar(path)
    pattern = "shard-{000..003}.tar"
    with HttpServer(root) as server:
        source = RemoteTarSource(server.url(pattern), cache_dir=tmp_path / "cache", retry=FAST_RETRY)
        opened = len(server.log())
        remote = fastio.StreamLoader(source, batch_size=6, shuffle="shard", seed=1, num_workers=2)
        local_copy = (
            tmp_path / "local"
        )  # the local reference indexes its own copy: the served dir stays as is
        local_copy.mkdir()
        for path in paths:
            (local_copy / path.name).write_bytes(path.read_bytes())
        local = fastio.StreamLoader(str(local_copy / pattern), batch_size=6, shuffle="shard", seed=1)
        assert _same_batches(local, remote) == len(local)
        source.close()
        at_open = server.log()[:opened]
    for path in paths:
        served = sum(r.sent for r in at_open if r.path == f"/{path.name}" and r.method == "GET")
        # With sidecars: at most the first .npy member's header is read at open; without: every tar.
        assert served == path.stat().st_size if not sidecars else served <= 4096


@pytest.mark.parametrize("sidecars", [False, True])
def test_the_cache_folder_never_holds_more_than_the_limit_plus_one_shard(tmp_path, sidecars):
    # 8 tar shards, cache_limit 3 shards, shuffle="shard" over 2-shard windows (then shuffle=True): sidecar
    # indexes, lock files and partial downloads count, so the folder stays under the limit plus one tar.
    paths = _write_tars(tmp_path / "www", shards=8, samples=60)
    if sidecars:
        for path in paths:
            fastio.index_tar(path)
    tar_bytes = max(p.stat().st_size for p in paths)
    cache_dir = tmp_path / "cache"
    peaks: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            if cache_dir.exists():
                peaks.append(cache_folder_bytes(cache_dir))
            stop.wait(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    evictions = 0
    try:
        with HttpServer(tmp_path / "www") as server:
            # Two runs sharing the cache: the second starts with the first's shards in it.
            for shuffle in ("shard", True):
                source = RemoteTarSource(server.url("shard-{000..007}.tar"), cache_dir=cache_dir,
                                         cache_limit=3 * tar_bytes, retry=FAST_RETRY)  # fmt: skip
                limit = source.cache.limit
                try:
                    for epoch in (0, 1):
                        loader = fastio.StreamLoader(
                            source,
                            batch_size=8,
                            shuffle=shuffle,
                            order=fastio.OrderOptions(shuffle_window=2),
                            seed=epoch,
                            num_workers=2,
                        )
                        seen = Counter()
                        for batch in loader:
                            peaks.append(cache_folder_bytes(cache_dir))
                            seen.update(batch["__key__"])
                        assert len(seen) == source.num_samples and set(seen.values()) == {1}
                finally:
                    source.close()
                evictions += source.cache.evictions
    finally:
        stop.set()
        sampler.join()
    assert len(peaks) > 10 and evictions > 0  # the limit bit: shards came and went
    assert max(peaks) <= limit + tar_bytes, f"{max(peaks) - limit - tar_bytes} bytes over limit + one shard"
