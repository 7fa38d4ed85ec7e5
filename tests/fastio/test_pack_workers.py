"""StreamLoader(pack=...) in worker threads: the same rows whatever num_workers, buffers reused or fresh, rows
planned in small chunks, worker_init_fn and persistent_workers, and the worker arguments pack= refuses."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import fastio
from fastio.assembly.pack import Pack
from fastio.pipeline.order import epoch_order

sys.path.insert(0, str(Path(__file__).parent))
from _pack_helpers import (  # noqa: E402
    BATCH,
    SEQ_LEN,
    SHARD_DOCS,
    assert_same,
    batched,
    collect,
    make_corpus,
    pack_loader,
    reference,
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[np.ndarray]]:
    return make_corpus(tmp_path_factory)


@pytest.mark.parametrize("workers", [1, 3])
def test_output_independent_of_num_workers(corpus, workers):
    directory, _ = corpus
    pack = Pack(seq_len=SEQ_LEN, eos=-1, shift=True, positions=True)
    serial = collect(pack_loader(directory, pack, shuffle=True, seed=2))
    kept = list(pack_loader(directory, pack, shuffle=True, seed=2, num_workers=workers))  # kept, not cloned
    assert len(kept) == len(serial)
    for a, b in zip(kept, serial, strict=True):
        for key in b:
            assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("group_bytes", [1, 2000])
def test_buffers_reused_when_batches_are_released(corpus, monkeypatch, group_bytes):
    from fastio.assembly.pack_fill import PackProducer

    monkeypatch.setattr(PackProducer, "GROUP_BYTES", group_bytes)  # 1: a batch per group; 2000: 4 batches
    directory, _ = corpus
    loader = pack_loader(
        directory, Pack(seq_len=SEQ_LEN), num_workers=2, workers=fastio.WorkerOptions(prefetch=1)
    )
    storages = {b["tokens"].untyped_storage().data_ptr() for b in loader}
    assert len(loader) > 50 and len(storages) <= 2 + 1 + 2  # the pool: slots + held + spare


def test_reuse_buffers_false_gives_fresh_tensors(corpus):
    directory, _ = corpus
    loader = pack_loader(directory, Pack(seq_len=SEQ_LEN), batches=fastio.BatchOptions(reuse_buffers=False))
    kept = list(loader)
    assert len({b["tokens"].data_ptr() for b in kept}) == len(kept)


@pytest.mark.parametrize(
    "workers, chunk_rows, group_bytes",
    [(0, 7, 1 << 20), (3, 7, 1 << 20), (3, 20, 3000)],
    ids=["serial", "threads", "threads-groups-of-4"],
)
def test_rows_planned_in_small_chunks_match_reference(corpus, monkeypatch, workers, chunk_rows, group_bytes):
    from fastio.assembly.pack_fill import PackProducer

    # 7: 2 batches of 3 per chunk, one group; 20 and 3000 bytes: groups of 4 batches (3 rows of 18 int32
    # tokens, ids and positions: 648 bytes), chunks of one group (6 batches cut to whole groups)
    monkeypatch.setattr(PackProducer, "CHUNK_ROWS", chunk_rows)
    monkeypatch.setattr(PackProducer, "GROUP_BYTES", group_bytes)
    monkeypatch.setattr(PackProducer, "KEEP_CHUNKS", 1)  # workers ahead evict chunks others still need
    directory, docs = corpus
    order = epoch_order([SHARD_DOCS] * 9, seed=3, epoch=0, shuffle=True)
    pack = Pack(seq_len=SEQ_LEN, eos=-2, shift=True, positions=True)
    ranks = fastio.OrderOptions(world_size=2, rank=1)
    loader = pack_loader(directory, pack, shuffle=True, seed=3, order=ranks, num_workers=workers)
    it = iter(loader)
    for _ in range(5):
        next(it)  # resume from an odd batch: chunks are counted from the resume row
    resumed = pack_loader(directory, pack, shuffle=True, seed=3, order=ranks, num_workers=workers)
    resumed.load_state_dict(loader.state_dict())
    want = batched(reference(docs, order, SEQ_LEN, -2, True, 2, 1), BATCH, False)[5:]
    got = collect(resumed)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)


class _Starts:
    """A worker_init_fn that records each call: worker id, thread, what fastio.worker_info() says."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, threading.Thread, fastio.WorkerInfo | None]] = []

    def __call__(self, worker_id: int) -> None:
        self.calls.append((worker_id, threading.current_thread(), fastio.worker_info()))


