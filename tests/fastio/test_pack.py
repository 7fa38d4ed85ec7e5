"""StreamLoader(pack=...): held to a plain-Python packer (concatenate, eos, cut) on odd sizes."""

from __future__ import annotations

import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import fastio
from fastio.assembly.pack import Pack
from fastio.pipeline.order import epoch_order

NUM_DOCS = 117
SHARD_DOCS = 13
SEQ_LEN = 17
BATCH = 3


def _rng(case: object) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(case).encode()))


def _write_docs(directory: Path, docs: list[np.ndarray], dtype: str = "int32") -> Path:
    with fastio.ShardWriter(
        directory, schema={"tokens": (dtype, None), "y": ("int64", ())}, max_samples=SHARD_DOCS
    ) as w:
        for i, doc in enumerate(docs):
            w.write({"tokens": doc.astype(dtype), "y": i})
    return directory


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[np.ndarray]]:
    rng = _rng("corpus")
    lengths = rng.integers(1, 301, size=NUM_DOCS)
    docs = [rng.integers(0, 2**31 - 1, size=n, dtype=np.int64).astype(np.int32) for n in lengths]
    return _write_docs(tmp_path_factory.mktemp("pack") / "docs", docs), docs


def _reference(docs, order, seq_len, eos, shift, world, rank):
    """Rows of rank ``rank``: (tokens, document_ids, positions) lists, by concatenating and cutting."""
    width = seq_len + int(shift)
    streams = []
    for r in range(world):
        tokens, owner = [], []
        for n, d in enumerate(order[r::world]):
            piece = [int(t) for t in docs[d]] + ([eos] if eos is not None else [])
            tokens += piece
            owner += [n] * len(piece)
        streams.append((tokens, owner))
    rows = min((len(t) - width) // seq_len + 1 if len(t) >= width else 0 for t, _ in streams)
    tokens, owner = streams[rank]
    out = []
    for k in range(rows):
        cut = slice(k * seq_len, k * seq_len + width)
        ids, positions = [], []
        for j, o in enumerate(owner[cut]):
            if j == 0:
                doc, pos = 0, 0
            elif o != owner[cut][j - 1]:
                doc, pos = doc + 1, 0
            else:
                pos += 1
            ids.append(doc)
            positions.append(pos)
        out.append((tokens[cut], ids, positions))
    return out


def _batches(reference_rows, batch_size, drop_last):
    chunks = [reference_rows[i : i + batch_size] for i in range(0, len(reference_rows), batch_size)]
    if drop_last and chunks and len(chunks[-1]) < batch_size:
        chunks.pop()
    return chunks


def _loader(directory, pack, **kwargs):
    kwargs.setdefault("batch_size", BATCH)
    return fastio.StreamLoader(str(directory), pack=pack, **kwargs)


def _assert_same(got, want_rows, keys=("tokens", "document_ids", "positions")):
    names = {"tokens": 0, "document_ids": 1, "positions": 2}
    for key in keys:
        expected = np.array([row[names[key]] for row in want_rows])
        np.testing.assert_array_equal(got[key].numpy(), expected, err_msg=key)


def _collect(loader):
    return [{k: v.clone() for k, v in b.items()} for b in loader]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("eos", [None, -7])
@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_matches_plain_python_packer(corpus, world, eos, shift, shuffle):
    directory, docs = corpus
    drop_last = (world + shift) % 2 == 0  # both last-batch policies across the sweep
    order = epoch_order([SHARD_DOCS] * 9, seed=5, epoch=0, shuffle=shuffle)
    pack = Pack("tokens", seq_len=SEQ_LEN, eos=eos, shift=shift, positions=True)
    counts = set()
    for rank in range(world):
        loader = _loader(
            directory,
            pack,
            shuffle=shuffle,
            seed=5,
            order=fastio.OrderOptions(world_size=world, rank=rank),
            drop_last=drop_last,
        )
        want = _batches(_reference(docs, order, SEQ_LEN, eos, shift, world, rank), BATCH, drop_last)
        got = _collect(loader)
        assert len(got) == len(want) == len(loader)
        for g, w in zip(got, want, strict=True):
            assert g["tokens"].dtype == torch.int32 and g["tokens"].shape == (len(w), SEQ_LEN + shift)
            _assert_same(g, w)
        counts.add(len(got))
    assert len(counts) == 1, f"ranks yield different batch counts: {counts}"


def test_ranks_read_disjoint_documents(tmp_path):
    rng = _rng("disjoint")
    docs = [np.arange(n, dtype=np.int32) + 1000 * i for i, n in enumerate(rng.integers(1, 301, NUM_DOCS))]
    directory = _write_docs(tmp_path / "docs", docs)
    seen = []
    for rank in range(3):
        loader = _loader(
            directory,
            Pack(seq_len=SEQ_LEN),
            shuffle=True,
            seed=1,
            order=fastio.OrderOptions(world_size=3, rank=rank),
        )
        tokens = torch.cat([b["tokens"].flatten() for b in loader])
        seen.append(set((tokens // 1000).tolist()))
    assert not (seen[0] & seen[1]) and not (seen[0] & seen[2]) and not (seen[1] & seen[2])
    assert len(seen[0] | seen[1] | seen[2]) > NUM_DOCS * 0.9  # only each stream's tail is dropped


@pytest.mark.parametrize("workers", [1, 3])
def test_output_independent_of_num_workers(corpus, workers):
    directory, _ = corpus
    pack = Pack(seq_len=SEQ_LEN, eos=-1, shift=True, positions=True)
    serial = _collect(_loader(directory, pack, shuffle=True, seed=2))
    kept = list(_loader(directory, pack, shuffle=True, seed=2, num_workers=workers))  # kept, not cloned
    assert len(kept) == len(serial)
    for a, b in zip(kept, serial, strict=True):
        for key in b:
            assert torch.equal(a[key], b[key]), key


def test_buffers_reused_when_batches_are_released(corpus):
    directory, _ = corpus
    loader = _loader(
        directory, Pack(seq_len=SEQ_LEN), num_workers=2, workers=fastio.WorkerOptions(prefetch=1)
    )
    pointers = {b["tokens"].data_ptr() for b in loader}
    assert len(loader) > 50 and len(pointers) <= 2 + 1 + 2  # the pool: slots + held + spare


def test_reuse_buffers_false_gives_fresh_tensors(corpus):
    directory, _ = corpus
    loader = _loader(directory, Pack(seq_len=SEQ_LEN), batches=fastio.BatchOptions(reuse_buffers=False))
    kept = list(loader)
    assert len({b["tokens"].data_ptr() for b in kept}) == len(kept)


@pytest.mark.parametrize("cut", [0, 1, 7, 40])
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_gives_the_batches_that_would_have_come(corpus, cut, workers):
    directory, _ = corpus
    pack = Pack(seq_len=SEQ_LEN, eos=-3, shift=True, positions=True)
    kwargs = {"shuffle": True, "seed": 9, "order": fastio.OrderOptions(world_size=2, rank=1)}
    full = _collect(_loader(directory, pack, **kwargs))
    first = _loader(directory, pack, num_workers=2 - workers, **kwargs)
    it = iter(first)
    for _ in range(cut):
        next(it)
    state = first.state_dict()
    assert state["rows_consumed"] == cut * BATCH and state["token_offset"] == cut * BATCH * SEQ_LEN
    resumed = _loader(directory, pack, num_workers=workers, **kwargs)
    resumed.load_state_dict(state)
    rest = _collect(resumed)
    assert len(rest) == len(full) - cut
    for a, b in zip(rest, full[cut:], strict=True):
        for key in b:
            assert torch.equal(a[key], b[key]), key
    if cut:  # the cut falls inside a document: its row starts at no document's first token
        assert state["token_offset"] not in set(resumed._batches.plan(0).starts.tolist())


def test_resume_with_another_batch_size_continues_at_the_same_row(corpus):
    directory, docs = corpus
    pack = Pack(seq_len=SEQ_LEN, eos=-1)
    loader = _loader(directory, pack, batch_size=4)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    resumed = _loader(directory, pack, batch_size=5)
    resumed.load_state_dict(state)
    rows = torch.cat([b["tokens"] for b in resumed])
    want = _reference(docs, np.arange(NUM_DOCS), SEQ_LEN, -1, False, 1, 0)[8:]
    np.testing.assert_array_equal(rows.numpy(), np.array([r[0] for r in want]))


def test_resume_in_a_later_epoch(corpus):
    directory, _ = corpus
    pack = Pack(seq_len=SEQ_LEN)
    loader = _loader(directory, pack, shuffle=True, seed=4)
    loader.set_epoch(3)
    full = _collect(loader)
    it = iter(loader)
    for _ in range(5):
        next(it)
    resumed = _loader(directory, pack, shuffle=True, seed=4)
    resumed.load_state_dict(loader.state_dict())
    assert resumed.epoch == 3
    rest = _collect(resumed)
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(rest, full[5:], strict=True))


def test_epochs_repeat_and_differ(corpus):
    directory, _ = corpus
    loader = _loader(directory, Pack(seq_len=SEQ_LEN), shuffle=True, seed=0)
    first = torch.cat([b["tokens"] for b in _collect(loader)])
    again = torch.cat([b["tokens"] for b in _collect(loader)])
    loader.set_epoch(1)
    other = torch.cat([b["tokens"] for b in _collect(loader)])
    assert torch.equal(first, again)
    assert not torch.equal(first[: len(other)], other[: len(first)])


@pytest.mark.parametrize(
    "change",
    [{"seq_len": 16}, {"shift": True}, {"eos": 0}, {"world_size": 3}, {"seed": 1}, {"shuffle": False}],
    ids=lambda c: next(iter(c)),
)
def test_resume_refuses_a_changed_stream(corpus, change):
    directory, _ = corpus
    base = {"seq_len": SEQ_LEN, "shift": False, "eos": None, "world_size": 1, "seed": 0, "shuffle": True}

    def make(settings):
        pack = Pack(seq_len=settings["seq_len"], shift=settings["shift"], eos=settings["eos"])
        return _loader(
            directory, pack, order=fastio.OrderOptions(world_size=settings["world_size"], rank=0),
            seed=settings["seed"], shuffle=settings["shuffle"],
        )  # fmt: skip

    state = make(base).state_dict()
    key = next(iter(change))
    with pytest.raises(ValueError, match=key):
        make({**base, **change}).load_state_dict(state)


def test_resume_refuses_another_dataset(corpus, tmp_path):
    directory, docs = corpus
    other = _write_docs(tmp_path / "other", [*docs[:-1], docs[-1][:-1]])  # one token fewer
    state = _loader(directory, Pack(seq_len=SEQ_LEN)).state_dict()
    with pytest.raises(ValueError, match="num_tokens"):
        _loader(other, Pack(seq_len=SEQ_LEN)).load_state_dict(state)


def test_requested_dtype(corpus):
    directory, docs = corpus
    got = _collect(_loader(directory, Pack(seq_len=SEQ_LEN, eos=-1, dtype=torch.int64)))
    want = _batches(_reference(docs, np.arange(NUM_DOCS), SEQ_LEN, -1, False, 1, 0), BATCH, False)
    assert got[0]["tokens"].dtype == torch.int64
    for g, w in zip(got, want, strict=True):
        _assert_same(g, w, keys=("tokens", "document_ids"))


def test_uint16_tokens_and_empty_documents(tmp_path):
    rng = _rng("uint16-empty")
    lengths = rng.integers(0, 40, size=NUM_DOCS) * (rng.random(NUM_DOCS) < 0.7)  # many empty documents
    docs = [rng.integers(0, 65536, size=n).astype(np.uint16) for n in lengths]
    directory = _write_docs(tmp_path / "docs", docs, dtype="uint16")
    for eos in (None, 65535):
        got = _collect(_loader(directory, Pack(seq_len=SEQ_LEN, eos=eos, positions=True)))
        want = _batches(_reference(docs, np.arange(NUM_DOCS), SEQ_LEN, eos, False, 1, 0), BATCH, False)
        assert got[0]["tokens"].dtype == torch.uint16 and len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _assert_same({k: v.to(torch.int64) for k, v in g.items()}, w)


def test_shifted_rows_overlap_by_one_token(corpus):
    directory, _ = corpus
    rows = torch.cat([b["tokens"] for b in _collect(_loader(directory, Pack(seq_len=SEQ_LEN, shift=True)))])
    assert torch.equal(rows[:-1, -1], rows[1:, 0])


@pytest.mark.parametrize(
    ("schema", "found"),
    [
        ({"tokens": ("int32", (4,))}, "int32 (4,)"),
        ({"tokens": "bytes"}, "bytes"),
        ({"tokens": ("float32", None)}, "float32"),
        ({"tokens": ("int32", None)}, None),
    ],
    ids=["fixed", "bytes", "float", "missing"],
)
def test_field_that_is_not_a_token_array_is_named(tmp_path, schema, found):
    value = {"int32 (4,)": np.ones(4, np.int32), "bytes": b"abc", "float32": np.ones(3, np.float32)}
    sample = {"tokens": value.get(found, np.ones(3, np.int32))}
    with fastio.ShardWriter(tmp_path / "d", schema=schema) as w:
        w.write(sample)
    field = "tokens" if found else "text"
    with pytest.raises(fastio.SchemaMismatchError, match=field) as err:
        _loader(tmp_path / "d", Pack(field, seq_len=2), batch_size=1)
    assert "1-D variable-length integer array" in str(err.value)
    assert (found or "no such field") in str(err.value)


@pytest.mark.parametrize(
    "kwargs",
    [{"seq_len": 0}, {"seq_len": -3}, {"seq_len": 2.5}, {"eos": 1.5}, {"dtype": torch.float32}],
    ids=["zero", "negative", "float", "eos-float", "dtype-float"],
)
def test_bad_pack_arguments(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        Pack("tokens", **{"seq_len": 8, **kwargs})


def test_eos_and_dtype_must_fit(corpus, tmp_path):
    directory, _ = corpus
    with pytest.raises(ValueError, match="wrap"):
        _loader(directory, Pack(seq_len=8, dtype=torch.int16))
    docs = [np.arange(1, 30, dtype=np.uint16)] * 4
    small = _write_docs(tmp_path / "u16", docs, dtype="uint16")
    with pytest.raises(ValueError, match="eos=70000"):
        _loader(small, Pack(seq_len=8, eos=70000))
    rows = torch.cat(
        [b["tokens"] for b in _collect(_loader(small, Pack(seq_len=8, eos=70000, dtype=torch.int32)))]
    )
    assert rows.dtype == torch.int32 and (rows == 70000).sum() == 4


@pytest.mark.parametrize("drop_last", [False, True])
def test_too_few_tokens_for_one_batch(tmp_path, drop_last):
    directory = _write_docs(tmp_path / "tiny", [np.arange(10, dtype=np.int32), np.arange(5, dtype=np.int32)])
    with pytest.raises(fastio.EmptySourceError, match="15 tokens"):
        _loader(directory, Pack(seq_len=16), batch_size=1)  # no row at all
    with pytest.raises(fastio.EmptySourceError, match="fewer than one batch"):
        _loader(
            directory,
            Pack(seq_len=4),
            batch_size=2,
            order=fastio.OrderOptions(world_size=2, rank=0),
            drop_last=True,
        )
    assert (
        len(
            _loader(directory, Pack(seq_len=4), batch_size=2, order=fastio.OrderOptions(world_size=2, rank=0))
        )
        == 1
    )


def test_pack_refuses_python_path_options(corpus):
    directory, _ = corpus
    with pytest.raises(ValueError, match="transform"):
        _loader(directory, Pack(seq_len=8), transform=lambda s: s)
    with pytest.raises(ValueError, match="process"):
        _loader(directory, Pack(seq_len=8), workers=fastio.WorkerOptions(mode="process"))


def test_pack_needs_a_shard_directory():
    dataset = [{"tokens": np.arange(5)}] * 4
    with pytest.raises(TypeError, match="shard directory"):
        fastio.StreamLoader(dataset, batch_size=1, pack=Pack(seq_len=2))


def test_stats_count_tokens(corpus):
    directory, _ = corpus
    loader = _loader(directory, Pack(seq_len=SEQ_LEN))
    for _ in loader:
        pass
    stats = loader.stats()
    assert stats["batches"] == len(loader) and stats["tokens"] == stats["samples"] * SEQ_LEN > 0


@pytest.mark.parametrize("workers", [0, 3])
def test_rows_planned_in_small_chunks_match_reference(corpus, monkeypatch, workers):
    from fastio.assembly.pack import _PackProducer

    monkeypatch.setattr(_PackProducer, "_CHUNK_ROWS", 7)  # 2 batches of 3 per chunk: most batches cross none
    monkeypatch.setattr(_PackProducer, "_KEEP_CHUNKS", 1)  # workers ahead evict chunks others still need
    directory, docs = corpus
    order = epoch_order([SHARD_DOCS] * 9, seed=3, epoch=0, shuffle=True)
    pack = Pack(seq_len=SEQ_LEN, eos=-2, shift=True, positions=True)
    ranks = fastio.OrderOptions(world_size=2, rank=1)
    loader = _loader(directory, pack, shuffle=True, seed=3, order=ranks, num_workers=workers)
    it = iter(loader)
    for _ in range(5):
        next(it)  # resume from an odd batch: chunks are counted from the resume row
    resumed = _loader(directory, pack, shuffle=True, seed=3, order=ranks, num_workers=workers)
    resumed.load_state_dict(loader.state_dict())
    want = _batches(_reference(docs, order, SEQ_LEN, -2, True, 2, 1), BATCH, False)[5:]
    got = _collect(resumed)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        _assert_same(g, w)


def test_flipped_token_byte_is_a_named_error(tmp_path):
    rng = _rng("flipped")
    docs = [rng.integers(0, 1000, size=n).astype(np.int32) for n in rng.integers(1, 60, size=40)]
    directory = _write_docs(tmp_path / "docs", docs)
    shard = sorted(directory.glob("*.fio"))[1]
    offsets, base = fastio.ShardReader(shard).variable_layout("tokens")
    data = bytearray(shard.read_bytes())
    data[base + int(offsets[3])] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(fastio.CorruptShardError, match=shard.name):
        _collect(_loader(directory, Pack(seq_len=SEQ_LEN)))


def _write_tar(path: Path, docs: list[np.ndarray]) -> str:
    import webdataset as wds

    with wds.TarWriter(str(path)) as sink:
        for i, doc in enumerate(docs):
            sink.write({"__key__": f"d{i:05d}", "tokens.npy": doc, "cls": i})
    return str(path)


@pytest.mark.parametrize("eos", [None, -4])
def test_tar_npy_documents_match_reference(corpus, tmp_path, eos):
    _, docs = corpus
    tars = [_write_tar(tmp_path / f"part-{k}.tar", docs[k * 60 : (k + 1) * 60]) for k in range(2)]
    order = epoch_order([60, NUM_DOCS - 60], seed=8, epoch=0, shuffle=True)
    pack = Pack("tokens.npy", seq_len=SEQ_LEN, eos=eos, shift=True, positions=True)
    loader = fastio.StreamLoader(
        tars,
        batch_size=BATCH,
        shuffle=True,
        seed=8,
        order=fastio.OrderOptions(world_size=2, rank=0),
        pack=pack,
    )
    want = _batches(_reference(docs, order, SEQ_LEN, eos, True, 2, 0), BATCH, False)
    got = _collect(loader)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        _assert_same(g, w)


def test_tar_member_that_is_not_a_token_array_is_named(tmp_path):
    tar = _write_tar(tmp_path / "a.tar", [np.ones((3, 2), np.int32), np.ones(4, np.int32)])
    with pytest.raises(fastio.SchemaMismatchError, match=r"tokens\.npy") as err:
        fastio.StreamLoader(tar, batch_size=1, pack=Pack("tokens.npy", seq_len=2))
    assert "(3, 2)" in str(err.value)
    with pytest.raises(fastio.SchemaMismatchError, match="cls"):
        fastio.StreamLoader(tar, batch_size=1, pack=Pack("cls", seq_len=2))


def test_tar_npy_member_shorter_than_its_header_says(tmp_path):
    import io
    import tarfile

    path = tmp_path / "short.tar"
    with tarfile.open(path, "w") as tar:
        for i, n in enumerate((9, 12)):
            buf = io.BytesIO()
            np.save(buf, np.arange(n, dtype=np.int32))
            data = buf.getvalue()[: -8 if i == 1 else None]  # the second member lost 2 tokens
            info = tarfile.TarInfo(f"d{i}.tokens.npy")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(fastio.CorruptShardError, match="sample 1") as err:
        fastio.StreamLoader(str(path), batch_size=1, pack=Pack("tokens.npy", seq_len=2))
    assert "short.tar" in str(err.value) and "48 bytes" in str(err.value)


def test_state_dict_reports_a_pending_resume_and_a_running_pass_is_left_alone(corpus):
    directory, _ = corpus
    pack = Pack(seq_len=SEQ_LEN)
    loader = _loader(directory, pack, shuffle=True, seed=6)
    full = _collect(loader)
    it = iter(loader)
    for _ in range(4):
        next(it)
    state = loader.state_dict()
    other = _loader(directory, pack, shuffle=True, seed=6)
    running = iter(other)
    next(running)
    with pytest.warns(UserWarning, match="continues unchanged"):
        other.load_state_dict(state)
    assert other.state_dict() == state  # the pending point, until the next iter()
    assert torch.equal(next(running)["tokens"], full[1]["tokens"])
    assert torch.equal(next(iter(other))["tokens"], full[4]["tokens"])


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
    loader = _loader(directory, pack, num_workers=2, worker_init_fn=starts, persistent_workers=persistent,
                     **kwargs)  # fmt: skip
    serial = _loader(directory, pack, **kwargs)
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
    loader = _loader(directory, pack, num_workers=2, persistent_workers=True, in_order=False, **kwargs)
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
    serial = _loader(directory, pack, **kwargs)
    serial.set_epoch(2)
    assert all(torch.equal(a, b["tokens"]) for a, b in zip(head + rest, serial, strict=True))


@pytest.mark.parametrize("context", ["spawn", "forkserver", "fork"])
def test_worker_processes_are_refused_with_a_named_reason(corpus, context):
    directory, _ = corpus
    message = "pack= makes its rows in worker threads.*drop multiprocessing_context="
    with pytest.raises(ValueError, match=message):
        _loader(directory, Pack(seq_len=SEQ_LEN), num_workers=2, multiprocessing_context=context)


def test_timeout_bounds_the_wait_for_a_packed_batch(corpus):
    directory, _ = corpus
    slow_start = lambda worker_id: time.sleep(0.3)  # noqa: E731
    loader = _loader(directory, Pack(seq_len=SEQ_LEN), num_workers=1, timeout=0.05, worker_init_fn=slow_start)
    with pytest.raises(fastio.WorkerTimeoutError, match=r"batch 0 not made within timeout=0.05 s"):
        next(iter(loader))