@pytest.mark.parametrize("persistent", [False, True])
def test_worker_init_fn_runs_first_in_each_pack_thread(corpus, persistent):
    directory, _ = corpus
    pack, kwargs = Pack(seq_len=SEQ_LEN, eos=-1), {"shuffle": True, "seed": 3, "batch_size": 32}
    starts = _Starts()
    loader = pack_loader(directory, pack, num_workers=2, worker_init_fn=starts, persistent_workers=persistent,
                     **kwargs)  # fmt: skip
    serial = pack_loader(directory, pack, **kwargs)
    for epoch in range(3):
        loader.set_epoch(epoch)
        serial.set_epoch(epoch)
        kept = list(loader)  # kept, not cloned
        assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(kept, serial, strict=True))
    passes = 1 if persistent else 3  # kept threads: worker_init_fn once per thread, not per epoch
    assert sorted(worker for worker, _, _ in starts.calls) == [0] * passes + [1] * passes
    assert len({thread for _, thread, _ in starts.calls}) == 2 * passes
    assert all(thread is not threading.main_thread() for _, thread, _ in starts.calls)
    infos = [info for _, _, info in starts.calls]
    assert all(info is not None and (info.num_workers, info.seed) == (2, 3) for info in infos)
    assert [info.id for info in infos] == [worker for worker, _, _ in starts.calls]
    assert {info.epoch for info in infos} == set(range(passes))


def test_kept_pack_threads_resume_mid_epoch_and_in_order_false_keeps_rows_in_order(corpus):
    directory, _ = corpus
    pack, kwargs = Pack(seq_len=SEQ_LEN, shift=True), {"shuffle": True, "seed": 8, "batch_size": 16}
    loader = pack_loader(directory, pack, num_workers=2, persistent_workers=True, in_order=False, **kwargs)
    for epoch in range(2):
        loader.set_epoch(epoch)
        list(loader)
    pipeline = loader._batches.kept.pipeline
    loader.set_epoch(2)
    iterator = iter(loader)
    head = [next(iterator)["tokens"].clone() for _ in range(3)]
    state = loader.state_dict()
    assert "batches_ahead" not in state and state["rows_consumed"] == 3 * 16
    with pytest.warns(UserWarning, match="continues unchanged"):
        loader.load_state_dict(state)
    rest = [b["tokens"].clone() for b in loader]
    assert loader._batches.kept.pipeline is pipeline
    serial = pack_loader(directory, pack, **kwargs)
    serial.set_epoch(2)
    assert all(torch.equal(a, b["tokens"]) for a, b in zip(head + rest, serial, strict=True))


@pytest.mark.parametrize("context", ["spawn", "forkserver", "fork"])
def test_worker_processes_are_refused_with_a_named_reason(corpus, context):
    directory, _ = corpus
    message = "pack= makes its rows in worker threads.*drop multiprocessing_context="
    with pytest.raises(ValueError, match=message):
        pack_loader(directory, Pack(seq_len=SEQ_LEN), num_workers=2, multiprocessing_context=context)


def test_timeout_bounds_the_wait_for_a_packed_batch(corpus):
    directory, _ = corpus
    slow_start = lambda worker_id: time.sleep(0.3)  # noqa: E731
    loader = pack_loader(
        directory, Pack(seq_len=SEQ_LEN), num_workers=1, timeout=0.05, worker_init_fn=slow_start
    )
    with pytest.raises(fastio.WorkerTimeoutError, match=r"batch 0 not made within timeout=0.05 s"):
        next(iter(loader))
